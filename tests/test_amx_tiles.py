"""The AMX tile bodies of the sparse kernels (native/amx_tiles.h, selected_rows.cpp, index_scores.cpp).

Each test runs them emulated (the tile operations in C++, their shape rules checked; any CPU with AVX-512 BF16)
and on the hardware (skipped with the reason on a CPU without AMX-BF16 and AMX-INT8), against fp32 computations
and against the AVX-512 bodies, and checks which shapes keep the AVX-512 bodies and how the mode is chosen at
load."""

import contextlib
import sys

import pytest
import torch
from test_native import random_case, reference

from dsaserve import LLM, SamplingParams
from dsaserve.native import amx, torch_ops
from dsaserve.native import index_scores as native_scores
from dsaserve.native.selected_rows import attend_selected_rows, has_bf16_kernel

pytestmark = pytest.mark.skipif(not has_bf16_kernel(), reason="the tile bodies' other parts are AVX-512 BF16 code: "
                                "no such CPU here, or the operators could not be built")

TILE_FORMS = ["emulated", pytest.param("hardware", marks=pytest.mark.skipif(
    not (torch_ops.load() and torch.ops.dsaserve.amx_available()),
    reason="no AMX-BF16 and AMX-INT8 on this CPU (lscpu: amx_bf16, amx_int8), or Linux did not grant the "
           "tile registers"))]


@contextlib.contextmanager
def tiles(form: str, expect_tiles: bool = True):
    """Runs the block with the kernels in `form`; checks that a tile body ran in it (or, for 'off' or
    expect_tiles=False, that none did), so that no test passes by never reaching the tiles."""
    previous = amx.set_mode(form)
    calls = torch.ops.dsaserve.amx_tile_calls()
    try:
        yield
    finally:
        amx.set_mode(previous)
    assert (torch.ops.dsaserve.amx_tile_calls() > calls) == (expect_tiles and form != "off")


def attend(form, query, rows, slots, value_dim, scale=0.2):
    out = torch.zeros(query.shape[0], query.shape[1], query.shape[2], dtype=torch.bfloat16)
    with tiles(form, expect_tiles=value_dim % 64 == 0):
        assert attend_selected_rows(query, rows, slots, scale, out[..., :value_dim])
    return out


@pytest.mark.parametrize("form", TILE_FORMS)
@pytest.mark.parametrize("heads, dim, value_dim, width", [
    (16, 72, 64, 150),     # columns padded to 96; a whole block of 128 rows and a ragged one
    (64, 576, 512, 300),   # GLM-5.2's: two whole blocks and a ragged one
    (32, 160, 128, 64),    # one block, no padding
])
def test_tile_attention_equals_fp32_attention(form, heads, dim, value_dim, width):
    query, rows, slots = random_case(dim, 3, heads, dim, width, 2 * width + 50)
    slots[1, ::7] = -1
    slots[2, 40:] = -1  # only the first 40 rows valid
    rows[slots[0, -3:]] = (query[0, 0].float() * 2).bfloat16()  # dominant rows last: earlier blocks rescaled
    out = attend(form, query, rows, slots, value_dim)
    expected = reference(query, rows, slots, 0.2, value_dim)
    assert (out[..., :value_dim].float() - expected).abs().max() <= 0.02 * expected.abs().max()
    assert not out[..., value_dim:].any()  # columns past the values are left alone
    avx512 = attend("off", query, rows, slots, value_dim)
    assert (out.float() - avx512.float()).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("form", TILE_FORMS)
def test_tile_attention_splits_a_lone_query_over_threads_and_merges(form):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        query, rows, slots = random_case(5, 1, 16, 72, 1000, 2000)
        rows[slots[0, -5:]] = (query[0, 0].float() * 2).bfloat16()  # dominant rows in the last part
        slots[0, 300:600] = -1  # most of a part empty
        out = attend(form, query, rows, slots, 64)
        expected = reference(query, rows, slots, 0.2, 64)
        assert (out[..., :64].float() - expected).abs().max() <= 0.02 * expected.abs().max()
        empty = attend(form, query, rows, torch.full_like(slots, -1), 64)
        assert not empty.any()  # no row at all: zeros, not NaN
    finally:
        torch.set_num_threads(before)


