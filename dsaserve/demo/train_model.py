"""A differentiable glm_moe_dsa forward for training the demo model, over checkpoint-named parameters.

It computes what dsaserve and the transformers reference compute at inference (MLA, the lightning
indexer with IndexShare, the sigmoid router with its correction bias, shared experts, the MTP layer),
on padded [batch, seq] tensors, and returns what DSA training needs besides the logits: each indexer's
scores and the attention probabilities of the layers that use its selection.

Following DeepSeek-V3.2, the indexer sees its inputs detached, so only its KL loss trains it; `sparse`
restricts every attention to the indexer's top-k (the serving path); otherwise attention is dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.model.checkpoint_layout import checkpoint_shapes
from dsaserve.model.layers import rope_inv_freq


@dataclass
class IndexerTrace:
    """One full layer's indexer scores [B, S, S] and the summed attention of the layers that use its selection."""

    scores: torch.Tensor
    selected: torch.Tensor | None  # bool [B, S, S] in sparse mode
    attention: list[torch.Tensor] = field(default_factory=list)  # each [B, S, S], summed over heads


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, S, vocab]
    mtp_logits: torch.Tensor | None  # [B, S, vocab]: position i predicts token i + 2
    final_hidden: torch.Tensor  # [B, S, hidden]: after the final norm (the MTP layer's h_0)
    traces: list[IndexerTrace]
    expert_counts: dict[str, torch.Tensor]  # router name → tokens per expert (for the bias update)
    head_attention: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # HeadWatch.probs


@dataclass
class HeadWatch:
    """The attention probabilities of chosen heads, kept with their gradients (for losses on attention)."""

    heads: list[tuple[str, int]]  # (attention prefix such as "model.layers.5.self_attn", head index)
    probs: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # → [B, S, T]

    def record(self, prefix: str, probs: torch.Tensor) -> None:
        for name, head in self.heads:
            if name == prefix:
                self.probs[name, head] = probs[:, head]


def init_weight(name: str, shape: tuple[int, ...], gen: torch.Generator, n_layers: int,
                shared_embedding: bool = False) -> torch.Tensor:
    if "norm" in name and name.endswith(".weight"):
        return torch.ones(shape)
    if name.endswith(("k_norm.bias", "e_score_correction_bias")):
        return torch.zeros(shape)
    if name.endswith("embed_tokens.weight"):
        rows = torch.randn(shape, generator=gen)
        # shared_embedding: every row also shares one random direction, so rotary queries and keys have a part
        # that does not depend on the token and position-only heads (attend to the previous token) can form
        # from the first steps; from independent rows alone they took hundreds (benchmarks/induction_probe.py).
        return rows + torch.randn(shape[-1], generator=gen) if shared_embedding else rows
    std = shape[-1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * n_layers)  # residual branches start small
    return torch.randn(shape, generator=gen) * std


