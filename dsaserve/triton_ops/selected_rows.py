"""Sparse MLA decode in Triton: each query's heads attend over the cache rows it selected, with an online softmax.

The contract of native/selected_rows.py: query [n, H, D] (absorbed: latent columns then rope columns), rows [N, D]
(the flattened latent cache), slots int64 [n, K] with -1 for empty entries, out [n, H, V] = softmax(scale · q·rowᵀ)
· row[:, :V]. One program takes one query and a block of its heads, so each selected row is read once for all of
them; the row is split into its value columns and the rest (for GLM-5.2: 512 latent + 64 rope), each a power-of-two
tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops import interpreting

ROWS_PER_STEP = 32  # selected rows scored per step of the online softmax (16 for fp32 rows: see attend_selected_rows)


@triton.jit
def _operand(x, LOW_PRECISION_DOT: tl.constexpr):
    # bf16/fp16 tiles go to the tensor cores as they are; fp32 ones in full fp32 (see dot_inputs). One return: the
    # compiler types every return of a function alike, a constexpr branch's too (the interpreter does not).
    if not LOW_PRECISION_DOT:
        x = x.to(tl.float32)
    return x


@triton.jit
def _query_tiles(q_row, row_ok, VALUE: tl.constexpr, REST: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_R: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr):
    """The queries' value columns and the rest (rope), [rows, BLOCK_V] and [rows, BLOCK_R], from row pointers."""
    v = tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    q_value = _operand(tl.load(q_row + v[None, :], mask=row_ok[:, None] & (v[None, :] < VALUE), other=0.0),
                       LOW_PRECISION_DOT)
    q_rest = _operand(tl.load(q_row + VALUE + r[None, :], mask=row_ok[:, None] & (r[None, :] < REST), other=0.0),
                      LOW_PRECISION_DOT)
    return q_value, q_rest


