"""Continuous batching: chunked prefill, late arrivals, preemption, prefix caching, isolation, aborts.

Every scenario checks greedy outputs against each request run alone on a fresh engine, and against
the transformers reference where the scenario is about the attention path.
"""

import itertools

import pytest
import torch
from reference import load_reference, reference_greedy

import dsaserve.engine.scheduling.kv_cache_manager as kv_cache_manager
from dsaserve import LLM, SamplingParams
from dsaserve.attention.metadata import BatchMetadata

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def path(make_checkpoint):
    return make_checkpoint("parity_mixed_FFSS", seed=0)  # index_topk 16, schedule FFSS


@pytest.fixture(scope="module")
def ref(path):
    return load_reference(path)


def make_llm(path, **kwargs) -> LLM:
    args = dict(dtype="float32", block_size=BLOCK, max_model_len=512, progress=False)
    args.update(kwargs)
    return LLM(path, **args)


def tokens(seed: int, n: int, vocab: int = 600) -> list[int]:
    return torch.randint(30, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(path, prompt, params=GREEDY) -> list[int]:
    llm = make_llm(path, enable_prefix_caching=False)
    return llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids


def drive(engine, arrivals: dict[int, list[tuple]]) -> dict:
    """Step the engine; arrivals[step] = [(request_id, prompt, params), …] are added before that step."""
    results, step = {}, 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            if out.request_id in results:
                results[out.request_id].add(out)
            else:
                results[out.request_id] = out
        step += 1
    return results


def test_chunks_smaller_than_topk_and_not_block_aligned(path, ref):
    prompts = [tokens(1, 77), tokens(2, 50), tokens(3, 9)]
    llm = make_llm(path, max_num_batched_tokens=7)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == alone(path, prompt) == reference_greedy(ref, prompt, 12)


def test_requests_arriving_while_others_decode(path, ref):
    engine = make_llm(path, max_num_batched_tokens=40).engine
    prompts = {"a": tokens(4, 70), "b": tokens(5, 33), "c": tokens(6, 81)}
    results = drive(engine, {0: [("a", prompts["a"], GREEDY)], 3: [("b", prompts["b"], GREEDY)],
                             6: [("c", prompts["c"], GREEDY)]})
    for rid, prompt in prompts.items():
        assert results[rid].outputs[0].token_ids == alone(path, prompt)
    assert results["c"].outputs[0].token_ids == reference_greedy(ref, prompts["c"], 12)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_to_identical_output(path, ref, prefix_caching):
    cfg_bytes_per_block = None
    prompts = [tokens(10 + i, 40 + 7 * i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    probe = make_llm(path)
    cfg = probe.engine.config
    cfg_bytes_per_block = BLOCK * 4 * (cfg.num_hidden_layers * cfg.kv_cache_dim
                                       + len(cfg.full_layers) * cfg.index_head_dim)
    # 8 blocks: each request needs 4-6 over its life, three together need 15.
    llm = make_llm(path, kv_cache_memory=8 * cfg_bytes_per_block, enable_prefix_caching=prefix_caching,
                   max_model_len=128)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == alone(path, prompt, params)
    assert outs[2].outputs[0].token_ids == reference_greedy(ref, prompts[2], 24)
    assert llm.engine.stats().num_free_blocks == 8


@pytest.mark.parametrize("shared_len", [64, 70])  # ends on a block boundary / mid-block
def test_prefix_cache_reuses_blocks_and_keeps_outputs(path, ref, shared_len):
    shared = tokens(20, shared_len)
    first, second = shared + tokens(21, 13), shared + tokens(22, 19)
    llm = make_llm(path)
    llm.generate(prompt_token_ids=first, sampling_params=GREEDY, use_tqdm=False)
    out = llm.generate(prompt_token_ids=second, sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.metrics["num_prefix_hit_tokens"] == 64  # 4 full shared blocks
    assert out.outputs[0].token_ids == alone(path, second) == reference_greedy(ref, second, 12)
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def check_prefix_chaining(path, ref):
    """A block whose tokens were cached after a different prefix (here: at another position) must not
    be reused: its keys were computed in a different context."""
    block = tokens(30, 16)
    first, second = tokens(31, 32) + block + tokens(33, 5), block + tokens(34, 40)
    llm = make_llm(path)
    llm.generate(prompt_token_ids=first, sampling_params=GREEDY, use_tqdm=False)
    out = llm.generate(prompt_token_ids=second, sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(ref, second, 12)
    assert out.metrics["num_prefix_hit_tokens"] == 0


def test_prefix_hashes_chain_through_the_parent(path, ref):
    check_prefix_chaining(path, ref)


def test_prefix_check_fails_without_chaining(path, ref, monkeypatch):
    unchained = kv_cache_manager.block_key
    monkeypatch.setattr(kv_cache_manager, "block_key", lambda parent, tokens: unchained(b"", tokens))
    with pytest.raises(AssertionError):
        check_prefix_chaining(path, ref)


def test_request_order_does_not_change_outputs(path):
    prompts = [tokens(40, 30), tokens(41, 66), tokens(42, 18)]
    expected = [alone(path, p) for p in prompts]
    llm = make_llm(path, max_num_batched_tokens=50)
    for order in itertools.permutations(range(3)):
        outs = llm.generate(prompt_token_ids=[prompts[i] for i in order], sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [expected[i] for i in order]


# ---- isolation ------------------------------------------------------------------------------------


def check_isolation_canary(path):
    """Fill the whole cache with NaN, run a batch: no request may read a slot it did not write
    (a NaN would poison its output), and no block outside the requests' tables may be written."""
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=23)
    cache = llm.engine.kv_cache
    for t in cache.tensors():
        t.fill_(float("nan"))
    prompts = [tokens(50, 45), tokens(51, 20), tokens(52, 60)]
    engine = llm.engine
    results = drive(engine, {0: [(str(i), p, GREEDY) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        assert results[str(i)].outputs[0].token_ids == alone(path, prompt)
    # Each request wrote its prompt and all but its last generated token.
    written = sum(bool(torch.isfinite(cache.latent[0][b]).any()) for b in range(cache.num_blocks))
    assert written == sum(-(-(len(p) + 11) // BLOCK) for p in prompts)


def test_cache_write_canary(path):
    check_isolation_canary(path)


def test_canary_catches_a_broken_slot_mapping(path, monkeypatch):
    original = BatchMetadata.build.__func__

    def shifted(cls, *args, **kwargs):
        meta = original(cls, *args, **kwargs)
        object.__setattr__(meta, "slot_mapping", meta.slot_mapping + BLOCK)  # write into the next block
        return meta

    monkeypatch.setattr(BatchMetadata, "build", classmethod(shifted))
    with pytest.raises(AssertionError):
        check_isolation_canary(path)


def test_corrupting_another_requests_blocks_leaves_this_one_unchanged(path):
    llm = make_llm(path, enable_prefix_caching=False)
    engine = llm.engine
    a, b = tokens(60, 70), tokens(61, 50)
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in results:
                results[out.request_id].add(out)
            else:
                results[out.request_id] = out
        if engine.scheduler.has_request("b"):
            for block in engine.scheduler.requests["b"].block_table:
                for t in engine.kv_cache.tensors():
                    t[block].normal_(0, 100)
    assert results["a"].outputs[0].token_ids == alone(path, a)
    assert results["b"].outputs[0].token_ids != alone(path, b)  # the corruption did reach b


# ---- aborts, errors ---------------------------------------------------------------------------------


def test_abort_mid_prefill_and_mid_decode_frees_every_block(path):
    engine = make_llm(path, max_num_batched_tokens=20).engine
    total = engine.stats().num_blocks
    engine.add_request("long", tokens(70, 90), GREEDY)
    engine.step()
    assert engine.scheduler.requests["long"].in_prompt and engine.stats().num_free_blocks < total
    engine.abort_request("long")
    assert engine.stats().num_free_blocks == total and not engine.has_unfinished_requests()
    engine.add_request("short", tokens(71, 10), GREEDY)
    engine.add_request("other", tokens(72, 12), GREEDY)
    for _ in range(4):
        engine.step()
    short = engine.scheduler.requests["short"]
    assert not short.in_prompt and len(short.output_token_ids) > 1
    engine.abort_request("short")
    drive(engine, {})
    assert engine.stats().num_free_blocks == total


def test_non_finite_logits_fail_only_that_request(path, monkeypatch):
    engine = make_llm(path).engine
    runner, model = engine.runner, engine.runner.model
    execute, compute_logits = runner.execute, model.compute_logits
    bad_row = {}

    def find_bad_row(scheduler_output):  # without prompt logprobs, logits rows are the sampling requests in order
        sampling = [s.request_id for s in scheduler_output.scheduled if s.sample]
        bad_row["row"] = sampling.index("bad") if "bad" in sampling else None
        return execute(scheduler_output)

    def poison(hidden):
        logits = compute_logits(hidden)
        if bad_row["row"] is not None:
            logits[bad_row["row"]] = float("nan")
        return logits

    monkeypatch.setattr(runner, "execute", find_bad_row)
    monkeypatch.setattr(model, "compute_logits", poison)
    results = drive(engine, {0: [("bad", tokens(80, 20), GREEDY), ("good", tokens(81, 20), GREEDY)]})
    assert results["bad"].outputs[0].finish_reason == "error" and "non-finite" in results["bad"].error
    assert results["good"].outputs[0].token_ids == alone(path, tokens(81, 20))
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


# ---- the KV cache manager on its own -----------------------------------------------------------------


def seq(ids):
    from dsaserve.engine.scheduling.request import Request

    return Request("x", list(ids), SamplingParams(), frozenset(), 4)


def computed(kv, request):
    assert kv.allocate(request, request.num_tokens, kv.cached_prefix(request))
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_lru_eviction_keeps_the_most_recently_freed_prefix():
    from dsaserve.engine.scheduling.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, b = seq(range(100, 108)), seq(range(200, 208))
    computed(kv, a)
    kv.free(a)
    computed(kv, b)
    kv.free(b)
    assert kv.num_free_blocks == 6  # cached blocks nobody references still count as free
    c = seq(range(300, 316))  # needs 4 fresh blocks: the 2 never used, then evicts a's (freed first)
    assert kv.allocate(c, 16)
    assert kv.cached_prefix(seq(list(range(100, 108)) + [1])) == []
    assert len(kv.cached_prefix(seq(list(range(200, 208)) + [1]))) == 2
    kv.free(c)
    assert kv.num_free_blocks == 6
    assert not kv.allocate(seq(range(400, 428)), 28)  # 7 blocks > 6: refused, nothing taken
    assert kv.num_free_blocks == 6


def test_stop_string_frees_blocks_in_the_same_step(path):
    llm = make_llm(path)
    engine = llm.engine
    base = llm.generate(prompt_token_ids=tokens(90, 30), sampling_params=GREEDY, use_tqdm=False)[0].outputs[0]
    stop = base.text[len(base.text) // 2 :][:2]
    engine.add_request("s", tokens(90, 30), SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))
    while True:
        outs = engine.step()
        if outs and outs[0].finished:
            break
    assert outs[0].outputs[0].finish_reason == "stop"
    assert engine.stats().num_free_blocks == engine.stats().num_blocks and not engine.has_unfinished_requests()


def test_fully_cached_prompt_still_computes_its_last_token(path):
    """A repeated prompt of whole blocks reuses all but its last block: the last token is recomputed
    for its logits, never written into a shared block."""
    prompt = tokens(95, 64)  # exactly 4 blocks
    engine = make_llm(path).engine
    outputs = []
    for rid in ("first", "again"):
        engine.add_request(rid, prompt, GREEDY)
        result = None
        for _ in range(100):  # bounded: a request that can never be scheduled must fail, not hang
            for out in engine.step():
                result = out if result is None else (result.add(out) or result)
            if not engine.has_unfinished_requests():
                break
        assert result is not None and result.finished
        outputs.append(result)
    assert outputs[1].metrics["num_prefix_hit_tokens"] == 48
    assert outputs[1].outputs[0].token_ids == outputs[0].outputs[0].token_ids


# ---- a context written by the caller (bench longctx's synthetic prefixes) --------------------------------


def test_a_prefilled_context_is_attended_like_a_computed_one(path):
    engine = make_llm(path, enable_prefix_caching=False).engine
    prompt = tokens(96, 40)
    engine.add_request("computed", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # the whole prompt is in the cache now
    blocks = list(engine.scheduler.requests["computed"].block_table)
    saved = [t[blocks].clone() for t in engine.kv_cache.tensors()]
    engine.abort_request("computed")
    for t in engine.kv_cache.tensors():
        t.fill_(float("nan"))  # only what the caller writes may be read

    def copy_saved(cache, table, n):  # positions 0 … n-1, at the new request's slots
        for t, s in zip(cache.tensors(), saved):
            for p in range(n):
                t[table[p // BLOCK], p % BLOCK] = s[p // BLOCK, p % BLOCK]

    request = engine.make_request("prefilled", prompt, GREEDY)
    engine.add_prefilled_request(request, len(prompt) - 1, copy_saved)
    out = drive(engine, {})["prefilled"]
    assert out.outputs[0].token_ids == alone(path, prompt)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_a_prefilled_request_takes_one_sample_and_leaks_nothing(path):
    engine = make_llm(path).engine
    request = engine.make_request("x", tokens(97, 20), SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="one sample"):
        engine.add_prefilled_request(request, 10, lambda *_: None)
    assert not engine.unfinished_request_ids() and not engine.has_unfinished_requests()


def test_a_samples_id_cannot_be_taken_by_another_request(path):
    engine = make_llm(path).engine
    engine.add_request("a", tokens(98, 20), SamplingParams(n=2, temperature=1.0, max_tokens=3))
    for taken in ("a", "a#0", "a#1"):
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(taken, tokens(99, 5), GREEDY)
    assert engine.unfinished_request_ids() == ["a"]
    drive(engine, {})
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_prefilled_requests_are_checked(path):
    request = lambda engine: engine.make_request("x", tokens(97, 20), GREEDY)  # noqa: E731
    cached = make_llm(path).engine
    with pytest.raises(ValueError, match="prefix caching"):
        cached.add_prefilled_request(request(cached), 10, lambda *_: None)
    engine = make_llm(path, enable_prefix_caching=False).engine
    with pytest.raises(ValueError, match="last prompt token"):
        engine.add_prefilled_request(request(engine), 20, lambda *_: None)

    def broken(*_):
        raise RuntimeError("no cache for you")

    with pytest.raises(RuntimeError):
        engine.add_prefilled_request(request(engine), 10, broken)
    assert not engine.has_unfinished_requests() and not engine.unfinished_request_ids()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
