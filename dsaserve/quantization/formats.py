"""The stored forms of a weight [N, K]: how a float weight becomes one, and the kernels' packed layout.

A form is (q [N, K], scale [N, G], group): dequant(q)[n, k] = q[n, k] · scale[n, (k + c) // group - c // group]
with c the column offset of a rank's slice of an FP8 tensor (0 otherwise).

    bf16  q bf16, scale 1                    the unquantized weight, for the bandwidth kernel
    fp8   q float8 e4m3 (as bytes)           scales as shipped: 128 × 128 blocks, repeated on each row
    int8  q int8, one scale per row          symmetric, amax / 127
    int4  q in -8 … 7, groups of 128         symmetric, amax / 7

Packed (native/quant_linear.cpp): rows in blocks of 16, columns in pairs; entry
((n // 16) · K2 + k // 2) · 32 + (n % 16) · 2 + k % 2 (int4: two columns per byte, value + 8), scales
[N16 / 16, G, 16]. Padding rows and columns hold zeros.
"""

from __future__ import annotations

import torch

from dsaserve.native import torch_ops
from dsaserve.quantization.fp8_blocks import Fp8Slice, as_float, quantize_fp8

KINDS = {"bf16": 0, "fp8": 1, "int8": 2, "int4": 3}
QUANTIZATION_MODES = ("fp8", "int8", "int4")
FP8_BLOCK = 128
INT4_GROUP = 128


def group_of(kind: str, k: int) -> int:
    return {"bf16": k + k % 2, "fp8": FP8_BLOCK, "int8": k + k % 2, "int4": INT4_GROUP}[kind]


def scale_columns(kind: str, k: int, col_offset: int = 0) -> int:
    group = group_of(kind, k)
    return (k - 1 + col_offset) // group - col_offset // group + 1


