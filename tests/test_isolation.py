"""One request's fault is that request's: poisonous parameters are refused at admission, and a fault in
one row of a step (its logits edits raise, its edited logits are not finite, its draw raises) fails that
request while the others produce exactly the tokens they produce alone (fp32)."""

import pytest
import torch

import dsaserve.sampling.isolated_sampling as isolated_sampling
from dsaserve import LLM, SamplingParams
from dsaserve.sampling_params import SamplingParamsError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=12, ignore_eos=True)
# Markers the injected faults below recognise: otherwise ordinary requests.
RAISES_IN_EDITS = SamplingParams(temperature=0, presence_penalty=1.5, max_tokens=12, ignore_eos=True)
NAN_AFTER_EDITS = SamplingParams(temperature=0, frequency_penalty=1.25, max_tokens=12, ignore_eos=True)
RAISES_IN_DRAW = SamplingParams(temperature=0.8, min_p=0.123, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def path(make_checkpoint):
    return make_checkpoint("parity_mixed_FFSS", seed=0)


def make_llm(path, **kwargs):
    return LLM(path, dtype="float32", block_size=16, max_model_len=256, progress=False, **kwargs)


def prompt(seed: int, n: int = 20) -> list[int]:
    return torch.randint(30, 600, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, arrivals: dict[int, list]) -> dict:
    results, step = {}, 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, ids, params in arrivals.get(step, []):
            engine.add_request(request_id, ids, params)
        for out in engine.step():
            (results.setdefault(out.request_id, out) if out.request_id not in results
             else results[out.request_id].add(out))
        step += 1
    return results


def inject_faults(monkeypatch):
    edits, draw = isolated_sampling.process_logits, isolated_sampling.sample

    def faulty_edits(logits, states):
        if any(s.params.presence_penalty == 1.5 for s in states):
            raise RuntimeError("an edit that breaks")
        out = edits(logits, states)
        for row, s in enumerate(states):
            if s.params.frequency_penalty == 1.25:
                out[row, 3] = float("nan")
        return out

    def faulty_draw(logits, params, generators):
        tokens = draw(logits, params, generators)  # the batch's generators have moved on when it breaks
        if any(p.min_p == 0.123 for p in params):
            raise RuntimeError("a draw that breaks")
        return tokens

    monkeypatch.setattr(isolated_sampling, "process_logits", faulty_edits)
    monkeypatch.setattr(isolated_sampling, "sample", faulty_draw)


@pytest.mark.parametrize("fields", [
    {"seed": 2**64 - 1, "n": 2},  # row 1: seed + 1 overflows the generator
    {"seed": 2**70},  # row 3
    {"seed": -(2**63) - 1},
    {"repetition_penalty": 1e-300},  # ÷ it overflows
    {"temperature": float("inf")},
    {"logit_bias": {5: float("nan")}},
])
def test_parameters_the_step_cannot_execute_are_refused_naming_the_field(fields):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**fields)
    assert caught.value.param == next(k for k in fields if k != "n")


def test_a_huge_top_k_samples_from_the_whole_vocabulary(path):
    llm = make_llm(path)
    huge = SamplingParams(temperature=0.9, top_k=2**63, seed=3, max_tokens=8, ignore_eos=True)
    none = SamplingParams(temperature=0.9, top_k=0, seed=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[prompt(1), prompt(1)], sampling_params=[huge, none], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_a_temperature_below_1e_5_is_greedy(path):
    llm = make_llm(path)
    tiny = SamplingParams(temperature=1e-45, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[prompt(2), prompt(2)], sampling_params=[tiny, GREEDY], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].finish_reason == "length"


def test_four_streams_finish_exactly_while_faulty_requests_fail_alone(path, monkeypatch):
    streams = {f"s{i}": (prompt(10 + i), SEEDED if i == 0 else GREEDY) for i in range(4)}
    alone = {}
    for rid, (ids, params) in streams.items():
        alone[rid] = make_llm(path).generate(prompt_token_ids=ids, sampling_params=params,
                                             use_tqdm=False)[0].outputs[0].token_ids
    inject_faults(monkeypatch)
    engine = make_llm(path).engine
    poison = [("edits", prompt(20), RAISES_IN_EDITS), ("nan", prompt(21), NAN_AFTER_EDITS),
              ("draw", prompt(22), RAISES_IN_DRAW),
              ("cold", prompt(23), SamplingParams(temperature=1e-45, max_tokens=12, ignore_eos=True))]
    results = run(engine, {0: [(rid, ids, params) for rid, (ids, params) in streams.items()], 3: poison})
    for rid in streams:
        assert results[rid].outputs[0].token_ids == alone[rid], rid
    assert "edits failed" in results["edits"].error and results["edits"].outputs[0].finish_reason == "error"
    assert "not finite" in results["nan"].error and results["nan"].outputs[0].finish_reason == "error"
    assert "sampling failed" in results["draw"].error and results["draw"].outputs[0].finish_reason == "error"
    assert results["cold"].error is None and len(results["cold"].outputs[0].token_ids) == 12
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_n_samples_count_against_max_num_seqs(path):
    engine = make_llm(path, max_num_seqs=4).engine
    engine.add_request("many", prompt(30), SamplingParams(n=16, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True))
    most, outputs = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out if outputs is None else (outputs.add(out) or outputs)
        most = max(most, engine.stats().num_running)
    assert most == 4
    assert outputs.finished and sorted(c.index for c in outputs.outputs) == list(range(16))
    assert all(len(c.token_ids) == 3 for c in outputs.outputs)


def test_rows_with_a_non_finite_logit_are_found_and_an_overflowing_sum_is_not_one():
    logits = torch.randn(5, 300)
    logits[1, 7] = float("nan")
    logits[2, 0] = float("-inf")
    logits[3, :2] = 3e38  # finite entries whose sum overflows: the row is usable
    logits[4, 5], logits[4, 9] = float("inf"), float("-inf")
    assert isolated_sampling.rows_finite(logits) == [True, False, False, True, False]
    assert isolated_sampling.rows_finite(logits[:0]) == []
