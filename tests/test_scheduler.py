"""The scheduler and update_from_output on their own: no model, a runner that samples a fixed token.

Each test names the rule it guards: the token budget and chunking, decodes before prefills, preempting
the newest, prefix hits, n samples sharing prompt blocks, each token-level stop, aborts in every state.
"""

import pytest

from dsaserve.engine.admission import EngineRequest
from dsaserve.engine.scheduling.kv_cache_manager import KVCacheManager
from dsaserve.engine.scheduling.request import RequestStatus, samples_of
from dsaserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from dsaserve.engine.workers.runner_output import ModelRunnerOutput
from dsaserve.sampling_params import SamplingParams

BLOCK = 4
EOS = 0


def make_scheduler(num_blocks=64, budget=64, max_model_len=256, max_num_seqs=16, prefix_caching=True):
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    return Scheduler(SchedulerConfig(max_model_len, max_num_seqs, budget), kv)


def add(scheduler, request_id, prompt, max_tokens=8, **params):
    params.setdefault("temperature", 0)
    sequences = samples_of(EngineRequest(request_id, None, list(prompt), SamplingParams(**params), max_tokens), [EOS])
    for sequence in sequences:
        scheduler.add_request(sequence)
    return sequences


def step(scheduler, token=7):
    """One step with a runner that samples `token` (or token[request_id]) for every request that samples."""
    out = scheduler.schedule()
    sampled = {s.request_id: [token[s.request_id] if isinstance(token, dict) else token]
               for s in out.scheduled if s.sample}
    updates = scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out, {u.request_id: u for u in updates}


def scheduled(out):
    return [(s.request_id, len(s.token_ids)) for s in out.scheduled]


def all_free(scheduler):
    return scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


# ---- token budget, chunking, order -----------------------------------------------------------------


def test_a_prompt_longer_than_the_budget_runs_in_chunks():
    s = make_scheduler(budget=10)
    (r,) = add(s, "a", range(100, 125))
    assert [scheduled(step(s)[0]) for _ in range(3)] == [[("a", 10)], [("a", 10)], [("a", 5)]]
    assert r.num_computed_tokens == 25 and r.output_token_ids == [7]


def test_chunk_positions_follow_the_computed_tokens():
    s = make_scheduler(budget=10)
    add(s, "a", range(100, 125))
    first, _ = step(s)
    second, _ = step(s)
    assert first.scheduled[0].num_computed_tokens == 0 and not first.scheduled[0].sample
    assert second.scheduled[0].num_computed_tokens == 10 and second.scheduled[0].token_ids == list(range(110, 120))


def test_the_budget_is_shared_and_never_exceeded():
    s = make_scheduler(budget=12)
    add(s, "a", range(100, 108))
    add(s, "b", range(200, 210))
    out, _ = step(s)
    assert scheduled(out) == [("a", 8), ("b", 4)] and out.num_scheduled_tokens == 12


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = Scheduler(SchedulerConfig(256, 16, 12, enable_chunked_prefill=False), KVCacheManager(64, BLOCK))
    add(s, "a", range(100, 108))
    add(s, "b", range(200, 210))
    assert scheduled(step(s)[0]) == [("a", 8)]  # b (10 tokens) does not fit the 4 left
    assert scheduled(step(s)[0]) == [("a", 1), ("b", 10)]


def test_decodes_come_before_prefills():
    s = make_scheduler(budget=10)
    add(s, "a", range(100, 104))
    step(s)  # a has its prompt computed: now it decodes
    add(s, "b", range(200, 230))
    out, _ = step(s)
    assert scheduled(out) == [("a", 1), ("b", 9)]
    out, _ = step(s)
    assert scheduled(out)[0] == ("a", 1)  # still first, before b's next chunk


def test_decodes_go_first_whatever_the_admission_order():
    s = make_scheduler(budget=10)
    (b,) = add(s, "b", range(200, 203))
    (a,) = add(s, "a", range(100, 130))
    step(s)  # b: whole prompt, now decoding; a: 7 of 30
    s.running[:] = [a, b]  # as if a had been admitted first
    assert scheduled(step(s)[0]) == [("b", 1), ("a", 9)]


