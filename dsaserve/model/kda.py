"""KDA (Kimi Delta Attention), GLM-5.3-Flash's linear-attention layer, over a batch of requests.

    q, k, v = silu(causal_conv(q_proj x | k_proj x | v_proj x))      (short depthwise convolution, fp32)
    g = lower_bound · sigmoid(exp(A_log) · (f_b(f_a x) + dt_bias))   (per key channel; decay exp(g) in (e^bound, 1))
    β = sigmoid(b_proj x)                                            (per head)
    o = gated delta rule (attention/delta_rule.py), per request from its state slot
    out = o_proj(RMSNorm(o) · sigmoid(g_b(g_a x)))                   (gated norm per head, fp32)

The state a request carries between steps (the recurrent state and the convolution's last inputs) lives in its
slot of the layer's LinearStateCache, which its rows update in place, so a chunked prompt continues where its
previous chunk stopped. Under tensor parallelism a rank holds its share of the heads (and their
state); o_proj sums the ranks' parts. A request with an empty context starts from zeros; one admitted on a
prefix-cache hit starts from the snapshot kept after that prefix, and the snapshots a step is asked for (the state
after given positions) are copied out as its rows pass them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.attention import delta_rule
from dsaserve.attention.linear_state import LinearStateCache
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.model.layers import one_operator
from dsaserve.model.linear import Linear
from dsaserve.model.parallel_layers import RowParallelLinear
from dsaserve.prepared_calls import PreparedCalls


class KimiDeltaAttention(PreparedCalls):
    def __init__(self, cfg: ModelConfig, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext.single()
        hybrid = cfg.hybrid
        self.heads = parallel.plan.local(hybrid.linear_num_heads)  # this rank's
        self.head_dim = hybrid.linear_head_dim
        h, qkv = cfg.hidden_size, self.heads * self.head_dim
        self.qkv_dim = qkv
        self.lower_bound = hybrid.gate_lower_bound
        self.norm_eps = cfg.rms_norm_eps
        self.q_proj, self.k_proj, self.v_proj = (Linear(h, qkv, bias=False) for _ in range(3))
        # q|k|v convolutions side by side, [channels, kernel] (the checkpoint's three [qkv, 1, kernel]), kept in fp32.
        self.conv_weight = nn.Parameter(torch.empty(3 * qkv, hybrid.conv_kernel))
        self.f_a_proj = Linear(h, self.head_dim, bias=False)
        self.f_b_proj = Linear(self.head_dim, qkv, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(qkv))  # kept in fp32
        self.A_log = nn.Parameter(torch.empty(self.heads))  # kept in fp32
        self.b_proj = Linear(h, self.heads, bias=False)
        self.g_a_proj = Linear(h, self.head_dim, bias=False)
        self.g_b_proj = Linear(self.head_dim, qkv, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(self.head_dim))
        self.o_proj = RowParallelLinear(qkv, h, bias=False, comm=parallel.tp)

    def forward(self, x: torch.Tensor, meta: BatchMetadata, state: LinearStateCache) -> torch.Tensor:
        for slot, snapshot in zip(meta.state_slots, meta.state_restore):
            if snapshot >= 0:
                state.restore(slot, snapshot)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        convolved = self.convolve(mixed, meta, state)
        q, k, v = (t.view(-1, self.heads, self.head_dim) for t in convolved.split(self.qkv_dim, dim=-1))
        q, k = delta_rule.prepare(q, k)
        g, beta = self.forget_gate(x), torch.sigmoid(self.b_proj(x))
        o = self.recur(q, k, v, g, beta, meta, state).to(x.dtype)
        gate = self.g_b_proj(self.g_a_proj(x)).view(-1, self.heads, self.head_dim)
        return self.o_proj(self.gated_norm(o, gate).reshape(x.shape[0], self.qkv_dim))

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """g [T, heads, head_dim] fp32: the log of each key channel's decay this step."""
        raw = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, self.heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw, threshold=20.0)

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's values (fp32, weight in fp32) times sigmoid(gate), back in o's dtype: the native
        gated_rms_norm where loaded (one pass), else torch's operators."""
        if one_operator(o, gate) and o.is_contiguous() and gate.is_contiguous():
            return torch.ops.dsaserve.gated_rms_norm(o, gate, self.o_norm.weight.float(), self.norm_eps)
        y = o.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (self.o_norm.weight.float() * y * torch.sigmoid(gate.float())).to(o.dtype)

    def convolve(self, mixed: torch.Tensor, meta: BatchMetadata, state: LinearStateCache) -> torch.Tensor:
        """silu(causal depthwise convolution) of mixed [T, channels], continuing each request's last inputs; computed
        in fp32, returned in mixed's dtype (the native kda_conv where loaded, else torch's operators)."""
        out = torch.empty_like(mixed)
        width = self.conv_weight.shape[1] - 1
        native = one_operator(mixed)
        single = [] if native else [i for i in meta.decode_requests() if not meta.state_snapshots[i]]
        if single:
            self.convolve_batched(mixed, meta, state, single, out)
        for i in sorted(set(range(meta.num_reqs)) - set(single)):
            start, end = meta.query_range(i)
            slot, context = meta.state_slots[i], meta.context_len(i)
            tail = mixed.new_zeros(width, mixed.shape[1], dtype=torch.float32) if context == 0 else state.conv[slot]
            rows = mixed[start:end]
            if native:
                out[start:end] = torch.ops.dsaserve.kda_conv(rows, tail.contiguous(), self.taps_by_channel())
            else:
                out[start:end] = self.convolve_torch(rows, tail)
            for position, snapshot in meta.state_snapshots[i]:  # the inputs before `position`
                state.snapshot_conv[snapshot] = inputs_before(tail, rows, position - context)
            state.conv[slot] = inputs_before(tail, rows, end - start)
        return out

    def convolve_torch(self, rows: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        weight = self.conv_weight.float()
        width = weight.shape[1] - 1
        seq = torch.cat([tail, rows.float()])  # [width + n, channels]: from position context - width
        out = seq[width:] * weight[:, width]  # one multiply-add per tap: no [n, channels, taps] product
        for tap in range(width):
            out.addcmul_(seq[tap : tap + rows.shape[0]], weight[:, tap])
        return F.silu(out).to(rows.dtype)

    def convolve_batched(self, mixed: torch.Tensor, meta: BatchMetadata, state: LinearStateCache, single: list[int],
                         out: torch.Tensor) -> None:
        """One row for each request in `single` (none keeping a snapshot), in one torch step over their gathered
        inputs: convolve_torch's sums in its order, so each row comes out as it would alone."""
        rows, slots, fresh = single_rows(meta, single)
        tails = state.conv[slots].masked_fill(fresh.view(-1, 1, 1), 0.0)  # [R, width, channels] fp32
        seq = torch.cat([tails, mixed[rows].float()[:, None]], dim=1)  # [R, width + 1, channels]
        weight = self.conv_weight.float()
        width = weight.shape[1] - 1
        convolved = seq[:, width] * weight[:, width]
        for tap in range(width):
            convolved.addcmul_(seq[:, tap], weight[:, tap])
        out[rows] = F.silu(convolved).to(out.dtype)
        state.conv[slots] = seq[:, 1:]

    def taps_by_channel(self) -> torch.Tensor:
        """conv_weight [channels, taps] as the native kernel reads it: [taps, channels] fp32, made once."""
        return self.prepared("taps by channel", lambda: self.conv_weight.float().t().contiguous())

    def recur(self, q, k, v, g, beta, meta: BatchMetadata, state: LinearStateCache) -> torch.Tensor:
        """The delta rule over every request's rows, each from its slot's state (updated in place): o [T, heads, dv]
        fp32. Without the native operator, single-token requests go in one batched torch step."""
        out = torch.empty(q.shape[0], self.heads, self.head_dim, dtype=torch.float32, device=q.device)
        single = [] if delta_rule.runs_natively(q) else meta.decode_requests()
        if single:
            self.recur_batched(q, k, v, g, beta, meta, state, single, out)
        for i in sorted(set(range(meta.num_reqs)) - set(single)):
            start, end = meta.query_range(i)
            context = meta.context_len(i)
            carried = state.recurrent[meta.state_slots[i]]  # a view: the delta rule updates it in place
            if not context:
                carried.zero_()
            done = start  # rows computed; split where snapshots are kept
            for cut, snapshot in [(start + p - context, s) for p, s in meta.state_snapshots[i]] + [(end, None)]:
                if cut > done:
                    out[done:cut] = delta_rule.over_rows(q[done:cut], k[done:cut], v[done:cut], g[done:cut],
                                                         beta[done:cut], carried)
                    done = cut
                if snapshot is not None:
                    state.snapshot_recurrent[snapshot] = carried
        return out

    def recur_batched(self, q, k, v, g, beta, meta: BatchMetadata, state: LinearStateCache, single: list[int],
                      out: torch.Tensor) -> None:
        """One token for each request in `single`, in one torch step over their gathered states."""
        rows, slots, fresh = single_rows(meta, single)
        carried = state.recurrent[slots].masked_fill(fresh.view(-1, 1, 1, 1), 0.0)
        out[rows] = delta_rule.recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], carried)
        state.recurrent[slots] = carried
        for j, i in enumerate(single):
            for _, snapshot in meta.state_snapshots[i]:  # (its one position: after this token)
                state.snapshot_recurrent[snapshot] = carried[j]

def single_rows(meta: BatchMetadata, single: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch row, state slot, whether the state starts fresh) of each single-row request, on the batch's device: made
    once per step for every KDA layer's batched steps."""
    def make():
        device = meta.positions.device
        return (torch.tensor([meta.query_start_loc_host[i] for i in single], device=device),
                torch.tensor([meta.state_slots[i] for i in single], device=device),
                torch.tensor([meta.context_len(i) == 0 for i in single], device=device))
    return meta.once(("kda single rows", tuple(single)), make)


def seed_single_rows(meta: BatchMetadata, rows: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> None:
    """single_rows of a batch whose every request has one row, given on the device (a captured step's, made from its
    static buffers rather than host values)."""
    meta.derived[("kda single rows", tuple(range(meta.num_reqs)))] = (rows, slots, fresh)


def inputs_before(tail: torch.Tensor, rows: torch.Tensor, offset: int) -> torch.Tensor:
    """The convolution's `width` inputs before row `offset` of a request's rows (fp32), reaching into the tail (the
    inputs before its first row) where offset < width."""
    width = tail.shape[0]
    if offset >= width:
        return rows[offset - width : offset].float()
    return torch.cat([tail[offset:], rows[:offset].float()])