@triton.jit
def _online_softmax_step(q_value, q_rest, rows, slot, attends, scale, best, total, acc, row_stride,
                         VALUE: tl.constexpr, REST: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                         LOW_PRECISION_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One step of the online softmax: the cache rows at `slot` (-1: none) scored by every query row, those where
    `attends` [rows, slots] is False weighing nothing; the running (best, total, acc) after them."""
    v = tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    valid = slot >= 0
    base = rows + tl.where(valid, slot, 0).to(tl.int64)[:, None] * row_stride
    key_value = _operand(tl.load(base + v[None, :], mask=valid[:, None] & (v[None, :] < VALUE), other=0.0),
                         LOW_PRECISION_DOT)
    key_rest = _operand(tl.load(base + VALUE + r[None, :], mask=valid[:, None] & (r[None, :] < REST), other=0.0),
                        LOW_PRECISION_DOT)
    score = tl.dot(q_value, tl.trans(key_value), input_precision=PRECISION)
    score += tl.dot(q_rest, tl.trans(key_rest), input_precision=PRECISION)
    score = tl.where(attends, score * scale, -1.0e30)
    new_best = tl.maximum(best, tl.max(score, axis=1))
    weight = tl.where(attends, tl.exp(score - new_best[:, None]), 0.0)
    rescale = tl.exp(best - new_best)
    total = total * rescale + tl.sum(weight, axis=1)
    acc = acc * rescale[:, None] + tl.dot(_operand(weight.to(key_value.dtype), LOW_PRECISION_DOT), key_value,
                                          input_precision=PRECISION)
    return new_best, total, acc


@triton.jit
def _selected_rows_kernel(
    query, rows, slots, out, lse, scale, heads, width,
    q_stride_n, q_stride_h, row_stride, slot_stride, out_stride_n, out_stride_h, lse_stride_n,
    VALUE: tl.constexpr, REST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_LSE: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # i · q_stride_n passes 2^31 at 32K rows of 128 heads × 576
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    v = tl.arange(0, BLOCK_V)
    head_ok = h < heads
    q_value, q_rest = _query_tiles(query + i * q_stride_n + h[:, None] * q_stride_h, head_ok, VALUE, REST, BLOCK_V,
                                   BLOCK_R, LOW_PRECISION_DOT)
    best = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        slot = tl.load(slots + i * slot_stride + k, mask=k < width, other=-1)
        best, total, acc = _online_softmax_step(q_value, q_rest, rows, slot, (slot >= 0)[None, :], scale, best,
                                                total, acc, row_stride, VALUE, REST, BLOCK_V, BLOCK_R,
                                                LOW_PRECISION_DOT, PRECISION)
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_ptr = out + i * out_stride_n + h[:, None] * out_stride_h + v[None, :]
    tl.store(out_ptr, result.to(out.dtype.element_ty), mask=head_ok[:, None] & (v[None, :] < VALUE))
    if HAS_LSE:  # the log-sum-exp of the scaled scores (-inf: no row), for merging parts of a context (DCP)
        lse_value = tl.where(total > 0, best + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse + i * lse_stride_n + h, lse_value, mask=head_ok)


def dot_inputs(dtype: torch.dtype) -> tuple[bool, str]:
    """(pass bf16/fp16 tiles to tl.dot as they are, tl.dot's input precision). fp32 models multiply in full fp32
    ('ieee', not tf32: the CUDA path must agree with the CPU's fp32 within 1e-3). The interpreter widens bf16 tiles
    first: its bf16 products are wrong (measured with Triton 3.9: loaded bf16 values added or multiplied as raw
    bits), while its fp32 ones are exact."""
    low = dtype in (torch.bfloat16, torch.float16) and not interpreting()
    return low, "tf32" if low else "ieee"


def attend_selected_rows(query: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float,
                         out: torch.Tensor, lse: torch.Tensor | None = None) -> None:
    """out[i, h] = softmax(scale · query[i, h] · rows[slots[i]]ᵀ) · rows[slots[i], :V], V = out.shape[-1]; empty
    entries (-1) take no weight and a query without any selected row gets zeros. lse (fp32 [n, heads], optional):
    log Σ exp(scale · query[i, h] · rows[slots[i]]ᵀ), -inf where no row is selected."""
    n, heads, dim = query.shape
    value = out.shape[-1]
    if lse is not None and (lse.shape != (n, heads) or lse.dtype != torch.float32 or lse.stride(-1) != 1):
        raise ValueError(f"selected rows: lse {tuple(lse.shape)} {lse.dtype} is not fp32 [{n}, {heads}] with unit "
                         "head stride")
    if rows.shape[1] != dim or slots.shape[0] != n or out.shape[:2] != (n, heads) or value > dim:
        raise ValueError(f"selected rows: shapes query {tuple(query.shape)}, rows {tuple(rows.shape)}, "
                         f"slots {tuple(slots.shape)}, out {tuple(out.shape)} do not fit together")
    if n == 0:
        return
    query = query if query.stride(-1) == 1 else query.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    slots = slots.to(torch.int64)
    slots = slots if slots.stride(-1) == 1 else slots.contiguous()
    target = out if out.stride(-1) == 1 else torch.empty_like(out)
    rest = dim - value
    low, precision = dot_inputs(rows.dtype)
    # tl.dot takes tiles of at least 16. Wide value rows (GLM-5.2's 512) keep 16 heads per program: the fp32
    # accumulator [heads, value] stays 32 registers a thread over 8 warps, where 64 heads would spill.
    block_h = 16 if value >= 256 else max(16, min(64, triton.next_power_of_2(heads)))
    # fp32 rows (the parity path) take half the rows a step: 32 of them with their pipelined copies are 111 KiB of
    # shared memory, over the 99 KiB of an RTX PRO 6000 or an L40S (python -m dsaserve.triton_ops.compile_check).
    block_k = ROWS_PER_STEP if rows.element_size() <= 2 else ROWS_PER_STEP // 2
    grid = (n, triton.cdiv(heads, block_h))
    _selected_rows_kernel[grid](
        query, rows, slots, target, target if lse is None else lse, float(scale), heads, slots.shape[1],
        query.stride(0), query.stride(1), rows.stride(0), slots.stride(0), target.stride(0), target.stride(1),
        0 if lse is None else lse.stride(0), VALUE=value, REST=rest, BLOCK_H=block_h,
        BLOCK_V=max(16, triton.next_power_of_2(value)), BLOCK_R=max(16, triton.next_power_of_2(max(rest, 1))),
        BLOCK_K=block_k, HAS_LSE=lse is not None, LOW_PRECISION_DOT=low, PRECISION=precision,
        num_warps=8 if value >= 256 else 4,
    )
    if target is not out:
        out.copy_(target)
