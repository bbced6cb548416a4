"""The gated delta rule of KDA (Kimi Delta Attention), per head, in fp32:

    S ← diag(exp(g_t)) S                       (decay, per key channel; g_t ≤ 0)
    δ_t = β_t (v_t − Sᵀ k_t)                    (what the state fails to predict)
    S ← S + k_t δ_tᵀ
    o_t = Sᵀ q_t

with q and k L2-normalised (q also scaled by head_dim^-0.5). S is [heads, key dim, value dim].

`recurrent_step` does one token for a batch of requests (decode). `over_rows` does a request's many tokens: the
native kda_delta where the operators are loaded (token by token with the state in cache, native/kda_delta.cpp), else
`chunked`, a chunk at a time: inside a chunk the δ's solve one unit lower-triangular system, so the work is a few
matrix products per chunk instead of a state update per token. The decays enter as exp(G_t − G_s) of cumulative
sums G within the chunk, factored as exp(G_t − G_0) · exp(G_0 − G_s) around the chunk's start, which keeps both
factors finite while the chunk's decay spans less than FACTOR_RANGE (16 tokens of a gate bounded below by -5 span at
most 80); a chunk whose decay spans more (an unbounded gate) takes exp(G_t − G_s) per channel instead, a
[heads, C, C, dk] tensor.
"""

from __future__ import annotations

import torch

from dsaserve.native import torch_ops

CHUNK = 16  # tokens per chunk of the chunked form
FACTOR_RANGE = 80.0  # exp(±80) is finite and normal in fp32


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dim (the reference's form: eps inside the root)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised q (scaled by head_dim^-0.5) and k."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token per request: q, k, g [B, H, dk] (prepared), v [B, H, dv], beta [B, H], state [B, H, dk, dv] fp32
    (updated in place). Returns o [B, H, dv]."""
    state.mul_(g.exp().unsqueeze(-1))
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.einsum("bhk,bhkv->bhv", q, state)


def runs_natively(q: torch.Tensor) -> bool:
    """Whether over_rows takes the native operator for q: on CPU, loaded, and no gradients (it has no backward)."""
    return q.is_cpu and not torch.is_grad_enabled() and torch_ops.load()


def over_rows(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One request's tokens in order, as `chunked` takes them (state contiguous, updated in place): the native
    operator where it runs, else `chunked`."""
    if runs_natively(q):
        return torch.ops.dsaserve.kda_delta(q.contiguous(), k.contiguous(), v.float().contiguous(),
                                            g.float().contiguous(), beta.float().contiguous(), state)
    return chunked(q, k, v, g, beta, state)


def chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """One request's tokens in order: q, k, g [T, H, dk] (prepared), v [T, H, dv], beta [T, H], state [H, dk, dv]
    fp32 (updated in place to the state after the last token). Returns o [T, H, dv]."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    for t0 in range(0, q.shape[0], chunk):
        t1 = min(t0 + chunk, q.shape[0])
        out[t0:t1] = _chunk(q[t0:t1], k[t0:t1], v[t0:t1].float(), g[t0:t1].float(), beta[t0:t1].float(), state)
    return out


def _chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """A chunk of C tokens, heads first inside: with G the cumulative decays and S0 the state before the chunk,

        δ = (I + diag(β) A)⁻¹ β (V − K̃ S0),  A[t, s] = Σ_c k_t k_s exp(G_t − G_s) for s < t,  K̃_t = exp(G_t) k_t
        o_t = (exp(G_t) q_t)ᵀ S0 + Σ_{s ≤ t} (Σ_c q_t k_s exp(G_t − G_s)) δ_s
        S_C = exp(G_C) S0 + Σ_s (exp(G_C − G_s) k_s) δ_sᵀ
    """
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, C, ·]
    beta = beta.transpose(0, 1)  # [H, C]
    n = q.shape[1]
    cum = g.cumsum(1)  # G [H, C, dk]
    if float((cum[:, -1] - cum[:, 0]).min()) > -FACTOR_RANGE:
        grow, shrink = (cum - cum[:, :1]).exp(), (cum[:, :1] - cum).exp()  # exp(G_t − G_0), exp(G_0 − G_s)
        k_grow, k_shrink = k * grow, k * shrink
        a = (k_grow @ k_shrink.transpose(1, 2)).tril(-1)
        b = ((q * grow) @ k_shrink.transpose(1, 2)).tril()
    else:
        upto = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # s ≤ t
        diff = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~upto[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [H, t, s, dk], zero above the diagonal
        a = torch.einsum("htc,hsc,htsc->hts", k, k, decay).tril(-1)
        b = torch.einsum("htc,hsc,htsc->hts", q, k, decay)
    system = torch.eye(n, device=q.device) + beta.unsqueeze(-1) * a
    rhs = beta.unsqueeze(-1) * (v - (cum.exp() * k) @ state)
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, dv]
    out = (cum.exp() * q) @ state + b @ delta
    last = cum[:, -1:]  # G_C [H, 1, dk]
    state.mul_(last.transpose(1, 2).exp())
    state.add_(((last - cum).exp() * k).transpose(1, 2) @ delta)
    return out.transpose(0, 1)
