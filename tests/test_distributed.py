"""Tensor, expert and decode-context parallelism on CPU (gloo), against one rank and against transformers.

Every multi-rank engine here runs rank 0 in the test process (the driver) and the other ranks in worker
processes, so the driver's scheduler can be made to preempt and its rank can be broken on purpose: the
isolation tests break rank 0 only, and the comparison with one rank must then fail.
"""

import collections
import contextlib
import dataclasses

import pytest
import torch
from reference import load_reference, reference_forward, reference_greedy
from test_parity import VARIANTS, prompt

import dsaserve.attention.indexer_selection as indexer_module
from dsaserve import LLM, SamplingParams
from dsaserve.attention.context_shard import ContextShard
from dsaserve.config import ModelConfig
from dsaserve.engine.workers.executor import ExecutorFailure

BASE = dict(dtype="float32", block_size=16, progress=False, max_model_len=256)
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2_ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "tp2_dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
}
CHECKPOINTS = ["mixed_FFSS", "expert_groups", "dense_prefix_2"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def batch(vocab: int) -> list[list[int]]:
    """Lengths past 4 × index_topk and below it, one sharing a 64-token prefix with the first (a prefix
    hit of whole blocks, also of DCP's 32-token blocks)."""
    first = prompt(vocab, 77, seed=21)
    return [first, prompt(vocab, 90, seed=22), first[:64] + prompt(vocab, 9, seed=23), prompt(vocab, 10, seed=24)]


@contextlib.contextmanager
def engine(path, **kwargs):
    llm = LLM(path, **{**BASE, **kwargs})
    try:
        yield llm
    finally:
        llm.shutdown()


def preempt_every(llm, every: int, monkeypatch):
    """Every `every`-th step the newest running sequence is preempted first (recomputed later)."""
    sched = llm.engine.scheduler
    original, steps = sched.schedule, collections.Counter()

    def schedule():
        steps["n"] += 1
        if steps["n"] % every == 0 and len(sched.running) > 1:
            sched._preempt(sched.running[-1])
        return original()

    monkeypatch.setattr(sched, "schedule", schedule)


def run_batch(llm, prompts, monkeypatch=None):
    """(tokens, chosen-token logprobs) per prompt, with 24-token chunks and forced preemption."""
    if monkeypatch is not None:
        preempt_every(llm, 5, monkeypatch)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[position[t].logprob for position, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs]
    return tokens, logprobs


def assert_same(ours, expected):
    tokens, logprobs = ours
    assert tokens == expected[0]
    diff = max(abs(a - b) for mine, theirs in zip(logprobs, expected[1]) for a, b in zip(mine, theirs))
    assert diff < 1e-4, f"chosen-token logprobs differ by {diff:.2e}"


@pytest.fixture(scope="module")
def single_rank(make_checkpoint):
    """Each checkpoint's batch on one rank (the expected result), computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            path = make_checkpoint(f"parity_{name}", seed=0, **VARIANTS[name])
            prompts = batch(ModelConfig.from_pretrained(path).vocab_size)
            with engine(path, max_num_batched_tokens=24) as llm:
                mp = pytest.MonkeyPatch()
                try:
                    result = run_batch(llm, prompts, mp)
                    stats = llm.engine.stats()
                finally:
                    mp.undo()
            assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0
            cache[name] = (path, prompts, result)
        return cache[name]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_parallel_layout_matches_one_rank(single_rank, checkpoint, layout, monkeypatch):
    """Greedy tokens identical, chosen-token logprobs within 1e-4, with chunked prefill, a prefix hit and
    preemption in the batch."""
    path, prompts, expected = single_rank(checkpoint)
    with engine(path, max_num_batched_tokens=24, **LAYOUTS[layout]) as llm:
        ours = run_batch(llm, prompts, monkeypatch)
        stats = llm.engine.stats()
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0
    assert_same(ours, expected)


def test_tp2_dcp2_matches_transformers(make_checkpoint):
    """Against the reference itself: prompt log-probabilities (1e-4) and a greedy continuation."""
    path = make_checkpoint("parity_mixed_FFSS", seed=0)
    ref = load_reference(path)
    ids = prompt(ref.config.vocab_size, 77, seed=1)
    expected = reference_forward(ref, ids).logprobs
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    with engine(path, **LAYOUTS["tp2_dcp2"]) as llm:
        out = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[p + 1][ids[p + 1]].logprob for p in range(len(ids) - 1)])
    theirs = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert out.outputs[0].token_ids == reference_greedy(ref, ids, 16)


def test_dense_backend_under_dcp(single_rank, make_checkpoint):
    """Without the indexer every rank attends to all the tokens it holds."""
    path, prompts, _ = single_rank("mixed_FFSS")
    with engine(path, attention_backend="dense", max_num_batched_tokens=24) as llm:
        expected = run_batch(llm, prompts)
    with engine(path, attention_backend="dense", max_num_batched_tokens=24, **LAYOUTS["tp2_dcp2"]) as llm:
        assert_same(run_batch(llm, prompts), expected)


def test_tp4_dcp2_four_processes(single_rank):
    """Four ranks: heads split four ways, the KV cache in two copies of two shards each."""
    path, prompts, expected = single_rank("mixed_FFSS")
    with engine(path, max_num_batched_tokens=24, tensor_parallel_size=4, decode_context_parallel_size=2) as llm:
        ours = run_batch(llm, prompts)
    assert ours[0] == expected[0]  # no preemption here; the same tokens all the same


def test_speculative_decoding_under_tp2_dcp2(make_checkpoint):
    """The MTP layer is split and sharded like the others: greedy output is what one rank gives without
    speculation, and every step's drafts are one rank's drafts."""
    path = make_checkpoint("tiny-mtp", seed=3, include_mtp=True)
    shared = {"index_share_for_mtp_iteration": True}  # draft step 2 attends to step 1's selection
    prompts = [[5 + (7 * i) % 300 for i in range(n)] for n in (17, 40, 29)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}

    def run(**layout):
        with engine(path, hf_overrides=shared, **layout) as llm:
            drafts, execute = [], llm.engine.executor.execute

            def recording(scheduler_output):
                output = execute(scheduler_output)
                drafts.append(dict(output.draft_token_ids))
                return output

            llm.engine.executor.execute = recording
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs], drafts, llm.engine.stats().spec_decode

    expected, _, _ = run()
    one_rank_tokens, one_rank_drafts, _ = run(speculative_config=spec)
    tokens, drafts, stats = run(speculative_config=spec, **LAYOUTS["tp2_dcp2"])
    assert tokens == one_rank_tokens == expected
    assert drafts == one_rank_drafts and stats.num_accepted_tokens > 0


def test_sampling_seeds_penalties_n_and_grammars_are_the_same_on_every_rank(tiny_checkpoint):
    """Every rank samples (so the MTP layer and the caches see the same tokens everywhere): seeded draws,
    n = 2, penalties and a structured-output grammar (compiled once, sent to the workers) give one rank's
    output."""
    import json

    from dsaserve.structured_output.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=16, n=2),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, presence_penalty=0.5, seed=1),
              SamplingParams(temperature=0.7, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))]
    prompts = ["hello there", "one two three", "give json"]

    def run(**layout):
        with engine(tiny_checkpoint, **layout) as llm:
            return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    assert run(**LAYOUTS["tp2_dcp2"]) == run()


def test_dcp_multiplies_kv_capacity_per_rank(tiny_checkpoint):
    """The same cache memory per rank holds twice the tokens when two ranks share the context."""
    def capacity(**layout):
        with engine(tiny_checkpoint, kv_cache_memory="1MiB", max_model_len=None, **layout) as llm:
            kv = llm.engine.scheduler.kv
            return kv.num_blocks * kv.block_size, llm.engine.kv_cache.nbytes()

    one, one_bytes = capacity()
    two, two_bytes = capacity(**LAYOUTS["tp2_dcp2"])
    assert two == 2 * one and two_bytes == one_bytes


def test_every_rank_runs_the_memory_profiling_step_on_a_cache_of_its_own(tiny_checkpoint):
    """The start-up memory profile on CUDA (engine/workers/memory_profile.py) runs its step on every rank together
    (their layers exchange partial results) and reports each rank's device; the cache the engine serves from is
    not written by it: the same prompts again (read from the prefix cache) give the same tokens."""
    prompts = batch(ModelConfig.from_pretrained(tiny_checkpoint).vocab_size)[:2]  # whole blocks to share
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with engine(tiny_checkpoint, **LAYOUTS["tp2_dcp2"]) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                               use_tqdm=False)]
        profiles = llm.engine.executor.profile_memory(80, 3)
        after = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                              use_tqdm=False)]
        hits = llm.engine.stats().prefix_cache_hit_tokens
    assert [p.step_tokens for p in profiles] == [80, 80]
    assert profiles[0].total == profiles[1].total > 0  # both ranks on this machine
    assert hits > 0 and after == before


# ---- rank isolation: break rank 0 alone, and the comparison with one rank must fail -----------------


def assert_breaks(path, prompts, expected, layout, monkeypatch):
    with engine(path, max_num_batched_tokens=24, **layout) as llm:
        try:
            ours = run_batch(llm, prompts)
        except ExecutorFailure:
            return  # the broken rank crashed the step: failing loudly is also failing
    with pytest.raises(AssertionError):
        assert_same(ours, expected)


def test_local_index_taken_for_a_global_position_is_caught(single_rank, monkeypatch):
    path, prompts, expected = single_rank("mixed_FFSS")
    monkeypatch.setattr(ContextShard, "to_global", lambda self, local: local)  # on rank 0 only
    assert_breaks(path, prompts, expected, LAYOUTS["tp2_dcp2"], monkeypatch)


def test_global_slot_written_where_a_local_one_belongs_is_caught(single_rank, monkeypatch):
    """Rank 0 addresses its cache with the unsharded slot of a position (its global block and offset)."""
    path, prompts, expected = single_rank("mixed_FFSS")

    def global_slots(self, table, positions):
        block = positions // self.tokens_per_block
        ids = table[block] if table.dim() == 1 else table.gather(-1, block)
        return ids * self.block_size + positions % self.block_size

    monkeypatch.setattr(ContextShard, "local_slots", global_slots)
    assert_breaks(path, prompts, expected, LAYOUTS["tp2_dcp2"], monkeypatch)


class TakesRankOnesPart:
    """A DCP communicator whose all_gather still runs (the ranks stay in step) but hands rank 0 the other
    rank's part in every place: rank 0 then selects with rank 1's local top-k."""

    def __init__(self, comm):
        self.comm = comm

    def all_gather(self, x, dim=0):
        every = self.comm.all_gather(x, dim)
        other = every.narrow(dim, x.shape[dim], x.shape[dim])
        return torch.cat([other] * self.comm.size, dim)


def use_rank_ones_topk(monkeypatch):
    original = indexer_module.select_sharded

    def select_sharded(q, weights, key_cache, meta, selection):
        shard = dataclasses.replace(meta.shard, comm=TakesRankOnesPart(meta.shard.comm))
        return original(q, weights, key_cache, dataclasses.replace(meta, shard=shard), selection)

    monkeypatch.setattr(indexer_module, "select_sharded", select_sharded)


def test_a_rank_using_another_ranks_topk_is_caught(single_rank, monkeypatch):
    path, prompts, expected = single_rank("mixed_FFSS")
    use_rank_ones_topk(monkeypatch)
    assert_breaks(path, prompts, expected, LAYOUTS["tp2_dcp2"], monkeypatch)


def test_ranks_compare_their_topk_when_asked(single_rank, monkeypatch):
    """check_ranks: every full layer's top-k is compared across ranks; equal ones pass, and a rank that selects
    differently stops the engine with an error naming the layer."""
    path, prompts, expected = single_rank("mixed_FFSS")
    with engine(path, max_num_batched_tokens=24, check_ranks=True, **LAYOUTS["tp2_dcp2"]) as llm:
        assert run_batch(llm, prompts)[0] == expected[0]
    use_rank_ones_topk(monkeypatch)
    with engine(path, check_ranks=True, **LAYOUTS["tp2_dcp2"]) as llm:
        with pytest.raises(ExecutorFailure, match=r"layer 0 top-k: rank \d and rank\(s\) \[\d\] disagree"):
            llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)


def test_fp8_checkpoint_dequantizes_per_shard(make_checkpoint):
    """FP8 blocks of 128 rows cut mid-block by the split (384 and 96 intermediate rows over two ranks):
    each rank dequantizes its own slice with its blocks' scales, and the result equals one rank's."""
    path = make_checkpoint("fp8-split", seed=0, fp8=True, intermediate_size=384, moe_intermediate_size=96)
    prompts = batch(ModelConfig.from_pretrained(path).vocab_size)[:2]
    with engine(path) as llm:
        expected = run_batch(llm, prompts)
    with engine(path, **LAYOUTS["tp2"]) as llm:
        assert_same(run_batch(llm, prompts), expected)


def test_an_fp8_checkpoint_kept_in_fp8_on_the_triton_path_under_tp2_matches_one_rank(make_checkpoint):
    """FP8 weights as shipped on the Triton path, split over two ranks mid-block: rank 1's down_proj and experts' down
    columns start 64 and 48 columns into a scale block, so its products take their first block's scale from where its
    slice starts. One CPU rank's greedy tokens, logprobs within the CUDA-vs-CPU bound."""
    path = make_checkpoint("fp8-split", seed=0, fp8=True, intermediate_size=384, moe_intermediate_size=96)
    prompts = batch(ModelConfig.from_pretrained(path).vocab_size)[:1]
    # Indexer keys in the model dtype: auto's 8-bit keys are scored with int8-rounded queries on the CPU path alone.
    with engine(path, indexer_cache_dtype="model") as llm:
        expected = run_batch(llm, prompts)
    with engine(path, tensor_parallel_size=2, triton_kernels="on", indexer_cache_dtype="model") as llm:
        tokens, logprobs = run_batch(llm, prompts)
    assert tokens == expected[0]
    assert max(abs(a - b) for mine, theirs in zip(logprobs, expected[1]) for a, b in zip(mine, theirs)) < 1e-3


def test_the_triton_path_under_tp2_with_expert_and_context_parallelism_matches_one_rank(single_rank, monkeypatch):
    """triton_kernels='on' (CPU tensors under Triton's interpreter, conftest.py) on two ranks holding 8 experts each and
    each half of every context (DCP 2: each rank's indexer scores and ranks its own tokens in Triton, and attends to the
    selected ones it holds in Triton; the group merges both): the routed-experts kernels skip the choices held by the
    other rank, and with the Triton selection and sparse attention the batch (chunks, a prefix hit, preemption) gives
    the single CPU rank's greedy tokens, logprobs within the CUDA-vs-CPU bound (torch's operators replace the native
    ones on this path). Two of the batch's prompts, the second sharing the first's prefix (the interpreter's time): a
    request's output does not depend on its batch."""
    path, prompts, expected = single_rank("expert_groups")
    chosen = [0, 2]
    with engine(path, max_num_batched_tokens=24, tensor_parallel_size=2, enable_expert_parallel=True,
                decode_context_parallel_size=2, triton_kernels="on") as llm:
        tokens, logprobs = run_batch(llm, [prompts[i] for i in chosen], monkeypatch)
        stats = llm.engine.stats()
    assert stats.prefix_cache_hit_tokens > 0 and stats.num_preemptions > 0
    assert tokens == [expected[0][i] for i in chosen]
    assert max(abs(a - b) for i, mine in zip(chosen, logprobs) for a, b in zip(mine, expected[1][i])) < 1e-3