class TrainableGlmMoeDsa(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0, include_mtp: bool = True, shared_embedding: bool = False):
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        shapes = checkpoint_shapes(cfg, include_mtp=include_mtp)
        self.names = list(shapes)
        self.weights = nn.ParameterDict({
            key(n): nn.Parameter(init_weight(n, s, gen, cfg.num_hidden_layers, shared_embedding),
                                 requires_grad=not n.endswith("e_score_correction_bias"))
            for n, s in shapes.items()})
        self.inv_freq, _ = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)  # the demo uses default rope (no yarn factor)
        self.include_mtp = include_mtp

    def w(self, name: str) -> torch.Tensor:
        return self.weights[key(name)]

    def state_dict_for_checkpoint(self) -> dict[str, torch.Tensor]:
        return {n: self.w(n).detach().clone() for n in self.names}

    def forward(self, ids: torch.Tensor, sparse: bool, with_mtp: bool = True,
                watch_heads: list[tuple[str, int]] | None = None) -> ForwardOutput:
        """with_mtp=False skips the MTP layer (mtp_logits None), for a frozen target's pass; watch_heads names
        heads whose attention probabilities come back (with gradients) in head_attention."""
        cfg = self.cfg
        seq = ids.shape[1]
        pos = torch.arange(seq)
        angles = pos[:, None].float() * self.inv_freq[None]
        cos, sin = angles.cos(), angles.sin()
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        embed = self.w("model.embed_tokens.weight")
        x = F.embedding(ids, embed)
        traces: list[IndexerTrace] = []
        counts: dict[str, torch.Tensor] = {}
        watch = HeadWatch(watch_heads or [])
        for i in range(cfg.num_hidden_layers):
            x = self.layer(f"model.layers.{i}", x, cos, sin, causal, cfg.is_full(i), sparse, traces, counts,
                           moe=cfg.mlp_layer_types[i] == "sparse", watch=watch)
        out = rms(x, self.w("model.norm.weight"), cfg.rms_norm_eps)
        lm_head = self.w("lm_head.weight")
        logits = out @ lm_head.T
        mtp_logits = None
        if self.include_mtp and with_mtp:
            p = f"model.layers.{cfg.num_hidden_layers}"
            nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # row i reads token i + 1 (the last row is unused)
            e = F.embedding(nxt, embed).masked_fill((pos == 0)[None, :, None], 0.0)
            h = self.layer(p, self.mtp_input(e, out), cos, sin, causal, True, sparse, traces, counts, moe=True)
            mtp_logits = self.mtp_head(h)
        return ForwardOutput(logits, mtp_logits, out, traces, counts, watch.probs)

    def mtp_input(self, embedded: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat[enorm(embedded token), hnorm(previous hidden state)]): the MTP block's input."""
        p, eps = f"model.layers.{self.cfg.num_hidden_layers}", self.cfg.rms_norm_eps
        return torch.cat([rms(embedded, self.w(f"{p}.enorm.weight"), eps), rms(prev, self.w(f"{p}.hnorm.weight"), eps)],
                         dim=-1) @ self.w(f"{p}.eh_proj.weight").T

    def mtp_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's logits: shared_head.norm, then the main lm_head."""
        p = f"model.layers.{self.cfg.num_hidden_layers}"
        return rms(hidden, self.w(f"{p}.shared_head.norm.weight"), self.cfg.rms_norm_eps) @ self.w("lm_head.weight").T

    def layer(self, p: str, x, cos, sin, causal, full: bool, sparse: bool, traces: list[IndexerTrace],
              counts: dict[str, torch.Tensor], moe: bool, watch: HeadWatch | None = None) -> torch.Tensor:
        eps = self.cfg.rms_norm_eps
        h = rms(x, self.w(f"{p}.input_layernorm.weight"), eps)
        x = x + self.attention(f"{p}.self_attn", h, cos, sin, causal, full, sparse, traces, watch)
        h = rms(x, self.w(f"{p}.post_attention_layernorm.weight"), eps)
        return x + (self.moe(f"{p}.mlp", h, counts) if moe else self.mlp(f"{p}.mlp", h))

    def attention(self, p: str, h, cos, sin, causal, full: bool, sparse: bool, traces: list[IndexerTrace],
                  watch: HeadWatch | None = None):
        cfg = self.cfg
        s = h.shape[1]
        queries, keys, v, q_resid = self.project(p, h, cos, sin)
        logits = torch.matmul(queries, keys.transpose(-1, -2)) * self.softmax_scale  # [B, H, S, T]
        if full:
            scores = self.indexer(f"{p}.indexer", h.detach(), q_resid.detach(), cos, sin)
            scores = scores.masked_fill(~causal, float("-inf"))
            selected = None
            if sparse:
                top = scores.topk(min(cfg.index_topk, s), dim=-1).indices
                selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & causal
            traces.append(IndexerTrace(scores, selected))
        visible = traces[-1].selected if sparse else causal
        probs = logits.masked_fill(~visible[:, None] if visible.dim() == 3 else ~visible, float("-inf")).softmax(-1)
        traces[-1].attention.append(probs.detach().sum(1))
        if watch is not None:
            watch.record(p, probs)
        return self.attention_output(p, torch.matmul(probs, v))

    @property
    def softmax_scale(self) -> float:
        return (self.cfg.qk_nope_head_dim + self.cfg.qk_rope_head_dim) ** -0.5

    def project(self, p: str, h, cos, sin):
        """MLA's per-head queries and keys [B, H, S, nope + rope] and values [B, H, S, v] of the normed
        input h [B, S, hidden] at the positions cos/sin [S, rope / 2] stand for; and q_resid (the indexer's input)."""
        cfg = self.cfg
        b, s, _ = h.shape
        heads, nope, rope_dim, vdim = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                       cfg.v_head_dim)
        q_resid = rms(h @ self.w(f"{p}.q_a_proj.weight").T, self.w(f"{p}.q_a_layernorm.weight"), cfg.rms_norm_eps)
        q = (q_resid @ self.w(f"{p}.q_b_proj.weight").T).view(b, s, heads, nope + rope_dim)
        latent, k_pe = (h @ self.w(f"{p}.kv_a_proj_with_mqa.weight").T).split([cfg.kv_lora_rank, rope_dim], dim=-1)
        latent = rms(latent, self.w(f"{p}.kv_a_layernorm.weight"), cfg.rms_norm_eps)
        k_nope, v = (latent @ self.w(f"{p}.kv_b_proj.weight").T).view(b, s, heads, nope + vdim).split([nope, vdim], -1)
        q_nope, q_pe = q.split([nope, rope_dim], dim=-1)
        q_pe, k_pe = rope(q_pe, cos[:, None], sin[:, None]), rope(k_pe, cos, sin)
        queries = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        keys = torch.cat([k_nope, k_pe[:, :, None].expand(b, s, heads, rope_dim)], dim=-1).transpose(1, 2)
        return queries, keys, v.transpose(1, 2), q_resid

    def attention_output(self, p: str, per_head: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs [B, H, S, v]."""
        b, heads, s, vdim = per_head.shape
        return per_head.transpose(1, 2).reshape(b, s, heads * vdim) @ self.w(f"{p}.o_proj.weight").T

    def indexer(self, p: str, h, q_resid, cos, sin) -> torch.Tensor:
        """Index scores [B, S, T] = Σ_heads w_h(s) · relu(q_h(s)·k(t) / √d), as the serving indexer computes."""
        cfg = self.cfg
        b, s, _ = h.shape
        n, d, rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        q = (q_resid @ self.w(f"{p}.wq_b.weight").T).view(b, s, n, d)
        q = torch.cat([rope(q[..., :rope_dim], cos[:, None], sin[:, None]), q[..., rope_dim:]], dim=-1)
        k = F.layer_norm(h @ self.w(f"{p}.wk.weight").T, (d,), self.w(f"{p}.k_norm.weight"),
                         self.w(f"{p}.k_norm.bias"), 1e-6)
        k = torch.cat([rope(k[..., :rope_dim], cos, sin), k[..., rope_dim:]], dim=-1)
        per_head = torch.matmul(q.transpose(1, 2), k[:, None].transpose(-1, -2)).mul(d**-0.5).relu()  # [B, n, S, T]
        weights = (h @ self.w(f"{p}.weights_proj.weight").T) * n**-0.5  # [B, S, n]
        return (per_head * weights.transpose(1, 2)[..., None]).sum(1)

    def mlp(self, p: str, h: torch.Tensor) -> torch.Tensor:
        gate, up = h @ self.w(f"{p}.gate_proj.weight").T, h @ self.w(f"{p}.up_proj.weight").T
        return (F.silu(gate) * up) @ self.w(f"{p}.down_proj.weight").T

    def moe(self, p: str, h: torch.Tensor, counts: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        flat = h.reshape(-1, h.shape[-1])
        scores = (flat @ self.w(f"{p}.gate.weight").T).sigmoid()
        ids = (scores + self.w(f"{p}.gate.e_score_correction_bias")).topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        out = self.mlp(f"{p}.shared_experts", flat) if cfg.n_shared_experts else torch.zeros_like(flat)
        counts[f"{p}.gate.e_score_correction_bias"] = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)
        for e in range(cfg.n_routed_experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                y = self.mlp(f"{p}.experts.{e}", flat[token]) * weights[token, slot, None]
                out = out.index_add(0, token, y)
        return out.view_as(h)


def key(name: str) -> str:
    return name.replace(".", "__")


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3)… each rotated by one frequency; the output keeps the pair layout."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
