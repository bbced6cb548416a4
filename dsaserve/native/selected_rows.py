"""Python side of selected_rows.cpp: attention of each query over its own selected cache rows."""

from __future__ import annotations

import functools

import torch

from dsaserve.native import torch_ops


def has_bf16_kernel() -> bool:
    """True when the operators are built and this CPU has AVX-512 BF16."""
    return torch_ops.cpu_kernels() == "avx512_bf16"


def fits(heads: int, dim: int, value_dim: int) -> bool:
    """Whether the kernel takes this shape on this machine."""
    return has_bf16_kernel() and _kernel_takes(heads, dim, value_dim)


@functools.lru_cache(maxsize=None)
def _kernel_takes(heads: int, dim: int, value_dim: int) -> bool:  # asked once per shape, not per layer
    return torch.ops.dsaserve.selected_rows_fits(heads, dim, value_dim)


def attend_selected_rows(query: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float,
                         out: torch.Tensor) -> bool:
    """out[i, h] = softmax(scale · query[i, h] · rows[slots[i]]ᵀ) · rows[slots[i], :V] with V = out.shape[-1].

    query bf16 [n, H, D], rows bf16 [N, D] (the flattened cache), slots int64 [n, K] with -1 for empty
    entries, out bf16 [n, H, V] (unit stride in its last dimension). Returns False, having done
    nothing, where the kernel does not apply (not bf16 on the CPU, a shape `fits` refuses, or no
    native operators): the caller then takes its torch path.
    """
    if not (query.dtype == rows.dtype == out.dtype == torch.bfloat16 and query.device.type == "cpu"):
        return False
    n, heads, dim = query.shape
    if not fits(heads, dim, out.shape[-1]):
        return False
    if rows.shape[1] != dim or slots.shape[0] != n or out.shape[:2] != (n, heads) or out.stride(-1) != 1:
        raise ValueError(f"selected rows: shapes query {tuple(query.shape)}, rows {tuple(rows.shape)}, "
                         f"slots {tuple(slots.shape)}, out {tuple(out.shape)} do not fit together")
    torch.ops.dsaserve.attend_selected_rows(query.contiguous(), rows.contiguous(),
                                            slots.to(torch.int64).contiguous(), scale, out)
    return True
