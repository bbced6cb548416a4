"""float8 e4m3fn in Triton, both ways, with integer operations where the hardware has no conversion.

e4m3_values decodes bytes to fp32: by the GPU's conversion where it has one (`native_fp8`: compute capability 8.9
and later, Ada and Hopper), else by shifts and masks (A100 and older have no fp8 conversion, and Triton refuses
fp8 there): s eeee mmm → the fp32 with the exponent rebased from 7 to 127 and the mantissa's top bits, exponent 0
being mant · 2^-9. e4m3_bits encodes fp32 to bytes, always with integer operations (see there). NaN bytes (0x7F,
0xFF) are not decoded as NaN: weights and cached keys never hold one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.triton_ops import interpreting


def native_fp8(device: torch.device) -> bool:
    """Whether Triton converts fp8 on `device` itself (its interpreter does, on CPU tensors)."""
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def e4m3_values(raw, NATIVE: tl.constexpr):
    """fp32 values of e4m3fn bytes (uint8)."""
    if NATIVE:  # if/else, one return: the compiler would also type (and emit) the code after a branch's return
        values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = raw.to(tl.int32)
        exponent = (v >> 3) & 0xF
        mantissa = v & 7
        normal = (((v & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = tl.where((v & 0x80) != 0, -1.0, 1.0) * mantissa.to(tl.float32) * 0.001953125  # 2^-9
        values = tl.where(exponent == 0, subnormal, normal)
    return values


@triton.jit
def e4m3_bits(x):
    """The float8 e4m3fn byte of fp32 values within ±448, rounded to nearest, ties to even, as torch rounds. Done
    with integer operations: Triton's interpreter converts to fp8 wrongly (ties up, carries into the exponent lost;
    seen with Triton 3.9), and this way both run the same code."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = tl.abs(x)
    # Below 2^-6 (subnormal): multiples of 2^-9; 8 of them is the smallest normal's byte, 0x08.
    small = magnitude * 512.0
    nearest = tl.floor(small + 0.5)
    odd = nearest * 0.5 != tl.floor(nearest * 0.5)
    subnormal = tl.where((nearest - small == 0.5) & odd, nearest - 1.0, nearest).to(tl.int32)
    # Normal: the exponent rebased from 127 to 7 and the top 3 mantissa bits, rounded on the 20 below them (a carry
    # moves into the exponent, as it should).
    exponent = ((bits >> 23) & 0xFF) - 127 + 7
    mantissa = bits & 0x7FFFFF
    kept = mantissa >> 20
    rest = mantissa & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((kept & 1) == 1))
    normal = tl.minimum((exponent << 3) + kept + up.to(tl.int32), 0x7E)
    return (tl.where(magnitude < 0.015625, subnormal, normal) | sign).to(tl.uint8)