def test_max_num_seqs_limits_admission():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(s, str(i), range(100 * (i + 1), 100 * (i + 1) + 5))
    out, _ = step(s)
    assert [r for r, _ in scheduled(out)] == ["0", "1"] and len(s.waiting) == 1


# ---- preemption ----------------------------------------------------------------------------------


def test_block_shortage_preempts_the_newest_running_request():
    s = make_scheduler(num_blocks=4, prefix_caching=False)
    (a,) = add(s, "a", range(100, 108), max_tokens=8)  # 8 tokens: 2 blocks, a third for the 9th
    (b,) = add(s, "b", range(200, 208), max_tokens=8)
    step(s)
    assert a.status == b.status == RequestStatus.RUNNING and s.kv.num_free_blocks == 0
    step(s)  # a and b each need a third block; none is free: b (admitted last) is preempted
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and b.num_preemptions == 1 and s.num_preemptions == 1
    assert a.status == RequestStatus.RUNNING and len(a.block_table) == 3
    assert b.output_token_ids == [7]  # kept: recomputed later as part of its prompt


def test_a_preempted_request_resumes_with_its_outputs_as_prompt():
    s = make_scheduler(num_blocks=4, prefix_caching=False)
    (a,) = add(s, "a", range(100, 108), max_tokens=3)
    (b,) = add(s, "b", range(200, 208), max_tokens=8)
    while a.status != RequestStatus.FINISHED:
        step(s)
    known = list(range(200, 208)) + b.output_token_ids
    out, _ = step(s)
    (resumed,) = [x for x in out.scheduled if x.request_id == "b"]
    assert resumed.num_computed_tokens == 0 and resumed.token_ids == known
    assert "b" not in [n.request_id for n in out.new_requests]  # the runner keeps its state across preemption


# ---- prefix caching --------------------------------------------------------------------------------


@pytest.mark.parametrize("shared, hit", [(8, 8), (10, 8), (7, 4)])  # the shared prefix ends on / inside a block
def test_a_prefix_hit_reuses_whole_blocks_only(shared, hit):
    s = make_scheduler()
    prefix = list(range(100, 100 + shared))
    (a,) = add(s, "a", prefix + [1, 2, 3], max_tokens=1)
    step(s)
    assert a.finished
    (b,) = add(s, "b", prefix + [4, 5, 6], max_tokens=1)
    out, _ = step(s)
    assert b.num_prefix_hit_tokens == hit and out.scheduled[0].num_computed_tokens == hit
    assert out.scheduled[0].token_ids == (prefix + [4, 5, 6])[hit:]


def test_blocks_filled_over_several_steps_are_cached_too():
    """A prompt computed in chunks, and the tokens generated after it, fill blocks across steps; each is
    registered once full (not marked as cached when it was allocated)."""
    s = make_scheduler(budget=3)
    prompt = list(range(100, 110))
    (a,) = add(s, "a", prompt, max_tokens=7, ignore_eos=True)
    while not a.finished:
        step(s)
    (b,) = add(s, "b", prompt + [7] * 6 + [1], max_tokens=1)  # the prompt, then what "a" generated
    step(s)
    assert b.num_prefix_hit_tokens == 16  # all four full blocks: three from the prompt's chunks, one generated


def test_a_request_that_fails_in_its_step_leaves_nothing_in_the_prefix_cache():
    """Its other per-layer caches (the MTP layer's) were not written for that step: no block is offered."""
    s = make_scheduler()
    (a,) = add(s, "a", list(range(100, 112)), max_tokens=4)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(errors={"a": "boom"}))
    assert a.finish_reason == "error" and not s.kv.cached


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = make_scheduler()
    prompt = list(range(100, 108))  # two whole blocks
    add(s, "a", prompt, max_tokens=1)
    step(s)
    (b,) = add(s, "b", prompt, max_tokens=1)
    out, _ = step(s)
    assert b.num_prefix_hit_tokens == 4 and scheduled(out) == [("b", 4)]


