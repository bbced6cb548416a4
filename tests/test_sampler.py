"""The sampler's filters and randomness, on hand-made logits."""

import pytest
import torch

from dsaserve.sampling.sampler import apply_filters, sample, top_logprobs
from dsaserve.sampling_params import SamplingParams

PROBS = [0.5, 0.25, 0.15, 0.1]
LOGITS = torch.log(torch.tensor([PROBS]))
DRAWS = 8000  # per distribution, from one seeded generator: the counts are the same every run
SIGMAS = 4  # allowed distance from an expected frequency, in binomial standard deviations


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


def draw(params: SamplingParams) -> torch.Tensor:
    """How often each token came out of DRAWS rows of LOGITS sampled with `params` (counts [V])."""
    gen = torch.Generator().manual_seed(0)
    tokens = sample(LOGITS.repeat(DRAWS, 1), [params] * DRAWS, [gen] * DRAWS)
    return torch.bincount(tokens, minlength=LOGITS.shape[1])


def assert_follows(counts: torch.Tensor, expected: list[float]) -> None:
    """Each token's frequency within SIGMAS binomial standard deviations of its expected probability;
    a token of probability 0 (filtered out) never drawn."""
    n = int(counts.sum())
    for token, (count, p) in enumerate(zip(counts.tolist(), expected)):
        if p == 0:
            assert count == 0, f"token {token} is filtered out but was drawn {count} times in {n}"
            continue
        sd = (p * (1 - p) / n) ** 0.5
        assert abs(count / n - p) <= SIGMAS * sd, (
            f"token {token}: frequency {count / n:.4f}, expected {p:.4f} ± {SIGMAS * sd:.4f}")


def renormalized(probs: list[float]) -> list[float]:
    return [p / sum(probs) for p in probs]


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.5), renormalized([p**2 for p in PROBS])),  # p^(1/T)
    (SamplingParams(temperature=2.0), renormalized([p**0.5 for p in PROBS])),
    (SamplingParams(top_k=2), renormalized([0.5, 0.25, 0, 0])),
    (SamplingParams(top_p=0.6), renormalized([0.5, 0.25, 0, 0])),
    (SamplingParams(top_p=0.9), renormalized([0.5, 0.25, 0.15, 0])),
    (SamplingParams(min_p=0.3), renormalized([0.5, 0.25, 0.15, 0])),  # 0.1 < 0.3 × 0.5
    (SamplingParams(temperature=0.5, min_p=0.2), renormalized([0.25, 0.0625, 0, 0])),  # filters after temperature
    (SamplingParams(top_k=3, top_p=0.6), renormalized([0.5, 0.25, 0, 0])),
], ids=["t1", "t0.5", "t2", "top_k2", "top_p0.6", "top_p0.9", "min_p0.3", "t0.5_min_p0.2", "top_k3_top_p0.6"])
def test_random_rows_follow_the_filtered_distribution(params, expected):
    assert_follows(draw(params), expected)


def test_greedy_rows_take_argmax_among_random_rows():
    n = DRAWS
    greedy_logits = torch.log(torch.tensor([[0.1, 0.2, 0.6, 0.1]]))
    logits = torch.cat([LOGITS, greedy_logits]).repeat(n, 1)  # random and greedy rows interleaved
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0)] * n
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits, params, [gen, None] * n)
    assert (tokens[1::2] == 2).all()
    assert_follows(torch.bincount(tokens[0::2], minlength=4), PROBS)


def test_same_seed_same_tokens_regardless_of_neighbours():
    """A seeded request's tokens over many steps are the same alone and next to another request."""
    params = SamplingParams(temperature=1.0)
    alone_gen, mixed_gen, neighbour_gen = (torch.Generator().manual_seed(s) for s in (7, 7, 99))
    alone, mixed = [], []
    for _ in range(300):
        alone.append(sample(LOGITS.clone(), [params], [alone_gen]).item())
        batch = torch.cat([torch.randn(1, 4), LOGITS])
        mixed.append(sample(batch, [params, params], [neighbour_gen, mixed_gen])[1].item())
    assert alone == mixed
    assert_follows(torch.bincount(torch.tensor(alone), minlength=4), PROBS)  # really random draws


def test_top_logprobs_ranks():
    lp = LOGITS.log_softmax(-1)
    top = top_logprobs(lp, torch.tensor([2]), 2)
    assert top.chosen_rank.tolist() == [3]
    assert top.top_ids.tolist() == [[0, 1]]
