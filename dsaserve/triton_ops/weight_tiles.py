"""A tile of a weight in its stored form, times activations: what the weight products (quantized_linear.py) and the
routed experts (moe.py) share.

The forms are quantization/quantized_weight.py's row layout, one row per output column:

    FLOAT  the model dtype's values                                              no scale
    FP8    float8 e4m3 bytes [N, K], scales [N, G] per 128-column block          as FP8 checkpoints ship them
    INT8   int8 [N, K], one scale per row [N, 1]                                 --quantization int8
    INT4   two values per byte [N, ⌈K / 2⌉] (column 2j low nibble, 2j + 1 high; value + 8), scales [N, ⌈K / 128⌉]

Quantized values are exact in bf16 (int8's and int4's integers, e4m3's 3 mantissa bits), so a tile is widened in
registers and multiplied on the tensor cores in the activations' dtype; a K step lies inside one scale group (steps
of at most 128 columns counted from the group's first column), so its product is scaled once per output column.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsaserve.triton_ops.fp8_e4m3 import e4m3_values
from dsaserve.triton_ops.selected_rows import _operand

# The kind codes, formats.KINDS' for the stored forms (bf16 there is a packed form of the CPU kernels, not one here).
FLOAT, FP8, INT8, INT4 = 0, 1, 2, 3
KIND_CODES = {"fp8": FP8, "int8": INT8, "int4": INT4}
SCALE_GROUP = 128  # columns per scale of FP8 and int4 weights


@triton.jit
def weight_values(w_rows, k, mask, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """The [K, N] tile of unscaled weight values at columns k (rows' pointers w_rows [1, N]), fp32 (FLOAT: as
    stored)."""
    if KIND == 1:  # FP8
        values = e4m3_values(tl.load(w_rows + k[:, None], mask=mask, other=0), NATIVE_FP8)
    elif KIND == 2:  # INT8
        values = tl.load(w_rows + k[:, None], mask=mask, other=0).to(tl.float32)
    elif KIND == 3:  # INT4: each byte read for both of its columns (the second read hits the cache)
        packed = tl.load(w_rows + (k // 2)[:, None], mask=mask, other=0x88).to(tl.int32)
        values = (((packed >> ((k % 2) * 4)[:, None]) & 0xF) - 8).to(tl.float32)
    else:
        values = tl.load(w_rows + k[:, None], mask=mask, other=0.0)
    return values


@triton.jit
def weight_product(a, w_rows, s_rows, k, k0, k_ok, col_ok, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                   LOW_PRECISION_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, K] times the weight's tile [K, N] at columns k, scaled: k0 counts the step's first column from its scale
    group's first (the step lies inside that group). s_rows: the rows' scale pointers (unread for FLOAT)."""
    w = weight_values(w_rows, k, col_ok[None, :] & k_ok[:, None], KIND, NATIVE_FP8)
    # if/else, one return: the compiler types the code after a constexpr branch's return too (see _operand)
    if KIND == 0:
        product = tl.dot(a, _operand(w, LOW_PRECISION_DOT), input_precision=PRECISION)
    else:
        if KIND == 2:  # int8: one scale per row
            scale = tl.load(s_rows, mask=col_ok, other=0.0)
        else:
            scale = tl.load(s_rows + k0 // 128, mask=col_ok, other=0.0)
        product = tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * scale[None, :]
    return product
