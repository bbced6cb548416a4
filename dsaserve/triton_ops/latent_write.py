"""The latent cache rows in Triton: `[kv_a_layernorm(latent) | rope(k_rope)]` of kv_a_proj_with_mqa's output,
normalized, rotated and written at each token's slot in one kernel (torch's path is a norm, a rotation, a
concatenation and an index_copy_). The rotation leaves the rotated pairs' first members in the first half and the
second members in the second (model/layers.py apply_rope), interleaved or half-split pairs alike."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _latent_rows_kernel(kv, norm_weight, cos, sin, rows, slots, rank, half, eps, kv_stride, cos_stride, row_stride,
                        INTERLEAVED: tl.constexpr, ROUND: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    inside = r < rank
    x = tl.load(kv + t * kv_stride + r, mask=inside, other=0.0).to(tl.float32)
    normed = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / rank + eps))
    if ROUND:  # as RMSNorm rounds to the model's dtype before the weight
        normed = normed.to(rows.dtype.element_ty).to(tl.float32)
    weight = tl.load(norm_weight + r, mask=inside, other=0.0).to(tl.float32)
    target = rows + slot * row_stride
    tl.store(target + r, (weight * normed).to(rows.dtype.element_ty), mask=inside)
    j = tl.arange(0, BLOCK_H)
    pair = j < half
    if INTERLEAVED:
        first = tl.load(kv + t * kv_stride + rank + 2 * j, mask=pair, other=0.0).to(tl.float32)
        second = tl.load(kv + t * kv_stride + rank + 2 * j + 1, mask=pair, other=0.0).to(tl.float32)
    else:
        first = tl.load(kv + t * kv_stride + rank + j, mask=pair, other=0.0).to(tl.float32)
        second = tl.load(kv + t * kv_stride + rank + half + j, mask=pair, other=0.0).to(tl.float32)
    c = tl.load(cos + t * cos_stride + j, mask=pair, other=0.0).to(tl.float32)
    s = tl.load(sin + t * cos_stride + j, mask=pair, other=0.0).to(tl.float32)
    tl.store(target + rank + j, (first * c - second * s).to(rows.dtype.element_ty), mask=pair)
    tl.store(target + rank + half + j, (second * c + first * s).to(rows.dtype.element_ty), mask=pair)


def write_latent_rows(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      interleaved: bool, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """kv [T, rank + rope] (kv_a_proj_with_mqa's output), cos/sin [T, rope / 2], rows [N, rank + rope] (the flattened
    latent cache), slots [T]."""
    tokens, width = kv.shape
    half = cos.shape[-1]
    rank = width - 2 * half
    if rows.shape[1] != width or slots.shape != (tokens,) or norm_weight.shape != (rank,):
        raise ValueError(f"latent rows: kv {tuple(kv.shape)}, cos {tuple(cos.shape)}, rows {tuple(rows.shape)}, "
                         f"slots {tuple(slots.shape)}, norm {tuple(norm_weight.shape)} do not fit together")
    if tokens == 0:
        return
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    _latent_rows_kernel[(tokens,)](
        kv, norm_weight, cos, sin, rows, slots, rank, half, float(eps), kv.stride(0), max(half, 1), rows.stride(0),
        INTERLEAVED=interleaved, ROUND=rows.dtype != torch.float32, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_H=max(16, triton.next_power_of_2(max(half, 1))))
