"""Python side of topk.c: row-wise top-k by selection instead of sorting."""

from __future__ import annotations

import torch

from dsaserve import native


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=1, sorted=False)` of a 2-D fp32 CPU matrix (rows may be strided), computed by the
    native kernel where it is built (faster than torch at the indexer's sizes; see docs/design-notes.md);
    otherwise, or for anything else, by torch. The order of the k entries is unspecified, and so is
    which of several values tied at the k-th place is kept, as for torch."""
    fn = (native.function("dsaserve_topk_rows", native.PTR, native.I64, native.I64, native.I64, native.I64,
                          native.PTR, native.PTR, native.INT)
          if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 else None)
    if fn is None or x.stride(1) != 1 or not 1 <= k <= x.shape[1]:
        return x.topk(k, dim=1, sorted=False)
    values = x.new_empty(x.shape[0], k)
    indices = torch.empty(x.shape[0], k, dtype=torch.long)
    if fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, values.data_ptr(), indices.data_ptr(),
          torch.get_num_threads()):
        raise MemoryError("top-k: the native kernel could not allocate its scratch memory")
    return values, indices