def test_value_widths_not_in_64s_keep_the_avx512_body():
    query, rows, slots = random_case(1, 2, 16, 72, 150, 400)
    assert torch.equal(attend("emulated", query, rows, slots, 32), attend("off", query, rows, slots, 32))
    assert not torch.equal(attend("emulated", query, rows, slots, 64), attend("off", query, rows, slots, 64))


def index_case(seed, n, heads, dim, keys):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g).bfloat16()
    weights = torch.rand(n, heads, generator=g) + 0.1
    key_rows = torch.randn(keys, dim, generator=g).bfloat16()
    expected = (torch.relu(q.float() @ key_rows.float().T) * weights[:, :, None]).sum(1)
    return q, weights, key_rows, expected


@pytest.mark.parametrize("form", TILE_FORMS)
@pytest.mark.parametrize("heads, dim, keys", [(16, 32, 300), (32, 128, 64), (48, 64, 1000)])
def test_tile_index_scores_equal_fp32_scores(form, heads, dim, keys):
    q, weights, key_rows, expected = index_case(heads + dim, 3, heads, dim, keys)
    packed = native_scores.pack_keys(key_rows, torch.empty(native_scores.packed_size(keys, dim), dtype=torch.int32))
    out = torch.full((3, keys + 5), -7.0)
    with tiles(form):
        native_scores.index_scores(q, weights, packed, keys, out)
    assert torch.allclose(out[:, :keys], expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert (out[:, keys:] == -7).all()  # nothing written past the keys


@pytest.mark.parametrize("form", TILE_FORMS)
def test_tile_index_scores_read_a_paged_cache_in_place(form):
    block_size, dim, keys = 32, 64, 150
    q, weights, key_rows, expected = index_case(9, 2, 32, dim, keys)
    cache = torch.zeros(8, block_size // 16, dim // 2, 16, dtype=torch.int32)
    table = torch.tensor([5, 0, 7, 2, 3])  # scrambled blocks, the last one partly filled
    positions = torch.arange(keys)
    torch.ops.dsaserve.write_packed_keys(cache, table[positions // block_size] * block_size + positions % block_size,
                                         key_rows)
    out = torch.empty(2, keys)
    with tiles(form):
        native_scores.index_scores_blocks(q, weights, cache, table, keys, out)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def int8_cache(seed, dim, keys, block_size=64):
    from dsaserve.attention.indexer_cache import IndexerKeyCache

    g = torch.Generator().manual_seed(seed)
    blocks = -(-keys // block_size) + 3
    cache = IndexerKeyCache(blocks, block_size, dim, "int8", torch.bfloat16, torch.device("cpu"), packed=True)
    table = torch.randperm(blocks, generator=g)[: -(-keys // block_size)]  # scrambled, the last block partly filled
    positions = torch.arange(keys)
    cache.write(table[positions // block_size] * block_size + positions % block_size,
                torch.randn(keys, dim, generator=g).bfloat16())
    return cache, table


@pytest.mark.skipif(not native_scores.fits_int8(16, 64), reason="no int8 index-scores kernel here (needs AVX-512 VNNI)")
@pytest.mark.parametrize("form", TILE_FORMS)
@pytest.mark.parametrize("heads, dim, keys, n", [(16, 64, 300, 3), (32, 128, 1000, 2), (16, 128, 4100, 1)])
def test_tile_int8_index_scores_are_the_vnni_bodys_bits(form, heads, dim, keys, n):
    """Integer sums are exact and the heads are added in the same order: the tile body's scores are the VNNI
    body's, bit for bit (which tests/test_long_context.py checks against the rounded-query formula)."""
    cache, table = int8_cache(heads + keys, dim, keys)
    g = torch.Generator().manual_seed(keys)
    q = (torch.randn(n, heads, dim, generator=g) * torch.rand(n, heads, 1, generator=g)).bfloat16()
    weights = torch.rand(n, heads, generator=g)
    outs = {}
    for each in (form, "off"):
        outs[each] = torch.full((n, keys + 3), -7.0)
        with tiles(each):
            native_scores.index_scores_int8_blocks(q, weights, cache.int8_groups, cache.scale, table, keys, outs[each])
    assert torch.equal(outs[form], outs["off"])
    assert (outs[form][:, keys:] == -7).all() and outs[form][:, :keys].abs().sum() > 0


def test_index_shapes_not_in_whole_tiles_keep_the_avx512_body():
    for heads, dim in ((8, 64), (16, 48)):
        q, weights, key_rows, _ = index_case(2, 2, heads, dim, 100)
        packed = native_scores.pack_keys(key_rows, torch.empty(native_scores.packed_size(100, dim), dtype=torch.int32))
        outs = []
        for form in ("emulated", "off"):
            outs.append(torch.empty(2, 100))
            with tiles(form, expect_tiles=False):
                native_scores.index_scores(q, weights, packed, 100, outs[-1])
        assert torch.equal(*outs), (heads, dim)


def test_the_hardware_form_is_refused_without_amx_and_unknown_forms_are_named():
    if not torch.ops.dsaserve.amx_available():
        with pytest.raises(RuntimeError, match="'hardware' needs a CPU with AMX-BF16"):
            amx.set_mode("hardware")
    with pytest.raises(RuntimeError, match="mode 'tiles' is not one of off, hardware, emulated"):
        amx.set_mode("tiles")
    assert amx.mode() in ("off", "hardware")  # never left emulated


def test_load_turns_tiles_on_only_where_available_and_in_agreement():
    previous = amx.set_mode("off")
    try:
        amx.choose_at_load(str(torch_ops.library_path()))
        assert amx.mode() == ("hardware" if torch.ops.dsaserve.amx_available() else "off")
    finally:
        amx.set_mode(previous)


@pytest.fixture
def own_verdicts(monkeypatch, tmp_path):
    """The load check's kept verdicts in a file of this test's own (faked checks must not reach the real one)."""
    path = tmp_path / amx.VERDICTS_FILE
    monkeypatch.setattr(amx, "verdicts_path", lambda library: path)
    return path


def test_the_load_check_verdict_is_kept_for_the_same_library_cpu_and_linux(monkeypatch, own_verdicts, tmp_path):
    """A finished check's verdict is reused by the next start on the same CPU and library, with the state saying
    so; another CPU identity checks again, and so does a start after a check that did not finish or an unreadable
    file."""
    runs, verdict = tmp_path / "runs", tmp_path / "verdict"
    verdict.write_text("null")
    code = (f"import sys; open({str(runs)!r}, 'a').write('x'); v = open({str(verdict)!r}).read(); "
            "print('{\"disagreement\": ' + v + '}') if v != 'fail' else sys.exit(3)")
    monkeypatch.setattr(amx, "_check_command", lambda library, tiles: [sys.executable, "-c", code])

    monkeypatch.setattr(torch.ops.dsaserve, "amx_available", lambda: True)
    monkeypatch.setattr(amx, "set_mode", lambda name: "off")
    library = str(torch_ops.library_path())

    def start() -> int:
        amx.choose_at_load(library)
        return len(runs.read_text()) if runs.exists() else 0

    try:
        assert start() == 1 and amx.state() == "on (AMX tiles, checked against the AVX-512 kernels at load)"
        assert start() == 1 and amx.state() == ("on (AMX tiles, checked against the AVX-512 kernels by an earlier "
                                                "start on this CPU and library)")
        monkeypatch.setattr(amx, "cpu_identity", lambda: "another microcode")
        verdict.write_text('"index_scores off by 0.5 of its largest value"')
        assert start() == 2 and "failed their check against the AVX-512 ones at load: index_scores" in amx.state()
        assert start() == 2 and "ones by an earlier start on this CPU and library: index_scores" in amx.state()
        monkeypatch.setattr(amx, "cpu_identity", lambda: "a third CPU")
        verdict.write_text("fail")
        assert start() == 3 and "exit status 3" in amx.state()
        assert start() == 4  # a check that failed is not kept
        own_verdicts.write_text("{not json")
        monkeypatch.setattr(amx, "cpu_identity", lambda: "another microcode")
        assert start() == 5 and "exit status 3" in amx.state()
    finally:
        monkeypatch.undo()
        amx.choose_at_load(library)  # this CPU's own verdict again
        torch_ops.configure("auto")


@pytest.mark.usefixtures("own_verdicts")
def test_native_kernels_avx512_keeps_tiles_that_passed_their_check_off(monkeypatch):
    """On an AMX CPU (faked, its mode recorded) whose check agrees the tiles go on; the engine option native_kernels
    'avx512' turns them off, saying why, and 'auto' back on."""
    mode = ["off"]
    monkeypatch.setattr(torch.ops.dsaserve, "amx_available", lambda: True)
    monkeypatch.setattr(amx, "set_mode", lambda name: mode.append(name) or mode[-2])
    monkeypatch.setattr(amx, "_check_command", lambda library, tiles: [
        sys.executable, "-c", "print('{\"disagreement\": null}')"])
    try:
        amx.choose_at_load(str(torch_ops.library_path()))
        assert mode[-1] == "hardware" and amx.state().startswith("on")
        torch_ops.configure("avx512")
        assert mode[-1] == "off" and amx.state() == "off (native_kernels 'avx512')"
        torch_ops.configure("auto")
        assert mode[-1] == "hardware" and amx.state().startswith("on")
    finally:
        monkeypatch.undo()
        amx.choose_at_load(str(torch_ops.library_path()))  # this CPU's own verdict again
        torch_ops.configure("auto")


def test_the_load_check_runs_the_tile_bodies_in_a_child_process():
    """The child loads the library, runs the tile bodies (emulated here) against the AVX-512 ones and reports
    agreement; this process's mode is untouched."""
    assert amx.check_in_child(str(torch_ops.library_path()), "emulated") is None
    assert amx.mode() in ("off", "hardware")
    # A check whose kernels never reach a tile body proves nothing, and says so.
    assert amx.tile_disagreement("off") == "attend_selected_rows did not take its tile body"


CHILDREN = {
    "disagrees": ("print('{\"disagreement\": \"index_scores off by 0.5 of its largest value\"}')", "off by 0.5"),
    "raises": ("raise RuntimeError('a tile fault')", "exit status 1: RuntimeError: a tile fault"),
    "faults": ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV"),
    "hangs": ("import time; time.sleep(60)", "did not finish in 2 s"),
    "prints no verdict": ("print('loaded')", "printed no verdict: 'loaded'"),
}


@pytest.mark.usefixtures("own_verdicts")
@pytest.mark.parametrize("child", sorted(CHILDREN))
def test_tiles_that_fail_the_load_check_stay_off(monkeypatch, caplog, child):
    """On an AMX CPU (faked) whose check disagrees, raises, kills its process, hangs or says nothing, the
    tiles stay off with the reason, and this process goes on."""
    code, reason = CHILDREN[child]
    previous = amx.set_mode("off")
    try:
        monkeypatch.setattr(torch.ops.dsaserve, "amx_available", lambda: True)  # as on an AMX CPU
        monkeypatch.setattr(amx, "_check_command", lambda library, tiles: [sys.executable, "-c", code])
        monkeypatch.setattr(amx, "CHECK_TIMEOUT_S", 2)
        amx.choose_at_load(str(torch_ops.library_path()))
        assert amx.mode() == "off"
        assert (amx.state().startswith("off (the AMX tile kernels failed their check")
                and "sparse kernels" in caplog.text)
        assert reason in amx.state(), amx.state()
    finally:
        amx.set_mode(previous)


def test_a_bf16_engine_generates_with_tile_kernels_what_it_generates_without(make_checkpoint):
    """A checkpoint whose shapes the tile bodies take (value width 64, 16 indexer heads of 32 columns): prompts
    past index_topk run the tile attention and scores in prefill and decode, emulated; greedy tokens and top
    logprobs agree with the AVX-512 bodies'."""
    path = make_checkpoint("tile_shapes", seed=0, dtype=torch.bfloat16, kv_lora_rank=64, index_n_heads=16)
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 41)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm = LLM(path, dtype="bfloat16", block_size=16, max_model_len=256, progress=False)

    def run(form):
        with tiles(form):
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    with_tiles, without = run("emulated"), run("off")  # tiles() checks that the tile bodies ran, or did not
    for a, b in zip(with_tiles, without):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 0.05 for t in x)
