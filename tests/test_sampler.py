"""The sampler's filters and randomness, on hand-made logits."""

import torch

from dsaserve.engine.sampler import apply_filters, sample, top_logprobs
from dsaserve.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))


def kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(apply_filters(LOGITS.clone(), [params])[0]).nonzero().flatten().tolist()


def test_top_k_keeps_k_most_likely():
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_k=0)) == [0, 1, 2, 3]


def test_top_p_keeps_smallest_set_reaching_p():
    assert kept(SamplingParams(top_p=0.5)) == [0]
    assert kept(SamplingParams(top_p=0.6)) == [0, 1]
    assert kept(SamplingParams(top_p=0.9)) == [0, 1, 2]


def test_min_p_drops_tokens_below_fraction_of_best():
    assert kept(SamplingParams(min_p=0.3)) == [0, 1, 2]  # 0.1 < 0.3 * 0.5


def test_rows_use_their_own_params():
    logits = LOGITS.repeat(2, 1)
    out = apply_filters(logits, [SamplingParams(top_k=1), SamplingParams()])
    assert torch.isfinite(out[0]).sum() == 1 and torch.isfinite(out[1]).sum() == 4


def test_greedy_rows_take_argmax_and_random_rows_follow_the_distribution():
    n = 20000
    logits = LOGITS.repeat(n, 1)
    params = [SamplingParams(temperature=1.0)] * n
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits, params, [gen] * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, LOGITS.exp()[0], atol=0.02)
    assert sample(LOGITS, [SamplingParams(temperature=0)], [None]).tolist() == [0]


def test_same_seed_same_tokens_regardless_of_neighbours():
    params = SamplingParams(temperature=1.0)
    a = sample(LOGITS.clone(), [params], [torch.Generator().manual_seed(7)])
    mixed = torch.cat([torch.randn(1, 4), LOGITS])
    b = sample(mixed, [params, params], [torch.Generator().manual_seed(99), torch.Generator().manual_seed(7)])
    assert a.item() == b[1].item()


def test_top_logprobs_ranks():
    lp = LOGITS.log_softmax(-1)
    top = top_logprobs(lp, torch.tensor([2]), 2)
    assert top.chosen_rank.tolist() == [3]
    assert top.top_ids.tolist() == [[0, 1]]
