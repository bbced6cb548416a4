"""The Triton kernels (the CUDA path) against their torch references, run on CPU tensors under Triton's
interpreter, and the engine driven through them: the same greedy tokens as the CPU path."""

import pytest
import torch
import torch.nn.functional as F
from reference import softmax_over_rows

from dsaserve import LLM, SamplingParams, triton_ops
from dsaserve.attention.indexer_cache import IndexerKeyCache
from dsaserve.attention.indexer_selection import Selection, select
from dsaserve.attention.metadata import BatchMetadata

pytestmark = pytest.mark.skipif(triton_ops.triton_imports() is not None, reason="Triton does not import here")
BS = 16

if triton_ops.triton_imports() is None:
    import triton
    import triton.language as tl

    from dsaserve.triton_ops.fp8_e4m3 import e4m3_values

    @triton.jit
    def _decode_bytes(raw, out, NATIVE: tl.constexpr):
        i = tl.arange(0, 256)
        tl.store(out + i, e4m3_values(tl.load(raw + i), NATIVE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# One block of heads, padded; two blocks, the second partial; value rows as wide as GLM-5.2's latent's half (16 heads
# per program there).
@pytest.mark.parametrize("heads, value", [(5, 32), (70, 32), (20, 256)])
def test_sparse_decode_kernel_is_the_softmax_over_each_querys_selected_rows(interpreter, dtype, heads, value):
    """Value columns and the rest of the row (rope) both scored, the value columns averaged; -1 entries take no
    weight, a query with nothing selected gets zeros, widths past one step of rows."""
    from dsaserve.triton_ops.selected_rows import attend_selected_rows

    g = torch.Generator().manual_seed(heads)
    n, dim, count, width = 4, value + 16, 300, 70
    query = torch.randn(n, heads, dim, generator=g).to(dtype)
    rows = torch.randn(count, dim, generator=g).to(dtype)
    slots = torch.randint(0, count, (n, width), generator=g)
    slots[0, 3:40] = -1
    slots[2, 33:] = -1
    slots[3] = -1
    out = torch.full((n, heads, value), 7.0, dtype=dtype)
    attend_selected_rows(query, rows, slots, 0.2, out)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), softmax_over_rows(query, rows, slots, 0.2, value), rtol=tolerance,
                               atol=tolerance)
    assert (out[3] == 0).all()


