"""The lightning indexer's selection: scores past tokens and picks what each query attends to.

score(t, s) = Σ_h relu(q_h(t)·k(s)) · index_head_dim^-0.5 · w_h(t) · index_n_heads^-0.5, with the causal
mask applied before any reduction. The projections that produce q, k and w are the model's
(model/indexer.py); the keys live in the layer's own paged key cache (attention/indexer_cache.py).

Scoring streams: a tile of queries meets the context a few whole KV blocks at a time and keeps a
running top-k, merged after every window of candidates, in buffers allocated once per call, so its
scratch memory is bounded by the tile, the chunk and the window, never by the context length. On
CPUs with AVX-512 BF16, a native kernel computes a chunk's relu'd, head-summed scores in registers
(native/index_scores.cpp); int8 keys kept in the int8 kernel's layout are scored with int8 products where the
CPU has AVX-512 VNNI (native/index_scores_int8.cpp, the queries rounded to int8 per head); elsewhere torch
materializes the per-head scores of the chunk. A batch of decode queries makes its whole selection in one
native call (native/decode_selection.cpp).
Selection is either token top-k (the model's trained semantics) or, for the page backend, whole
pages ranked by the best visible token inside each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from dsaserve import triton_ops
from dsaserve.attention.context_shard import ContextShard
from dsaserve.attention.indexer_cache import IndexerKeyCache
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.native import index_scores as native_scores
from dsaserve.native.topk import topk_rows

# Upper bound on score elements materialized at once ([query tile, index heads, key chunk]); with
# the tile and chunk below it, the bound on scratch memory.
INDEXER_SCORE_BUDGET = 1 << 22
QUERY_TILE = 64
MAX_KEY_CHUNK = 16384
MERGE_WINDOW = 16384  # candidates scored between two running top-k merges (a merge is a top-k of keep + window)


@dataclass(frozen=True)
class Selection:
    """What the indexer returns per query: `index_topk` tokens, or `pages` whole pages."""

    index_topk: int
    pages: int | None = None  # page mode when set

    def width(self, block_size: int) -> int:
        """Positions per query row of the output."""
        return self.pages * block_size if self.pages else self.index_topk


def select_topk(keys: torch.Tensor, queries: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                key_cache: IndexerKeyCache, meta: BatchMetadata, selection: Selection) -> torch.Tensor:
    """Write this step's indexer keys [T, D] at their slots; return the selected logical positions
    int32 [T, width] (-1 = empty). `queries()` gives (q [T, H, D], weights [T, H] fp32) and is called
    only when some request sees more than `width` tokens."""
    key_cache.write(meta.slot_mapping, meta.rows_to_write(keys))
    return select_written(queries, key_cache, meta, selection)


def select_written(queries: Callable[[], tuple[torch.Tensor, torch.Tensor]], key_cache: IndexerKeyCache,
                   meta: BatchMetadata, selection: Selection) -> torch.Tensor:
    """`select_topk` once this step's keys are in `key_cache`."""
    every = selects_every_position(meta, selection)
    if every is not None:
        return every
    q, weights = queries()
    if meta.shard is not None:
        return select_sharded(q, weights, key_cache, meta, selection)
    return select(q, weights, key_cache, meta, selection)


def selects_every_position(meta: BatchMetadata, selection: Selection) -> torch.Tensor | None:
    """The selection where every request sees at most `width` tokens, so all of them are selected: no scoring,
    the same rows (one tensor) for every full layer of the batch. None where some request sees more."""
    width = selection.width(meta.block_size)
    if max(meta.seq_lens_host) > width:
        return None
    return meta.once(("all visible", width), lambda: all_visible(meta.positions, width))


