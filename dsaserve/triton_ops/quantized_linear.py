"""Quantized weights multiplied in their stored form, in Triton: y = x · dequant(W)ᵀ with W [N, K] in FP8 (as FP8
checkpoints ship it), int8 or int4 (--quantization), the row layouts of weight_tiles.py.

The weight stays quantized in memory (FP8 and int8: half the bytes of bf16, what lets GLM-5.2 fit on 8 GPUs; int4: a
quarter); each program widens its tiles in registers (weight_tiles.py; FP8 also on GPUs without fp8 conversion) and
multiplies them with the activations on the tensor cores. Decode is bound by the weight's bytes, so fewer bytes are
a faster step where the widening keeps up (benchmarks/gpu_check.py times each form against bf16).
Its K loop steps through whole scale groups: a step starts where the weight's column groups do (a rank's slice of an
FP8 tensor may start `col_offset` columns into its first block), so a step's products share one scale per output row
and are scaled once, after the dot. A leading batch dimension serves per-head weights (W_UK, W_UV) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops.fp8_e4m3 import native_fp8
from dsaserve.triton_ops.selected_rows import _operand, dot_inputs
from dsaserve.triton_ops.weight_tiles import INT4, INT8, KIND_CODES, SCALE_GROUP, weight_product


@triton.jit
def _quantized_linear_kernel(x, w, scale, out, rows, cols, width, col_offset,
                             x_stride_b, x_stride_m, w_stride_b, w_stride_n, s_stride_b, s_stride_n, o_stride_b,
                             o_stride_m, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NATIVE_FP8: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr,
                             PRECISION: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    batch = tl.program_id(2).to(tl.int64)
    m_ok, n_ok = m < rows, n < cols
    x_rows = x + batch * x_stride_b + m[:, None].to(tl.int64) * x_stride_m
    w_rows = w + batch * w_stride_b + n[None, :].to(tl.int64) * w_stride_n
    s_rows = scale + batch * s_stride_b + n.to(tl.int64) * s_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, width + col_offset, BLOCK_K):  # k0 counts from the first scale group's first column
        k = k0 - col_offset + tl.arange(0, BLOCK_K)
        k_ok = (k >= 0) & (k < width)
        a = _operand(tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0), LOW_PRECISION_DOT)
        acc += weight_product(a, w_rows, s_rows, k, k0, k_ok, n_ok, KIND, NATIVE_FP8, LOW_PRECISION_DOT, PRECISION)
    target = out + batch * o_stride_b + m[:, None].to(tl.int64) * o_stride_m + n[None, :]
    tl.store(target, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, kind: str,
                     col_offset: int = 0) -> torch.Tensor:
    """x [M, K] by a weight of `kind` (fp8, int8, int4) in its row layout, qweight [N, K] (int4: [N, ⌈K / 2⌉]) with
    scales [N, G]: [M, N] in x's dtype. Batched: x [B, M, K] (any strides with unit columns), qweight and scale with
    a leading B → [B, M, N]. col_offset: an FP8 weight's first column inside its scale block."""
    batched = x.dim() == 3
    xs, ws, ss = (x, qweight, scale) if batched else (x.unsqueeze(0), qweight.unsqueeze(0), scale.unsqueeze(0))
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    count, rows, width = xs.shape
    cols = ws.shape[1]
    code = KIND_CODES[kind]
    stored = -(-width // 2) if code == INT4 else width
    groups = 1 if code == INT8 else (width + col_offset - 1) // SCALE_GROUP + 1  # (col_offset < SCALE_GROUP)
    if ws.shape[2] != stored or ss.shape[2] != groups:
        raise ValueError(f"quantized_matmul: activations [{rows}, {width}], {kind} weight {tuple(ws.shape[1:])}, "
                         f"scales {tuple(ss.shape[1:])} with col_offset {col_offset} do not agree")
    out = torch.empty(count, rows, cols, dtype=x.dtype, device=x.device)
    if rows:
        low, precision = dot_inputs(x.dtype)
        block_m = 16 if rows <= 16 else 64
        block_n = 32 if rows <= 16 else 128  # few rows: more programs over N to keep the memory busy
        if x.element_size() > 2 and rows > 16:  # fp32 (the parity path): 64 × 128 tiles need 160 KiB of shared memory,
            block_m, block_n = 32, 64  # over an RTX PRO 6000's or an L40S's 99 KiB (triton_ops/compile_check.py)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), count)
        _quantized_linear_kernel[grid](
            xs, ws, ss, out, rows, cols, width, col_offset, xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1),
            ss.stride(0), ss.stride(1), out.stride(0), out.stride(1), KIND=code, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=SCALE_GROUP, NATIVE_FP8=native_fp8(x.device), LOW_PRECISION_DOT=low, PRECISION=precision)
    return out if batched else out[0]
