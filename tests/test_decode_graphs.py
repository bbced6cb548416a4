"""Decode steps replayed from CUDA graphs (engine/workers/decode_graphs.py), checked without a GPU: the Triton path on
CPU tensors under Triton's interpreter, with a stand-in for torch.cuda.CUDAGraph that runs the captured forward again
at each replay. What this checks is everything but the capture itself: the static buffers, the padding rows and
their block, the capture's host values, which steps replay and which run eagerly, and that the captured forward
never reads a device value on the host nor makes a tensor from host data (either would break a capture). Each run
is held to the eager CPU path's (its native operators: the fastest reference here) tokens and logprobs."""

import os

import pytest
import torch
from replayed_graphs import ReplayedForward, StepReads, install

from dsaserve import LLM, SamplingParams, cuda_graph_sizes, triton_ops
from dsaserve.engine.workers import decode_graphs

pytestmark = pytest.mark.skipif(triton_ops.triton_imports() is not None, reason="Triton does not import here")

@pytest.fixture
def replayed(monkeypatch):
    """Graphs on for CPU tensors, replayed by ReplayedForward; context buckets of 32 tokens and max_model_len."""
    install(monkeypatch.setattr)
    ReplayedForward.host_reads = []
    return ReplayedForward


def replays(llm, rows: int = 1) -> dict[tuple[int, int], int]:
    """Replays so far per captured (batch size, context bucket), of `rows` tokens per request."""
    return {(shape.size, shape.context): step.graph.replays
            for shape, step in llm.engine.runner.graphs.captured.items() if shape.rows == rows}


# Prompts past index_topk (16: the full layers score and select) and within it, three decoding together (a size-4
# graph with one padding row), then two (size 2) after the shortest stops, all in the 128-token bucket; then two
# short prompts alone (the 32-token bucket).
PROMPTS = [torch.randint(30, 600, (n,), generator=torch.Generator().manual_seed(8000 + n)).tolist()
           for n in (45, 9, 30)]
SHORT = [torch.randint(30, 600, (n,), generator=torch.Generator().manual_seed(9000 + n)).tolist() for n in (12, 5)]


def generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in max_tokens]
    return [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def engine(path, triton_kernels="on", **kwargs):
    return LLM(path, dtype="float32", block_size=16, max_model_len=128, max_num_batched_tokens=64,
               triton_kernels=triton_kernels, progress=False, **kwargs)


def test_replayed_decode_steps_generate_what_eager_steps_do(interpreter, make_checkpoint, replayed, monkeypatch):
    """Greedy tokens equal to the eager CPU path's, logprobs within float noise (a capture scores every position
    of its context bucket, so its selections come in another order); decode batches of 3 and 2 replayed the sizes 4
    and 2 in the 128-token bucket, short contexts the 32-token one, prefill steps ran eagerly, and the padding rows
    wrote to the block past the scheduler's. And the replayed forward read nothing back from the device: no
    item()/tolist()/bool() of a tensor, no data-sized output (nonzero, masking, repeat_interleave without its size),
    no tensor made from host data; each would stop a CUDA graph's capture (or bake one step's values into it).
    The whole step around the replay reads the device back once: the sampled tokens with their checks and logprobs."""
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    llm = engine(path, cuda_graph_sizes="1,2,4")
    steps = StepReads()
    steps.install(llm.engine, monkeypatch.setattr)
    graphed = generate(llm, PROMPTS, (8, 4, 8))
    graphs = llm.engine.runner.graphs
    assert set(replays(llm)) == {(size, context) for size in (1, 2, 4) for context in (32, 128)}
    first = replays(llm)
    assert first[4, 128] >= 2 and first[2, 128] >= 2 and first[2, 32] == 0
    graphed += generate(llm, SHORT, (4, 4))
    assert replays(llm)[2, 32] >= 2
    assert graphs.pad_block == llm.engine.kv_cache.num_blocks - 1 == llm.engine.stats().num_blocks
    assert llm.engine.kv_cache.latent[0][graphs.pad_block, 0].abs().sum() > 0  # the padding rows wrote there
    assert replayed.host_reads == []
    assert len(steps.per_step) >= 8 and all(len(reads) == 1 for reads in steps.per_step), steps.per_step
    eager_llm = engine(path, "off")
    eager = generate(eager_llm, PROMPTS, (8, 4, 8)) + generate(eager_llm, SHORT, (4, 4))
    assert eager_llm.engine.runner.graphs is None
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    diff = max(abs(a[t].logprob - b[t].logprob) for x, y in zip(graphed, eager)
               for a, b, t in zip(x.logprobs, y.logprobs, x.token_ids))
    assert diff < 1e-4, diff


def test_flash_decode_steps_replayed_keep_each_requests_kda_state(interpreter, make_checkpoint, replayed,
                                                                   monkeypatch):
    """GLM-5.3-Flash (KDA state slots, pooled keys, mHC streams): decode batches of 3 and 2 replay sizes 4 and 2, each
    request's KDA state read and written at its slot (the padding requests' at a slot of their own, started afresh),
    the pools a row completes written from the device's positions; a step that keeps a prefix-cache snapshot of the
    state (every 32 tokens here) runs eagerly. Greedy tokens equal to the eager CPU path's, logprobs within float
    noise, nothing read back inside a replay and one read a step around it."""
    path = make_checkpoint("glm5_next", seed=0, model_type="glm5_next")
    flash = dict(cuda_graph_sizes="1,2,4", state_snapshot_interval=32)
    llm = engine(path, **flash)
    steps = StepReads()
    steps.install(llm.engine, monkeypatch.setattr)
    eager_steps = []
    run = llm.engine.runner._forward
    monkeypatch.setattr(llm.engine.runner, "_forward", lambda out, rows: eager_steps.append(out) or run(out, rows))
    graphed = generate(llm, PROMPTS, (8, 4, 8))
    graphs = llm.engine.runner.graphs
    assert graphs.pad_slot == llm.engine.kv_cache.latent[0].num_slots - 1
    assert replays(llm)[4, 128] >= 1 and replays(llm)[2, 128] >= 2
    snapshot_steps = [out for out in eager_steps if any(s.state_snapshots for s in out.scheduled)]
    assert any(len(out.scheduled[0].token_ids) == 1 for out in snapshot_steps)  # decode steps that ran eagerly
    assert replayed.host_reads == []
    assert len(steps.per_step) >= 6 and all(len(reads) == 1 for reads in steps.per_step), steps.per_step
    eager_llm = engine(path, "off", **flash)
    eager = generate(eager_llm, PROMPTS, (8, 4, 8))
    assert eager_llm.engine.runner.graphs is None
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    diff = max(abs(a[t].logprob - b[t].logprob) for x, y in zip(graphed, eager)
               for a, b, t in zip(x.logprobs, y.logprobs, x.token_ids))
    assert diff < 1e-4, diff


SPEC = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.mark.parametrize("share", [False, True], ids=["own-index", "shared-index"])
def test_verify_steps_replayed_with_their_drafts_generate_what_eager_steps_do(interpreter, make_checkpoint,
                                                                              replayed, monkeypatch, share):
    """Speculative decoding (MTP, 2 drafts): verify steps of 3 tokens per request replay their graphs, whose hidden
    states the drafter reads, and the drafter's rounds replay theirs; tokens and every step's drafts equal to the
    eager CPU path's (with index_share_for_mtp_iteration, draft step 2 attends to step 1's selection); nothing read
    back from the device in a replay (as above), and a step reads back twice around them."""
    from dsaserve.attention import tile_unions
    from dsaserve.engine.workers import model_runner

    drafts, propose = [], model_runner.propose
    monkeypatch.setattr(model_runner, "propose", lambda *a: drafts.append(out := propose(*a)) or out)
    built_in_graph, build = [], tile_unions.tile_unions  # (a captured forward's batch carries "requests")
    monkeypatch.setattr(tile_unions, "tile_unions",
                        lambda meta, *a: built_in_graph.append("requests" in meta.derived) or build(meta, *a))
    path = make_checkpoint(f"tiny-mtp-{share}", seed=3, include_mtp=True, index_share_for_mtp_iteration=share)
    prompts = PROMPTS[::2]  # two requests past index_topk: verify steps of size 2
    llm = engine(path, cuda_graph_sizes="1,2", speculative_config=SPEC)
    steps = StepReads()
    steps.install(llm.engine, monkeypatch.setattr)
    eager_steps, run = [], llm.engine.runner._forward
    monkeypatch.setattr(llm.engine.runner, "_forward", lambda out, rows: eager_steps.append(out) or run(out, rows))
    graphed = generate(llm, prompts, (9, 9))
    # Only steps with prompt rows ran eagerly: a step where a request has fewer drafts (none after its prompt, fewer
    # near its max_tokens) replayed the verify graph with padding rows after its tokens.
    assert eager_steps and all(any(len(s.token_ids) > 1 + len(s.spec_token_ids) for s in out.scheduled)
                               for out in eager_steps)
    assert replays(llm, rows=3)[2, 128] >= 3 and replayed.host_reads == []
    draft_rounds = {(shape.size, shape.context): step.graph.replays
                    for shape, step in llm.engine.runner.draft_graphs.captured.items()}
    assert draft_rounds[2, 128] >= 3 and set(draft_rounds) == {(size, ctx) for size in (1, 2) for ctx in (32, 128)}
    # Every round replayed, also those where a request near its max_tokens drafts fewer tokens; so did catch-ups of
    # the MTP layer's caches (a step that accepted drafts has one; one after prompt rows runs eagerly).
    assert sum(draft_rounds.values()) == sum(1 for d in drafts if d)
    assert sum(step.graph.replays for step in llm.engine.runner.draft_graphs.catch_up.captured.values()) >= 1
    assert any(len(tokens) < SPEC["num_speculative_tokens"] for d in drafts for tokens in d.values())
    # A verify step reads back twice: the verdicts with their logprobs, then the next drafts (a step that also samples
    # a request that had no drafts, once more).
    assert all(len(reads) <= 2 + any("isolated_sampling" in r for r in reads) for reads in steps.per_step), \
        steps.per_step
    # Prompt steps attend by tile unions (4 heads); captured steps per query (the unions' sort may not capture).
    assert built_in_graph and not any(built_in_graph)
    graphed_drafts, drafts[:] = list(drafts), []
    # A request that drafts one token from the last position of its last block: the round's second position lies past
    # its block table, and writes into the padding block; its one draft is the eager round's.
    from dsaserve.engine.speculative.mtp_drafter import DraftInput
    from dsaserve.engine.speculative.mtp_drafter import propose as eager_round
    runner = llm.engine.runner
    short = DraftInput("short", 14, [77, 91], [0, 1], [3], num_drafts=1)
    hidden = torch.randn(2, llm.engine.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # (as the runner's steps run)
        alone = eager_round(runner.model, runner.kv_cache, [short], hidden, share)
        assert runner.draft_graphs.run([short], hidden) == alone and len(alone["short"]) == 1
    # A catch-up replayed writes the MTP layer's cache entries an eager one writes: latent rows and indexer keys of two
    # kept rows (positions 40 and 41: the third block of the table, 7).
    layer = llm.engine.config.num_hidden_layers
    mtp_rows = lambda: [t.flatten(0, 1)[[7 * 16 + 8, 7 * 16 + 9]].clone()  # noqa: E731
                        for t in [runner.kv_cache.latent[layer], *runner.kv_cache.indexer[layer].tensors()]]
    kept = DraftInput("kept", 40, [11, 12], [0, 1], [5, 6, 7], num_drafts=0)
    with torch.inference_mode():
        eager_round(runner.model, runner.kv_cache, [kept], hidden, share)
        written = mtp_rows()
        for t in [runner.kv_cache.latent[layer], *runner.kv_cache.indexer[layer].tensors()]:
            t.zero_()
        runner.draft_graphs.catch_up.run([(kept, 2)], hidden)
    assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(written, mtp_rows()))
    eager = generate(engine(path, "off", speculative_config=SPEC), prompts, (9, 9))
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert graphed_drafts == drafts and any(graphed_drafts)  # the drafter read the replays' hidden states


def test_graphs_stay_off_where_the_captured_forward_would_not_be_the_step(interpreter, make_checkpoint, monkeypatch,
                                                                          caplog):
    """--enforce-eager, or the Triton kernels off: every step eager, no padding block, the reason logged."""
    monkeypatch.setattr(decode_graphs, "graphs_possible", lambda device: True)
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    for kwargs, why in [(dict(enforce_eager=True, triton_kernels="on"), "--enforce-eager"),
                        (dict(triton_kernels="off"), "the Triton kernels are off")]:
        caplog.clear()
        with caplog.at_level("INFO", logger="dsaserve.engine.workers.worker"):
            engine = LLM(path, dtype="float32", block_size=16, max_model_len=128, progress=False, **kwargs).engine
        assert engine.runner.graphs is None
        assert engine.kv_cache.num_blocks == engine.stats().num_blocks
        assert f"CUDA graphs: off ({why}" in caplog.text


class RefusedCapture(ReplayedForward):
    def capture(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_decode_eager_and_says_why(interpreter, make_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(decode_graphs, "graphs_possible", lambda device: True)
    monkeypatch.setattr(decode_graphs, "CudaGraph", RefusedCapture)
    with caplog.at_level("WARNING", logger="dsaserve.engine.workers.decode_graphs"):
        llm = LLM(make_checkpoint("parity_mixed_FFSS", seed=0), dtype="float32", block_size=16, max_model_len=128,
                  triton_kernels="on", progress=False)
    assert llm.engine.runner.graphs is None
    assert "CUDA graphs: capture failed, so decode steps run eagerly" in caplog.text
    assert "operation not permitted when stream is capturing" in caplog.text


def test_context_buckets_grow_by_four_up_to_max_model_len():
    assert cuda_graph_sizes.context_buckets(131072) == (4096, 16384, 65536, 131072)
    assert cuda_graph_sizes.context_buckets(65536) == (4096, 16384, 65536)
    assert cuda_graph_sizes.context_buckets(1024) == (1024,)


def test_capture_sizes_default_to_powers_of_two_up_to_max_num_seqs():
    assert cuda_graph_sizes.capture_sizes(None, 256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert cuda_graph_sizes.capture_sizes(None, 48) == (1, 2, 4, 8, 16, 32, 48)
    assert cuda_graph_sizes.capture_sizes(None, 1000) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert cuda_graph_sizes.capture_sizes((8, 2, 2), 256) == (2, 8)


@pytest.mark.parametrize("value", ["1,x", "0,4", ""])
def test_cuda_graph_sizes_name_what_is_wrong(value):
    from dsaserve.engine_args import EngineArgs

    with pytest.raises(ValueError, match="cuda_graph_sizes=.* must be"):
        EngineArgs(model="unused", cuda_graph_sizes=value)


def test_replayed_decode_steps_under_tp2_and_dcp2_generate_what_eager_steps_do(interpreter, make_checkpoint,
                                                                               replayed, monkeypatch, tmp_path):
    """Two ranks (TP 2) that also split every context (DCP 2): each rank, the worker process too, captures and replays
    its decode steps (each member writes every row, those whose token the other member holds into the padding block;
    the selection and attention merge across the group inside the replay); greedy tokens equal to the eager CPU
    path's of the same layout, logprobs within float noise, and no replay on either rank read anything back from the
    device."""
    log = tmp_path / "worker_replays.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "worker_site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DSASERVE_TEST_REPLAYED_GRAPHS", str(log))
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    layout = dict(tensor_parallel_size=2, decode_context_parallel_size=2, cuda_graph_sizes="1,2,4")
    llm = engine(path, **layout)
    try:
        graphed = generate(llm, PROMPTS, (8, 4, 8))
        assert replays(llm)[4, 128] >= 2 and replays(llm)[2, 128] >= 2
    finally:
        llm.shutdown()
    worker_lines = log.read_text().splitlines()
    assert len(worker_lines) == sum(replays(llm).values())  # the worker replayed every step rank 0 did
    assert replayed.host_reads == [] and all(line.split() == line.split()[:1] for line in worker_lines)
    monkeypatch.delenv("DSASERVE_TEST_REPLAYED_GRAPHS")
    eager_llm = engine(path, "off", **layout)
    try:
        eager = generate(eager_llm, PROMPTS, (8, 4, 8))
        assert eager_llm.engine.runner.graphs is None
    finally:
        eager_llm.shutdown()
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    diff = max(abs(a[t].logprob - b[t].logprob) for x, y in zip(graphed, eager)
               for a, b, t in zip(x.logprobs, y.logprobs, x.token_ids))
    assert diff < 1e-4, diff
