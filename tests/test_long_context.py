"""Long context: the streaming indexer (same top-k, bounded memory), page selection, quantized indexer
cache (recall, accounting), and end-to-end equality with the reference."""

import contextlib

import pytest
import torch
from conftest import native_bodies
from reference import load_reference, reference_greedy
from torch.utils._python_dispatch import TorchDispatchMode

import dsaserve.attention.indexer_selection as indexer
from dsaserve import LLM, SamplingParams
from dsaserve.attention.indexer_cache import IndexerKeyCache
from dsaserve.attention.indexer_selection import Selection, select, stream_select
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.bench.longctx import HeapSampler
from dsaserve.engine.workers.kv_cache import KVCacheLayout
from dsaserve.engine_args import EngineArgs
from dsaserve.native import index_scores as native_scores
from dsaserve.native import torch_ops

HEADS, DIM, BS = 4, 16, 16


def random_context(seed: int, context: int, new: int, kind: str = "model", heads: int = HEADS, dim: int = DIM):
    """A request with `context` cached tokens and `new` queries, keys in a scrambled paged cache."""
    g = torch.Generator().manual_seed(seed)
    total = context + new
    nblocks = -(-total // BS)
    cache = IndexerKeyCache(nblocks + 5, BS, dim, kind, torch.float32, torch.device("cpu"))
    table = torch.randperm(nblocks + 5, generator=g)[:nblocks].tolist()
    meta = BatchMetadata.build([[1] * new], [context], [table], BS, [])
    keys = torch.randn(total, dim, generator=g)
    all_slots = meta.slots(0, torch.arange(total))
    cache.write(all_slots, keys)
    q = torch.randn(new, heads, dim, generator=g)
    weights = torch.rand(new, heads, generator=g) + 0.1
    return cache, meta, keys, q, weights


def direct_scores(keys, q, weights, positions):
    """The plain computation: every score [t, S] materialized in fp32, future keys at -inf."""
    scores = (torch.relu(q.float() @ keys.float().T) * weights[:, :, None]).sum(1)
    scores[torch.arange(keys.shape[0])[None, :] > positions[:, None]] = float("-inf")
    return scores


def direct_topk(keys, q, weights, positions, k):
    """Direct scores, then top-k."""
    scores = direct_scores(keys, q, weights, positions)
    values, idx = scores.topk(k, dim=1)
    scored = positions >= k  # queries that see more than k tokens
    margin = (values[scored, -1] - scores[scored].topk(k + 1, dim=1).values[:, -1]).min() if scored.any() else 1.0
    return [set(i for i, v in zip(r.tolist(), vals.tolist()) if v > float("-inf"))
            for r, vals in zip(idx, values)], margin


@pytest.mark.parametrize("context, new", [(0, 96), (37, 48), (100, 50), (250, 1)])
def test_streaming_indexer_matches_direct_topk(monkeypatch, context, new):
    """Query chunks that are and are not block multiples, after cached prefixes (position = prefix + offset)."""
    monkeypatch.setattr(indexer, "INDEXER_SCORE_BUDGET", 64 * HEADS * 32)  # 2-block key chunks
    monkeypatch.setattr(indexer, "MERGE_WINDOW", 64)  # two chunks per merge: many merges per query
    cache, meta, keys, q, weights = random_context(context + new, context, new)
    k = 24
    out = select(q, weights, cache, meta, Selection(k))
    expected, margin = direct_topk(keys, q, weights, meta.positions, k)
    assert margin > 1e-4  # the data has no near-ties at the boundary
    got = [set(x for x in row.tolist() if x >= 0) for row in out]
    assert got == expected


def test_a_decode_tile_masks_its_future_as_the_general_mask_does():
    """A tile whose queries share one position (a decode step) masks the chunk's tail with one fill: the same
    scores, -inf included, as the per-query causal mask, for chunks ending before, within and at the end of its
    block."""
    cache, meta, keys, q, weights = random_context(5, 150, 1)
    scratch = indexer.ScoreScratch(1, HEADS, DIM, BS, Selection(24), torch.float32, torch.device("cpu"))
    position = int(meta.positions[0])  # 150: block 9, offset 6
    flat = q.reshape(HEADS, -1)
    for blocks in ((0, 4), (0, 10), (5, 10), (9, 10), (3, 9)):
        general = indexer.chunk_candidates(flat, weights, cache, meta.block_tables[0], blocks, BS, scratch,
                                           meta.positions, position, Selection(24)).clone()
        one_fill = indexer.chunk_candidates(flat, weights, cache, meta.block_tables[0], blocks, BS, scratch,
                                            meta.positions, position, Selection(24), None, position)
        assert torch.equal(general, one_fill), blocks
        assert one_fill.isinf().sum() == max(0, blocks[1] * BS - 1 - position)


def test_decode_selections_reuse_one_scratch_and_keep_nothing_between_calls(monkeypatch):
    """Tiles of a few queries (decode) reuse the scratch made for their shapes; each selection is still its own
    top-k (nothing carried over from the previous one in the same buffers, with running merges over several
    windows). Prefill tiles get their own."""
    monkeypatch.setattr(indexer, "INDEXER_SCORE_BUDGET", HEADS * 32)  # 2-block key chunks
    monkeypatch.setattr(indexer, "MERGE_WINDOW", 64)  # two chunks per merge
    made = [indexer.score_scratch(1, HEADS, DIM, BS, Selection(24), torch.float32, torch.device("cpu"))
            for _ in range(2)]
    assert made[0] is made[1]
    assert (indexer.score_scratch(64, HEADS, DIM, BS, Selection(24), torch.float32, torch.device("cpu"))
            is not indexer.score_scratch(64, HEADS, DIM, BS, Selection(24), torch.float32, torch.device("cpu")))
    for seed, context in ((11, 300), (12, 90), (13, 700)):
        cache, meta, keys, q, weights = random_context(seed, context, 1)
        out = select(q, weights, cache, meta, Selection(24))
        expected, margin = direct_topk(keys, q, weights, meta.positions, 24)
        assert margin > 1e-4
        assert [set(x for x in row.tolist() if x >= 0) for row in out] == expected, seed


def decode_batch(seed: int, contexts: list[int], heads: int = 8, kind: str = "model"):
    """Single-query requests over `contexts` cached tokens each, keys (bf16, or int8) in one packed cache, or fp32
    queries and keys in a plain fp32 cache (kind "fp32": an fp32 model's), or fp32 queries and int8 keys ("int8-fp32":
    an fp32 model's int8 cache), scrambled tables."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + 1 for c in contexts]
    counts = [-(-n // BS) for n in lens]
    dtype = torch.float32 if kind in ("fp32", "int8-fp32") else torch.bfloat16
    cache = IndexerKeyCache(sum(counts) + 3, BS, DIM, {"fp32": "model", "int8-fp32": "int8"}.get(kind, kind), dtype,
                            torch.device("cpu"), packed=kind != "fp32")
    order = torch.randperm(sum(counts) + 3, generator=g).tolist()
    tables = [order[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(lens))]
    meta = BatchMetadata.build([[1]] * len(lens), contexts, tables, BS, [])
    for i, n in enumerate(lens):
        cache.write(meta.slots(i, torch.arange(n)), torch.randn(n, DIM, generator=g).to(dtype))
    q = torch.randn(len(lens), heads, DIM, generator=g).to(dtype)
    return cache, meta, q, torch.rand(len(lens), heads, generator=g) + 0.1


@pytest.mark.skipif(not native_scores.fits(8, DIM), reason="no native index-scores kernel here (needs AVX-512 BF16)")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["model", pytest.param("int8", marks=pytest.mark.skipif(
    not native_scores.fits_int8(8, DIM), reason="no int8 index-scores kernel here (needs AVX-512 VNNI)")),
    pytest.param("fp32", marks=pytest.mark.skipif("avx2" not in native_bodies(), reason="no AVX2 body here")),
    pytest.param("int8-fp32", marks=pytest.mark.skipif(not native_scores.fits_int8(8, DIM), reason="no int8 body"))])
def test_a_decode_batch_selects_in_one_native_call_what_the_tile_loop_selects(monkeypatch, threads, kind):
    """A batch of single queries takes one native call (decode_selection.cpp) that gives the tile loop's positions in
    its order: contexts within the width (all visible), within one chunk, and over several chunks and merge windows,
    queries ending mid-block and at a block's end; whole queries per thread or each query's scoring shared out; bf16
    keys and int8 ones; fp32 queries and keys on the AVX2 body (an fp32 model's), fp32 queries and int8 keys."""
    with body_family("avx2" if kind == "fp32" else "auto"):
        selects_in_one_call(monkeypatch, threads, kind)


@pytest.fixture
def default_family_after():
    """The process's body family back to the default after a test whose engine chose another."""
    yield
    torch_ops.configure("auto", "auto")


@contextlib.contextmanager
def body_family(cpu_isa: str):
    torch_ops.configure("auto", cpu_isa)
    try:
        yield
    finally:
        torch_ops.configure("auto", "auto")


def selects_in_one_call(monkeypatch, threads: int, kind: str) -> None:
    monkeypatch.setattr(indexer, "INDEXER_SCORE_BUDGET", 2 * BS * 8 * 4)  # 2-block chunks for tiles of 4
    monkeypatch.setattr(indexer, "MERGE_WINDOW", 4 * BS)  # two chunks per merge window
    cache, meta, q, weights = decode_batch(5, [10, 23, 40, 63, 130, 300], kind=kind)
    calls = []
    native = torch.ops.dsaserve.decode_selection.default
    monkeypatch.setattr(torch.ops.dsaserve.decode_selection, "default", lambda *a: calls.append(1) or native(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = select(q, weights, cache, meta, Selection(24))
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(indexer, "decodes_natively", lambda *a: False)
    expected = select(q, weights, cache, meta, Selection(24))
    assert calls == [1]
    assert torch.equal(got, expected)
    assert (got[0] >= 0).sum() == 11 and (got[1:] >= 0).all()


@pytest.mark.skipif(not native_scores.fits(8, DIM), reason="no native index-scores kernel here (needs AVX-512 BF16)")
def test_a_decode_selection_refuses_a_block_table_shorter_than_its_context():
    cache, meta, q, weights = decode_batch(6, [40, 70])
    with pytest.raises(RuntimeError, match="length 71 of query 1 is not within its block table's 64 positions"):
        torch.ops.dsaserve.decode_selection(q, weights, cache.groups, meta.block_tables[:, :4], [41, 71], 24, 2, 4)
    bad = meta.block_tables.clone()
    bad[1, 2] = 10**6
    with pytest.raises(RuntimeError, match="block id 1000000 of query 1 is not in the cache's"):
        torch.ops.dsaserve.decode_selection(q, weights, cache.groups, bad, [41, 71], 24, 2, 4)


@pytest.mark.parametrize("native_kernel", [
    pytest.param(True, id="native", marks=pytest.mark.skipif(
        not native_scores.fits(8, DIM), reason="no native index-scores kernel here (needs AVX-512 BF16)")),
    pytest.param(False, id="torch"),
])
def test_bf16_scoring_selects_within_rounding_of_fp32_scores(native_kernel, monkeypatch, body):
    """bf16 models score q·k from bf16 inputs with fp32 accumulation (the torch path also rounds each
    head's score to bf16). A key that beats the k-th fp32 score by more than twice the rounding bound
    must be selected, and none that trails it by more may be. The native kernel under each body family."""
    if not native_kernel:
        monkeypatch.setattr(indexer.native_scores, "fits", lambda heads, dim: False)
    kernel_calls = []
    real_kernel = native_scores.index_scores
    monkeypatch.setattr(native_scores, "index_scores", lambda *a: kernel_calls.append(1) or real_kernel(*a))
    cache, meta, keys, q, weights = random_context(3, 600, 40, heads=8)
    q, keys = q.bfloat16(), keys.bfloat16()
    bf16_cache = IndexerKeyCache(cache.data.shape[0], BS, DIM, "model", torch.bfloat16, torch.device("cpu"))
    bf16_cache.write(meta.slots(0, torch.arange(keys.shape[0])), keys)
    assert indexer.score_dtype(q) == torch.bfloat16
    k = 64
    out = select(q, weights, bf16_cache, meta, Selection(k))
    assert bool(kernel_calls) == native_kernel  # the path this case is about is the one that ran
    per_head = q.float() @ keys.float().T  # [t, H, S], exact products of the bf16 inputs
    exact = direct_scores(keys, q, weights, meta.positions)
    # bf16 rounds each head's score by ≤ 2^-9 relative; per query, the worst key bounds the error
    bound = (per_head.abs() * weights[:, :, None]).sum(1).amax(dim=1) * 2.0**-8
    kth = exact.topk(k, dim=1).values[:, -1]
    for row, scores, threshold, err in zip(out, exact, kth, bound):
        chosen = set(row.tolist()) - {-1}
        assert len(chosen) == k
        assert set((scores > threshold + 2 * err).nonzero().flatten().tolist()) <= chosen
        assert chosen <= set((scores >= threshold - 2 * err).nonzero().flatten().tolist())


class PeakHeap(TorchDispatchMode):
    """Peak bytes of the C heap (glibc mallinfo2: arenas + mmap) observed after every torch op."""

    def __init__(self):
        super().__init__()
        self.used = HeapSampler().used  # the benchmark's reading of the heap, checked here after each op
        self.base = self.peak = self.used()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.used())
        return out


def scratch_bytes(context: int) -> int:
    cache, meta, _, q, weights = random_context(1, context, 64, heads=32)
    with PeakHeap() as heap:
        stream_select(q, weights, cache, meta, 0, meta.positions, Selection(2048))
    return heap.peak - heap.base


def test_streaming_indexer_scratch_memory_does_not_grow_with_context():
    small, large = scratch_bytes(16384), scratch_bytes(65536)
    # [64 queries, 32 heads, chunk] fp32 scores: the chunk is sized to INDEXER_SCORE_BUDGET elements
    bound = 6 * indexer.INDEXER_SCORE_BUDGET * 4
    assert large <= bound and small <= bound, (small, large, bound)
    assert large <= 1.25 * small, (small, large)
    # the matrix the streaming avoids: [64, 65536] fp32 scores alone, or [64, 32, 65536] per head
    assert large < 64 * 32 * 65536 * 4 / 8


def page_query(scores: list[float], query_pos: int):
    """One query, one head, weight 1: key s scores exactly scores[s] (relu of q·k with q = e0)."""
    n = len(scores)
    cache = IndexerKeyCache(-(-n // 8), 8, 4, "model", torch.float32, torch.device("cpu"))
    meta = BatchMetadata.build([[1]], [query_pos], [list(range(-(-n // 8)))], 8, [])
    keys = torch.zeros(n, 4)
    keys[:, 0] = torch.tensor(scores)
    cache.write(torch.arange(n), keys)
    q = torch.zeros(1, 1, 4)
    q[0, 0, 0] = 1.0
    return cache, meta, q, torch.ones(1, 1)


def chosen_pages(out: torch.Tensor) -> set[int]:
    return {p // 8 for p in out[0].tolist() if p >= 0}


def test_page_ranking_masks_before_the_maximum():
    """Query at 20 (pages of 8): page 2 holds visible 16..20 (low scores) and invisible 22 (huge).
    Masking after the maximum would promote page 2; the right order keeps page 0."""
    scores = [0.1] * 32
    scores[3], scores[9], scores[18], scores[22] = 5.0, 3.0, 1.0, 100.0
    cache, meta, q, w = page_query(scores, 20)
    out = stream_select(q, w, cache, meta, 0, meta.positions, Selection(2048, pages=1))
    assert chosen_pages(out) == {0}
    assert set(out[0].tolist()) - {-1} == set(range(8))


def test_page_selection_across_merge_windows_matches_direct(monkeypatch):
    """Pages of 16, one block per scoring chunk, two pages per merge window: the running page top-k
    over many windows equals ranking every page by its best visible token at once."""
    monkeypatch.setattr(indexer, "INDEXER_SCORE_BUDGET", 64 * HEADS * BS)
    monkeypatch.setattr(indexer, "MERGE_WINDOW", 2 * BS)
    cache, meta, keys, q, weights = random_context(11, 300, 20)
    pages = 3
    out = select(q, weights, cache, meta, Selection(2048, pages=pages))
    scores = direct_scores(keys, q, weights, meta.positions)
    padded = torch.full((scores.shape[0], -(-keys.shape[0] // BS) * BS), float("-inf"))
    padded[:, : keys.shape[0]] = scores
    best_pages = padded.view(scores.shape[0], -1, BS).amax(-1).topk(pages, dim=1).indices
    for row, chosen, position in zip(out, best_pages, meta.positions.tolist()):
        expected = {p * BS + j for p in chosen.tolist() for j in range(BS) if p * BS + j <= position}
        assert set(row.tolist()) - {-1} == expected


def test_only_pages_with_a_visible_token_are_chosen():
    scores = [1.0] * 40
    scores[30] = 50.0  # page 3: entirely in the future of a query at 12
    cache, meta, q, w = page_query(scores, 12)
    out = stream_select(q, w, cache, meta, 0, meta.positions, Selection(2048, pages=4))
    assert chosen_pages(out) == {0, 1}
    assert max(out[0].tolist()) == 12  # the visible tokens of page 1 only


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_indexer_recall(kind, dtype):
    """Against exact fp32 scoring; bf16 models also score the dequantized keys in bf16."""
    recalls = []
    for seed in range(4):
        exact_cache, meta, keys, q, weights = random_context(seed, 1000, 8, heads=8)
        quant = IndexerKeyCache(exact_cache.data.shape[0], BS, DIM, kind, dtype, torch.device("cpu"))
        quant.write(meta.slots(0, torch.arange(keys.shape[0])), keys)
        a = select(q, weights, exact_cache, meta, Selection(128))
        b = select(q.to(dtype), weights, quant, meta, Selection(128))
        for x, y in zip(a, b):
            recalls.append(len(set(x.tolist()) & set(y.tolist())) / 128)
    assert sum(recalls) / len(recalls) >= 0.95


def int8_caches(seed: int, context: int, new: int, heads: int = 8, dim: int = DIM):
    """The same bf16-model keys in an int8 key cache kept in the int8 kernel's layout and in a plain one."""
    _, meta, keys, q, weights = random_context(seed, context, new, heads=heads, dim=dim)
    blocks = -(-(context + new) // BS) + 5
    packed, plain = (IndexerKeyCache(blocks, BS, dim, "int8", torch.bfloat16, torch.device("cpu"), packed=p)
                     for p in (True, False))
    for cache in (packed, plain):
        cache.write(meta.slots(0, torch.arange(keys.shape[0])), keys.bfloat16())
    return packed, plain, meta, keys, q.bfloat16(), weights


@pytest.mark.skipif(not native_scores.fits_int8(8, DIM), reason="no int8 index-scores kernel here")
@pytest.mark.parametrize("dim", [16, 20])  # queries rounded 16 values at a time, and one at a time
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_int8_keys_scored_in_place_by_int8_products_of_the_rounded_queries(dim, q_dtype, body):
    """The int8 kernel's scores, per body family (VNNI; the AVX2 body's signed byte products): the stored int8 keys
    and scales, the queries (bf16, or an fp32 model's) rounded per query and head to int8 (amax / 127, nearest
    even), exact integer dot products, relu, weighted head sum; keys past a block's end and block lists in any
    order. The int8 layout holds the plain cache's values."""
    packed, plain, meta, keys, q, weights = int8_caches(21, 200, 5, dim=dim)
    q = (q.float() + 1e-3 * torch.randn(q.shape, generator=torch.Generator().manual_seed(dim))).to(q_dtype)
    assert packed.int8_groups is not None and not packed.packed and plain.int8_groups is None
    table = meta.block_tables[0]
    blocks = table[torch.tensor([3, 0, 7, 12, 5])]
    assert torch.equal(packed.read_blocks(blocks, torch.float32), plain.read_blocks(blocks, torch.float32))
    n_keys = 5 * BS - 7  # the last block only partly
    out = torch.full((q.shape[0], 5 * BS), 7.0)
    native_scores.index_scores_int8_blocks(q, weights, packed.int8_groups, packed.scale, blocks, n_keys, out)
    key_values = torch.index_select(plain.data, 0, blocks).reshape(-1, dim).float()[:n_keys]
    key_scales = torch.index_select(plain.scale, 0, blocks).reshape(-1).float()[:n_keys]
    q_scales = q.float().abs().amax(-1) / 127
    q_values = (q.float() / q_scales[..., None]).round().clamp(-127, 127)
    per_head = torch.relu(torch.einsum("thd,sd->ths", q_values, key_values))  # exact: integers below 2^24
    expected = (per_head * (weights * q_scales)[:, :, None]).sum(1) * key_scales
    torch.testing.assert_close(out[:, :n_keys], expected, rtol=1e-5, atol=1e-6)
    assert (out[:, n_keys:] == 7.0).all()  # nothing written past `keys`


@pytest.mark.skipif(not ({"avx512_bf16", "avx2"} <= set(native_bodies()) and native_scores.fits_int8(8, DIM)),
                    reason="needs a CPU running both the AVX-512 VNNI int8 body and the AVX2 one")
def test_the_avx2_int8_scores_are_the_vnni_bodys_bits():
    """The AVX2 body's signed byte products (vpmaddubsw on |key| and the query byte with the key's sign) make the
    VNNI body's integer sums, heads summed in its order: the same scores, bit for bit, also for keys of -127 and
    127 and queries at their extremes (the largest pair products an int16 holds)."""
    packed, _, meta, keys, q, weights = int8_caches(22, 300, 3, heads=12, dim=64)
    q[0, 0, :8] = torch.tensor([1.0, -1.0] * 4)  # rounded to ±127
    blocks = meta.block_tables[0][:19]
    results = {}
    for family in ("avx512_bf16", "avx2"):
        with body_family(family):
            out = torch.zeros(q.shape[0], 19 * BS)
            native_scores.index_scores_int8_blocks(q, weights, packed.int8_groups, packed.scale, blocks, 19 * BS - 3,
                                                   out)
            results[family] = out
    assert torch.equal(results["avx512_bf16"], results["avx2"])


@pytest.mark.skipif(not native_scores.fits_int8(8, DIM), reason="no int8 index-scores kernel here (needs AVX-512 VNNI)")
def test_int8_keys_in_the_kernels_layout_select_with_the_recall_of_the_plain_int8_cache():
    """Rounding the queries to int8 as well (the int8 kernel's path) keeps the top-k recall against exact fp32
    scoring at the plain int8 cache's bar."""
    recalls = []
    for seed in range(4):
        exact_cache, meta, keys, q, weights = random_context(seed, 1000, 8, heads=8)
        packed, _, _, _, _, _ = int8_caches(seed, 1000, 8)
        a = select(q, weights, exact_cache, meta, Selection(128))
        b = select(q.bfloat16(), weights, packed, meta, Selection(128))
        recalls += [len(set(x.tolist()) & set(y.tolist())) / 128 for x, y in zip(a, b)]
    assert sum(recalls) / len(recalls) >= 0.95


def test_cache_accounting_with_odd_widths(make_checkpoint):
    """Latent 30 + rope 6 and indexer 20 wide: padding either part (or the concatenation) would show."""
    path = make_checkpoint("odd_widths", seed=0, kv_lora_rank=30, qk_rope_head_dim=6, qk_nope_head_dim=10,
                           v_head_dim=12, index_head_dim=20)
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=512, kv_cache_memory="1MiB",
              indexer_cache_dtype="int8", progress=False)
    engine = llm.engine
    cache, cfg = engine.kv_cache, engine.config
    live = sum(t.untyped_storage().nbytes() for t in cache.tensors())
    per_token = cfg.num_hidden_layers * 36 * 2 + len(cfg.full_layers) * (20 + 2)  # bf16 latents; int8 keys + fp16 scale
    assert engine.kv_layout.bytes_per_token == per_token
    assert live == per_token * cache.num_blocks * cache.block_size == cache.nbytes()
    assert cache.num_blocks == (1 << 20) // (per_token * 16)  # admission sizes the pool with the same bytes
    bf16 = KVCacheLayout.of(cfg, torch.bfloat16, "model").indexer_bytes_per_token
    assert engine.kv_layout.indexer_bytes_per_token <= 0.6 * bf16
    out = llm.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("fp8_weights, asked, kept", [(True, "auto", "int8"), (False, "auto", "model"),
                                                       (True, "model", "model"), (False, "fp8", "fp8")])
def test_indexer_cache_dtype_auto_keeps_8bit_keys_for_fp8_weights_alone(make_checkpoint, fp8_weights, asked, kept):
    """As FP8 releases are served: an FP8 checkpoint's indexer keys are int8 unless `model` asks for its dtype; other
    checkpoints keep the model dtype unless told otherwise. The cache, its bytes per token and the engine agree."""
    path = make_checkpoint("fp8-split" if fp8_weights else "parity_mixed_FFSS", seed=0, fp8=fp8_weights)
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, indexer_cache_dtype=asked, progress=False)
    caches = list(llm.engine.kv_cache.indexer.values())
    assert caches and {c.kind for c in caches} == {kept}
    dim = llm.engine.config.index_head_dim
    assert llm.engine.kv_layout.indexer_bytes_per_token == len(caches) * IndexerKeyCache.bytes_per_token(
        dim, kept, torch.float32)


def test_indexer_cache_dtype_names_its_choices(make_checkpoint):
    with pytest.raises(ValueError, match="indexer_cache_dtype='bf16' is not supported; use one of auto, model"):
        EngineArgs(model=make_checkpoint("parity_mixed_FFSS", seed=0), indexer_cache_dtype="bf16")


def test_int8_indexer_on_glm52_is_under_055_of_bf16():
    import json

    from conftest import REFERENCE_CONFIG

    from dsaserve.config import ModelConfig

    cfg = ModelConfig.from_dict(json.load(open(REFERENCE_CONFIG)))
    int8 = KVCacheLayout.of(cfg, torch.bfloat16, "int8").indexer_bytes_per_token
    bf16 = KVCacheLayout.of(cfg, torch.bfloat16, "model").indexer_bytes_per_token
    assert int8 / bf16 <= 0.55  # (128 + 2) / 256


def test_streaming_indexer_end_to_end_matches_reference(make_checkpoint, monkeypatch):
    """Prompts longer than index_topk, chunked prefill, multi-chunk streaming: greedy = reference."""
    monkeypatch.setattr(indexer, "INDEXER_SCORE_BUDGET", 64 * 8 * 16)  # 1-block key chunks
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    ref = load_reference(path)
    prompt = torch.randint(30, ref.config.vocab_size, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=29, progress=False)
    out = llm.generate(prompt_token_ids=prompt,
                       sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(ref, prompt, 12)


def test_page_backend_with_every_page_reproduces_dense(make_checkpoint):
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    prompt = torch.randint(30, 600, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = {}
    for backend, budget in (("dense", None), ("page", 64), ("page", 2)):
        llm = LLM(path, dtype="float32", block_size=16, attention_backend=backend, page_budget=budget, progress=False)
        outs[(backend, budget)] = llm.generate(prompt_token_ids=prompt, sampling_params=params,
                                               use_tqdm=False)[0].outputs[0]
    dense, every, few = outs[("dense", None)], outs[("page", 64)], outs[("page", 2)]
    assert every.token_ids == dense.token_ids
    for a, b in zip(every.logprobs, dense.logprobs):
        t = next(iter(b))
        assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert few.token_ids != dense.token_ids or any(
        abs(a[t].logprob - b[t].logprob) > 1e-3 for a, b, t in zip(few.logprobs, dense.logprobs, dense.token_ids))


@pytest.mark.skipif(not native_scores.fits_int8(8, 32), reason="no int8 index-score kernel here (needs the operators "
                    "built): int8 indexer key caches stay plain")
@pytest.mark.parametrize("family, dtype", [("auto", "bfloat16"), pytest.param("avx2", "auto", marks=pytest.mark.skipif(
    "avx2" not in native_bodies(), reason="no AVX2 body here"))])
def test_an_engine_scores_int8_indexer_keys_in_place_and_generates_what_plain_int8_keys_give(make_checkpoint,
                                                                                            monkeypatch, family, dtype,
                                                                                            default_family_after):
    """`indexer_cache_dtype="int8"` in a bf16 model (VNNI on this CPU, or the AVX2 body), or an fp32 one (dtype auto
    on the AVX2 body): the key caches are in the int8 kernel's layout, which scores them in prefill and in decode
    (one native selection per full layer). The prompts' selections agree with those of the plain int8 cache
    (dequantized keys against the model's queries) but for the queries' rounding to int8: at least 95% of the
    positions, in every full layer."""
    import dsaserve.engine.workers.kv_cache as kv_cache

    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 41)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    from dsaserve.model.decode_plan import DecodePlan

    # Decode selections made from Python (the operator call is seen here); a step that selects inside its one native
    # call gives the same tokens (tests/test_decode_plan.py).
    monkeypatch.setattr(DecodePlan, "_selection_in_call", lambda *a: None)
    scored, selected = [], []
    real_scores, real_selection = native_scores.index_scores_int8_blocks, torch.ops.dsaserve.decode_selection.default
    monkeypatch.setattr(native_scores, "index_scores_int8_blocks", lambda *a: scored.append(1) or real_scores(*a))
    monkeypatch.setattr(torch.ops.dsaserve.decode_selection, "default",
                        lambda *a: selected.append(a[-1] is not None) or real_selection(*a))

    def run():
        llm = LLM(path, dtype=dtype, block_size=16, max_model_len=256, indexer_cache_dtype="int8", progress=False,
                  cpu_isa=family)
        assert llm.engine.dtype == (torch.float32 if dtype == "auto" else torch.bfloat16)
        layouts = {cache.int8_groups is not None for cache in llm.engine.kv_cache.indexer.values()}
        chosen = {}  # the prompts' selections (the indexers' forward), per full layer
        for i, layer in enumerate(llm.engine.model.model.layers):
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.register_forward_hook(
                    lambda module, args, out, i=i: chosen.setdefault(i, out.clone()))
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        return layouts, chosen

    layouts, in_place = run()
    assert layouts == {True} and scored and selected and all(selected)  # prefill and decode through the kernel
    monkeypatch.setattr(kv_cache, "packs_indexer_keys", lambda cfg, bs, dtype, device, kind: False)
    scored.clear()
    layouts, plain = run()
    assert layouts == {False} and not scored and in_place.keys() == plain.keys()
    for layer, rows in in_place.items():
        shared = [len(set(a.tolist()) & set(b.tolist()) - {-1}) / len(set(b.tolist()) - {-1})
                  for a, b in zip(rows, plain[layer])]
        assert sum(shared) / len(shared) >= 0.95, layer


@pytest.mark.skipif(not native_scores.fits(8, 32), reason="no native index-score kernel here (needs the operators "
                    "built and AVX-512 BF16): indexer key caches stay unpacked")
def test_a_bf16_engine_keeps_indexer_keys_packed_and_generates_what_unpacked_keys_give(make_checkpoint, monkeypatch,
                                                                                       body):
    """bf16 on a CPU with the scoring kernel: the key caches are in its layout and scored in place. Prompts
    past index_topk (16) make every full layer score and select in prefill and decode; tokens and logprobs
    are those of the same engine with plain key rows, gathered and packed per chunk. Under each body family
    (cpu_isa): the AVX2 one's kernel too."""
    import dsaserve.engine.workers.kv_cache as kv_cache

    path = make_checkpoint("bf16", seed=0, dtype=torch.bfloat16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 41)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False, cpu_isa=body)
        packed = {cache.packed for cache in llm.engine.kv_cache.indexer.values()}
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return packed, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    packed, with_packed = run()
    assert packed == {True}
    scored = []
    real = native_scores.index_scores
    monkeypatch.setattr(native_scores, "index_scores", lambda *a: scored.append(1) or real(*a))
    monkeypatch.setattr(kv_cache, "packs_indexer_keys", lambda *a: False)
    packed, with_rows = run()
    assert packed == {False} and scored  # the other layout, through the gather-and-pack kernel
    assert with_packed == with_rows
