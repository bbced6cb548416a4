"""A step's sampling reads the device back once (tokens, the finiteness checks and the logprobs in one copy), and a
faulty row still fails its request alone with every other request's token unchanged; the penalties' counts stay on
the device and grow by the new tokens alone."""

import dataclasses

import pytest
import torch

from dsaserve.engine.workers.runner_state import RunnerRequest
from dsaserve.sampling import isolated_sampling
from dsaserve.sampling.isolated_sampling import sample_isolated
from dsaserve.sampling.logits_processors import process_logits
from dsaserve.sampling_params import SamplingParams
from tests.replayed_graphs import SYNCING, HostReads

VOCAB = 50


def request(seed: int | None = None, output: tuple = (), **params) -> RunnerRequest:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return RunnerRequest(SamplingParams(**params), [1, 2, 3], frozenset({0}), generator, False, list(output))


def mixed_batch() -> list[RunnerRequest]:
    """Greedy, seeded random with filters, penalties with logprobs, a bias: every kind of row a step samples."""
    return [request(temperature=0, logprobs=2),
            request(seed=7, temperature=0.8, top_p=0.9),
            request(seed=8, temperature=1.0, top_k=5, output=(4, 4, 9), frequency_penalty=0.5,
                    repetition_penalty=1.3, logprobs=0),
            request(temperature=0, logit_bias={"11": 30.0}),
            request(temperature=0.7)]  # unseeded: draws from the batch's generator


def logits_for(n: int) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(3)) * 3


class Reads:
    """Counts values read back to the host (tolist, item, bool(), ...) while active."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _m=original: self._read(_m, t, *a))

    def _read(self, method, tensor, *args):
        self.count += 1
        return method(tensor, *args)


def test_a_healthy_step_reads_back_once_and_samples_what_the_careful_path_samples(monkeypatch):
    logits = logits_for(5)
    careful = isolated_sampling._sample_row_by_row(logits, mixed_batch(), torch.Generator().manual_seed(1))
    reads = Reads(monkeypatch)
    out = sample_isolated(logits, mixed_batch(), torch.Generator().manual_seed(1), num_logprobs=2)
    assert reads.count == 1
    monkeypatch.undo()
    assert out.rows == careful.rows == [0, 1, 2, 3, 4] and out.errors == {}
    assert out.tokens == careful.tokens
    assert out.tokens[3] == 11  # the bias was applied
    expected = torch.log_softmax(logits, -1)
    for row, (chosen, rank, ids, values) in enumerate(out.top):
        token = out.tokens[row]
        assert chosen == pytest.approx(float(expected[row, token]), abs=1e-6)
        assert rank == int((expected[row] > expected[row, token]).sum()) + 1
        assert ids == expected[row].topk(2).indices.tolist()
        assert values == pytest.approx(expected[row].topk(2).values.tolist(), abs=1e-6)


@pytest.mark.parametrize("fault", ["nan logit", "edits raise"])
def test_a_faulty_row_fails_alone_and_the_others_draw_what_they_would_have(fault):
    logits = logits_for(6)
    states = mixed_batch()
    if fault == "nan logit":
        logits[2, 5] = float("nan")
        states.insert(2, request(temperature=0))
    else:  # its repetition penalty indexes a prompt token past the logits' vocabulary
        states.insert(2, RunnerRequest(SamplingParams(repetition_penalty=1.2), [VOCAB + 5], frozenset(), None, False))
    out = sample_isolated(logits, states, torch.Generator().manual_seed(1), num_logprobs=2)
    healthy = [0, 1, 3, 4, 5]
    assert list(out.errors) == [2] and out.rows == healthy
    alone = sample_isolated(logits[healthy], mixed_batch(), torch.Generator().manual_seed(1), num_logprobs=2)
    assert out.tokens == alone.tokens  # the seeded and the batch generator restarted from where they were
    assert out.top == alone.top


def test_penalty_counts_grow_by_the_new_tokens_and_a_copy_keeps_its_own():
    state = request(temperature=0, output=(4, 4), frequency_penalty=1.0, presence_penalty=0.5,
                    repetition_penalty=2.0)
    logits = torch.ones(1, VOCAB)
    # 1 - 0.5 presence - 1.0 per time generated, then (now negative) doubled by the repetition penalty
    assert process_logits(logits, [state])[0, 4] == pytest.approx((1 - 0.5 - 2.0) * 2)
    view = dataclasses.replace(state, output_token_ids=state.output_token_ids + [9, 9, 9])  # a draft's view
    assert process_logits(logits, [view])[0, 9] == pytest.approx((1 - 0.5 - 3.0) * 2)
    assert process_logits(logits, [state])[0, 9] == 1  # the view's drafts are not the request's
    state.output_token_ids.append(9)
    edited = process_logits(logits, [state])[0]
    assert edited[9] == pytest.approx((1 - 0.5 - 1.0) * 2) and edited[4] == pytest.approx((1 - 0.5 - 2.0) * 2)
    assert edited[2] == pytest.approx(1 / 2) and edited[5] == 1  # a prompt token: repetition penalty alone
    assert state._counts.counted == 3


def test_penalties_run_no_operator_that_waits_for_the_device():
    state = request(temperature=0, output=(4, 4, 7), frequency_penalty=1.0, repetition_penalty=1.2)
    watch = HostReads()
    with watch:
        process_logits(torch.ones(1, VOCAB), [state])
        state.output_token_ids.append(8)
        process_logits(torch.ones(1, VOCAB), [state])
    waits = [name for name in watch.seen if name != "aten.lift_fresh.default"]  # (copies of new tokens to the device)
    assert not waits, f"operators that read back on a GPU: {waits} (of {sorted(SYNCING)})"
