"""Python side of selected_rows.c: attention of each query over its own selected cache rows."""

from __future__ import annotations

import torch

from dsaserve import native


def has_bf16_kernel() -> bool:
    """True when this CPU and compiler built the kernel (it needs AVX-512 BF16)."""
    fn = native.function("dsaserve_has_bf16_kernel")
    return fn is not None and bool(fn())


def fits(heads: int, dim: int, value_dim: int) -> bool:
    """Whether the kernel takes this shape on this machine."""
    fn = native.function("dsaserve_selected_rows_fits", native.I64, native.I64, native.I64)
    return fn is not None and bool(fn(heads, dim, value_dim))


def attend_selected_rows(query: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float,
                         out: torch.Tensor) -> bool:
    """out[i, h] = softmax(scale · query[i, h] · rows[slots[i]]ᵀ) · rows[slots[i], :V] with V = out.shape[-1].

    query bf16 [n, H, D], rows bf16 [N, D] (the flattened cache), slots int64 [n, K] with -1 for empty
    entries, out bf16 [n, H, V] (unit stride in its last dimension). Returns False, having done
    nothing, where the kernel does not apply (not bf16 on the CPU, a shape `fits` refuses, or no
    native library): the caller then takes its torch path.
    """
    if not (query.dtype == rows.dtype == out.dtype == torch.bfloat16 and query.device.type == "cpu"):
        return False
    n, heads, dim = query.shape
    if not fits(heads, dim, out.shape[-1]):
        return False
    I64, PTR = native.I64, native.PTR
    fn = native.function("dsaserve_attend_selected_rows", PTR, I64, PTR, I64, PTR, I64, I64, I64, I64, I64,
                         native.FLOAT, PTR, I64, I64, native.INT)
    query, rows, slots = query.contiguous(), rows.contiguous(), slots.to(torch.int64).contiguous()
    if rows.shape[1] != dim or slots.shape[0] != n or out.shape[:2] != (n, heads) or out.stride(-1) != 1:
        raise ValueError(f"selected rows: shapes query {tuple(query.shape)}, rows {tuple(rows.shape)}, "
                         f"slots {tuple(slots.shape)}, out {tuple(out.shape)} do not fit together")
    failed = fn(query.data_ptr(), heads * dim, rows.data_ptr(), dim, slots.data_ptr(), n, heads, dim, slots.shape[1],
                out.shape[-1], scale, out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads())
    if failed == 2:
        raise AssertionError("selected rows: the kernel refused a shape fits() accepted")
    if failed:
        raise MemoryError("selected rows: the native kernel could not allocate its scratch memory")
    return True