def invisible(key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """[queries, keys] True where the key lies in the query's future (the causal mask)."""
    return key_pos[None, :] > query_pos[:, None]


def all_visible(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Rows selecting every causal-visible position, for queries that see at most `width` tokens."""
    columns = torch.arange(width, device=positions.device)
    return torch.where(columns[None, :] <= positions[:, None], columns[None, :], -1).to(torch.int32)


def select(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata,
           selection: Selection) -> torch.Tensor:
    """Per query, the positions its attention reads. q [T, H, D], weights [T, H] fp32."""
    width = selection.width(meta.block_size)
    if triton_ops.runs_on(q):  # one Triton kernel scores every row where the keys are (the CUDA path)
        from dsaserve.attention.scored_selection import select_scored

        return select_scored(q, weights, key_cache, meta, selection.pages, width)
    if decodes_natively(q, key_cache, meta, selection):
        chunk_blocks, window_blocks = chunk_and_window(min(QUERY_TILE, q.shape[0]), q.shape[1], meta.block_size)
        int8 = key_cache.int8_groups is not None
        keys = key_cache.int8_groups if int8 else key_cache.groups if key_cache.packed else key_cache.data
        return torch.ops.dsaserve.decode_selection.default(
            q.contiguous(), weights.contiguous(), keys,
            meta.block_tables, meta.seq_lens_host, width, chunk_blocks, window_blocks,
            key_cache.scale if int8 else None)
    out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
    scratch = None
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        split = meta.split_at_position(i, width)  # rows before it see ≤ width tokens
        if split > start:
            out[start:split] = all_visible(meta.positions[start:split], width)
        for t0 in range(split, end, QUERY_TILE):
            t1 = min(t0 + QUERY_TILE, end)
            scratch = scratch or score_scratch(min(QUERY_TILE, q.shape[0]), q.shape[1], q.shape[2], meta.block_size,
                                               selection, score_dtype(q), q.device)
            out[t0:t1] = stream_select(q[t0:t1], weights[t0:t1], key_cache, meta, i, meta.positions[t0:t1], selection,
                                       (meta.position_of(i, t0), meta.position_of(i, t1 - 1)), scratch)
    return out


def decodes_natively(q: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata, selection: Selection) -> bool:
    """Whether the batch's selection is one native call (native/decode_selection.cpp, the loop below in C++, the same
    positions): every request a single query, token top-k, a key cache kept packed (bf16 or int8 keys) that a kernel
    scores in place, fp32 queries too against int8 keys, or against fp32 keys on the AVX2 body."""
    if not (meta.num_tokens == meta.num_reqs and not selection.pages and q.is_cpu
            and q.dtype in (torch.bfloat16, torch.float32)):
        return False
    if key_cache.int8_groups is not None:  # bf16 or fp32 queries
        return native_scores.fits_int8(q.shape[1], q.shape[2])
    if q.dtype == torch.float32:
        return (key_cache.kind == "model" and not key_cache.packed and key_cache.data.dtype == torch.float32
                and native_scores.fits_f32(q.shape[1], q.shape[2]))
    return key_cache.packed and native_scores.fits(q.shape[1], q.shape[2])


def select_sharded(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata,
                   selection: Selection) -> torch.Tensor:
    """`select` under decode context parallelism (token top-k): each rank streams the top-k of the keys
    it holds, the group exchanges (score, position) pairs, and every rank keeps the top-k of their union:
    the same set as the top-k over the whole context, since each of those is in its own rank's top-k."""
    if triton_ops.runs_on(q):  # each rank's scores and top-k in Triton (the CUDA path)
        from dsaserve.attention.scored_selection import select_scored_sharded

        return select_scored_sharded(q, weights, key_cache, meta, selection.index_topk)
    shard = meta.shard
    width = selection.index_topk
    values = torch.full((q.shape[0], width), float("-inf"), device=q.device)
    positions = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    scored = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    scratch = None
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        split = meta.split_at_position(i, width)  # rows before it see ≤ width tokens: all selected
        for t0 in range(split, end, QUERY_TILE):
            t1 = min(t0 + QUERY_TILE, end)
            scratch = scratch or score_scratch(min(QUERY_TILE, q.shape[0]), q.shape[1], q.shape[2], shard.block_size,
                                               selection, score_dtype(q), q.device)
            best, ids = stream_best(q[t0:t1], weights[t0:t1], key_cache, meta, i, meta.positions[t0:t1], selection,
                                    (meta.position_of(i, t0), meta.position_of(i, t1 - 1)), scratch)
            values[t0:t1] = best
            positions[t0:t1] = torch.where(best == float("-inf"), -1, ids)
        scored[split:end] = True
    out = all_visible(meta.positions, width)
    out[scored] = shard.merge_best(values, positions, width)[scored]
    return out


def score_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype of q·k's inputs: bf16 in bf16 models (fp32 accumulation; faster than fp32 on CPU at a
    top-k recall close to fp32 scoring's, where production DSA kernels score in fp8; measurements in
    docs/architecture.md#measurements), fp32 otherwise, exactly as the reference computes it. The native kernel
    keeps each head's score in fp32 through the relu and head sum; the torch path rounds it to bf16
    first."""
    return torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32


def key_chunk_blocks(tile: int, heads: int, block_size: int) -> int:
    """Whole blocks per scoring chunk so that [tile, heads, chunk] stays within the budget."""
    tokens = max(block_size, min(MAX_KEY_CHUNK, INDEXER_SCORE_BUDGET // max(1, tile * heads)))
    return max(1, tokens // block_size)


def chunk_and_window(tile: int, heads: int, block_size: int) -> tuple[int, int]:
    """(blocks per scoring chunk, blocks per merge window: whole chunks) for a query tile."""
    chunk_blocks = key_chunk_blocks(tile, heads, block_size)
    return chunk_blocks, chunk_blocks * max(1, MERGE_WINDOW // (chunk_blocks * block_size))


class ScoreScratch:
    """The scoring buffers, allocated once per select() and reused by every query tile: a fresh
    multi-MiB allocation per tile costs page faults comparable to the scoring matmul itself."""

    def __init__(self, tile: int, heads: int, head_dim: int, block_size: int, selection: Selection,
                 score_dtype: torch.dtype, device):
        self.chunk_blocks, self.window_blocks = chunk_and_window(tile, heads, block_size)
        chunk = self.chunk_blocks * block_size
        self.keep = selection.pages or selection.index_topk
        self.score_dtype = score_dtype
        self.scores = torch.empty(tile * chunk, device=device)
        # The native kernel (bf16 on CPUs with AVX-512 BF16) sums heads in registers and needs only the
        # keys repacked; the torch path materializes the per-head scores.
        self.native = score_dtype == torch.bfloat16 and device.type == "cpu" and native_scores.fits(heads, head_dim)
        if self.native:  # (a key cache kept packed is scored in place: no buffer)
            self.chunk_keys, self.head_dim, self._packed_keys = chunk, head_dim, None
        else:
            self.per_head = torch.empty(tile * heads * chunk, device=device)  # fp32: the head sum's input
            self.per_head_low = (torch.empty(tile * heads * chunk, dtype=score_dtype, device=device)
                                 if score_dtype != torch.float32 else None)
        # Columns [0, keep) hold the running best; a window's candidates are appended after them.
        candidates = self.window_blocks * (1 if selection.pages else block_size)
        self.merged = torch.empty(tile * (self.keep + candidates), device=device)

    def packed_keys(self) -> torch.Tensor:
        """The buffer a chunk's keys are packed into for the native kernel (made on first use)."""
        if self._packed_keys is None:
            size = native_scores.packed_size(self.chunk_keys, self.head_dim)
            self._packed_keys = torch.empty(size, dtype=torch.int32)
        return self._packed_keys


KEPT_SCRATCH_TILE = 16  # tiles up to this many queries (decode, draft verification) reuse their scratch
_kept_scratch = threading.local()


def score_scratch(tile: int, heads: int, head_dim: int, block_size: int, selection: Selection,
                  score_dtype: torch.dtype, device) -> ScoreScratch:
    """A ScoreScratch for these shapes. A decode step selects once per full layer, each time for a tile of a
    few queries, where making the buffers costs a sixth of scoring 8K keys; such small tiles reuse the one made
    last in this thread when it has the same shapes (the buffers hold nothing between calls; one is kept, so the
    memory kept is one scratch's, as bounded as a call's). Larger tiles (prefill) get their own, freed with the
    call."""
    if tile > KEPT_SCRATCH_TILE:
        return ScoreScratch(tile, heads, head_dim, block_size, selection, score_dtype, device)
    key = (tile, heads, head_dim, block_size, selection, score_dtype, str(device), INDEXER_SCORE_BUDGET, MERGE_WINDOW,
           MAX_KEY_CHUNK)
    kept = getattr(_kept_scratch, "last", None)
    if kept is None or kept[0] != key:
        kept = _kept_scratch.last = (key, ScoreScratch(tile, heads, head_dim, block_size, selection, score_dtype,
                                                       device))
    return kept[1]


def stream_select(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata, i: int,
                  positions: torch.Tensor, selection: Selection, position_range: tuple[int, int] | None = None,
                  scratch: ScoreScratch | None = None) -> torch.Tensor:
    """Running top-k (tokens or pages) of one query tile of request i over its visible blocks.
    `position_range` (the tile's smallest and largest position, known on the host) saves device syncs."""
    best, best_ids = stream_best(q, weights, key_cache, meta, i, positions, selection, position_range, scratch)
    chosen = torch.where(best == float("-inf"), -1, best_ids)
    if not selection.pages:
        return chosen.to(torch.int32)
    # Pages → their tokens, each query keeping only the ones it may see.
    bs = meta.block_size
    tokens = chosen[:, :, None] * bs + torch.arange(bs, device=q.device)
    tokens = torch.where((chosen[:, :, None] >= 0) & (tokens <= positions[:, None, None]), tokens, -1)
    return tokens.view(positions.shape[0], -1).to(torch.int32)


def stream_best(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, meta: BatchMetadata, i: int,
                positions: torch.Tensor, selection: Selection, position_range: tuple[int, int] | None = None,
                scratch: ScoreScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, ids) [t, keep] of the tile's best candidates: token positions (global ones under decode
    context parallelism, over the tokens this rank holds) or page numbers; -inf scores are no choice."""
    shard = meta.shard
    bs = meta.block_size if shard is None else shard.block_size  # tokens per block of the key cache
    t, heads = q.shape[0], q.shape[1]
    scratch = scratch or score_scratch(t, heads, q.shape[2], bs, selection, score_dtype(q), q.device)
    keep = scratch.keep
    first_position, last_position = position_range or (int(positions.min()), int(positions.max()))
    # Later blocks are in every query's future.
    visible_blocks = (last_position // bs + 1 if shard is None
                      else -(-shard.local_count(last_position + 1) // bs))
    per_block = 1 if selection.pages else bs  # candidates per block
    q = q.to(scratch.score_dtype).reshape(t * heads, -1)

    def candidates_of(b0: int, b1: int) -> torch.Tensor:
        return chunk_candidates(q, weights, key_cache, meta.block_tables[i], (b0, b1), bs, scratch, positions,
                                first_position, selection, shard, last_position)

    if visible_blocks <= scratch.chunk_blocks and visible_blocks * per_block >= keep:
        # One chunk holds every visible key (decode at a few thousand tokens): rank it directly.
        best, best_ids = topk_rows(candidates_of(0, visible_blocks), keep)
    else:
        best, best_ids = running_top_k(candidates_of, visible_blocks, per_block, t, scratch)
    return best, best_ids if shard is None else shard.to_global(best_ids)


def running_top_k(candidates_of, visible_blocks: int, per_block: int, t: int,
                  scratch: ScoreScratch) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [t, keep] of the best candidates over all visible blocks, merging a window of
    chunks at a time into the running best."""
    keep = scratch.keep
    width = keep + scratch.window_blocks * per_block
    merged = scratch.merged[: t * width].view(t, width)
    merged[:, :keep] = float("-inf")
    best_ids = torch.full((t, keep), -1, dtype=torch.long, device=merged.device)
    for w0 in range(0, visible_blocks, scratch.window_blocks):
        w1 = min(w0 + scratch.window_blocks, visible_blocks)
        for b0 in range(w0, w1, scratch.chunk_blocks):
            b1 = min(b0 + scratch.chunk_blocks, w1)
            merged[:, keep + (b0 - w0) * per_block: keep + (b1 - w0) * per_block] = candidates_of(b0, b1)
        candidates = (w1 - w0) * per_block
        if w0 == 0 and candidates >= keep:  # nothing kept yet: rank the first window alone
            best, best_ids = topk_rows(merged[:, keep:keep + candidates], keep)
        else:
            best, order = topk_rows(merged[:, : keep + candidates], keep)
            # Column c < keep is the previous best_ids[c]; later columns count candidates from w0 on.
            best_ids = torch.where(order < keep, best_ids.gather(1, order.clamp(max=keep - 1)),
                                   order - keep + w0 * per_block)
        merged[:, :keep] = best
    return merged[:, :keep], best_ids


