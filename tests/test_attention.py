"""Attention backends on random paged caches, against plain per-query reference computations."""

import torch

from dsaserve.attention import DenseAttention, SparseAttention
from dsaserve.attention.metadata import BatchMetadata

BLOCK, HEADS, RANK, ROPE = 8, 4, 16, 8


def setup(seed: int, new: list[int], context: list[int]):
    g = torch.Generator().manual_seed(seed)
    total = sum(-(-(c + n) // BLOCK) for c, n in zip(context, new))
    cache = torch.randn(total + 3, BLOCK, RANK + ROPE, generator=g)
    perm = torch.randperm(total + 3, generator=g).tolist()
    tables, used = [], 0
    for c, n in zip(context, new):
        k = -(-(c + n) // BLOCK)
        tables.append(perm[used : used + k])
        used += k
    meta = BatchMetadata.build([[1] * n for n in new], context, tables, BLOCK, [])
    query = torch.randn(sum(new), HEADS, RANK + ROPE, generator=g)
    return cache, meta, query


def per_query(query, cache, meta, positions_for):
    """Reference: each query gathers its own key rows and runs a softmax over them."""
    out = torch.empty(query.shape[0], HEADS, RANK)
    rows = cache.view(-1, cache.shape[-1])
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        for t in range(start, end):
            pos = positions_for(t, int(meta.positions[t]))
            keys = rows[meta.slots(i, torch.tensor(pos))]
            probs = torch.softmax(query[t] @ keys.T * 0.1, dim=-1)
            out[t] = probs @ keys[:, :RANK]
    return out


def test_dense_equals_per_query_causal():
    cache, meta, query = setup(0, new=[5, 1, 13], context=[0, 30, 9])
    out = DenseAttention().forward(query, cache, meta, 0.1, RANK)
    expected = per_query(query, cache, meta, lambda t, p: list(range(p + 1)))
    assert torch.allclose(out, expected, atol=1e-5)


def test_tiled_sparse_equals_per_query_sparse():
    topk_k = 6
    cache, meta, query = setup(1, new=[70, 1, 9], context=[0, 40, 20])
    g = torch.Generator().manual_seed(2)
    topk = torch.full((query.shape[0], topk_k), -1, dtype=torch.int32)
    for t in range(query.shape[0]):
        p = int(meta.positions[t])
        if p + 1 <= topk_k:
            topk[t, : p + 1] = torch.arange(p + 1)
        else:
            topk[t] = torch.randperm(p + 1, generator=g)[:topk_k].to(torch.int32)
    out = SparseAttention().forward(query, cache, meta, 0.1, RANK, topk)

    def selected(t, p):
        return sorted(x for x in topk[t].tolist() if x >= 0)
    assert torch.allclose(out, per_query(query, cache, meta, selected), atol=1e-5)


def test_sparse_selecting_everything_reproduces_dense():
    cache, meta, query = setup(3, new=[40, 1], context=[0, 50])
    k = 64
    topk = torch.full((query.shape[0], k), -1, dtype=torch.int32)
    for t in range(query.shape[0]):
        p = int(meta.positions[t])
        topk[t, : p + 1] = torch.arange(p + 1)
    sparse = SparseAttention().forward(query, cache, meta, 0.1, RANK, topk)
    dense = DenseAttention().forward(query, cache, meta, 0.1, RANK)
    assert torch.allclose(sparse, dense, atol=1e-5)


def test_tiles_with_barely_overlapping_selections_give_the_same_result(monkeypatch):
    import dsaserve.attention.sparse as sparse

    topk_k = 6
    cache, meta, query = setup(5, new=[60], context=[90])
    g = torch.Generator().manual_seed(6)
    topk = torch.stack([torch.randperm(int(p) + 1, generator=g)[:topk_k] for p in meta.positions]).to(torch.int32)
    monkeypatch.setattr(sparse, "UNION_LIMIT", 1000)  # force the union path everywhere
    union_path = SparseAttention().forward(query, cache, meta, 0.1, RANK, topk)
    monkeypatch.setattr(sparse, "UNION_LIMIT", 0)  # force the per-query fallback everywhere
    own_rows = SparseAttention().forward(query, cache, meta, 0.1, RANK, topk)

    def selected(t, p):
        return sorted(x for x in topk[t].tolist() if x >= 0)
    expected = per_query(query, cache, meta, selected)
    assert torch.allclose(union_path, expected, atol=1e-5) and torch.allclose(own_rows, expected, atol=1e-5)


def test_union_scored_in_key_chunks_with_online_softmax(monkeypatch):
    """Chunks of 5 union rows: most queries have no selected row in some chunk (the first included)."""
    import dsaserve.attention.sparse as sparse

    cache, meta, query = setup(7, new=[50], context=[70])
    g = torch.Generator().manual_seed(8)
    topk = torch.stack([torch.randperm(int(p) + 1, generator=g)[:6] for p in meta.positions]).to(torch.int32)
    monkeypatch.setattr(sparse, "UNION_LIMIT", 1000)  # the union path everywhere
    monkeypatch.setattr(sparse, "SCORE_BUDGET", sparse.QUERY_TILE * query.shape[1] * 5)
    out = SparseAttention().forward(query, cache, meta, 0.1, RANK, topk)

    def selected(t, p):
        return sorted(x for x in topk[t].tolist() if x >= 0)
    assert torch.allclose(out, per_query(query, cache, meta, selected), atol=1e-5)


def test_small_union_probe_only_skips_tiles_whose_union_is_too_large():
    """The probe (first UNION_PROBE queries) may only reject: a small probe union must still be
    checked against the whole tile, and a small tile union must be returned with its positions."""
    from dsaserve.attention.sparse import UNION_PROBE, small_union

    rows = UNION_PROBE + 4
    overlapping = torch.tensor([[1, 3, 5]] * rows, dtype=torch.int32)
    overlapping[-1] = torch.tensor([5, 7, -1])
    member, positions = small_union(overlapping, seq_len=20, limit=4)
    assert positions.tolist() == [1, 3, 5, 7]
    assert member[-1].nonzero().squeeze(1).tolist() == [5, 7]

    late_spread = overlapping.clone()
    late_spread[UNION_PROBE:] = torch.arange(UNION_PROBE * 3, rows * 3).view(-1, 3) % 20
    assert small_union(late_spread, seq_len=20, limit=4) is None  # the probe alone is within the limit

    early_spread = torch.arange(rows * 3, dtype=torch.int32).view(rows, 3) % 20
    assert small_union(early_spread, seq_len=20, limit=4) is None


def test_bf16_per_query_rows_stay_within_bf16_rounding_of_fp32(monkeypatch):
    """The per-query path takes bf16 scores straight into the softmax; the result must stay within
    bf16 rounding of the same attention computed in fp32."""
    from dsaserve.attention import sparse

    cache, meta, query = setup(9, new=[40], context=[60])
    g = torch.Generator().manual_seed(10)
    topk = torch.stack([torch.randperm(int(p) + 1, generator=g)[:6] for p in meta.positions]).to(torch.int32)
    monkeypatch.setattr(sparse, "UNION_LIMIT", 0)  # the per-query path everywhere
    cache, query = cache.bfloat16(), (query * 3).bfloat16()  # sharper softmax than unit scores
    out = SparseAttention().forward(query, cache, meta, 0.1, RANK, topk).float()

    def selected(t, p):
        return sorted(x for x in topk[t].tolist() if x >= 0)
    expected = per_query(query.float(), cache.float(), meta, selected)
    assert (out - expected).abs().max() <= 0.02 * expected.abs().max()
