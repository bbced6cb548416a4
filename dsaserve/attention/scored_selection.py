"""The indexer's selection where a Triton kernel scores (the CUDA path): whole score rows, then a top-k per row.

A tile of queries is scored against every position of the batch's longest context in one kernel call
(triton_ops/index_scores.py: keys read from the paged cache in place, invisible positions -inf), which also counts
each row's scores by their top key byte; a radix selection (triton_ops/row_topk.py) takes each row's top k from
there. The rows stay bounded: tiles hold at most SCORE_ELEMENTS scores, whatever the context length. Queries that
see at most `width` tokens get all of them (only finite scores are chosen), so no host loop over requests is
needed; the positions come out in no particular order, a set equal to the streaming selection's
(attention/indexer_selection.py) where scores do not tie. Pages rank by their best token's score, the same way.
"""

from __future__ import annotations

import torch

from dsaserve.attention.indexer_cache import IndexerKeyCache
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.triton_ops.index_scores import index_scores
from dsaserve.triton_ops.row_topk import BINS, row_topk

SCORE_ELEMENTS = 1 << 24  # fp32 scores per tile: 64 MiB, e.g. 256 queries at 64K


def select_scored(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata,
                  pages: int | None, width: int) -> torch.Tensor:
    """int32 [T, width] positions (-1 empty): each query's top `width` tokens, or with `pages` the tokens of its
    best `pages` pages (a page scores as its best visible token) that it may see."""
    bs = meta.block_size
    columns = max(meta.seq_lens_host)
    if pages:
        columns = -(-columns // bs) * bs  # whole pages
    out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
    for t0, t1, rows, counts in scored_tiles(q, weights, key_cache, meta, meta.positions, columns):
        if pages:
            out[t0:t1] = page_tokens(rows.view(t1 - t0, -1, bs).amax(dim=-1), pages, bs, meta.positions[t0:t1], width)
        else:
            row_topk(rows, min(width, columns), out[t0:t1], counts)
    return out


def scored_tiles(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata,
                 positions: torch.Tensor, columns: int):
    """(t0, t1, scores fp32 [t1 - t0, columns], their top-byte counts) for each tile of queries, scored against the
    first `columns` entries of their requests' paged keys, masked past `positions` (the buffers are reused: each tile
    is used before the next is made)."""
    t = q.shape[0]
    tile = max(1, min(t, SCORE_ELEMENTS // columns))
    scores = torch.empty(tile, columns, dtype=torch.float32, device=q.device)
    counts = torch.empty(tile, BINS, dtype=torch.int32, device=q.device)
    requests = meta.row_requests()
    for t0 in range(0, t, tile):
        t1 = min(t0 + tile, t)
        counts.zero_()
        index_scores(q[t0:t1], weights[t0:t1].float().contiguous(), key_cache.data, key_cache.scale, meta.block_tables,
                     requests[t0:t1], positions[t0:t1], scores[: t1 - t0], counts[: t1 - t0])
        yield t0, t1, scores[: t1 - t0], counts[: t1 - t0]


def select_scored_sharded(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata,
                          width: int) -> torch.Tensor:
    """Token top-k under decode context parallelism: each rank scores the tokens it holds and keeps its best `width`
    with their scores (`shard_best`), and the group keeps the best `width` of their union: the top-k over the whole
    context, since each of its tokens is in its own rank's top-k."""
    values, positions = shard_best(q, weights, key_cache, meta, width)
    return meta.shard.merge_best(values, positions, width)


def shard_best(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32 [T, width], -inf for none; their global positions int64 [T, width], -1 for none) of each query's
    best tokens among those this rank holds. The rank's cache is a paged sequence of local indices (c holds position
    c · N + rank, context_shard.py): a query at position p sees the local indices c ≤ (p - rank) // N, which is the
    position the scoring kernel masks at."""
    shard = meta.shard
    local_positions = torch.div(meta.positions - shard.rank, shard.size, rounding_mode="floor")
    columns = max(1, shard.local_count(max(meta.seq_lens_host)))
    keep = min(width, columns)
    values = torch.full((q.shape[0], width), float("-inf"), device=q.device)
    ids = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
    for t0, t1, rows, counts in scored_tiles(q, weights, key_cache, meta, local_positions, columns):
        row_topk(rows, keep, ids[t0:t1], counts)
        chosen = ids[t0:t1, :keep].long()
        values[t0:t1, :keep] = torch.where(chosen >= 0, rows.gather(1, chosen.clamp(min=0)), float("-inf"))
    return values, torch.where(ids >= 0, shard.to_global(ids.long()), -1)


def page_tokens(page_scores: torch.Tensor, pages: int, block_size: int, positions: torch.Tensor,
                width: int) -> torch.Tensor:
    """The visible tokens of each row's best `pages` pages, [t, width] (-1 empty)."""
    keep = min(pages, page_scores.shape[1])
    chosen = torch.empty(page_scores.shape[0], keep, dtype=torch.int32, device=page_scores.device)
    row_topk(page_scores, keep, chosen)
    tokens = chosen[:, :, None] * block_size + torch.arange(block_size, device=chosen.device)
    tokens = torch.where((chosen[:, :, None] >= 0) & (tokens <= positions[:, None, None]), tokens, -1)
    out = torch.full((positions.shape[0], width), -1, dtype=torch.int32, device=chosen.device)
    out[:, : keep * block_size] = tokens.view(positions.shape[0], -1)
    return out
