"""Python side of selected_rows.cpp: attention of each query over its own selected cache rows."""

from __future__ import annotations

import functools

import torch

from dsaserve.native import torch_ops


def has_bf16_kernel() -> bool:
    """True when the operators are built and run a body of theirs here (cpu_isa: AVX-512 BF16, or AVX2)."""
    return torch_ops.runs("selected_rows")


def takes_dtype(dtype: torch.dtype) -> bool:
    """bf16 on every body; fp32 too on the AVX2 one (what dtype auto computes in on CPUs without AVX-512 BF16)."""
    return dtype == torch.bfloat16 or (dtype == torch.float32 and torch_ops.avx2_family())


def head_lanes() -> int:
    """The kernel's heads per register in the family this process runs: fewer heads are padded to a multiple."""
    return FEW_HEADS_PADDED if torch_ops.cpu_kernels() == "avx512_bf16" else AVX2_HEAD_LANES


def fits(heads: int, dim: int, value_dim: int) -> bool:
    """Whether the kernel takes this shape on this machine."""
    return has_bf16_kernel() and _kernel_takes(torch_ops.cpu_kernels(), heads, dim, value_dim)


@functools.lru_cache(maxsize=None)
def _kernel_takes(body: str, heads: int, dim: int, value_dim: int) -> bool:  # once per body and shape, not per layer
    return torch.ops.dsaserve.selected_rows_fits(heads, dim, value_dim)


def attend_selected_rows(query: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float,
                         out: torch.Tensor) -> bool:
    """out[i, h] = softmax(scale · query[i, h] · rows[slots[i]]ᵀ) · rows[slots[i], :V] with V = out.shape[-1].

    query bf16 [n, H, D], rows bf16 [N, D] (the flattened cache), slots int64 [n, K] with -1 for empty
    entries, out bf16 [n, H, V] (unit stride in its last dimension); fp32 all three on the AVX2 body. Returns
    False, having done nothing, where the kernel does not apply (a dtype `takes_dtype` refuses, not on the CPU, a
    shape `fits` refuses, or no native operators): the caller then takes its torch path.
    """
    if not (query.dtype == rows.dtype == out.dtype and takes_dtype(query.dtype) and query.device.type == "cpu"):
        return False
    n, heads, dim = query.shape
    padded = -(-heads // head_lanes()) * head_lanes()
    if not fits(padded, dim, out.shape[-1]):
        return False
    if rows.shape[1] != dim or slots.shape[0] != n or out.shape[:2] != (n, heads) or out.stride(-1) != 1:
        raise ValueError(f"selected rows: shapes query {tuple(query.shape)}, rows {tuple(rows.shape)}, "
                         f"slots {tuple(slots.shape)}, out {tuple(out.shape)} do not fit together")
    slots = slots.to(torch.int64).contiguous()
    if padded == heads:
        torch.ops.dsaserve.attend_selected_rows.default(query.contiguous(), rows.contiguous(), slots, scale, out)
        return True
    # Fewer heads than the kernel's 16 lanes (small models): zero queries fill the lanes, their
    # outputs are dropped. Cheaper than the torch path's gather and two bmm calls for decode rows.
    wide = query.new_zeros(n, padded, dim)
    wide[:, :heads] = query
    result = out.new_empty(n, padded, out.shape[-1])
    torch.ops.dsaserve.attend_selected_rows(wide, rows.contiguous(), slots, scale, result)
    out.copy_(result[:, :heads])
    return True


FEW_HEADS_PADDED = 16  # the kernel's heads per register; fewer are padded to it
AVX2_HEAD_LANES = 8  # the AVX2 body's heads per register
