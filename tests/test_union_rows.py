"""Sparse MLA over a query tile's union (attention/tile_unions.py, triton_ops/union_rows.py): the unions hold each
tile's selected positions once with a bit per query that chose them, and the kernel gives every query the softmax
over its own selection, as the per-query kernel does."""

from __future__ import annotations

import pytest
import torch
from reference import softmax_over_rows

from dsaserve import triton_ops
from dsaserve.attention import tile_unions
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.attention.sparse import SparseAttention, selection_slots
from dsaserve.triton_ops.union_tiles import tile_queries

pytestmark = pytest.mark.skipif(triton_ops.triton_imports() is not None, reason="Triton does not import here")
BS = 16
LENGTHS, NEW = [90, 40, 66], [7, 1, 5]  # a prompt chunk of 7 rows (a partial last tile), a decode, a chunk of 5


TABLES = [[3, 0, 5, 7, 9, 11], [1, 2, 4], [6, 8, 10, 12, 13]]


def batch(new: list[int] = NEW) -> BatchMetadata:
    return BatchMetadata.build([[1] * k for k in new], [n - k for n, k in zip(LENGTHS, new)], TABLES, BS, [])


def selections(meta: BatchMetadata, width: int, seed: int) -> torch.Tensor:
    """int32 [T, width]: neighbouring rows share most of their positions (as a trained indexer's do), each row sees
    only its past, and rows that see fewer than `width` positions end in -1 (top-k wider than the context)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        common = torch.randperm(LENGTHS[i], generator=g)
        for row in range(start, end):
            visible = meta.positions[row].item() + 1
            own = torch.cat([common[: width // 2], torch.randperm(visible, generator=g)])
            own = own[own < visible].unique()
            own = own[torch.randperm(own.shape[0], generator=g)][:width]
            rows.append(torch.cat([own, torch.full((width - own.shape[0],), -1)]))
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("queries", [1, 4, 16])
def test_each_tiles_union_holds_its_rows_selected_positions_once_with_a_bit_per_row(queries):
    meta = batch()
    topk = selections(meta, 24, seed=queries)
    tiles = tile_unions.tile_unions(meta, topk, queries)
    starts = meta.query_start_loc_host
    expected_tiles = [(a, min(queries, e - a)) for s, e in zip(starts, starts[1:]) for a in range(s, e, queries)]
    assert list(zip(tiles.first.tolist(), tiles.length.tolist())) == expected_tiles  # no tile spans two requests
    requests = meta.row_requests()
    for t, (first, length) in enumerate(expected_tiles):
        chosen = [set(topk[first + q][topk[first + q] >= 0].tolist()) for q in range(length)]
        count = tiles.counts[t].item()
        slots, bits = tiles.slots[t, :count], tiles.members[t, :count]
        union = sorted(set().union(*chosen))
        assert count == len(union)
        assert (tiles.slots[t, count:] == -1).all()
        request = requests[first].item()
        assert slots.tolist() == meta.slots(request, torch.tensor(union)).tolist()
        for q in range(queries):
            assert [p for p, b in zip(union, bits.tolist()) if b >> q & 1] == sorted(chosen[q] if q < length else [])


@pytest.mark.parametrize("queries", [1, 4, 16])
def test_unions_built_in_chunks_equal_one_build(monkeypatch, queries):
    meta = batch()
    topk = selections(meta, 24, seed=3)
    whole = tile_unions.tile_unions(meta, topk, queries)
    monkeypatch.setattr(tile_unions, "UNION_ELEMENTS", 50)  # a few tiles a chunk
    meta = batch()
    chunked = tile_unions.tile_unions(meta, topk, queries)
    for field in ("first", "length", "slots", "members", "counts"):
        assert torch.equal(getattr(chunked, field), getattr(whole, field)), field


def test_a_position_twice_in_one_row_sets_its_bit_once():
    meta = batch()
    topk = selections(meta, 24, seed=4)
    topk[0, 1] = topk[0, 0]  # row 0 (the first tile's first query) repeats a position
    tiles = tile_unions.tile_unions(meta, topk, 4)
    position = topk[0, 0].item()
    entry = tiles.slots[0].tolist().index(meta.slots(0, torch.tensor([position])).item())
    chose = {q for q in range(4) if position in topk[q].tolist()}
    assert {q for q in range(4) if tiles.members[0, entry].item() >> q & 1} == chose


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, value, width", [(2, 32, 24), (8, 32, 40), (16, 256, 24)])
def test_the_union_kernel_gives_each_query_the_softmax_over_its_own_selection(interpreter, dtype, heads, value,
                                                                              width):
    """Tiles of 16, 4 and 2 queries; unions wider than one step of rows (40-wide selections of 4 rows), partial last
    tiles, -1 entries; rows of other queries of the tile take no weight."""
    from dsaserve.triton_ops.union_rows import attend_union_rows

    meta = batch()
    topk = selections(meta, width, seed=heads)
    g = torch.Generator().manual_seed(heads)
    dim, blocks = value + 16, 14
    query = torch.randn(meta.num_tokens, heads, dim, generator=g).to(dtype)
    rows = torch.randn(blocks * BS, dim, generator=g).to(dtype)
    out = torch.full((meta.num_tokens, heads, value), 7.0, dtype=dtype)
    tiles = tile_unions.tile_unions(meta, topk, tile_queries(heads))
    attend_union_rows(query, rows, tiles, 0.2, out)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), softmax_over_rows(query, rows, selection_slots(meta, topk), 0.2, value),
                               rtol=tolerance, atol=tolerance)


def test_sparse_attention_goes_by_tile_unions_for_prompt_rows_with_few_heads(interpreter, monkeypatch):
    """8 heads (GLM-5.2 at TP=8) with prompt rows: the step goes by tile unions and gives what the per-query kernel
    gives; 16 and more fill the per-query kernel's tiles, and a decode-only step has no tile to share."""
    meta = batch()
    decode_only = batch([1, 1, 1])
    assert tile_unions.takes(meta, 8) and tile_unions.takes(meta, 2)
    assert not tile_unions.takes(meta, 16) and not tile_unions.takes(decode_only, 8)
    captured = batch()
    tile_unions.per_query_only(captured)  # (what a decode graph's captured forward does)
    assert not tile_unions.takes(captured, 8)
    heads, value, dim = 8, 32, 48
    topk = selections(meta, 24, seed=5)
    g = torch.Generator().manual_seed(5)
    query = torch.randn(meta.num_tokens, heads, dim, generator=g)
    cache = torch.randn(14, BS, dim, generator=g)
    made = []
    build = tile_unions.tile_unions
    monkeypatch.setattr(tile_unions, "tile_unions", lambda *args: made.append(1) or build(*args))
    by_tiles = SparseAttention().forward(query, cache, meta, 0.2, value, topk).clone()
    assert made
    monkeypatch.setattr(tile_unions, "takes", lambda meta, heads: False)
    per_query = SparseAttention().forward(query, cache, batch(), 0.2, value, topk)
    torch.testing.assert_close(by_tiles, per_query, rtol=1e-5, atol=1e-5)
