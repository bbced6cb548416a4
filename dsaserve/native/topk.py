"""Python side of topk.cpp: row-wise top-k by selection instead of sorting."""

from __future__ import annotations

import torch

from dsaserve.native import torch_ops


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=1, sorted=False)` of a 2-D fp32 CPU matrix (rows may be strided), computed by the
    native operator where it is built (faster than torch at the indexer's sizes; see docs/architecture.md#measurements);
    otherwise, or for anything else, by torch. The order of the k entries is unspecified, and so is
    which of several values tied at the k-th place is kept, as for torch."""
    if (x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1
            or not 1 <= k <= x.shape[1] or not torch_ops.load()):
        return x.topk(k, dim=1, sorted=False)
    return torch.ops.dsaserve.topk_rows(x, k)