def paged_keys(kind: str, lengths: list[int], dim: int, seed: int):
    """Two requests' keys in one scrambled paged cache: (cache, block tables, keys per request)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BS) for n in lengths]
    order = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    tables = [order[:blocks[0]], order[blocks[0]:blocks[0] + blocks[1]]]
    cache = IndexerKeyCache(sum(blocks) + 3, BS, dim, kind, torch.float32, torch.device("cpu"))
    keys = []
    for n, table in zip(lengths, tables):
        k = torch.randn(n, dim, generator=g)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        cache.write(slots, k)
        keys.append(cache.read_blocks(torch.tensor(table), torch.float32)[:n])  # the stored (dequantized) values
    return cache, tables, keys


@pytest.mark.parametrize("kind", ["model", "int8", "fp8", "fp8-integer-decode"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_index_scores_kernel_reads_each_key_where_the_paged_cache_keeps_it(interpreter, kind, qdtype, monkeypatch):
    """Scores of queries of two requests against their own blocks (scrambled, the last one partial): the weighted
    head sum of relu(q·k) with each token's scale, -inf in each query's future. fp8 keys also decoded by integer
    operations (GPUs without fp8 conversion)."""
    import dsaserve.triton_ops.index_scores as scores_module
    from dsaserve.triton_ops.index_scores import index_scores

    if kind == "fp8-integer-decode":
        kind = "fp8"
        monkeypatch.setattr(scores_module, "native_fp8", lambda device: False)

    heads, dim = 6, 32
    lengths = [75, 40]
    cache, tables, keys = paged_keys(kind, lengths, dim, seed=3)
    g = torch.Generator().manual_seed(4)
    positions = torch.tensor([74, 50, 10, 39, 0])
    request = torch.tensor([0, 0, 0, 1, 1])
    q = torch.randn(5, heads, dim, generator=g).to(qdtype)
    weights = torch.rand(5, heads, generator=g) + 0.1
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = torch.full((5, 75), 7.0)
    index_scores(q, weights, cache.data, cache.scale, table, request, positions, out,
                 torch.zeros(5, 256, dtype=torch.int32))
    for row in range(5):
        k = keys[int(request[row])]
        expected = (torch.relu(q[row].float() @ k.T) * weights[row][:, None]).sum(0)
        visible = int(positions[row]) + 1
        tolerance = 1e-4 if qdtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[row, :visible], expected[:visible], rtol=tolerance, atol=tolerance)
        assert (out[row, visible:] == float("-inf")).all()


def test_index_scores_kernel_counts_each_rows_scores_by_their_top_key_byte(interpreter):
    """The first histogram of the top-k (row_topk.py), counted by the scoring kernel as it writes the scores: the
    scores' own (row_topk.top_byte_counts, in torch), -inf (future) scores not counted; negative weights give
    negative scores."""
    from dsaserve.triton_ops.index_scores import index_scores
    from dsaserve.triton_ops.row_topk import top_byte_counts

    heads, dim = 3, 16
    cache, tables, _ = paged_keys("model", [150, 40], dim, seed=11)
    g = torch.Generator().manual_seed(12)
    positions = torch.tensor([149, 70, 39, 5])
    request = torch.tensor([0, 0, 1, 1])
    q = torch.randn(4, heads, dim, generator=g)
    weights = torch.randn(4, heads, generator=g)
    table = torch.tensor([tables[0], tables[1] + [0] * (len(tables[0]) - len(tables[1]))])
    out = torch.empty(4, 150)
    counts = torch.zeros(4, 256, dtype=torch.int32)
    index_scores(q, weights, cache.data, cache.scale, table, request, positions, out, counts)
    assert (out < 0).any() and torch.isinf(out).any()
    assert torch.equal(counts, top_byte_counts(out))


@pytest.mark.parametrize("first_counts", [False, True])
def test_row_topk_kernel_takes_each_rows_k_largest_scores(interpreter, first_counts):
    """Rows past one step of columns (1024), of every sign and magnitude; -inf and NaN never chosen (a row with
    fewer candidates than k, or none, ends in -1 entries; one with exactly k takes them all); ties cut by k taken in
    position order after the larger scores, -0.0 and +0.0 one value; k past the columns; entries past k untouched.
    With the first histogram given (as the scoring kernel counts it), the same positions."""
    from dsaserve.triton_ops.row_topk import row_topk, top_byte_counts

    g = torch.Generator().manual_seed(13)
    k, rows = 40, 9
    scale = torch.tensor([1e-3, 1.0, 1e3, -5.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    scores = torch.randn(rows, 2500, generator=g) * scale[:, None]
    scores[1, 1200:] = float("-inf")
    scores[4] = float("-inf")
    scores[4, [3, 1500, 2499]] = torch.tensor([-2.0, 0.0, 7.0])  # fewer candidates than k
    scores[5] = float("-inf")  # none
    scores[6, 100:2500:50] = 9.0  # 48 ties, two larger scores: those and the first 38 ties by position
    scores[6, [7, 1525]] = 10.0
    scores[7] = -scores[7].abs() - 1
    scores[7, 1000:1100:2], scores[7, 1001:1100:2] = -0.0, 0.0  # 100 zeros of both signs, one larger score
    scores[7, 2000] = 1.0
    scores[8] = float("nan")
    scores[8, torch.randperm(2500, generator=g)[:k]] = torch.randn(k, generator=g)  # exactly k candidates
    scores[8, :5] = float("-inf")
    out = torch.full((rows, k + 3), 77, dtype=torch.int32)
    row_topk(scores, k, out, top_byte_counts(scores) if first_counts else None)
    expected = {6: [7, 1525] + list(range(100, 2000, 50)), 7: [2000] + list(range(1000, 1039)),
                8: torch.nonzero(scores[8] > float("-inf")).flatten().tolist()}
    for row in range(rows):
        candidates = int((scores[row] > float("-inf")).sum())
        chosen = [c for c in out[row, :k].tolist() if c != -1]
        if row in expected:
            assert sorted(chosen) == sorted(expected[row]), row
        else:
            assert set(chosen) == set(scores[row].topk(min(k, candidates)).indices.tolist()), row
        assert len(chosen) == min(k, candidates) and out[row, :k].tolist().count(-1) == k - len(chosen)
    assert (out[:, k:] == 77).all()
    wide = torch.full((2, 9), 77, dtype=torch.int32)
    row_topk(scores[:2, :5].contiguous(), 9, wide)  # k past the columns
    assert [sorted(r[:5]) for r in wide.tolist()] == [list(range(5))] * 2 and (wide[:, 5:] == -1).all()


@pytest.mark.parametrize("kind", ["model", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_kernel_stores_the_bytes_and_scales_the_torch_path_stores(kind, dtype):
    """Keys written at scattered slots, quantized per token: the same bytes and scales as IndexerKeyCache's torch
    path, with values on rounding ties (int8 halves; fp8's midpoints between neighbours) and every fp8 value."""
    from dsaserve.triton_ops.cache_write import write_rows

    g = torch.Generator().manual_seed(5)
    dim = 40
    keys = torch.randn(30, dim, generator=g) * 3
    keys[0, :5] = torch.tensor([0.5, -1.5, 2.5, -3.5, 127.0])  # int8 ties (the row's scale is 127 / 127)
    fp8_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fp8_values = fp8_values[torch.isfinite(fp8_values)].unique().sort().values
    special = torch.cat([fp8_values, (fp8_values[1:] + fp8_values[:-1]) / 2])  # every value, every midpoint
    rows = -(-special.numel() // (dim - 1))
    keys[1:1 + rows, 1:] = torch.cat([special, torch.zeros(rows * (dim - 1) - special.numel())]).view(rows, dim - 1)
    keys[1:1 + rows, 0] = 448.0  # fp8 scale 1: those values themselves are rounded
    keys = keys.to(dtype)
    slots = torch.randperm(96, generator=g)[:30]
    caches = [IndexerKeyCache(6, BS, dim, kind, dtype, torch.device("cpu")) for _ in range(2)]
    caches[0].write(slots, keys)
    write_rows(caches[1].data.view(-1, dim), None if kind == "model" else caches[1].scale.view(-1), slots, keys)
    assert torch.equal(caches[0].data.view(torch.uint8), caches[1].data.view(torch.uint8))
    assert kind == "model" or torch.equal(caches[0].scale, caches[1].scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rope", [16, 0])  # GLM-5.2's layout; NoPE (GLM-5.3-Flash)
def test_latent_write_kernel_stores_the_normed_and_rotated_rows_at_their_slots(dtype, interleaved, rope):
    """kv_a_layernorm of the latent and the rotated rope key, written at scattered slots; other rows untouched."""
    from dsaserve.model.layers import RMSNorm, apply_rope
    from dsaserve.triton_ops.latent_write import write_latent_rows

    g = torch.Generator().manual_seed(rope + interleaved)
    tokens, rank = 9, 40
    kv = (torch.randn(tokens, rank + rope, generator=g) * 2).to(dtype)
    norm = RMSNorm(rank, 1e-6)
    norm.weight.data = (torch.rand(rank, generator=g) + 0.5).to(dtype)
    angles = torch.rand(tokens, rope // 2, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(40, generator=g)[:tokens]
    rows = torch.full((40, rank + rope), 7.0, dtype=dtype)
    write_latent_rows(kv, norm.weight.data, 1e-6, cos, sin, interleaved, rows, slots)
    with torch.no_grad():
        expected = torch.cat([norm(kv[:, :rank]), apply_rope(kv[:, rank:], cos, sin, interleaved)], dim=-1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the norm's and the weight's roundings, 1-2 ulp
    torch.testing.assert_close(rows[slots].float(), expected.float(), rtol=tolerance, atol=tolerance)
    others = torch.ones(40, dtype=torch.bool)
    others[slots] = False
    assert (rows[others] == 7.0).all()


def routed_reference(x, ids, weights, gate_up, down, first, limit):
    """Token by token, choice by choice: the experts' definition."""
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], x.shape[1])
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if 0 <= e < gate_up.shape[0]:
                gate, up = (x[t].float() @ gate_up[e].float().T).split(inter)
                if limit is not None:
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                out[t] += weights[t, j] * ((F.silu(gate) * up) @ down[e].float().T)
    return out


@pytest.mark.parametrize("tokens, first, limit", [(5, 0, None), (37, 2, 0.7)])
def test_routed_experts_kernels_sum_each_tokens_chosen_experts(tokens, first, limit, monkeypatch):
    """Grouped GEMMs over pairs sorted by expert on the device: each token's choices weighted and summed; choices
    of experts held elsewhere (expert parallelism: experts [first, first + 6) here) add nothing; swiglu's limit;
    tiles that straddle an expert's count, and token chunks (a small pair budget forces three)."""
    import dsaserve.triton_ops.moe as moe

    monkeypatch.setattr(moe, "PAIR_BUFFER_ELEMENTS", 3 * 40 * 16)  # 16 tokens per chunk
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 6, 3, 40, 24
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    ids = torch.stack([torch.randperm(experts + 2, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    got = moe.routed_experts(x, ids, weights, gate_up, down, first, limit)
    torch.testing.assert_close(got, routed_reference(x, ids, weights, gate_up, down, first, limit), rtol=1e-5,
                               atol=1e-5)


def fp8_weight(n: int, k: int, col_offset: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight as a checkpoint ships it, sliced `col_offset` columns into its first block: (bytes [n, k],
    scales per row [n, G]). Every 128 × 128 block has its own magnitude, so a wrong block's scale shows."""
    from dsaserve.quantization.formats import quantize_fp8_rows

    grid = torch.rand(-(-n // 128), -(-(k + col_offset) // 128), generator=g) * 4 + 0.05
    magnitude = grid.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, col_offset:col_offset + k]
    return quantize_fp8_rows(torch.randn(n, k, generator=g) * magnitude, col_offset)


@pytest.mark.parametrize("native", [True, False])
def test_every_fp8_byte_decodes_to_torchs_value_with_and_without_the_hardware_conversion(native):
    """All 254 finite e4m3fn bytes (subnormals, ±0, ±448): the integer decode (GPUs before compute capability 8.9)
    and Triton's own conversion both give torch's values."""
    raw = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    _decode_bytes[(1,)](raw, out, NATIVE=native)
    expected = raw.view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(expected)
    assert finite.sum() == 254 and torch.equal(out[finite], expected[finite])


def quantized_form(kind: str, n: int, k: int, col_offset: int,
                   g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stored bytes, scales, the weight they dequantize to [n, k]) of a weight in the row layout of `kind`
    (triton_ops/weight_tiles.py). FP8 as a checkpoint ships it (fp8_weight); int8 and int4 with every row, and every
    128-column group of a row, of its own magnitude, so a scale read from the wrong row or group shows."""
    from dsaserve.quantization import formats

    if kind == "fp8":
        q, scale = fp8_weight(n, k, col_offset, g)
        return q, scale, formats.dequantize_reference("fp8", q, scale, col_offset)
    magnitude = (torch.rand(n, -(-k // 128), generator=g) * 4 + 0.05).repeat_interleave(128, 1)[:, :k]
    q, scale = formats.quantize(kind, torch.randn(n, k, generator=g) * magnitude)
    dense = formats.dequantize_reference(kind, q, scale)
    return (formats.pack_int4_rows(q) if kind == "int4" else q), scale, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# decode rows of an odd width; prefill rows past one tile, two row blocks of scales, a slice starting inside its first
# column block (FP8); per-head weights in one launch (W_UK's form), the activations strided as attention hands them
@pytest.mark.parametrize("rows, n, k, col_offset, heads", [(3, 40, 301, 0, None), (70, 200, 260, 40, None),
                                                           (5, 24, 136, 0, 3)])
# FP8 by Triton's conversion or by the integer decode (A100); int8; int4
@pytest.mark.parametrize("kind", ["fp8", "fp8-integer-decode", "int8", "int4"])
def test_quantized_linear_kernel_scales_each_group_of_the_weight_in_its_stored_form(interpreter, dtype, rows, n, k,
                                                                                    col_offset, heads, kind,
                                                                                    monkeypatch):
    import dsaserve.triton_ops.quantized_linear as quantized_linear

    monkeypatch.setattr(quantized_linear, "native_fp8", lambda device: kind == "fp8")
    kind = kind.removesuffix("-integer-decode")
    col_offset = col_offset if kind == "fp8" else 0  # (only an FP8 tensor's slice starts inside a block)
    g = torch.Generator().manual_seed(rows + n)
    forms = [quantized_form(kind, n, k, col_offset, g) for _ in range(heads or 1)]
    q, scale, dense = (torch.stack([f[i] for f in forms]) for i in range(3))
    x = torch.randn(rows, heads or 1, k, generator=g).to(dtype).transpose(0, 1)  # [heads, rows, k], strided
    got = (quantized_linear.quantized_matmul(x, q, scale, kind, col_offset) if heads
           else quantized_linear.quantized_matmul(x[0], q[0], scale[0], kind, col_offset)[None])
    expected = torch.stack([x[h].float() @ dense[h].T for h in range(heads or 1)])
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


# FP8: a rank's share of the intermediate starting inside a block; the integer fp8 decode (GPUs without fp8 conversion)
@pytest.mark.parametrize("kind, down_offset, native", [("fp8", 0, True), ("fp8", 24, True), ("fp8", 24, False),
                                                       ("int8", 0, False), ("int4", 0, False)])
def test_routed_experts_kernels_take_quantized_experts_in_their_stored_form(kind, down_offset, native, monkeypatch):
    """Quantized gate|up and down (stored bytes and scales, widths past one 128-column group) through the grouped
    GEMMs: the reference over the dequantized experts."""
    import dsaserve.triton_ops.moe as moe

    monkeypatch.setattr(moe, "native_fp8", lambda device: native)

    g = torch.Generator().manual_seed(down_offset)
    experts, top_k, hidden, inter, tokens = 4, 2, 160, 144, 19
    gate_up = [quantized_form(kind, 2 * inter, hidden, 0, g) for _ in range(experts)]
    down = [quantized_form(kind, hidden, inter, down_offset, g) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    stacked = [torch.stack([form[i] for form in forms]) for forms in (gate_up, down) for i in range(3)]
    got = moe.routed_experts(x, ids, weights, stacked[0], stacked[3], 0, None, (stacked[1], stacked[4]), down_offset,
                             kind)
    expected = routed_reference(x, ids, weights, stacked[2], stacked[5], 0, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def batch_of(lengths: list[int], new: list[int], tables: list[list[int]]) -> BatchMetadata:
    return BatchMetadata.build([[1] * k for k in new], [n - k for n, k in zip(lengths, new)], tables, BS, [])


@pytest.mark.parametrize("width", [24, 96])  # fewer than the contexts; more than either (every position selected)
def test_scored_selection_selects_what_the_streaming_selection_does(interpreter, width):
    """A prefill chunk of one request and a decode of another in one batch: each query's set of positions equals
    the streaming torch selection's, for token top-k and for pages (Triton off for the reference)."""
    heads, dim = 4, 16
    lengths, new = [75, 40], [6, 1]
    cache, tables, _ = paged_keys("model", lengths, dim, seed=7)
    meta = batch_of(lengths, new, tables)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(7, heads, dim, generator=g)
    weights = torch.rand(7, heads, generator=g) + 0.1
    for selection in (Selection(width), Selection(width, pages=2)):
        got = select(q, weights, cache, meta, selection)
        triton_ops.configure("off", torch.device("cpu"))
        expected = select(q, weights, cache, meta, selection)
        triton_ops.configure("on", torch.device("cpu"))
        assert got.shape == expected.shape
        assert [set(r.tolist()) for r in got] == [set(r.tolist()) for r in expected]


class OtherRanksParts:
    """all_gather for one rank of a DCP group of two, the other rank's parts computed beforehand (in call order)."""

    def __init__(self, rank: int, parts: list[torch.Tensor]):
        self.rank, self.parts = rank, parts

    def all_gather(self, x, dim=0):
        other = self.parts.pop(0)
        return torch.cat([x, other] if self.rank == 0 else [other, x], dim)


@pytest.mark.parametrize("width", [24, 50])  # fewer than both contexts; more than the decode request's
def test_each_dcp_ranks_scored_selection_merges_to_the_unsharded_selection(interpreter, width):
    """Decode context parallelism, two ranks: each scores the tokens it holds (position p at local index p // 2 of
    rank p % 2, in its own paged cache) and keeps its best; merged, each rank's selection is the unsharded streaming
    selection's set (Triton off for the reference), for a prefill chunk and a decode in one batch."""
    import dataclasses

    from dsaserve.attention.context_shard import ContextShard
    from dsaserve.attention.scored_selection import select_scored_sharded, shard_best

    heads, dim, dcp = 4, 16, 2
    lengths, new = [75, 40], [6, 1]
    cache, tables, keys = paged_keys("model", lengths, dim, seed=9)  # the unsharded cache (blocks of 16)
    g = torch.Generator().manual_seed(10)
    q = torch.randn(7, heads, dim, generator=g)
    weights = torch.rand(7, heads, generator=g) + 0.1
    triton_ops.configure("off", torch.device("cpu"))
    expected = select(q, weights, cache, batch_of(lengths, new, tables), Selection(width))
    triton_ops.configure("on", torch.device("cpu"))
    shard_tables = [[3, 0, 5], [4, 1]]  # scheduler blocks of 32 tokens, the same ids on both ranks
    metas = []
    for rank in range(dcp):
        shard = ContextShard(rank, dcp, BS)
        rank_cache = IndexerKeyCache(6, BS, dim, "model", torch.float32, torch.device("cpu"))
        for k, table in zip(keys, shard_tables):
            owned = torch.arange(rank, k.shape[0], dcp)
            rank_cache.write(shard.local_slots(torch.tensor(table), owned), k[owned])
        meta = BatchMetadata.build([[1] * n for n in new], [n - m for n, m in zip(lengths, new)], shard_tables,
                                   BS * dcp, [], shard=shard)
        metas.append((rank_cache, meta))
    parts = [list(shard_best(q, weights, c, m, width)) for c, m in metas]
    for rank, (rank_cache, meta) in enumerate(metas):
        comm = OtherRanksParts(rank, parts[1 - rank])
        meta = dataclasses.replace(meta, shard=dataclasses.replace(meta.shard, comm=comm))
        got = select_scored_sharded(q, weights, rank_cache, meta, width)
        assert got.shape == expected.shape
        assert [set(r.tolist()) for r in got] == [set(r.tolist()) for r in expected]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_dcp_ranks_attention_parts_are_the_torch_paths(interpreter, dtype):
    """Decode context parallelism, two ranks: each rank's partial attention (out and log-sum-exp per head) over the
    selected positions it holds, in one Triton call, equals the torch path's per-request loop (Triton off): a prefill
    chunk past the selection's width whose selections hold -1s and a future position, a decode, and a prompt's first
    rows (every visible position selected; on rank 1, the row at position 0 holds none: zeros and -inf)."""
    from dsaserve.attention.context_parallel import local_partials
    from dsaserve.attention.context_shard import ContextShard

    heads, value, rest, width, dcp = 3, 16, 8, 24, 2
    lengths, new = [75, 40, 3], [6, 1, 3]
    shard_tables = [[3, 0, 5], [4, 1], [2]]  # scheduler blocks of 32 tokens, the same ids on both ranks
    meta_args = ([[1] * n for n in new], [n - m for n, m in zip(lengths, new)], shard_tables, BS * dcp, [])
    g = torch.Generator().manual_seed(11)
    query = torch.randn(sum(new), heads, value + rest, generator=g).to(dtype)
    positions = BatchMetadata.build(*meta_args).positions
    topk = torch.full((sum(new), width), -1, dtype=torch.int32)
    for row, p in enumerate(positions.tolist()):
        if p < width:
            topk[row, :p + 1] = torch.arange(p + 1)
        else:
            chosen = torch.randperm(p + 1, generator=g)[:width - 4]
            topk[row, :width - 4] = chosen
            topk[row, width - 4] = p + 1  # a future position: never attended
    for rank in range(dcp):
        shard = ContextShard(rank, dcp, BS)
        cache = (torch.randn(6, BS, value + rest, generator=g) * 2).to(dtype)
        meta = BatchMetadata.build(*meta_args, shard=shard)
        got_out, got_lse = local_partials(query, cache, meta, 0.3, value, topk)
        triton_ops.configure("off", torch.device("cpu"))
        try:
            out, lse = local_partials(query, cache, meta, 0.3, value, topk)
        finally:
            triton_ops.configure("on", torch.device("cpu"))
        assert (lse == float("-inf")).any() == (rank == 1)
        torch.testing.assert_close(got_lse, lse, rtol=1e-4, atol=1e-4)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got_out, out, rtol=tolerance, atol=tolerance)


def test_the_interpreter_wraps_the_language_once_a_launch(interpreter, monkeypatch):
    """interpreter_calls.py: within one launch, device-function calls after the first of their modules do not wrap
    triton.language again (Triton 3.9 walks it on every call, about 0.7 ms each; two rows of the top-k make some 40
    such calls). What the kernels compute under it is every other test of this file."""
    from triton.runtime import interpreter as triton_interpreter

    from dsaserve.triton_ops.row_topk import row_topk

    walks, walk = [], triton_interpreter._patch_lang
    monkeypatch.setattr(triton_interpreter, "_patch_lang", lambda fn: walks.append(fn.__name__) or walk(fn))
    row_topk(torch.randn(2, 300), 8, torch.empty(2, 8, dtype=torch.int32))
    assert walks[0] == "_row_topk_kernel" and 1 < len(walks) <= 4, walks


def test_triton_kernels_on_a_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_ops.configure("on", torch.device("cpu"))
    triton_ops.configure("auto", torch.device("cpu"))
    assert triton_ops.active_device() is None  # auto on a CPU: the native kernels


@pytest.mark.parametrize("indexer_cache_dtype", ["auto", "fp8"])
def test_the_engine_through_the_triton_kernels_generates_what_the_cpu_path_does(interpreter, make_checkpoint,
                                                                               monkeypatch, indexer_cache_dtype):
    """fp32 tiny checkpoint, prompts past index_topk (16) whose indexer scores have no near-ties (checked on the
    reference), chunked prefill and a decode batch: the latent and indexer-key writes, the indexer's scores, the
    sparse attention and the routed experts run in Triton (counted); every full layer selects the CPU path's sets,
    then greedy tokens and logprobs are the CPU path's. With fp8 indexer keys both paths score the same stored bytes
    (the Triton path wrote them)."""
    from reference import indexer_margin, load_reference

    import dsaserve.attention.scored_selection as scored
    import dsaserve.triton_ops.cache_write as cache_write
    import dsaserve.triton_ops.latent_write as latent_write
    import dsaserve.triton_ops.moe as moe
    import dsaserve.triton_ops.selected_rows as triton_rows

    calls = {"scores": 0, "rows": 0, "writes": 0, "experts": 0, "latents": 0}
    real_scores, real_rows, real_writes = scored.index_scores, triton_rows.attend_selected_rows, cache_write.write_rows
    real_experts, real_latents = moe.routed_experts, latent_write.write_latent_rows
    monkeypatch.setattr(latent_write, "write_latent_rows",
                        lambda *a: calls.__setitem__("latents", calls["latents"] + 1) or real_latents(*a))
    monkeypatch.setattr(moe, "routed_experts", lambda *a: calls.__setitem__("experts", calls["experts"] + 1)
                        or real_experts(*a))
    monkeypatch.setattr(cache_write, "write_rows", lambda *a: calls.__setitem__("writes", calls["writes"] + 1)
                        or real_writes(*a))
    monkeypatch.setattr(scored, "index_scores", lambda *a: calls.__setitem__("scores", calls["scores"] + 1)
                        or real_scores(*a))
    monkeypatch.setattr(triton_rows, "attend_selected_rows", lambda *a: calls.__setitem__("rows", calls["rows"] + 1)
                        or real_rows(*a))
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    prompts = [torch.randint(30, 600, (n,), generator=torch.Generator().manual_seed(6000 + n)).tolist()
               for n in (90, 41)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs, chosen = {}, {}
    for mode in ("on", "off"):
        llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, max_num_batched_tokens=64,
                  triton_kernels=mode, indexer_cache_dtype=indexer_cache_dtype, progress=False)
        chosen[mode] = []  # every full layer's selections, in call order
        for layer in llm.engine.model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.register_forward_hook(
                    lambda module, args, out, mode=mode: chosen[mode].append([set(r.tolist()) - {-1} for r in out]))
        outs[mode] = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]
        if mode == "on":
            assert all(calls.values())
            counted = dict(calls)
    assert calls == counted  # the CPU path called neither
    ref = load_reference(path)
    assert min(indexer_margin(ref, p + o.token_ids[:-1]) for p, o in zip(prompts, outs["off"])) > 1e-5
    assert chosen["on"] == chosen["off"]
    # Within the CUDA-vs-CPU bound: with the native kernels off, torch's fp32 GEMMs (MKL) round by memory
    # alignment, so the same run differs by up to ~1.3e-4 between processes here (MKL_CBWR=COMPATIBLE removes it).
    for a, b in zip(outs["on"], outs["off"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids)) < 1e-3


def test_an_fp8_checkpoint_on_the_triton_path_stays_fp8_and_generates_what_the_cpu_path_does(interpreter,
                                                                                            make_checkpoint,
                                                                                            monkeypatch):
    """Every tensor an FP8 checkpoint ships in FP8 is held as its bytes ([N, K] uint8) and per-block scales, and
    multiplied so (the projections by quantized_linear, the routed experts by the grouped GEMMs with their scales), not
    widened at load; greedy tokens are the CPU path's and logprobs within the CUDA-vs-CPU bound."""
    import dsaserve.triton_ops.moe as moe
    import dsaserve.triton_ops.quantized_linear as quantized_linear
    from dsaserve.model.loader import fp8_params
    from dsaserve.quantization.quantized_weight import ROWS, QuantizedWeight

    calls = {"linear": 0, "experts": 0}
    real_linear, real_experts = quantized_linear.quantized_matmul, moe.routed_experts

    def count_experts(*args):
        calls["experts"] += len(args) > 7  # the FP8 experts' call (scales given)
        return real_experts(*args)

    monkeypatch.setattr(quantized_linear, "quantized_matmul",
                        lambda *a: calls.__setitem__("linear", calls["linear"] + 1) or real_linear(*a))
    monkeypatch.setattr(moe, "routed_experts", count_experts)
    path = make_checkpoint("fp8-split", seed=0, fp8=True, intermediate_size=384, moe_intermediate_size=96)
    prompts = [torch.randint(30, 600, (50,), generator=torch.Generator().manual_seed(7050)).tolist()]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("on", "off"):
        # Indexer keys in the model dtype: auto's 8-bit keys are scored with int8-rounded queries on the CPU path alone.
        llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, max_num_batched_tokens=64,
                  triton_kernels=mode, indexer_cache_dtype="model", progress=False)
        if mode == "on":
            model = llm.engine.model
            held = {name for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}
            # (kv_b_proj is split per head into W_UK and W_UV at load, in floats on every path)
            shipped = {n for n in fp8_params(llm.engine.config, path) if not n.endswith(".kv_b_proj.weight")}
            assert held == shipped and len(held) > 10
            for name in held:
                weight = model.get_submodule(name)
                assert weight.kind == "fp8" and weight.layout == ROWS and weight.qweight.dtype == torch.uint8
                assert weight.qweight.shape[-2:] == (weight.out_features, weight.in_features)
        outs[mode] = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]
        if mode == "on":
            assert calls["linear"] and calls["experts"]
            counted = dict(calls)
    assert calls == counted  # the CPU path called neither
    for a, b in zip(outs["on"], outs["off"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids)) < 1e-3


@pytest.mark.parametrize("quantization", ["fp8", "int8", "int4"])
def test_a_float_checkpoint_quantized_on_the_triton_path_generates_what_the_cpu_path_does(interpreter,
                                                                                        tiny_checkpoint, quantization,
                                                                                        monkeypatch):
    """--quantization on the CUDA path: every projection quantized at load into its row layout (W_UK and W_UV, the
    per-head products, included: one batched launch each) and multiplied in it (the projections by quantized_linear,
    the routed experts by the grouped GEMMs with their scales: counted), the CPU path's tokens."""
    import dsaserve.triton_ops.moe as moe
    import dsaserve.triton_ops.quantized_linear as quantized_linear
    from dsaserve.quantization.quantized_weight import ROWS, QuantizedWeight

    calls = {"linear": 0, "experts": 0}
    real_linear, real_experts = quantized_linear.quantized_matmul, moe.routed_experts

    def count_linear(x, qweight, scale, kind, *rest):
        calls["linear"] += kind == quantization
        return real_linear(x, qweight, scale, kind, *rest)

    def count_experts(*args):
        calls["experts"] += args[-1] == quantization  # the quantized experts' call (its kind last)
        return real_experts(*args)

    monkeypatch.setattr(quantized_linear, "quantized_matmul", count_linear)
    monkeypatch.setattr(moe, "routed_experts", count_experts)
    prompt = torch.randint(30, 600, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("on", "off"):
        llm = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=128, quantization=quantization,
                  triton_kernels=mode, indexer_cache_dtype="model", progress=False)  # (as above: model-dtype keys)
        weights = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, QuantizedWeight)}
        assert "model.layers.1.self_attn.w_uk" in weights and "model.layers.1.self_attn.w_uv" in weights
        weights = list(weights.values())
        assert len(weights) > 10 and all(w.kind == quantization for w in weights)
        assert mode == "off" or all(w.layout == ROWS for w in weights)
        outs[mode] = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
        if mode == "on":
            assert calls["linear"] and calls["experts"]
            counted = dict(calls)
    assert calls == counted  # the CPU path called neither
    assert outs["on"].token_ids == outs["off"].token_ids
    assert max(abs(x[t].logprob - y[t].logprob)
               for x, y, t in zip(outs["on"].logprobs, outs["off"].logprobs, outs["off"].token_ids)) < 1e-3


def test_on_cuda_weights_are_stored_quantized_only_through_triton():
    """The forms a CUDA engine may hold: FP8 (a checkpoint's own, or --quantization fp8), int8 and int4 where the
    Triton kernels run; any quantization without them is refused naming the option."""
    from dsaserve.quantization.apply import weight_forms

    cuda = torch.device("cuda")
    try:
        triton_ops.configure("auto", cuda)
        for kind in ("fp8", "int8", "int4"):
            assert weight_forms(kind, set(), torch.bfloat16, cuda)("any.weight") == kind
        shipped = weight_forms(None, {"a.weight"}, torch.bfloat16, cuda)
        assert shipped("a.weight") == "fp8" and shipped("b.weight") is None
        assert weight_forms(None, set(), torch.bfloat16, cuda) is None
        triton_ops.configure("off", cuda)
        with pytest.raises(ValueError, match="quantization='int8' on cuda.*triton_kernels auto or on"):
            weight_forms("int8", set(), torch.bfloat16, cuda)
    finally:
        triton_ops.configure("auto", torch.device("cpu"))


def test_weights_packed_for_the_cpu_kernels_are_refused_on_another_device(tiny_checkpoint):
    """Packed forms are read only by CPU operators: on any other device (here `meta`) loading them is an error
    that says so, before anything is read."""
    from dsaserve.config import ModelConfig
    from dsaserve.model import load_model

    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match="int4.*exist only on the CPU"):
        load_model(cfg, tiny_checkpoint, torch.float32, torch.device("meta"), weight_forms="int4", progress=False)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm5_next"])
def test_the_other_families_through_the_triton_kernels_generate_what_the_cpu_path_does(interpreter, make_checkpoint,
                                                                                      family):
    """DeepSeek-V3.2 (every layer its own indexer, grouped routing) and GLM-5.3-Flash (KDA, pooled keys, mHC, swiglu's
    limit) on the Triton path: the CPU path's greedy tokens, logprobs within the CUDA-vs-CPU bound."""
    from test_deepseek_v32 import V32

    path = make_checkpoint(family, seed=0, **(V32 if family == "deepseek_v32" else dict(model_type="glm5_next")))
    prompts = [torch.randint(30, 600, (n,), generator=torch.Generator().manual_seed(6000 + n)).tolist()
               for n in (90, 41)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = {}
    for mode in ("on", "off"):
        llm = LLM(path, dtype="float32", block_size=16, max_model_len=256, max_num_batched_tokens=64,
                  triton_kernels=mode, progress=False)
        outs[mode] = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                         use_tqdm=False)]
    for a, b in zip(outs["on"], outs["off"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids)) < 1e-3


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32", "glm5_next"])
def test_an_eager_decode_step_on_the_gpu_path_reads_back_once(interpreter, make_checkpoint, monkeypatch, family):
    """A GPU's eager decode step (the Triton kernels, no native CPU operator; GLM-5.3-Flash always runs this way on
    CUDA): one value read back to the host, the sampled tokens, and no operator that would make the host wait for the
    device (a data-sized output, a mask index, bincount; copies of host data to the device are allowed)."""
    from replayed_graphs import HostReads, HostValueReads
    from test_deepseek_v32 import V32

    from dsaserve.native import torch_ops

    kwargs = {"deepseek_v32": V32, "glm5_next": dict(model_type="glm5_next")}.get(family, {})
    path = make_checkpoint(family if kwargs else "tiny", seed=0, **kwargs)
    monkeypatch.setattr(torch_ops, "load", lambda: False)
    engine = LLM(path, dtype="float32", block_size=16, max_model_len=256, triton_kernels="on",
                 progress=False).engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    for i, n in enumerate((35, 9)):  # past index_topk (the indexer selects) and within it
        engine.add_request(f"r{i}", list(range(30, 30 + n)), params)
    first = engine.step()  # both prompts in one step, each with its first token
    assert sorted(o.request_id for o in first if o.outputs[0].token_ids) == ["r0", "r1"]
    steps = []
    while engine.has_unfinished_requests():
        with HostValueReads() as reads, HostReads() as ops:
            engine.step()
        steps.append((reads.seen, [op for op in ops.seen if op != "aten.lift_fresh.default"]))
    assert len(steps) == 2 and all(len(reads) == 1 and not ops for reads, ops in steps), steps


