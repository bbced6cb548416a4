"""FP8 weights multiplied as they ship, in Triton: y = x · dequant(W)ᵀ with W float8 e4m3 [N, K] and one fp32 scale per
row and 128-column block ([N, G], the rows layout of quantization/quantized_weight.py).

The weight stays in FP8 in memory (half the bytes of bf16, what lets GLM-5.2 fit on 8 GPUs); each program widens its
tiles in registers (e4m3 values are exact in bf16; fp8_e4m3.py, also on GPUs without fp8 conversion) and multiplies
them with the activations on the tensor cores.
Its K loop steps through whole scale blocks: a step starts where the weight's column blocks do (a rank's slice may
start `col_offset` columns into its first block), so a step's products share one scale per output row and are scaled
once, after the dot. A leading batch dimension serves per-head weights (W_UK, W_UV) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops.fp8_e4m3 import e4m3_values, native_fp8
from dsaserve.triton_ops.selected_rows import _operand, dot_inputs

SCALE_BLOCK = 128  # columns per scale (FP8 checkpoints' 128 × 128 blocks)


@triton.jit
def _fp8_linear_kernel(x, w, scale, out, rows, cols, width, col_offset,
                       x_stride_b, x_stride_m, w_stride_b, w_stride_n, s_stride_b, s_stride_n, o_stride_b, o_stride_m,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr, PRECISION: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    batch = tl.program_id(2).to(tl.int64)
    m_ok, n_ok = m < rows, n < cols
    x_rows = x + batch * x_stride_b + m[:, None].to(tl.int64) * x_stride_m
    w_rows = w + batch * w_stride_b + n[None, :].to(tl.int64) * w_stride_n
    s_rows = scale + batch * s_stride_b + n.to(tl.int64) * s_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, width + col_offset, BLOCK_K):  # k0 counts from the first scale block's first column
        k = k0 - col_offset + tl.arange(0, BLOCK_K)
        k_ok = (k >= 0) & (k < width)
        a = _operand(tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0), LOW_PRECISION_DOT)
        q = tl.load(w_rows + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        b = e4m3_values(q, NATIVE_FP8).to(a.dtype)
        s = tl.load(s_rows + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION) * s[None, :]
    target = out + batch * o_stride_b + m[:, None].to(tl.int64) * o_stride_m + n[None, :]
    tl.store(target, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, col_offset: int = 0) -> torch.Tensor:
    """x [M, K] by an FP8 weight qweight [N, K] (its bytes, uint8) with scales [N, G]: [M, N] in x's dtype. Batched:
    x [B, M, K] (any strides with unit columns), qweight [B, N, K], scale [B, N, G] → [B, M, N]. col_offset: the
    weight's first column inside its scale block."""
    batched = x.dim() == 3
    xs, ws, ss = (x, qweight, scale) if batched else (x.unsqueeze(0), qweight.unsqueeze(0), scale.unsqueeze(0))
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    count, rows, width = xs.shape
    cols = ws.shape[1]
    if ws.shape[2] != width or ss.shape[2] != (width + col_offset - 1) // SCALE_BLOCK + 1:
        raise ValueError(f"fp8_matmul: activations [{rows}, {width}], weight {tuple(ws.shape[1:])}, scales "
                         f"{tuple(ss.shape[1:])} with col_offset {col_offset} do not agree")
    out = torch.empty(count, rows, cols, dtype=x.dtype, device=x.device)
    if rows:
        low, precision = dot_inputs(x.dtype)
        block_m = 16 if rows <= 16 else 64
        block_n = 32 if rows <= 16 else 128  # few rows: more programs over N to keep the memory busy
        if x.element_size() > 2 and rows > 16:  # fp32 (the parity path): 64 × 128 tiles need 160 KiB of shared memory,
            block_m, block_n = 32, 64  # over an RTX PRO 6000's or an L40S's 99 KiB (triton_ops/compile_check.py)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), count)
        _fp8_linear_kernel[grid](
            xs, ws, ss, out, rows, cols, width, col_offset, xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1),
            ss.stride(0), ss.stride(1), out.stride(0), out.stride(1), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=SCALE_BLOCK, SCALE_BLOCK=SCALE_BLOCK, NATIVE_FP8=native_fp8(x.device), LOW_PRECISION_DOT=low,
            PRECISION=precision)
    return out if batched else out[0]
