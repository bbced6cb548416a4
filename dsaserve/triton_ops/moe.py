"""The routed experts in Triton, with no host synchronisation: the (token, choice) pairs sorted by expert on the
device, then two grouped GEMMs that read each expert's counts and offsets there.

Pairs are ordered by expert (torch's argsort, and a scatter-add that counts them, on the device). The first kernel
takes a tile of one expert's pairs and a block of the intermediate columns: gate and up from the tokens' rows, swiglu,
into a [pairs, intermediate] buffer. The second multiplies that by the expert's down projection, scales by the pair's
routing weight and writes the pair's own output row, so the k choices of a token are summed afterwards in a fixed order
(no atomics: the same bits every run). The grid covers every expert × the most tiles one expert could need;
programs past an expert's count return at once. Tokens are taken in chunks so the pair buffers stay bounded.

Quantized experts (FP8 as shipped, one scale per row and 128-column block; int8 and int4 from --quantization) are
widened in registers and each K step's product scaled once per output column (weight_tiles.py): the K loop steps
through whole scale groups, starting where they start (a rank's share of an FP8 intermediate may begin inside one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops.fp8_e4m3 import native_fp8
from dsaserve.triton_ops.selected_rows import _operand, dot_inputs
from dsaserve.triton_ops.weight_tiles import FLOAT, KIND_CODES, weight_product

PAIR_BUFFER_ELEMENTS = 1 << 24  # fp32 elements of a chunk's per-pair outputs: 64 MiB
BLOCK_M = 16  # pairs per tile (tl.dot's smallest)


@triton.jit
def _tile_pairs(starts, counts, BLOCK_M: tl.constexpr):
    """This program's tile of its expert's pairs: (positions in the sorted order, which of them exist)."""
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    expert = tl.program_id(0)
    return tl.load(starts + expert) + m, m < tl.load(counts + expert)


@triton.jit
def _gate_up_kernel(x, weights, scales, token_of, starts, counts, hidden_out, hidden, inter, x_stride, w_stride_e,
                    w_stride_n, s_stride_e, s_stride_n, h_stride, limit,
                    HAS_LIMIT: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                    LOW_PRECISION_DOT: tl.constexpr, PRECISION: tl.constexpr):
    expert = tl.program_id(0)
    if tl.program_id(1) * BLOCK_M >= tl.load(counts + expert):  # past this expert's pairs
        return
    pair, row_ok = _tile_pairs(starts, counts, BLOCK_M)
    token = tl.load(token_of + pair, mask=row_ok, other=0).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = n < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w = weights + expert.to(tl.int64) * w_stride_e
    s = scales + expert.to(tl.int64) * s_stride_e
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = _operand(tl.load(x + token[:, None] * x_stride + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                             other=0.0), LOW_PRECISION_DOT)
        gate += weight_product(a, w + n[None, :] * w_stride_n, s + n * s_stride_n, k, k0, k_ok, col_ok, KIND,
                                NATIVE_FP8, LOW_PRECISION_DOT, PRECISION)
        up += weight_product(a, w + (inter + n[None, :]) * w_stride_n, s + (inter + n) * s_stride_n, k, k0, k_ok,
                              col_ok, KIND, NATIVE_FP8, LOW_PRECISION_DOT, PRECISION)
    if ROUND:  # a bf16/fp16 model rounds the projection's output, as torch's path does
        gate = gate.to(hidden_out.dtype.element_ty).to(tl.float32)
        up = up.to(hidden_out.dtype.element_ty).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(hidden_out + pair[:, None].to(tl.int64) * h_stride + n[None, :], h.to(hidden_out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(hidden_in, weights, scales, pair_index, pair_weight, starts, counts, out, hidden, inter, col_offset,
                 h_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n, out_stride,
                 ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr,
                 PRECISION: tl.constexpr):
    expert = tl.program_id(0)
    if tl.program_id(1) * BLOCK_M >= tl.load(counts + expert):  # past this expert's pairs
        return
    pair, row_ok = _tile_pairs(starts, counts, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = n < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w = weights + expert.to(tl.int64) * w_stride_e
    s = scales + expert.to(tl.int64) * s_stride_e
    for k0 in range(0, inter + col_offset, BLOCK_K):  # k0 counts from the first scale block's first column
        k = k0 - col_offset + tl.arange(0, BLOCK_K)
        k_ok = (k >= 0) & (k < inter)
        a = _operand(tl.load(hidden_in + pair[:, None].to(tl.int64) * h_stride + k[None, :],
                             mask=row_ok[:, None] & k_ok[None, :], other=0.0), LOW_PRECISION_DOT)
        acc += weight_product(a, w + n[None, :] * w_stride_n, s + n * s_stride_n, k, k0, k_ok, col_ok, KIND,
                               NATIVE_FP8, LOW_PRECISION_DOT, PRECISION)
    if ROUND:
        acc = acc.to(hidden_in.dtype.element_ty).to(tl.float32)
    scale = tl.load(pair_weight + pair, mask=row_ok, other=0.0)
    target = tl.load(pair_index + pair, mask=row_ok, other=0).to(tl.int64)
    tl.store(out + target[:, None] * out_stride + n[None, :], acc * scale[:, None],
             mask=row_ok[:, None] & col_ok[None, :])


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, first_expert: int, limit: float | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None, down_offset: int = 0,
                   kind: str = "fp8") -> torch.Tensor:
    """Σ_j weights[t, j] · down_e(swiglu(gate_up_e(x[t]))) over token t's choices e = ids[t, j] held here
    (experts [first_expert, first_expert + E)); fp32 [T, H]. gate_up [E, 2I, H] (gate rows, then up), down [E, H, I].
    Quantized experts (with `scales`): gate_up and down in the row layout of `kind` (weight_tiles.py: FP8's bytes as
    shipped, int8, int4's packed pairs), `scales` theirs ([E, 2I, G], [E, H, G]) and down_offset an FP8 down's first
    column inside its scale block."""
    quantized = scales is not None
    gate_up_scale, down_scale = scales if quantized else (gate_up, down)  # (unread for float experts)
    code = KIND_CODES[kind] if quantized else FLOAT
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    total = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    chunk = max(1, PAIR_BUFFER_ELEMENTS // (top_k * max(hidden, inter)))
    low, precision = dot_inputs(x.dtype)
    native = native_fp8(x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    for t0 in range(0, tokens, chunk):
        t1 = min(t0 + chunk, tokens)
        local = (ids[t0:t1] - first_expert).flatten()
        held = (local >= 0) & (local < experts)
        key = torch.where(held, local, experts)  # pairs routed elsewhere sort last and are never read
        order = key.argsort(stable=True)
        # (not torch.bincount: on CUDA it reads its input's range back to the host, which a graph cannot capture)
        counts = torch.zeros(experts + 1, dtype=torch.int64, device=x.device).scatter_add_(
            0, key, torch.ones_like(key))[:experts]
        starts = torch.cumsum(counts, 0) - counts
        token_of = (order // top_k + t0).contiguous()
        pair_weight = weights[t0:t1].flatten()[order].float().contiguous()
        pairs = (t1 - t0) * top_k
        hidden_buffer = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        pair_out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
        tiles = triton.cdiv(t1 - t0, BLOCK_M)  # an expert takes a token at most once
        block_k = max(16, min(64, triton.next_power_of_2(hidden)))
        block_n = max(16, min(64, triton.next_power_of_2(inter)))
        _gate_up_kernel[(experts, tiles, triton.cdiv(inter, block_n))](
            x, gate_up, gate_up_scale, token_of, starts, counts, hidden_buffer, hidden, inter, x.stride(0),
            gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1),
            hidden_buffer.stride(0), float(limit or 0.0), HAS_LIMIT=limit is not None,
            ROUND=x.dtype != torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, KIND=code,
            NATIVE_FP8=native, LOW_PRECISION_DOT=low, PRECISION=precision)
        block_n = max(16, min(64, triton.next_power_of_2(hidden)))
        block_k = max(16, min(64, triton.next_power_of_2(inter)))
        _down_kernel[(experts, tiles, triton.cdiv(hidden, block_n))](
            hidden_buffer, down, down_scale, order.contiguous(), pair_weight, starts, counts, pair_out, hidden, inter,
            down_offset if quantized else 0, hidden_buffer.stride(0), down.stride(0), down.stride(1),
            down_scale.stride(0), down_scale.stride(1), pair_out.stride(0), ROUND=x.dtype != torch.float32,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, KIND=code, NATIVE_FP8=native, LOW_PRECISION_DOT=low,
            PRECISION=precision)
        total[t0:t1] = pair_out.view(t1 - t0, top_k, hidden).sum(1)
    return total
