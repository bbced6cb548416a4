"""The union of each query tile's selections, for triton_ops/union_rows.py, made on the device without a host
synchronisation. Captured decode graphs still attend per query (per_query_only: the sort may not capture).

A request's rows are cut into tiles of `queries` consecutive rows (its last tile may be shorter); a tile never spans
two requests. Each tile's selections (positions, -1 empty) are keyed position · queries + query, sorted, and each run
of one position becomes one union entry: the position's cache slot and a bit per tile query that selected it, the
entries packed at the start of the tile's row (`counts` of them). Made once per step and top-k tensor: shared layers
reuse their full layer's selection, and with it this.
"""

from __future__ import annotations

import torch

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.triton_ops.union_tiles import TILE_ROWS, TileUnions

UNION_ELEMENTS = 1 << 20  # selection entries sorted at once: 8 MiB per int64 temporary


def build_bytes(entries: int) -> int:
    """The unions' build's transient bytes for a step's `entries` selection entries (rows × top-k): about ten int64
    temporaries (the sort's included) of one chunk."""
    return 80 * min(entries, UNION_ELEMENTS)


SEVERAL_ROWS = ("a request of several rows",)  # meta.derived's key for takes()


def per_query_only(meta: BatchMetadata) -> None:
    """This batch attends per query (captured decode graphs: the unions' sort may be one CUDA graphs cannot capture —
    torch sorts rows over 4,096 keys with CUB, whose segmented sort reads counts back to the host, NVIDIA/cccl#10798;
    which one torch takes was not checked on a GPU — and a refused capture would cost every decode graph; their
    warm-ups take the same path, so the capture compiles nothing new)."""
    meta.derived[SEVERAL_ROWS] = False


def takes(meta: BatchMetadata, heads: int) -> bool:
    """Whether a step's sparse attention goes by tile unions: at most 8 heads (where the per-query kernel masks half
    its 16-head tile or more; a tile then holds 4 queries or more) and some request with several rows (a prompt
    chunk, a verify step). At 16 heads a tile holds 2 queries, whose union the trained demo measures at 0.84 of their
    rows for 1.7× the products (docs/benchmarks.md): the per-query kernel stays. Single-row decode steps keep it
    too: a tile of one query would fill only `heads` of its pairs."""
    def several_rows():
        starts = meta.query_start_loc_host
        return any(b - a > 1 for a, b in zip(starts, starts[1:]))

    return heads <= TILE_ROWS // 4 and meta.once(SEVERAL_ROWS, several_rows)


def tile_layout(meta: BatchMetadata, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row int64, rows int32) of each tile, from the device's query_start_loc; the tile count from the host's
    copy of it (fixed for a captured shape)."""
    def derive():
        starts = meta.query_start_loc_host
        count = sum(-(-(b - a) // queries) for a, b in zip(starts, starts[1:]))
        loc = meta.query_start_loc
        tiles = (loc[1:] - loc[:-1] + queries - 1) // queries
        request = torch.repeat_interleave(torch.arange(tiles.shape[0], device=loc.device), tiles, output_size=count)
        before = torch.cumsum(tiles, 0) - tiles  # tiles of the earlier requests
        first = loc[request] + (torch.arange(count, device=loc.device) - before[request]) * queries
        length = torch.minimum(loc[request + 1] - first, torch.full_like(first, queries))
        return first, length.to(torch.int32)

    return meta.once(("tile layout", queries), derive)


def tile_unions(meta: BatchMetadata, topk: torch.Tensor, queries: int) -> TileUnions:
    """The tiles of `queries` rows and their selections' unions (topk int32 [T, width], -1 empty)."""
    def derive():
        first, length = tile_layout(meta, queries)
        count, width = first.shape[0], queries * topk.shape[1]
        slots = torch.empty(count, width, dtype=torch.int32, device=topk.device)
        members = torch.empty_like(slots)
        counts = torch.empty(count, dtype=torch.int32, device=topk.device)
        step = max(1, UNION_ELEMENTS // width)
        requests = meta.row_requests()
        for t0 in range(0, count, step):
            t1 = min(t0 + step, count)
            positions, members[t0:t1], counts[t0:t1] = _unions(topk, first[t0:t1], length[t0:t1], queries)
            valid = positions >= 0
            found = meta.slots_of(requests[first[t0:t1]], positions.clamp(min=0))
            slots[t0:t1] = torch.where(valid, found, -1)
        return topk, TileUnions(queries, first, length, slots, members, counts)

    return meta.once(("tile unions", id(topk), queries), derive)[1]  # the entry holds topk: its id is not reused


def _unions(topk: torch.Tensor, first: torch.Tensor, length: torch.Tensor,
            queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(union positions int64 [n, queries × width] (-1 past the count), member bits int32, counts int32) of n tiles."""
    n, k = first.shape[0], topk.shape[1]
    q = torch.arange(queries, device=topk.device)
    present = q[None, :] < length[:, None]
    selected = topk[(first[:, None] + q[None, :]).clamp(max=topk.shape[0] - 1)].long()  # [n, queries, k]
    selected = torch.where(present[:, :, None] & (selected >= 0), selected, -1)
    none = torch.iinfo(torch.int64).max
    key = torch.where(selected >= 0, selected * queries + q[None, :, None], none).view(n, queries * k)
    key = key.sort(dim=1).values
    valid = key != none
    position = key // queries
    starts_run = valid.clone()
    starts_run[:, 1:] &= position[:, 1:] != position[:, :-1]
    spare = queries * k  # where entries past the union land, dropped after
    place = torch.where(valid, torch.cumsum(starts_run, 1) - 1, spare)
    union = torch.full((n, spare + 1), -1, dtype=torch.int64, device=topk.device)
    union.scatter_(1, place, torch.where(valid, position, -1))  # a run's entries all write its position
    repeated = torch.zeros_like(valid)  # a position twice in one row (no selector makes one) sets its bit once
    repeated[:, 1:] = key[:, 1:] == key[:, :-1]
    bits = torch.where(valid & ~repeated, torch.bitwise_left_shift(1, key % queries), 0).to(torch.int32)
    members = torch.zeros(n, spare + 1, dtype=torch.int32, device=topk.device).scatter_add_(1, place, bits)
    return union[:, :spare], members[:, :spare], starts_run.sum(1).to(torch.int32)
