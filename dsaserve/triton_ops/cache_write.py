"""Writing keys into the indexer's paged key cache in Triton: each row to its slot, quantized on the way where the
cache keeps int8 or fp8 keys (one scale per token: amax / 127 or amax / 448, as attention/indexer_cache.py's torch
path computes it, int8 rounding half to even), in one kernel instead of a chain of torch operators."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops.fp8_e4m3 import e4m3_bits


@triton.jit
def _write_rows_kernel(rows, scales, slots, values, dim, row_stride, value_stride,
                       QUANT: tl.constexpr, TOP: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    inside = d < dim
    slot = tl.load(slots + i).to(tl.int64)
    x = tl.load(values + i * value_stride + d, mask=inside, other=0.0).to(tl.float32)
    target = rows + slot * row_stride + d
    if QUANT == 0:
        tl.store(target, x.to(rows.dtype.element_ty), mask=inside)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8) / TOP
        scaled = x / scale
        if QUANT == 1:  # int8: nearest, ties to even (torch.round), within ±127
            nearest = tl.floor(scaled + 0.5)
            odd = nearest * 0.5 != tl.floor(nearest * 0.5)
            nearest = tl.where((nearest - scaled == 0.5) & odd, nearest - 1.0, nearest)
            tl.store(target, tl.minimum(tl.maximum(nearest, -127.0), 127.0).to(tl.int8), mask=inside)
        else:  # fp8 e4m3fn, written as its bytes (rows is the cache's uint8 view)
            tl.store(target, e4m3_bits(scaled), mask=inside)
        tl.store(scales + slot, scale.to(scales.dtype.element_ty))


def write_rows(rows: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, values: torch.Tensor) -> None:
    """rows[slots[i]] = values[i] (rows [N, D] of the cache's storage dtype): int8 rows (scales fp16 [N]) hold
    round(v / s) with s = amax / 127, fp8 rows (scales fp32 [N]) hold v / s with s = amax / 448, other dtypes v."""
    n, dim = values.shape
    if rows.shape[1] != dim or slots.shape != (n,):
        raise ValueError(f"write rows: rows {tuple(rows.shape)}, slots {tuple(slots.shape)}, values "
                         f"{tuple(values.shape)} do not fit together")
    if n == 0:
        return
    quant = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(rows.dtype, 0)
    if quant and scales is None:
        raise ValueError(f"write rows: {rows.dtype} rows need their scales")
    values = values if values.stride(-1) == 1 else values.contiguous()
    rows = rows.view(torch.uint8) if quant == 2 else rows
    _write_rows_kernel[(n,)](rows, scales if quant else rows, slots, values, dim, rows.stride(0), values.stride(0),
                             QUANT=quant, TOP=127.0 if quant == 1 else 448.0,
                             BLOCK_D=max(16, triton.next_power_of_2(dim)))