def chunk_candidates(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, table: torch.Tensor,
                     blocks: tuple[int, int], block_size: int, scratch: ScoreScratch, positions: torch.Tensor,
                     first_position: int, selection: Selection, shard: ContextShard | None = None,
                     last_position: int | None = None) -> torch.Tensor:
    """Masked candidate scores [t, tokens or pages] of whole blocks: invisible keys are -inf before
    any maximum or top-k, and in page mode each page scores as its best visible token. With a shard the
    blocks hold this rank's tokens (local index c is position shard.to_global(c)). `last_position`: the
    tile's largest position, where the host knows it."""
    b0, b1 = blocks
    scores = score_chunk(q, weights, key_cache, table, blocks, block_size, scratch)
    last_key = b1 * block_size - 1
    if shard is None and last_position == first_position and last_key > first_position:
        # Every query of the tile at one position (a decode step): its future is the chunk's tail.
        scores[:, max(0, first_position + 1 - b0 * block_size):] = float("-inf")
    elif (last_key if shard is None else shard.to_global(last_key)) > first_position:
        # Some key of this chunk is in some query's future.
        key_pos = torch.arange(b0 * block_size, b1 * block_size, device=q.device)
        if shard is not None:
            key_pos = shard.to_global(key_pos)
        scores.masked_fill_(invisible(key_pos, positions), float("-inf"))
    if selection.pages:
        scores = scores.view(scores.shape[0], b1 - b0, block_size).amax(dim=-1)
    return scores