# ---- FP8 weights on the FP8 tensor cores (triton_ops/fp8_scaled_mm.py) -------------------------------------------
# torch's block-scaled matmul runs on Hopper GPUs only; here it is replaced by this emulation of its documented
# semantics, which also asserts the scales' shapes and layout that the CUDA kernel requires. On a GPU the engine checks
# the real kernel against quantized_linear.py once before using it (fp8_scaled_mm.unavailable).


def emulated_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16):
    m, k = a.shape
    n = b.shape[1]
    assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
    assert a.dtype == b.dtype == torch.float8_e4m3fn and m % 4 == 0
    assert scale_a.shape == (m, k // 128) and scale_a.stride(0) == 1  # outer-dim-major
    assert scale_b.shape == (-(-(k // 128) // 4) * 4, n // 128)  # [K blocks padded to 4, N blocks]
    wide_a = a.float() * scale_a.repeat_interleave(128, dim=1)
    wide_b = b.float() * scale_b[: k // 128].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return (wide_a @ wide_b).to(output_dtype)


def checkpoint_blocks(n: int, k: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight as a checkpoint ships it: bytes [n, k] and a scale per 128 × 128 block, in the rows layout."""
    from dsaserve.triton_ops.fp8_scaled_mm import fp8_bytes

    scales = (torch.rand(n // 128, k // 128, generator=g) * 3 + 0.1).repeat_interleave(128, dim=0)
    weight = torch.randn(n, k, generator=g) * scales.repeat_interleave(128, dim=1) * 100
    return fp8_bytes(weight, scales), scales


def test_block_scales_come_only_from_a_checkpoints_128_row_blocks():
    from dsaserve.triton_ops.fp8_scaled_mm import block_scales

    g = torch.Generator().manual_seed(1)
    _, scales = checkpoint_blocks(256, 640, g)
    blocks = block_scales(scales)
    assert blocks.shape == (2, 8) and torch.equal(blocks[:, :5], scales[::128]) and (blocks[:, 5:] == 1).all()
    per_row = scales.clone()
    per_row[3, 0] *= 2  # one row's own scale: --quantization fp8's form, not a block's
    assert block_scales(per_row) is None and block_scales(scales[:200]) is None


def test_activations_are_quantized_per_row_and_128_columns():
    from dsaserve.triton_ops.fp8_scaled_mm import quantize_activations

    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[2, 128:] *= 1000  # one group far larger than the others: each has its own scale
    quantized, scale = quantize_activations(x)
    assert quantized.shape == (8, 256) and scale.shape == (8, 2) and scale.stride(0) == 1
    back = quantized.float() * scale.repeat_interleave(128, dim=1)
    amax = x.float().abs().view(5, 2, 128).amax(dim=-1).repeat_interleave(128, dim=1)
    assert ((back[:5] - x.float()).abs() <= amax / 16).all()  # within e4m3's rounding of each group's range
    assert (back[5:] == 0).all()


def test_scaled_matmul_agrees_with_the_fp8_kernel(interpreter, monkeypatch):
    from dsaserve.triton_ops.fp8_scaled_mm import block_scales, scaled_matmul
    from dsaserve.triton_ops.quantized_linear import quantized_matmul

    monkeypatch.setattr(F, "scaled_mm", emulated_scaled_mm)
    g = torch.Generator().manual_seed(3)
    q, scales = checkpoint_blocks(256, 640, g)
    x = torch.randn(66, 640, generator=g).to(torch.bfloat16)
    got, expected = scaled_matmul(x, q, block_scales(scales)).float(), quantized_matmul(x, q, scales, "fp8").float()
    assert got.shape == (66, 256)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()  # 8-bit activations' rounding


def test_fp8_weights_take_the_fp8_tensor_cores_for_prefill_rows_of_bf16_only(interpreter, monkeypatch):
    """Where the probe passed: 64 or more bf16 rows by a checkpoint's 128 × 128 blocks; decode rows, fp32 rows and a
    weight with per-row scales keep the Triton kernel."""
    from dsaserve.quantization.quantized_weight import ROWS, QuantizedWeight
    from dsaserve.triton_ops import fp8_scaled_mm

    calls = []
    monkeypatch.setattr(fp8_scaled_mm, "unavailable", lambda device: None)
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: calls.append(a[0].shape[0]) or emulated_scaled_mm(*a, **k))
    g = torch.Generator().manual_seed(4)

    def weight(scales_per_row: bool) -> QuantizedWeight:
        q, scales = checkpoint_blocks(256, 384, g)
        if scales_per_row:
            scales = scales * torch.linspace(1, 2, 256)[:, None]
        module = QuantizedWeight("fp8", 256, 384)
        assert module.layout == ROWS
        module.qweight.copy_(q)
        module.scale.copy_(scales)
        return module

    blocks, per_row = weight(False), weight(True)
    for rows, dtype in ((64, torch.bfloat16), (16, torch.bfloat16), (64, torch.float32)):
        blocks.matrix().matmul(torch.randn(rows, 384, generator=g).to(dtype))
    per_row.matrix().matmul(torch.randn(64, 384, generator=g).to(torch.bfloat16))
    assert calls == [64]


def test_the_fp8_tensor_core_probe_says_why_not_here():
    from dsaserve.triton_ops.fp8_scaled_mm import unavailable

    assert unavailable(torch.device("cpu")) == "it runs on CUDA only"
