"""The lightning indexer's scores in Triton, read from the paged key cache where the keys are.

out[t, s] = Σ_h w[t, h] · relu(q[t, h] · key(s)) for the positions s of query t's request, -inf where s lies in
the query's future (s > position[t]) or past the columns the request holds. Keys are the cache's own rows: in the
model's dtype, or int8 / fp8 with a scale per token (attention/indexer_cache.py), dequantized in registers. One
program scores one query against a block of positions, all heads at once, so each key is read once per query and
the per-head scores never leave registers; programs wholly in the query's future only write -inf (a short request
batched with a long one costs little). Each program also adds its scores' top key bytes to its query's histogram
(those above -inf) in `counts`: the first pass of the top-k that follows (row_topk.py), done while the scores are in
registers. (Page selections rank pages, not these scores, and leave the counts unread: one kernel form, compiled
once, for a few atomics a program.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops.fp8_e4m3 import e4m3_values, native_fp8
from dsaserve.triton_ops.row_topk import BINS, _key_digit, _order_key
from dsaserve.triton_ops.selected_rows import _operand, dot_inputs

POSITIONS_PER_PROGRAM = 64


@triton.jit
def _index_scores_kernel(
    q, weights, keys, key_scales, tables, row_request, positions, out, counts, heads, dim, columns, block_size,
    q_stride_t, q_stride_h, w_stride_t, key_stride_block, key_stride_token, scale_stride_block, table_stride,
    out_stride_t, count_stride_t,
    HAS_SCALE: tl.constexpr, FP8_KEYS: tl.constexpr, NATIVE_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    in_range = s < columns
    position = tl.load(positions + t)
    if tl.program_id(1) * BLOCK_S > position:  # wholly in this query's future (a shorter request of the batch)
        tl.store(out + t * out_stride_t + s, tl.full((BLOCK_S,), float("-inf"), tl.float32), mask=in_range)
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    head_ok = h < heads
    query = _operand(tl.load(q + t * q_stride_t + h[:, None] * q_stride_h + d[None, :],
                             mask=head_ok[:, None] & (d[None, :] < dim), other=0.0), LOW_PRECISION_DOT)
    weight = tl.load(weights + t * w_stride_t + h, mask=head_ok, other=0.0).to(tl.float32)
    request = tl.load(row_request + t)
    block = tl.load(tables + request * table_stride + s // block_size, mask=in_range, other=0).to(tl.int64)
    offset = s % block_size
    key = tl.load(keys + block[:, None] * key_stride_block + offset[:, None] * key_stride_token + d[None, :],
                  mask=in_range[:, None] & (d[None, :] < dim), other=0)
    key = e4m3_values(key, NATIVE_FP8) if FP8_KEYS else key.to(tl.float32)
    if HAS_SCALE:
        key = key * tl.load(key_scales + block * scale_stride_block + offset, mask=in_range, other=0.0).to(
            tl.float32)[:, None]
    per_head = tl.dot(query, tl.trans(_operand(key.to(query.dtype), LOW_PRECISION_DOT)), input_precision=PRECISION)
    score = tl.sum(tl.maximum(per_head, 0.0) * weight[:, None], axis=0)
    score = tl.where(s <= position, score, float("-inf"))
    tl.store(out + t * out_stride_t + s, score, mask=in_range)
    block_counts = tl.histogram(_key_digit(_order_key(score), 24, 8), 256, mask=in_range & (score > float("-inf")))
    tl.atomic_add(counts + t * count_stride_t + tl.arange(0, 256), block_counts, mask=block_counts > 0)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None,
                 tables: torch.Tensor, row_request: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                 counts: torch.Tensor) -> None:
    """q [t, H, D], weights fp32 [t, H], keys [num_blocks, block_size, D] (the cache's data: model dtype, int8 or
    fp8) with key_scales [num_blocks, block_size] for quantized keys, tables [R, max_blocks] block ids per request,
    row_request [t] and positions [t] per query, out fp32 [t, C]: the scores of positions 0 .. C-1 (C at most the
    tables' width × block_size). counts int32 [t, 256]: each row's row_topk.top_byte_counts are added to it (zeros
    before: the top-k's first histogram)."""
    t, heads, dim = q.shape
    if keys.shape[-1] != dim or weights.shape != (t, heads) or out.shape[0] != t or out.stride(-1) != 1:
        raise ValueError(f"index scores: q {tuple(q.shape)}, weights {tuple(weights.shape)}, keys "
                         f"{tuple(keys.shape)}, out {tuple(out.shape)} do not fit together")
    columns = out.shape[1]
    if columns > tables.shape[1] * keys.shape[1]:
        raise ValueError(f"index scores: {columns} columns but the block tables hold "
                         f"{tables.shape[1] * keys.shape[1]} positions")
    if counts.shape != (t, BINS) or counts.dtype != torch.int32 or counts.stride(-1) != 1:
        raise ValueError(f"index scores: counts {tuple(counts.shape)} {counts.dtype} is not int32 [{t}, {BINS}]")
    if t == 0 or columns == 0:
        return
    q = q if q.stride(-1) == 1 else q.contiguous()
    low, precision = dot_inputs(q.dtype)
    scales = key_scales if key_scales is not None else weights  # an unread pointer where keys have no scale
    fp8 = keys.dtype == torch.float8_e4m3fn
    keys = keys.view(torch.uint8) if fp8 else keys  # decoded in the kernel (fp8_e4m3.py)
    grid = (t, triton.cdiv(columns, POSITIONS_PER_PROGRAM))
    _index_scores_kernel[grid](
        q, weights, keys, scales, tables, row_request, positions, out, counts, heads, dim, columns, keys.shape[1],
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1),
        scales.stride(0) if key_scales is not None else 0, tables.stride(0), out.stride(0), counts.stride(0),
        HAS_SCALE=key_scales is not None, FP8_KEYS=fp8, NATIVE_FP8=native_fp8(q.device),
        BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_S=POSITIONS_PER_PROGRAM, LOW_PRECISION_DOT=low, PRECISION=precision,
    )