def score_chunk(q: torch.Tensor, weights: torch.Tensor, key_cache: IndexerKeyCache, table: torch.Tensor,
                blocks: tuple[int, int], block_size: int, scratch: ScoreScratch) -> torch.Tensor:
    """Unmasked scores [t, c] of a query tile (q flattened to [t * heads, D]) against whole blocks."""
    b0, b1 = blocks
    t, heads = weights.shape
    if (key_cache.int8_groups is not None and q.dtype in (torch.bfloat16, torch.float32)
            and q.is_cpu):  # int8 keys, scored in place
        c = (b1 - b0) * block_size
        scores = scratch.scores[: t * c].view(t, c)
        native_scores.index_scores_int8_blocks(q.view(t, heads, -1), weights, key_cache.int8_groups, key_cache.scale,
                                               table[b0:b1], c, scores)
        return scores
    if (q.dtype == torch.float32 and key_cache.kind == "model" and not key_cache.packed and q.is_cpu
            and key_cache.data.dtype == torch.float32 and native_scores.fits_f32(heads, key_cache.dim)):
        c = (b1 - b0) * block_size  # an fp32 model on the AVX2 body: fp32 keys scored where they are
        scores = scratch.scores[: t * c].view(t, c)
        native_scores.index_scores_f32_blocks(q.view(t, heads, -1), weights, key_cache.data, table[b0:b1], c, scores)
        return scores
    if scratch.native and key_cache.packed:  # scored where they are
        c = (b1 - b0) * block_size
        scores = scratch.scores[: t * c].view(t, c)
        native_scores.index_scores_blocks(q.view(t, heads, -1), weights, key_cache.groups, table[b0:b1], c, scores)
        return scores
    keys = key_cache.read_blocks(table[b0:b1], scratch.score_dtype)  # [(b1-b0) * block_size, D]
    c = keys.shape[0]
    if scratch.native:
        scores = scratch.scores[: t * c].view(t, c)
        native_scores.index_scores(q.view(t, heads, -1), weights, native_scores.pack_keys(keys, scratch.packed_keys()),
                                   c, scores)
        return scores
    per_head = scratch.per_head[: t * heads * c].view(t * heads, c)
    if scratch.per_head_low is None:
        torch.mm(q, keys.T, out=per_head).relu_()
    else:
        # The relu runs after the fp32 copy: on CPU, relu on fp32 is faster than on bf16 (same values).
        per_head.copy_(torch.mm(q, keys.T, out=scratch.per_head_low[: t * heads * c].view(t * heads, c))).relu_()
    scores = scratch.scores[: t * c].view(t, 1, c)
    return torch.bmm(weights[:, None, :], per_head.view(t, heads, c), out=scores).view(t, c)