# ---- n samples ---------------------------------------------------------------------------------------


def test_n_samples_wait_for_sample_0_then_share_its_prompt_blocks():
    s = make_scheduler()
    samples = add(s, "p", range(100, 110), max_tokens=3, n=3, temperature=1.0)  # 2 full blocks + 2 tokens
    assert [x.request_id for x in samples] == ["p#0", "p#1", "p#2"]
    out, _ = step(s)
    assert scheduled(out) == [("p#0", 10)]
    out, _ = step(s)
    assert scheduled(out) == [("p#0", 1), ("p#1", 2), ("p#2", 2)]  # 8 of 10 prompt tokens from the cache
    shared = samples[0].block_table[:2]
    assert all(x.block_table[:2] == shared for x in samples)
    assert all(s.kv.ref_counts[b] == 3 for b in shared)
    assert len({x.block_table[2] for x in samples}) == 3  # the partial block is each sample's own
    while s.has_unfinished():
        step(s)
    assert all(x.finished for x in samples) and all_free(s)


def test_n_samples_share_prompt_blocks_even_without_prefix_caching():
    s = make_scheduler(prefix_caching=False)
    samples = add(s, "p", range(100, 110), max_tokens=3, n=2, temperature=1.0)
    assert scheduled(step(s)[0]) == [("p#0", 10)]
    assert scheduled(step(s)[0]) == [("p#0", 1), ("p#1", 2)]
    assert samples[1].block_table[:2] == samples[0].block_table[:2]
    (other,) = add(s, "q", range(100, 110), max_tokens=1)  # another client's request: no cache without caching
    step(s)
    assert other.num_prefix_hit_tokens == 0 and s.kv.stats.queried_tokens == 0


def test_prefix_cache_stats_count_a_request_once_not_per_sample():
    s = make_scheduler()
    add(s, "p", range(100, 110), max_tokens=2, n=3, temperature=1.0)
    step(s)
    step(s)
    assert s.kv.stats.queried_tokens == 10 and s.kv.stats.hit_tokens == 0


def test_n_samples_have_their_own_seeds():
    s = make_scheduler()
    add(s, "p", range(100, 110), n=2, seed=40, temperature=1.0)
    seeds = [n.seed for _ in range(2) for n in step(s)[0].new_requests]
    assert seeds == [40, 41]


def test_samples_share_the_stop_ids_and_only_sample_0_wants_prompt_logprobs():
    samples = samples_of(EngineRequest("p", None, [5, 6],
                                       SamplingParams(n=2, stop_token_ids=[9], prompt_logprobs=1), 4), [EOS])
    assert [x.want_prompt_logprobs for x in samples] == [True, False]
    assert all(x.stop_token_ids == {9, EOS} for x in samples)


# ---- token-level stops ---------------------------------------------------------------------------------


def run_with_tokens(tokens, **kwargs):
    s = make_scheduler()
    (r,) = add(s, "a", range(100, 105), **kwargs)
    updates = []
    for token in tokens:
        _, u = step(s, token)
        updates.append(u["a"])
        if r.finished:
            break
    return s, r, updates


def test_eos_stops_and_frees_the_blocks_in_the_same_step():
    s, r, updates = run_with_tokens([7, 7, EOS, 7])
    assert r.output_token_ids == [7, 7, EOS] and r.finish_reason == "stop"
    assert updates[-1].finish_reason == "stop" and updates[-1].stopped_on_token and updates[-1].stop_reason is None
    assert all_free(s) and not s.has_unfinished()


def test_a_stop_token_id_is_the_stop_reason():
    _, r, updates = run_with_tokens([7, 9], stop_token_ids=[9])
    assert r.finish_reason == "stop" and updates[-1].stop_reason == 9


