"""Attention of each query over its own selected cache rows, by the kernel that runs where the tensors are: the
native one on CPU (native/selected_rows.py), the Triton one where the engine runs Triton kernels
(triton_ops/selected_rows.py). Returns False, having done nothing, where neither applies: the caller then takes
its torch path."""

from __future__ import annotations

import torch

from dsaserve import triton_ops
from dsaserve.native import selected_rows as native_rows


def attend_selected_rows(query: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float,
                         out: torch.Tensor) -> bool:
    """out[i, h] = softmax(scale · query[i, h] · rows[slots[i]]ᵀ) · rows[slots[i], :V] (the contract of
    native/selected_rows.attend_selected_rows; -1 slots are empty)."""
    if triton_ops.runs_on(query):
        from dsaserve.triton_ops.selected_rows import attend_selected_rows as triton_attend

        triton_attend(query, rows, slots, scale, out)
        return True
    return native_rows.attend_selected_rows(query, rows, slots, scale, out)
