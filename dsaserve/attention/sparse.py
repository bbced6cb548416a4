"""Sparse MLA attention (DSA): each query attends only to its top-k logical positions.

Top-k rows come from the last full layer's indexer (`int32 [T, index_topk]`, -1 = empty). A query
that sees at most `index_topk` tokens selects all of them, so it takes the dense path: same support,
no gather of a per-query key copy. Other queries are processed in tiles: the union of the tile's
selected rows is loaded once, and a membership mask restores each query's own support. Trained
indexers pick overlapping rows for neighbouring queries, so the union stays near index_topk; when it
does not (more than UNION_LIMIT × the width, as with random weights at long context), scoring the
union would cost as much as dense attention, and the tile falls back to per-query rows.
"""

from __future__ import annotations

import torch

from dsaserve import triton_ops
from dsaserve.attention import tile_unions
from dsaserve.attention.dense import (
    FEW_ROWS,
    SCORE_BUDGET,
    DecodeRows,
    attend_decode_rows,
    attend_latent_online,
    attend_own_keys,
    causal_rows,
    decode_causal,
    dense_rows,
    every_row_slots,
)
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.attention.selected_rows import attend_selected_rows
from dsaserve.native import torch_ops
from dsaserve.triton_ops.union_tiles import tile_queries

QUERY_TILE = 64  # queries sharing one load of their selected rows
UNION_LIMIT = 2  # above this many × the selection width, a tile's union is not worth scoring
MEMBER_BUDGET = 1 << 22  # [tile, context] membership bools per tile: 64 queries up to a 64K context


