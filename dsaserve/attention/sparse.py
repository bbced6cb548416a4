"""Sparse MLA attention (DSA): each query attends only to its top-k logical positions.

Top-k rows come from the last full layer's indexer (`int32 [T, index_topk]`, -1 = empty). A request
whose whole context fits in `index_topk` selects every visible token, so it takes the dense path:
same support, no gather of a per-query key copy.
"""

from __future__ import annotations

import torch

from dsaserve.attention.dense import SCORE_BUDGET, attend_latent, dense_request
from dsaserve.attention.metadata import BatchMetadata


class SparseAttention:
    name = "sparse"
    uses_indexer = True

    def __init__(self, index_topk: int):
        self.index_topk = index_topk

    def forward(
        self, query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_dim: int,
        topk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if topk is None:
            raise ValueError("sparse attention needs the top-k indices of a full layer")
        out = query.new_empty(query.shape[0], query.shape[1], value_dim)
        rows = cache.view(-1, cache.shape[-1])
        for i in range(meta.num_reqs):
            if meta.seq_lens_host[i] <= self.index_topk:
                dense_request(query, cache, meta, i, scale, value_dim, out)
                continue
            start, end = meta.query_range(i)
            tile = max(1, SCORE_BUDGET // (topk.shape[1] * rows.shape[1]))
            for t0 in range(start, end, tile):
                t1 = min(t0 + tile, end)
                selected = topk[t0:t1].long()
                invalid = selected < 0
                keys = rows[meta.slots(i, selected.clamp(min=0))]  # [t, K, D]
                out[t0:t1] = attend_latent(query[t0:t1], keys, invalid, scale, value_dim)
        return out