def test_ignore_eos_is_applied_when_the_samples_are_made():
    samples = samples_of(EngineRequest("a", None, [5], SamplingParams(ignore_eos=True, stop_token_ids=[9]), 4), [EOS])
    assert samples[0].stop_token_ids == {9}


def test_min_tokens_holds_back_stop_tokens():
    _, r, _ = run_with_tokens([EOS, EOS, EOS, 7], min_tokens=3)
    assert r.output_token_ids == [EOS, EOS, EOS] and r.finish_reason == "stop"


def test_max_tokens_ends_with_length():
    s, r, updates = run_with_tokens([7] * 10, max_tokens=4)
    assert len(r.output_token_ids) == 4 and r.finish_reason == "length" and updates[-1].finish_reason == "length"
    assert all_free(s)


def test_max_model_len_ends_with_length():
    s = make_scheduler(max_model_len=8)
    (r,) = add(s, "a", range(100, 105), max_tokens=50)
    while not r.finished:
        step(s)
    assert r.num_tokens == 8 and r.finish_reason == "length"


def test_several_committed_tokens_stop_at_the_first_stop():
    s = make_scheduler()
    (r,) = add(s, "a", range(100, 105))
    out = s.schedule()
    (u,) = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [7, EOS, 8]}))
    assert r.output_token_ids == [7, EOS] and u.new_token_ids == [7, EOS] and u.finish_reason == "stop"


def test_a_runner_error_finishes_only_that_request():
    s = make_scheduler()
    (a,) = add(s, "a", range(100, 105))
    (b,) = add(s, "b", range(200, 205))
    out = s.schedule()
    updates = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"b": [7]}, errors={"a": "boom"}))
    assert a.finish_reason == "error" and updates[0].error == "boom" and b.output_token_ids == [7]
    assert not a.block_table and b.status == RequestStatus.RUNNING


def test_finished_requests_are_reported_to_the_runner_once():
    s = make_scheduler()
    add(s, "a", range(100, 105), max_tokens=1)
    add(s, "b", range(200, 205), max_tokens=3)
    step(s)
    assert step(s)[0].finished_request_ids == ["a"]
    assert step(s)[0].finished_request_ids == []


# ---- aborts in every state -------------------------------------------------------------------------------


def test_abort_while_waiting():
    s = make_scheduler(max_num_seqs=1)
    add(s, "a", range(100, 105))
    (b,) = add(s, "b", range(200, 205))
    step(s)
    s.finish_requests(["b"], "abort")
    assert b.finished and b.finish_reason == "abort" and not s.waiting
    assert step(s)[0].finished_request_ids == []  # the runner never saw it


def test_abort_mid_prefill_and_mid_decode():
    s = make_scheduler(budget=6)
    (a,) = add(s, "a", range(100, 120))
    (b,) = add(s, "b", range(200, 203))
    step(s)
    assert a.in_prompt and a.block_table
    s.finish_requests(["a"], "abort")
    told = [step(s)[0].finished_request_ids for _ in range(3)]
    assert told[0] == ["a"] and not b.in_prompt and len(b.output_token_ids) > 1
    s.finish_requests(["b"], "abort")
    assert all_free(s) and not s.has_unfinished()
    assert step(s)[0].finished_request_ids == ["b"]


def test_abort_after_preemption():
    s = make_scheduler(num_blocks=4, prefix_caching=False)
    add(s, "a", range(100, 108))
    (b,) = add(s, "b", range(200, 208))
    step(s)
    step(s)
    assert b.status == RequestStatus.WAITING and b.num_preemptions == 1
    s.finish_requests(["b"], "abort")
    assert not s.waiting and b.finished
    s.finish_requests(["a"], "abort")
    assert all_free(s)


def test_abort_of_a_finished_or_unknown_request_is_a_no_op():
    s = make_scheduler()
    (a,) = add(s, "a", range(100, 105), max_tokens=1)
    step(s)
    s.finish_requests(["a", "nobody"], "abort")
    assert a.finish_reason == "length" and all_free(s)
