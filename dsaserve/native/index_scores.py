"""Python side of index_scores.cpp and index_scores_int8.cpp: the indexer's fused q·k, relu and weighted head
sum, over bf16 keys packed for it per chunk (`pack_keys`) or read in place from a key cache kept packed
(`index_scores_blocks`), or over int8 keys read in place (`index_scores_int8_blocks`)."""

from __future__ import annotations

import functools

import torch

from dsaserve.native import torch_ops

KEY_GROUP = 64  # the kernel's keys per work item; packed keys are padded to a multiple of it


def fits(heads: int, dim: int) -> bool:
    """Whether the kernel takes bf16 queries of `heads` × `dim` on this machine."""
    return torch_ops.runs("index_scores") and _kernel_takes(heads, dim)


@functools.lru_cache(maxsize=None)
def _kernel_takes(heads: int, dim: int) -> bool:  # asked once per shape, not per selection
    return torch.ops.dsaserve.index_scores_fits(heads, dim)


def fits_int8(heads: int, dim: int) -> bool:
    """Whether the int8 kernel (AVX-512 VNNI, or the AVX2 body) scores `heads` × `dim` queries against int8 keys on
    this machine."""
    return torch_ops.runs("index_scores_int8") and _int8_kernel_takes(torch_ops.cpu_kernels(), heads, dim)


@functools.lru_cache(maxsize=None)
def _int8_kernel_takes(body: str, heads: int, dim: int) -> bool:  # asked once per body and shape
    return torch.ops.dsaserve.index_scores_int8_fits(heads, dim)


def fits_f32(heads: int, dim: int) -> bool:
    """Whether the AVX2 body scores fp32 queries of `heads` × `dim` against an fp32 key cache in place (what an fp32
    model, dtype auto on CPUs without AVX-512 BF16, scores)."""
    return torch_ops.runs("index_scores_f32") and _f32_kernel_takes(torch_ops.cpu_kernels(), heads, dim)


@functools.lru_cache(maxsize=None)
def _f32_kernel_takes(body: str, heads: int, dim: int) -> bool:  # once per body and shape
    return torch.ops.dsaserve.index_scores_f32_fits(heads, dim)


def index_scores_f32_blocks(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor,
                            keys: int, out: torch.Tensor) -> None:
    """out[:, :keys] = Σ_h weights · relu(q · key) of fp32 q [t, heads, dim] against the first `keys` keys of the
    listed blocks of an fp32 key cache [num_blocks, block_size, dim], read in place."""
    check_call(q, weights, out, "fits_f32")
    torch.ops.dsaserve.index_scores_f32_blocks(q.contiguous(), weights.float().contiguous(), cache,
                                               blocks.to(torch.int64).contiguous(), keys, out)


def packed_size(keys: int, dim: int) -> int:
    """int32 elements of the packed form of `keys` keys of width `dim`."""
    return -(-keys // KEY_GROUP) * KEY_GROUP * dim // 2


def pack_keys(keys: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """keys bf16 [c, dim] → int32 [c' / 16, dim / 2, 16] in `buffer`: column pairs of 16 keys at a
    time, zero keys up to c' (the next multiple of KEY_GROUP)."""
    c, dim = keys.shape
    padded = -(-c // KEY_GROUP) * KEY_GROUP
    if padded != c:
        keys = torch.cat([keys, keys.new_zeros(padded - c, dim)])
    packed = buffer[: packed_size(c, dim)].view(padded // 16, dim // 2, 16)
    return packed.copy_(keys.view(torch.int32).view(padded // 16, 16, dim // 2).transpose(1, 2))


def check_call(q: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, fits_name: str) -> None:
    """The operators built, and q [t, heads, dim], weights [t, heads], out [t, ≥ keys] with unit column stride."""
    if not torch_ops.load():
        raise RuntimeError(f"index scores: the native operators are not built here; check {fits_name}() first")
    t, heads, _ = q.shape
    if out.stride(1) != 1 or out.shape[0] != t or weights.shape != (t, heads):
        raise ValueError(f"index scores: q {tuple(q.shape)}, weights {tuple(weights.shape)}, out {tuple(out.shape)}")


def index_scores(q: torch.Tensor, weights: torch.Tensor, packed: torch.Tensor, keys: int, out: torch.Tensor) -> None:
    """out[i, s] = Σ_h weights[i, h] · relu(q[i, h] · key[s]) for s < keys: q bf16 [t, heads, dim],
    weights fp32 [t, heads], packed from pack_keys, out fp32 [t, ≥ keys] (unit column stride).
    Only for shapes `fits` accepts."""
    check_call(q, weights, out, "fits")
    torch.ops.dsaserve.index_scores(q.contiguous(), weights.to(torch.float32).contiguous(), packed, keys, out)


def index_scores_blocks(q: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor, blocks: torch.Tensor, keys: int,
                        out: torch.Tensor) -> None:
    """index_scores over the first `keys` keys of `blocks` (int64 block ids, in order) of a key cache kept
    packed: `groups` int32 [num_blocks, block_size / 16, dim / 2, 16] (IndexerKeyCache.groups). The same
    values as pack_keys of the gathered keys would give, without the gather and the repacking."""
    check_call(q, weights, out, "fits")
    torch.ops.dsaserve.index_scores_blocks(q.contiguous(), weights.to(torch.float32).contiguous(), groups,
                                           blocks.to(torch.int64).contiguous(), keys, out)


def index_scores_int8_blocks(q: torch.Tensor, weights: torch.Tensor, groups: torch.Tensor, scales: torch.Tensor,
                             blocks: torch.Tensor, keys: int, out: torch.Tensor) -> None:
    """out[i, s] = ks[s] · Σ_h weights[i, h] · qs[i, h] · relu(qi[i, h] · ki[s]) over the first `keys` keys of
    `blocks` of an int8 key cache kept in the VNNI layout (IndexerKeyCache.int8_groups, its fp16 `scale`): the keys'
    int8 values ki and scales ks as stored, the queries (bf16, or fp32: an fp32 model's) rounded per query and head to
    qi · qs (amax / 127). Only for shapes `fits_int8` accepts."""
    check_call(q, weights, out, "fits_int8")
    torch.ops.dsaserve.index_scores_int8_blocks(q.contiguous() if q.dtype == torch.float32 else
                                                q.to(torch.bfloat16).contiguous(),
                                                weights.to(torch.float32).contiguous(),
                                                groups, scales, blocks.to(torch.int64).contiguous(), keys, out)
