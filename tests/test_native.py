"""The native kernels (selected-rows attention, indexer scores) against fp32 computations, their use
by the sparse backend and the indexer, and the torch fallback where they cannot be built."""


import pytest
import torch
from conftest import NO_BODY, native_bodies

from dsaserve import native
from dsaserve.attention import SparseAttention, sparse
from dsaserve.attention.indexer_cache import IndexerKeyCache
from dsaserve.attention.indexer_selection import ScoreScratch, Selection
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.native import index_scores as native_scores
from dsaserve.native import torch_ops
from dsaserve.native.selected_rows import attend_selected_rows, fits, has_bf16_kernel
from dsaserve.native.topk import topk_rows

CPU_HAS_AVX512_BF16 = all(flag in native.cpu_signature() for flag in ("avx512_bf16", "avx512bw"))
needs_bf16_kernel = pytest.mark.skipif(
    not has_bf16_kernel(),  # builds the kernels here on first use
    reason="no native AVX-512 BF16 kernel here (needs a C++ compiler and AVX-512 BF16)")


def reference(query, rows, slots, scale, value_dim):
    """fp32 softmax attention of each query over its own rows (-1 slots left out)."""
    out = torch.empty(query.shape[0], query.shape[1], value_dim)
    for i in range(query.shape[0]):
        keys = rows[slots[i][slots[i] >= 0]].float()
        probs = torch.softmax(query[i].float() @ keys.T * scale, dim=-1)
        out[i] = probs @ keys[:, :value_dim]
    return out


def random_case(seed, n, heads, dim, width, pool, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    query = (torch.randn(n, heads, dim, generator=g) * 3).to(dtype)  # sharp: the online rescaling matters
    rows = torch.randn(pool, dim, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(pool, generator=g)[:width] for _ in range(n)])
    return query, rows, slots


def attention_bodies() -> list:
    """(body, dtype) the selected-rows kernel runs on this host: bf16 on each body, fp32 on the AVX2 one."""
    bodies = native_bodies()
    cases = [(b, torch.bfloat16) for b in bodies] + ([("avx2", torch.float32)] if "avx2" in bodies else [])
    return [pytest.param(c, id=f"{c[0]}-{str(c[1]).removeprefix('torch.')}") for c in cases] or [NO_BODY]


@pytest.fixture(params=attention_bodies())
def rows_body(request):
    """The dtype the selected-rows kernel runs in, under the body family (cpu_isa) it runs; the default after."""
    body, dtype = request.param
    torch_ops.configure("auto", body)
    yield dtype
    torch_ops.configure("auto", "auto")


def tolerance(dtype) -> float:
    return 0.02 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding


@pytest.mark.skipif(not CPU_HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16")
def test_kernel_is_built_on_a_machine_with_a_compiler_and_avx512_bf16():
    assert has_bf16_kernel()
    assert fits(16, 576, 512) and fits(64, 576, 512)
    assert native_scores.fits(32, 128)


def test_other_shapes_keep_the_torch_path():
    assert not fits(4, 576, 512) and not fits(16, 576, 500)
    assert not native_scores.fits(6, 128)


def test_selected_rows_equal_fp32_attention_within_bf16_rounding(rows_body):
    # 150 rows: two whole blocks of 64 and a ragged one, with empty (-1) entries in every block.
    dtype = rows_body
    for heads, dim, value_dim in ((16, 72, 64), (32, 40, 32), (4, 80, 64), (24, 48, 40)):  # 4, 24: padded heads
        query, rows, slots = random_case(0, 5, heads, dim, 150, 400, dtype)
        slots[1, ::7] = -1
        slots[3, 64:] = -1  # only the first block valid
        wide = torch.zeros(5, heads, dim, dtype=dtype)  # written through a strided view
        if not attend_selected_rows(query, rows, slots, 0.2, wide[..., :value_dim]):
            assert value_dim % 32 and torch_ops.cpu_kernels() == "avx512_bf16"  # value columns in 32s there
            continue
        expected = reference(query, rows, slots, 0.2, value_dim)
        out = wide[..., :value_dim].float()
        assert (out - expected).abs().max() <= tolerance(dtype) * expected.abs().max()
        assert not wide[..., value_dim:].any()  # columns past the values are left alone


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_a_query_alone_is_split_over_the_threads_and_merged_correctly(threads, rows_body):
    """Fewer queries than threads: each query's rows go in parts to the threads and the parts are merged. The
    dominant rows sit in the last part, one part holds no valid row, and the rows are ragged."""
    dtype = rows_body
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, width in ((1, 150), (1, 1000), (2, 333)):
            query, rows, slots = random_case(width, n, 16, 72, width, 2 * width, dtype)
            rows[slots[:, -5:].flatten()] = (query[0, 0].float() * 2).to(dtype)  # dominant rows, last part
            slots[-1, width // 4: 3 * width // 4] = -1  # empty entries: a whole part of them at 3 or 4 threads
            out = torch.empty(n, 16, 64, dtype=dtype)
            assert attend_selected_rows(query, rows, slots, 0.2, out)
            expected = reference(query, rows, slots, 0.2, 64)
            assert (out.float() - expected).abs().max() <= tolerance(dtype) * expected.abs().max(), (n, width)
        query, rows, slots = random_case(0, 1, 16, 72, 300, 400, dtype)
        out = torch.empty(1, 16, 64, dtype=dtype)
        assert attend_selected_rows(query, rows, torch.full_like(slots, -1), 0.2, out)
        assert not out.any()  # no row at all: zeros, as in one pass, not NaN
    finally:
        torch.set_num_threads(before)


def test_a_query_whose_best_rows_come_late_is_rescaled_correctly(rows_body):
    """The running maximum grows in a later block: earlier blocks' sums must be scaled down."""
    dtype = rows_body
    query, rows, slots = random_case(1, 2, 16, 72, 200, 300, dtype)
    rows[slots[:, 180:].flatten()] = (query[0, 0].float() * 2).to(dtype)  # dominant rows in the last block
    out = torch.empty(2, 16, 64, dtype=dtype)
    assert attend_selected_rows(query, rows, slots, 0.2, out)
    expected = reference(query, rows, slots, 0.2, 64)
    assert (out.float() - expected).abs().max() <= tolerance(dtype) * expected.abs().max()


def test_sparse_backend_takes_the_kernel_for_bf16_per_query_rows(monkeypatch):
    block, heads, rank, rope = 16, 16, 64, 8
    g = torch.Generator().manual_seed(3)
    context, new = 300, 20
    blocks = -(-(context + new) // block)
    cache = torch.randn(blocks + 2, block, rank + rope, generator=g).bfloat16()
    table = torch.randperm(blocks + 2, generator=g)[:blocks].tolist()
    meta = BatchMetadata.build([[1] * new], [context], [table], block, [])
    query = torch.randn(new, heads, rank + rope, generator=g).bfloat16()
    topk = torch.stack([torch.randperm(int(p) + 1, generator=g)[:100] for p in meta.positions]).to(torch.int32)
    topk[0, 90:] = -1
    calls = []
    real = sparse.attend_selected_rows
    monkeypatch.setattr(sparse, "attend_selected_rows", lambda *a: calls.append(real(*a)) or calls[-1])
    monkeypatch.setattr(sparse, "UNION_LIMIT", 0)  # the per-query path
    out = SparseAttention().forward(query, cache, meta, 0.2, rank, topk).float()
    assert calls and all(used == has_bf16_kernel() for used in calls)
    rows = cache.view(-1, rank + rope)
    slots = torch.stack([meta.slots(0, torch.tensor([max(int(p), 0) for p in topk[t].tolist()]))
                         for t in range(new)])
    slots[topk.long() < 0] = -1
    expected = reference(query, rows, slots, 0.2, rank)
    assert (out - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.skipif(not CPU_HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16")
def test_decode_batches_take_the_kernel_for_bf16(monkeypatch):
    """Single-query requests of different lengths (dense: each its whole context, padded to the longest;
    sparse: its own top-k with empty entries) read their rows through the kernel."""
    from dsaserve.attention import DenseAttention, dense

    block, heads, rank, rope = 16, 16, 64, 8
    g = torch.Generator().manual_seed(5)
    context = [40, 300, 7]
    blocks = [-(-(c + 1) // block) for c in context]
    cache = torch.randn(sum(blocks) + 2, block, rank + rope, generator=g).bfloat16()
    perm = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables = [perm[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(context))]
    meta = BatchMetadata.build([[1]] * len(context), context, tables, block, [])
    query = (torch.randn(len(context), heads, rank + rope, generator=g) * 3).bfloat16()
    calls = []
    real = dense.attend_selected_rows
    monkeypatch.setattr(dense, "attend_selected_rows", lambda *a: calls.append(real(*a)) or calls[-1])
    rows = cache.view(-1, rank + rope)

    def expected_for(positions):
        slots = torch.full((len(context), max(len(p) for p in positions)), -1)
        for i, p in enumerate(positions):
            slots[i, :len(p)] = meta.slots(i, torch.tensor(p))
        return reference(query, rows, slots, 0.2, rank)

    out = DenseAttention().forward(query, cache, meta, 0.2, rank).float()
    expected = expected_for([list(range(c + 1)) for c in context])
    assert calls == [True] and (out - expected).abs().max() <= 0.02 * expected.abs().max()
    width = 24
    topk = torch.full((len(context), width), -1, dtype=torch.int32)
    chosen = []
    for i, c in enumerate(context):
        pick = torch.randperm(c + 1, generator=g)[: min(c + 1, width - 3)]
        topk[i, : len(pick)] = pick.to(torch.int32)
        chosen.append(pick.tolist() if c + 1 > width else list(range(c + 1)))  # short ones see everything
    out = SparseAttention().forward(query, cache, meta, 0.2, rank, topk).float()
    expected = expected_for(chosen)
    assert calls[1:] == [True, True] and (out - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.skipif(not CPU_HAS_AVX512_BF16, reason="this CPU has no AVX-512 BF16")
def test_a_few_row_request_ahead_of_a_prompt_attends_through_the_kernel_correctly():
    """A request with three new tokens (draft verification, a short chunk) as the batch's first rows, then a
    prompt and a decode row: the few rows go through the single-query path as requests of their own, whose
    rows are the batch's first ones but not all of it. Each row's output against its own causal softmax."""
    from dsaserve.attention import DenseAttention

    block, heads, rank, rope = 16, 16, 64, 8
    g = torch.Generator().manual_seed(13)
    new, context = [3, 20, 1], [12, 0, 30]
    blocks = [-(-(c + n) // block) for c, n in zip(context, new)]
    cache = torch.randn(sum(blocks) + 2, block, rank + rope, generator=g).bfloat16()
    perm = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables = [perm[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(new))]
    meta = BatchMetadata.build([[1] * n for n in new], context, tables, block, [])
    query = (torch.randn(sum(new), heads, rank + rope, generator=g) * 3).bfloat16()
    rows = cache.view(-1, rank + rope)
    for backend, extra in ((DenseAttention(), ()), (SparseAttention(), (torch.full((sum(new), 64), -1).int(),))):
        if extra:  # every row sees at most 64 positions: all of them selected
            for t in range(sum(new)):
                extra[0][t, : int(meta.positions[t]) + 1] = torch.arange(int(meta.positions[t]) + 1)
        out = backend.forward(query, cache, meta, 0.2, rank, *extra).float()
        for i in range(meta.num_reqs):
            start, end = meta.query_range(i)
            for t in range(start, end):
                slots = meta.slots(i, torch.arange(int(meta.positions[t]) + 1))[None]
                expected = reference(query[t:t + 1], rows, slots, 0.2, rank)
                # bf16 scores and probabilities: the prompt's torch path rounds more than the kernel
                assert (out[t:t + 1] - expected).abs().max() <= 0.05 * expected.abs().max(), (type(backend), t)


def test_without_a_compiler_the_operators_are_off_and_attention_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(torch_ops, "_loaded", None)
    monkeypatch.setattr(torch_ops, "_kernels", None)
    monkeypatch.setattr(torch_ops, "_unavailable", None)
    monkeypatch.setenv("DSASERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert torch_ops.load() is False and torch_ops.cpu_kernels() == "none"
    assert "no C++ compiler" in torch_ops.unavailable()
    query, rows, slots = random_case(2, 2, 16, 72, 80, 100)
    out = torch.empty(2, 16, 64, dtype=torch.bfloat16)
    assert attend_selected_rows(query, rows, slots, 0.2, out) is False


def test_index_scores_equal_relu_weighted_head_sum_in_fp32(body):
    # 150 keys: two whole groups of 64 and a ragged one ending inside a 16-key register.
    g = torch.Generator().manual_seed(4)
    for heads, dim, keys in ((8, 128, 150), (32, 128, 64), (4, 16, 3)):
        q = torch.randn(6, heads, dim, generator=g).bfloat16()
        weights = torch.randn(6, heads, generator=g) * 0.1
        key_rows = torch.randn(keys, dim, generator=g).bfloat16()
        assert native_scores.fits(heads, dim)
        out = torch.full((6, keys + 9), 7.0)
        packed = native_scores.pack_keys(key_rows, torch.empty(native_scores.packed_size(keys, dim), dtype=torch.int32))
        native_scores.index_scores(q, weights, packed, keys, out)
        expected = ((q.float() @ key_rows.float().T).relu() * weights[:, :, None]).sum(1)
        assert torch.allclose(out[:, :keys], expected, atol=1e-4, rtol=1e-4)
        assert (out[:, keys:] == 7.0).all()  # nothing written past the keys


@pytest.mark.skipif("avx2" not in native_bodies(), reason="no AVX2 body here")
@pytest.mark.parametrize("heads, dim", [(32, 128), (8, 40), (24, 16)])  # two passes of 16; one of 8; 16 + 8
def test_fp32_index_scores_on_the_avx2_body_read_the_key_cache_in_place(heads, dim):
    """An fp32 model's indexer on the AVX2 body (dtype auto there): scores of fp32 queries against fp32 keys read
    along a scrambled block list, the last block partial and a key range not in fours; the torch path's values."""
    g = torch.Generator().manual_seed(heads + dim)
    block_size, num_blocks = 16, 9
    cache = IndexerKeyCache(num_blocks, block_size, dim, "model", torch.float32, torch.device("cpu"))
    cache.write(torch.arange(num_blocks * block_size), torch.randn(num_blocks * block_size, dim, generator=g))
    blocks = torch.tensor([6, 1, 8, 3])
    keys = len(blocks) * block_size - 7
    q = torch.randn(3, heads, dim, generator=g)
    weights = torch.randn(3, heads, generator=g)
    out = torch.full((3, keys + 5), 7.0)
    torch_ops.configure("auto", "avx2")
    try:
        assert native_scores.fits_f32(heads, dim)
        native_scores.index_scores_f32_blocks(q, weights, cache.data, blocks, keys, out)
    finally:
        torch_ops.configure("auto", "auto")
    key_rows = cache.read_blocks(blocks, torch.float32)[:keys]
    expected = ((q @ key_rows.T).relu() * weights[:, :, None]).sum(1)
    torch.testing.assert_close(out[:, :keys], expected, rtol=1e-5, atol=1e-5)
    assert (out[:, keys:] == 7.0).all()  # nothing written past the keys


def test_an_fp32_models_indexer_selects_through_the_avx2_kernel_what_torch_selects(monkeypatch):
    """select() on an fp32 model under the AVX2 body scores through the kernel (counted) and keeps the positions the
    torch path keeps, for a prompt chunk and a decode row."""
    from dsaserve.attention.indexer_selection import select

    g = torch.Generator().manual_seed(11)
    block_size, heads, dim = 16, 32, 64
    lengths, new = [300, 90], [12, 1]
    blocks = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables = [order[:blocks[0]], order[blocks[0]:sum(blocks)]]
    cache = IndexerKeyCache(sum(blocks) + 2, block_size, dim, "model", torch.float32, torch.device("cpu"))
    for n, table in zip(lengths, tables):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        cache.write(slots, torch.randn(n, dim, generator=g))
    meta = BatchMetadata.build([[1] * k for k in new], [n - k for n, k in zip(lengths, new)], tables, block_size, [])
    q = torch.randn(sum(new), heads, dim, generator=g)
    weights = torch.rand(sum(new), heads, generator=g)
    calls = []
    real = native_scores.index_scores_f32_blocks
    monkeypatch.setattr(native_scores, "index_scores_f32_blocks", lambda *a: calls.append(1) or real(*a))
    torch_ops.configure("auto", "avx2")
    try:
        got = select(q, weights, cache, meta, Selection(64))
    finally:
        torch_ops.configure("auto", "auto")
    monkeypatch.setattr(native_scores, "fits_f32", lambda heads, dim: False)
    expected = select(q, weights, cache, meta, Selection(64))
    assert calls and [set(r.tolist()) for r in got] == [set(r.tolist()) for r in expected]


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_index_scores_read_in_place_from_a_packed_key_cache_equal_the_gathered_keys_scores(block_size, body):
    """A packed key cache scored in place along a block list gives the bits of the same keys gathered,
    packed per chunk and scored: any block order, a block count whose 16-key groups do not fill the
    kernel's 64-key items, and keys ending inside a block."""
    g = torch.Generator().manual_seed(block_size)
    heads, dim, num_blocks = 8, 128, 11
    cache = IndexerKeyCache(num_blocks, block_size, dim, "model", torch.bfloat16, torch.device("cpu"), packed=True)
    cache.write(torch.arange(num_blocks * block_size), torch.randn(num_blocks * block_size, dim, generator=g))
    blocks = torch.tensor([7, 2, 9, 0, 5])
    keys = len(blocks) * block_size - 5
    q = torch.randn(3, heads, dim, generator=g).bfloat16()
    weights = torch.rand(3, heads, generator=g)
    in_place = torch.full((3, keys + 4), 7.0)
    native_scores.index_scores_blocks(q, weights, cache.groups, blocks, keys, in_place)
    gathered = cache.read_blocks(blocks, torch.bfloat16)[:keys]
    packed = native_scores.pack_keys(gathered, torch.empty(native_scores.packed_size(keys, dim), dtype=torch.int32))
    expected = torch.empty(3, keys)
    native_scores.index_scores(q, weights, packed, keys, expected)
    assert torch.equal(in_place[:, :keys], expected)
    assert (in_place[:, keys:] == 7.0).all()  # nothing written past the keys
    with pytest.raises(RuntimeError, match="block id 11"):
        native_scores.index_scores_blocks(q, weights, cache.groups, torch.tensor([3, 11]), block_size, in_place)


@pytest.mark.parametrize("block_size", [16, 64])
def test_a_packed_key_cache_gives_back_the_keys_written_at_their_slots(block_size):
    g = torch.Generator().manual_seed(3)
    plain = IndexerKeyCache(6, block_size, 32, "model", torch.bfloat16, torch.device("cpu"))
    packed = IndexerKeyCache(6, block_size, 32, "model", torch.bfloat16, torch.device("cpu"), packed=True)
    slots = torch.randperm(6 * block_size, generator=g)[: 3 * block_size]  # scattered over every block
    keys = torch.randn(len(slots), 32, generator=g)
    for cache in (plain, packed):
        cache.write(slots, keys)
    blocks = torch.tensor([4, 0, 5, 1])
    assert torch.equal(packed.read_blocks(blocks, torch.float32), plain.read_blocks(blocks, torch.float32))
    assert not torch.equal(packed.data, plain.data)  # the same keys, laid out for the kernel
    for kind, dim in (("fp8", 32), ("int8", 30)):  # no kernel layout for fp8 keys; int8 ones go by 4 dims
        with pytest.raises(ValueError, match="packed indexer key cache"):
            IndexerKeyCache(6, block_size, dim, kind, torch.bfloat16, torch.device("cpu"), packed=True)


@needs_bf16_kernel
def test_packed_keys_written_in_one_call_equal_the_torch_indexing(monkeypatch):
    g = torch.Generator().manual_seed(6)
    slots, keys = torch.randperm(4 * 32, generator=g)[:40], torch.randn(40, 24, generator=g)
    native, python = (IndexerKeyCache(4, 32, 24, "model", torch.bfloat16, torch.device("cpu"), packed=True)
                      for _ in range(2))
    native.write(slots, keys)
    monkeypatch.setattr(torch_ops, "load", lambda: False)
    python.write(slots, keys)
    assert torch.equal(native.data, python.data) and native.data.abs().sum() > 0
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="slot 128 is not in the cache"):
        native.write(torch.tensor([128]), keys[:1])


@pytest.mark.skipif(not native_scores.fits_int8(8, 32), reason="int8 keys stay plain without AVX-512 VNNI")
def test_int8_keys_written_in_one_call_equal_the_torch_rounding_and_indexing(monkeypatch):
    g = torch.Generator().manual_seed(7)
    slots, keys = torch.randperm(4 * 32, generator=g)[:40], torch.randn(40, 24, generator=g) * 3
    keys[5] = 0  # an all-zero key: the scale's floor
    for dtype in (torch.float32, torch.bfloat16):
        native, python = (IndexerKeyCache(4, 32, 24, "int8", torch.bfloat16, torch.device("cpu"), packed=True)
                          for _ in range(2))
        native.write(slots, keys.to(dtype))
        with monkeypatch.context() as patch:
            patch.setattr(torch_ops, "load", lambda: False)
            python.write(slots, keys.to(dtype))
        assert torch.equal(native.data, python.data) and torch.equal(native.scale, python.scale)
        assert native.scale.abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot 128 is not in the cache"):
        native.write(torch.tensor([128]), keys[:1])


def test_indexer_scratch_takes_the_kernel_for_bf16_on_this_cpu():
    scratch = ScoreScratch(64, 32, 128, 64, Selection(2048), torch.bfloat16, torch.device("cpu"))
    assert scratch.native == native_scores.fits(32, 128)
    fp32 = ScoreScratch(64, 32, 128, 64, Selection(2048), torch.float32, torch.device("cpu"))
    assert not fp32.native  # fp32 models score exactly as the reference, in torch


def test_topk_rows_match_torch_topk_sets_with_masked_and_tied_values():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(7, 3000, generator=g)
    x = wide[:, 100:2900]  # strided rows
    x[1, 40:] = float("-inf")  # fewer finite values than k: -inf fills the rest
    x[2] = torch.randint(0, 5, (2800,), generator=g).float()  # ties at the k-th value
    x[3, ::2] = -0.0
    x[3, 1::2] = 0.0
    for k in (1, 300, 2800):
        values, indices = topk_rows(x, k)
        expected = x.topk(k, dim=1, sorted=False).values
        assert torch.equal(values.sort(dim=1).values, expected.sort(dim=1).values)
        assert torch.equal(torch.gather(x, 1, indices), values)
        assert all(len(set(row.tolist())) == k for row in indices)  # k distinct columns per row
    untied = torch.randn(3, 500, generator=g)
    assert torch.equal(topk_rows(untied, 50)[1].sort(dim=1).values,
                       untied.topk(50, dim=1).indices.sort(dim=1).values)


needs_operators = pytest.mark.skipif(not torch_ops.load(), reason="dsaserve's torch operators could not be built here "
                                                                  "(needs a C++ compiler)")


def torch_path(monkeypatch, fn, *args):
    """fn(*args) with the native operators off (model/layers.py's torch operators)."""
    with monkeypatch.context() as m:
        m.setattr(torch_ops, "load", lambda: False)
        return fn(*args)


@needs_operators
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_operator_gives_the_torch_operators_bits(monkeypatch, dtype):
    """Strided queries (a slice of the head dimension, as q_rope is), several heads and a 2-D key, both pair
    orders: the same bits as the torch path, every product and sum rounded as it rounds."""
    from dsaserve.model.layers import apply_rope

    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 3, 40, generator=g).to(dtype)[..., 8:]  # [5, 3, 32], last dimension unit-stride
    k = torch.randn(5, 32, generator=g).to(dtype)
    cos, sin = torch.randn(5, 16, generator=g).to(dtype), torch.randn(5, 16, generator=g).to(dtype)
    for x in (q, k):
        for interleaved in (False, True):
            assert torch.equal(apply_rope(x, cos, sin, interleaved), torch_path(monkeypatch, apply_rope, x, cos, sin,
                                                                                interleaved))


@needs_operators
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_rope_of_the_leading_dims_in_one_call_gives_the_torch_operators_bits(monkeypatch, dtype):
    """The indexer rotates the first rope dims of its 2-D keys and 3-D queries and keeps the rest: the rope
    operator does both in one call, with the bits of slicing, rotating and concatenating in torch."""
    from types import SimpleNamespace

    from dsaserve.model.indexer import Indexer

    g = torch.Generator().manual_seed(5)
    cos, sin = torch.randn(5, 8, generator=g).to(dtype), torch.randn(5, 8, generator=g).to(dtype)
    for x in (torch.randn(5, 40, generator=g).to(dtype), torch.randn(5, 3, 40, generator=g).to(dtype)):
        for interleaved in (False, True):
            indexer = SimpleNamespace(rope_dim=16, rope_interleave=interleaved)
            fused = Indexer.rope(indexer, x, cos, sin)
            assert torch.equal(fused[..., 16:], x[..., 16:])
            assert torch.equal(fused, torch_path(monkeypatch, Indexer.rope, indexer, x, cos, sin))


@needs_operators
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_operator_equals_the_torch_operators_up_to_the_sum_order(monkeypatch, dtype):
    from dsaserve.model.layers import RMSNorm

    g = torch.Generator().manual_seed(6)
    norm = RMSNorm(300, 1e-6)
    norm.weight.data = (torch.rand(300, generator=g) + 0.5).to(dtype)
    x = (torch.randn(2, 7, 300, generator=g) * 3).to(dtype)
    with torch.inference_mode():
        ours, theirs = norm(x), torch_path(monkeypatch, norm, x)
    assert ours.shape == theirs.shape and ours.dtype == dtype
    # fp32: the sums' order; bf16: at most one rounding step of an output element that lies on the edge
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((ours.float() - theirs.float()).abs() <= tolerance * theirs.float().abs() + 1e-6).all()
    if dtype == torch.bfloat16:  # and that rarely: the same bits almost everywhere
        assert (ours != theirs).float().mean() < 1e-2


@needs_operators
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_rows_written_in_one_call_equal_the_operators_bits(monkeypatch, dtype):
    """MLA's cache rows [kv_a_layernorm(latent) | rope(k_rope)] written by one native call against the split,
    norm, rotary, concatenation and index_copy_ it replaces: the same bits, at scattered slots (three tokens of
    a batch, two of them in other blocks), both pair orders; no other row is touched."""
    from dsaserve.config import ModelConfig
    from dsaserve.demo.checkpoint_builder import small_config
    from dsaserve.model import mla as mla_module

    g = torch.Generator().manual_seed(8)
    for interleaved in (False, True):
        cfg = ModelConfig.from_dict(small_config(rope_interleave=interleaved))
        attn = mla_module.MLAAttention(cfg, 0, SparseAttention(), Selection(cfg.index_topk))
        with torch.no_grad():
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            attn.kv_a_layernorm.weight.add_(1.0)
        attn.to(dtype)
        x = torch.randn(3, cfg.hidden_size, generator=g).to(dtype)
        cos, sin = torch.randn(3, cfg.qk_rope_head_dim // 2, generator=g).to(dtype), \
            torch.randn(3, cfg.qk_rope_head_dim // 2, generator=g).to(dtype)
        meta = BatchMetadata.build([[1, 2, 3]], [5], [[4, 1]], 4, [2])  # positions 5, 6, 7: slots 5, 6, 7
        meta = BatchMetadata(**{**meta.__dict__, "slot_mapping": torch.tensor([17, 6, 30])})
        caches = []
        for native_call in (True, False):
            cache = torch.full((8, 4, cfg.kv_cache_dim), 7.0, dtype=dtype)
            monkeypatch.setattr(mla_module, "one_operator", lambda *a: native_call and torch_ops.load())
            with torch.inference_mode():
                attn.write_latents(x, cos, sin, meta, cache)
            caches.append(cache)
        assert torch.equal(caches[0], caches[1]), interleaved
        written = caches[0].view(-1, cfg.kv_cache_dim)
        assert (written[[17, 6, 30]] != 7.0).any(dim=1).all()
        untouched = torch.ones(32, dtype=torch.bool)
        untouched[[17, 6, 30]] = False
        assert (written[untouched] == 7.0).all()


@needs_operators
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_addition_and_norm_in_one_call_give_their_bits(monkeypatch, dtype):
    """A decoder layer's `x + attn` and the norm after it in one native call: the sum's bits, and the norm's
    bits as the norm operator gives them for that sum."""
    from dsaserve.model import layers
    from dsaserve.model.layers import RMSNorm

    g = torch.Generator().manual_seed(12)
    norm = RMSNorm(300, 1e-6)
    norm.weight.data = (torch.rand(300, generator=g) + 0.5).to(dtype)
    x, attn = (torch.randn(3, 300, generator=g) * 3).to(dtype), torch.randn(3, 300, generator=g).to(dtype)
    with torch.inference_mode():
        normed, total = norm(attn, residual=x)
        assert torch.equal(total, x + attn) and torch.equal(normed, norm(x + attn))
        monkeypatch.setattr(layers, "one_operator", lambda *a: False)
        assert torch.equal(norm(attn, residual=x)[1], total)


def test_an_edit_recompiles_only_the_sources_it_touches(monkeypatch, tmp_path):
    """Objects are kept by what each source's text depends on: an edit to one source compiles it alone; an edit to
    a header compiles the sources that include it (directly or through another header), and no other."""
    from dsaserve.native import build

    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "pieces.h").write_text('#include "row_math.h"\n')
    (folder / "row_math.h").write_text("// maths\n")
    for name, text in {"a.cpp": '#include "pieces.h"\n', "b.cpp": "// alone\n",
                       "c.cpp": '#include "row_math.h"\n'}.items():
        (folder / name).write_text(text)
    monkeypatch.setattr(build, "SOURCE_DIR", folder)
    monkeypatch.setattr(build, "SOURCES", sorted(folder.glob("*.cpp")))
    monkeypatch.setenv("DSASERVE_CACHE", str(tmp_path / "cache"))
    compiled = []
    monkeypatch.setattr(build, "_compile", lambda source, obj: compiled.append(source.name) or obj.write_bytes(b""))
    monkeypatch.setattr(build, "_run", lambda command, output: output.write_bytes(b""))

    def build_now() -> list[str]:
        compiled.clear()
        library = build.library_path()
        if not library.exists():
            build.build(library)
        return sorted(compiled)

    assert build_now() == ["a.cpp", "b.cpp", "c.cpp"] and build_now() == []
    (folder / "b.cpp").write_text("// alone, edited\n")
    assert build_now() == ["b.cpp"]
    (folder / "row_math.h").write_text("// maths, edited\n")
    assert build_now() == ["a.cpp", "c.cpp"]


def test_a_failed_compile_leaves_no_object_and_says_why(monkeypatch, tmp_path):
    """A source that does not compile raises with the compiler's message; nothing half-written stays in the cache
    (the next start compiles it again)."""
    from dsaserve.native import build

    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    output = tmp_path / "bad.o"
    with pytest.raises(RuntimeError, match="failed"):
        build._compile(bad, output)
    assert not output.exists() and [p.name for p in tmp_path.iterdir()] == ["bad.cpp"]


@needs_operators
def test_every_operator_has_a_meta_kernel_beside_its_schema():
    """Each operator taking tensors registers a Meta kernel in its own source (shapes without computing), and the
    shapes it gives are the CPU kernel's."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsaserve::")]
    with_tensors = [n for n in names if any(
        "Tensor" in str(a.type) for a in getattr(torch.ops.dsaserve, n.split("::")[1]).default._schema.arguments)]
    assert len(with_tensors) >= 20
    assert [n for n in with_tensors if not torch._C._dispatch_has_kernel_for_dispatch_key(n, "Meta")] == []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    weight = torch.rand(64, generator=g).bfloat16() + 0.5
    cases = [(torch.ops.dsaserve.rms_norm.default, (x, weight, 1e-6)),
             (torch.ops.dsaserve.add_rms_norm.default, (x, x, weight, 1e-6)),
             (torch.ops.dsaserve.topk_rows.default, (torch.randn(4, 50, generator=g), 7)),
             (torch.ops.dsaserve.apply_rope.default, (x.view(3, 2, 32), x[:, :8], x[:, :8], True)),
             (torch.ops.dsaserve.context_slots.default, (torch.arange(6).view(2, 3), [5, 9], 4))]
    for op, args in cases:
        real = op(*args)
        fake = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
        for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
            assert f.device.type == "meta" and (f.shape, f.dtype) == (r.shape, r.dtype), op


@pytest.mark.skipif(not torch_ops.load(), reason="the native operators are not built here (no compiler)")
@pytest.mark.parametrize("reqs", [[0, 1, 2], [2, 1]])
def test_whole_context_slots_in_one_call_equal_the_torch_derivation(monkeypatch, reqs):
    """Each request's positions through its own (shuffled) block table, -1 past its length; every request of
    a decode batch (no gather of rows) or some of them in another order."""
    from dsaserve.attention import dense

    block_size = 4
    tables = [torch.randperm(12)[:n].tolist() for n in (3, 1, 5)]
    lens = [10, 2, 17]
    meta = BatchMetadata.build([[5]] * 3, [n - 1 for n in lens], tables, block_size, [0, 1, 2])
    native_rows = dense.DecodeRows.whole_contexts(meta, reqs)
    monkeypatch.setattr(dense.torch_ops, "load", lambda: False)
    torch_rows = dense.DecodeRows.whole_contexts(meta, reqs)
    assert torch.equal(native_rows.slots, torch_rows.slots) and native_rows.slots.dtype == torch.int64
    assert torch.equal(native_rows.query_rows, torch_rows.query_rows)
    assert native_rows.every_row == torch_rows.every_row == (reqs == [0, 1, 2])
    assert native_rows.slots[reqs.index(1), 2:].eq(-1).all()  # request 1 holds 2 positions


@pytest.mark.skipif(not torch_ops.load(), reason="the native operators are not built here (no compiler)")
def test_selected_position_slots_in_one_call_equal_the_torch_derivation(monkeypatch):
    """A decode batch's top-k positions (-1 = none) through each request's own shuffled block table, as the
    sparse backend derives them for every full layer's selection; a position past the table is refused."""
    from dsaserve.attention import sparse

    block_size = 4
    tables = [torch.randperm(12)[:n].tolist() for n in (3, 1, 5)]
    lens = [10, 2, 17]
    meta = BatchMetadata.build([[5]] * 3, [n - 1 for n in lens], tables, block_size, [0, 1, 2])
    topk = torch.tensor([[9, 0, 4, -1, 7], [1, 0, -1, -1, -1], [16, 3, 12, 8, 5]], dtype=torch.int32)
    native_rows = sparse.selected_rows(meta, [0, 1, 2], topk)
    monkeypatch.setattr(sparse.torch_ops, "load", lambda: False)
    torch_rows = sparse.selected_rows(BatchMetadata.build([[5]] * 3, [n - 1 for n in lens], tables, block_size,
                                                          [0, 1, 2]), [0, 1, 2], topk)
    assert torch.equal(native_rows.slots, torch_rows.slots) and native_rows.slots.dtype == torch.int64
    assert torch.equal(native_rows.query_rows, torch_rows.query_rows) and native_rows.every_row
    assert native_rows.slots[1, 2:].eq(-1).all()
    with pytest.raises(RuntimeError, match="position 4 of row 0 is past its block table.s 4 positions"):
        torch.ops.dsaserve.position_slots(meta.block_tables[1:2, :1], torch.tensor([[4]], dtype=torch.int32),
                                          block_size)