def packed_shapes(kind: str, n: int, k: int,
                  col_offset: int = 0) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]:
    """(shape, dtype) of the packed q, and the shape of the packed scales, for a [n, k] weight."""
    blocks, k2 = -(-n // 16), -(-k // 2)
    q = {"bf16": ((blocks, k2, 32), torch.bfloat16), "fp8": ((blocks, k2, 32), torch.uint8),
         "int8": ((blocks, k2, 32), torch.int8), "int4": ((blocks, k2, 16), torch.uint8)}[kind]
    return q[0], q[1], (blocks, scale_columns(kind, k, col_offset), 16)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (int8 [N, K], fp32 scale [N, 1])."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    return (w / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (values -8 … 7 as int8 [N, K], fp32 scale [N, ceil(K / group)])."""
    w = w.float()
    n, k = w.shape
    groups = -(-k // group)
    if k % group:  # the last group padded with zeros
        w = torch.cat([w, w.new_zeros(n, groups * group - k)], dim=1)
    blocks = w.view(n, groups, group)
    scale = blocks.abs().amax(dim=2).clamp_(min=1e-12).div_(7)
    q = (blocks / scale[:, :, None]).round_().clamp_(-8, 7).to(torch.int8).view(n, -1)[:, :k]
    return q, scale


def quantize(kind: str, source) -> tuple[torch.Tensor, torch.Tensor]:
    """A float tensor [N, K] or an Fp8Slice in the int8 or int4 form: quantize_int8/int4 of it as fp32, natively where
    the operators are loaded (the same bits, one row of fp32 at a time instead of several copies of the whole)."""
    weight = source.weight if isinstance(source, Fp8Slice) else source
    if weight.is_cpu and torch_ops.load():
        if isinstance(source, Fp8Slice):
            return torch.ops.dsaserve.quantize_rows(*source.native_args(), KINDS[kind])
        if source.dtype in (torch.bfloat16, torch.float32):
            return torch.ops.dsaserve.quantize_rows(source.contiguous(), None, 1, 1, 0, 0, KINDS[kind])
    w = as_float(source).float()
    return quantize_int8(w) if kind == "int8" else quantize_int4(w)


def quantize_fp8_rows(w: torch.Tensor, col_offset: int = 0,
                      block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] → (float8 e4m3 bytes [N, K], fp32 scales per row [N, G]) in 128 × 128 blocks, as FP8
    checkpoints ship them; the column blocks start `col_offset` columns before w's first column."""
    padded = torch.cat([w.new_zeros(w.shape[0], col_offset), w], dim=1)
    q, scale_inv = quantize_fp8(padded, (block, block))
    return q[:, col_offset:].contiguous().view(torch.uint8), scale_inv.repeat_interleave(block, 0)[: w.shape[0]]


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int4 values q [N, K] (-8 … 7) in the row layout the Triton kernels read: uint8 [N, ⌈K / 2⌉], column 2j in the
    low nibble and 2j + 1 in the high one, each value + 8 (an odd K's last high nibble holds 8, a zero)."""
    n, k = q.shape
    nibbles = torch.full((n, k + k % 2), 8, dtype=torch.uint8, device=q.device)
    nibbles[:, :k] = (q.to(torch.int16) + 8).to(torch.uint8)
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_int4_rows(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_int4_rows: int8 values [N, k]."""
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)[:, :k]
    return (pairs.to(torch.int16) - 8).to(torch.int8)


def pack(kind: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] in its kind's values, scale [N, G]) → the packed (q, scale)."""
    n, k = q.shape
    blocks, k2 = -(-n // 16), -(-k // 2)
    if kind == "int4":
        full = torch.full((blocks * 16, k2 * 2), 8, dtype=torch.uint8)
        full[:n, :k] = (q.to(torch.int16) + 8).to(torch.uint8)
        pairs = full.view(blocks, 16, k2, 2).permute(0, 2, 1, 3)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
    else:
        full = torch.zeros(blocks * 16, k2 * 2, dtype=q.dtype)
        full[:n, :k] = q
        packed = full.view(blocks, 16, k2, 2).permute(0, 2, 1, 3).reshape(blocks, k2, 32)
    scales = torch.zeros(blocks * 16, scale.shape[1])
    scales[:n] = scale.float()
    return packed.contiguous(), scales.view(blocks, 16, -1).permute(0, 2, 1).contiguous()


def pack_into(kind: str, q: torch.Tensor, scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    """pack(kind, q, scale) written into qweight and scales (the packed blocks of those rows, contiguous): natively
    where the operators are loaded, without pack's padded and permuted copies."""
    if qweight.is_cpu and torch_ops.load():
        torch.ops.dsaserve.pack_rows(q.contiguous(), scale.float().contiguous(), KINDS[kind], qweight, scales)
        return
    packed_q, packed_s = pack(kind, q, scale)
    qweight.copy_(packed_q)
    scales.copy_(packed_s)


def unpack(kind: str, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack: (q [n, k], scale [n, G])."""
    blocks, k2 = packed.shape[0], packed.shape[1]
    if kind == "int4":
        pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # [B, K2, 16, 2]
        q = (pairs.permute(0, 2, 1, 3).reshape(blocks * 16, k2 * 2).to(torch.int16) - 8).to(torch.int8)
    else:
        q = packed.view(blocks, k2, 16, 2).permute(0, 2, 1, 3).reshape(blocks * 16, k2 * 2)
    return q[:n, :k], scales.permute(0, 2, 1).reshape(blocks * 16, -1)[:n]


def dequantize_reference(kind: str, q: torch.Tensor, scale: torch.Tensor, col_offset: int = 0) -> torch.Tensor:
    """fp32 [N, K] from an unpacked form, in torch (the kernels' oracle)."""
    k = q.shape[1]
    values = q.view(torch.float8_e4m3fn).float() if kind == "fp8" else q.float()
    group = group_of(kind, k)
    columns = (torch.arange(k, device=scale.device) + col_offset) // group - col_offset // group
    return values * scale.float()[:, columns]