class SparseAttention:
    """Attends to the positions the indexer selected; the selection's width (index_topk tokens, or
    pages × block_size) is the row width of `topk`."""

    uses_indexer = True

    def __init__(self, name: str = "sparse"):
        self.name = name

    def forward(
        self, query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_dim: int,
        topk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if topk is None:
            raise ValueError("sparse attention needs the top-k indices of a full layer")
        rows = cache.view(-1, cache.shape[-1])
        # Per-query products come out with whole latent rows (see attend_own_keys) and are written in
        # place; the value columns are the view returned.
        wide = query.new_empty(query.shape[0], query.shape[1], rows.shape[1])
        out = wide[..., :value_dim]
        if meta.shard is None and triton_ops.runs_on(query):
            # One Triton call, no host loop, no sync: with few heads, tiles of a request's neighbouring rows read
            # their union's rows once (prompt chunks, verify steps); otherwise every row its own selection.
            if tile_unions.takes(meta, query.shape[1]):
                from dsaserve.triton_ops.union_rows import attend_union_rows

                tiles = tile_unions.tile_unions(meta, topk, tile_queries(query.shape[1]))
                attend_union_rows(query, rows, tiles, scale, out)
            else:
                attend_selected_rows(query, rows, selection_slots(meta, topk), scale, out)
            return out
        heads = query.shape[1]
        width = topk.shape[1]
        decode = meta.decode_requests()
        self._single_queries(query, cache, meta, decode, topk, scale, value_dim, out)
        few = meta.few_row_requests(FEW_ROWS)
        if few:  # each row as its own single query: one batched pass instead of a loop over requests
            singles = meta.once(("single queries", tuple(few)), lambda: meta.rows_as_single_queries(few))
            self._single_queries(query, cache, singles, list(range(singles.num_reqs)), topk, scale, value_dim, out)
        for i in sorted(set(range(meta.num_reqs)) - set(decode) - set(few)):
            start, end = meta.query_range(i)
            split = meta.split_at_position(i, width)  # rows before it see ≤ width tokens
            dense_rows(query, cache, meta, i, (start, split), scale, value_dim, out)
            if split == end:
                continue
            seq_len = meta.seq_lens_host[i]
            slot_of = meta.context_slots(i, seq_len)
            tile = max(1, min(QUERY_TILE, MEMBER_BUDGET // seq_len))
            for t0 in range(split, end, tile):
                t1 = min(t0 + tile, end)
                union = small_union(topk[t0:t1], seq_len, UNION_LIMIT * width)
                if union is None:
                    attend_own_rows(query, rows, slot_of, topk, (t0, t1), scale, wide, value_dim)
                    continue
                member, positions = union
                keys = torch.index_select(rows, 0, slot_of[positions])  # each selected row loaded once
                key_chunk = max(1, SCORE_BUDGET // ((t1 - t0) * heads))
                out[t0:t1] = attend_latent_online(query[t0:t1], keys, ~member[:, positions], scale, value_dim,
                                                  key_chunk)
        return out

    @classmethod
    def _single_queries(cls, query, cache, meta, reqs, topk, scale, value_dim, out) -> None:
        """Single-query requests: those that see at most the selection's width attend to everything."""
        short = [i for i in reqs if meta.seq_lens_host[i] <= topk.shape[1]]
        decode_causal(query, cache, meta, short, scale, value_dim, out)
        cls._decode_selected(query, cache, meta, [i for i in reqs if i not in set(short)], topk, scale, value_dim, out)

    @staticmethod
    def _decode_selected(query, cache, meta, reqs, topk, scale, value_dim, out) -> None:
        """Batched attention of single-query requests over their own top-k positions."""
        if reqs:
            attend_decode_rows(query, cache, selected_rows(meta, reqs, topk), scale, value_dim, out)

    def decode_slots(self, meta: BatchMetadata, topk: torch.Tensor | None = None) -> torch.Tensor | None:
        """Where every request of the batch is single-query and all of them see at most the selection's width
        (whole contexts) or all more (their top-k): slots [T, W] such that one attend_selected_rows call over
        them is `forward` (a decode plan's attention piece makes that call); None otherwise."""
        if topk is None:
            return None

        def rows_of(reqs):
            short = [meta.seq_lens_host[i] <= topk.shape[1] for i in reqs]
            if all(short):
                return causal_rows(meta, reqs)
            return None if any(short) else selected_rows(meta, reqs, topk)

        return every_row_slots(meta, rows_of)


def selection_slots(meta: BatchMetadata, topk: torch.Tensor) -> torch.Tensor:
    """int64 [T, width]: the cache slot of each row's selected positions, -1 where the selection is empty (made once
    per step and top-k tensor: shared layers reuse their full layer's)."""
    def derive():
        selected = topk.long()
        return topk, meta.slots_of(meta.row_requests(), selected.clamp(min=0)).masked_fill_(selected < 0, -1)

    return meta.once(("selection slots", id(topk)), derive)[1]  # the entry holds topk: its id is not reused


def selected_rows(meta: BatchMetadata, reqs: list[int], topk: torch.Tensor) -> DecodeRows:
    """Single-query requests `reqs` over their selected positions (derived once per step and top-k tensor)."""
    def derive():
        if (topk.is_cpu and topk.shape[0] == len(reqs) and DecodeRows.are_every_row(meta, reqs)
                and torch_ops.load()):  # a decode batch: the slots in one native call
            slots = torch.ops.dsaserve.position_slots.default(meta.block_tables, topk, meta.block_size)
            return topk, DecodeRows(meta.query_start_loc[:-1], slots, True)
        selected = topk[meta.query_start_loc[torch.tensor(reqs, device=topk.device)]].long()  # [R, K]
        return topk, DecodeRows.of(meta, reqs, selected.clamp(min=0), selected < 0)

    # Shared layers attend with their full layer's top-k tensor itself: its rows are derived once. The
    # entry holds the tensor, so no other tensor can take its id while the batch runs.
    return meta.once(("selected rows", id(topk), tuple(reqs)), derive)[1]


OWN_ROWS_STEP = 2  # queries per gather in the per-query path (more only adds cache misses)
UNION_PROBE = 4  # queries whose union is measured first: past the limit already, the tile skips the rest


def small_union(topk: torch.Tensor, seq_len: int, limit: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a tile's selections, (membership [t, seq_len], sorted positions any query selected) when at
    most `limit` positions are selected, else None. A few queries are probed first: their union is a
    subset of the tile's, so when it is already too large the full [t, seq_len] mask is never built."""
    probe = topk[:UNION_PROBE]
    if probe.shape[0] < topk.shape[0] and int(selection_members(probe, seq_len).any(dim=0).sum()) > limit:
        return None
    member = selection_members(topk, seq_len)
    in_union = member.any(dim=0)
    if int(in_union.sum()) > limit:
        return None
    return member, in_union.nonzero().squeeze(1)


def attend_own_rows(query: torch.Tensor, rows: torch.Tensor, slot_of: torch.Tensor, topk: torch.Tensor,
                    span: tuple[int, int], scale: float, wide: torch.Tensor, value_dim: int) -> None:
    """When a tile's selections hardly overlap, the union is most of the context and scoring it costs
    as much as dense attention; each query then reads only its own rows. slot_of maps the request's
    positions to cache slots. The native kernel (bf16 with AVX-512 BF16) reads the rows in place and
    writes the value columns of `wide`, with no gathered copy. Elsewhere the torch path below gathers
    a few queries' rows at a time with index_select into one reused buffer (advanced indexing would
    allocate a fresh [q, K, D] tensor per step, which is much slower on CPU) and writes whole-row
    products into `wide`. The measurements are in docs/architecture.md#measurements."""
    t0, t1 = span
    width = topk.shape[1]
    selected = topk[t0:t1].long()
    invalid = selected < 0
    slots = slot_of[selected.clamp(min=0)]  # [t, K], one address lookup for the span
    masked = bool(invalid.any())
    if attend_selected_rows(query[t0:t1], rows, slots.masked_fill(invalid, -1) if masked else slots, scale,
                            wide[t0:t1, :, :value_dim]):
        return
    scaled_q = query[t0:t1] * scale
    buffer = rows.new_empty(OWN_ROWS_STEP * width, rows.shape[1])
    for a in range(0, t1 - t0, OWN_ROWS_STEP):
        b = min(a + OWN_ROWS_STEP, t1 - t0)
        keys = torch.index_select(rows, 0, slots[a:b].reshape(-1), out=buffer[: (b - a) * width])
        attend_own_keys(scaled_q[a:b], keys.view(b - a, width, -1), invalid[a:b] if masked else None,
                        out=wide[t0 + a:t0 + b])


def selection_members(topk: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[t, seq_len] True where the position is in that query's selection (-1 entries select nothing)."""
    selected = topk.long()
    member = torch.zeros(selected.shape[0], seq_len + 1, dtype=torch.bool, device=topk.device)
    member.scatter_(1, torch.where(selected >= 0, selected, seq_len), True)  # -1 lands in a spare column
    return member[:, :seq_len]
