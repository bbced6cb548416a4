"""Sampling from logits rows: greedy, temperature, top-k, top-p, min-p, per-request seeds; log-probabilities.

Random rows use the exponential race (argmax of p / Exp(1)), drawing noise from the request's own
generator when it has a seed, so a seeded request samples the same tokens whatever else is in the batch.
Log-probabilities are those of the raw model distribution (before temperature and filtering), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.sampling_params import SamplingParams


@dataclass
class TopLogprobs:
    """For each row: the chosen token's log-prob and rank, and the n most likely tokens."""

    chosen_logprob: torch.Tensor  # [N]
    chosen_rank: torch.Tensor  # [N], 1 = most likely
    top_ids: torch.Tensor  # [N, n]
    top_logprobs: torch.Tensor  # [N, n]

    def packed(self) -> torch.Tensor:
        """[N, 2 + 2n] fp64, a row's fields side by side (fp64 holds each exactly), for reading back with other
        results in one copy; rows_from() turns the host copy into host_rows()."""
        return torch.cat([self.chosen_logprob[:, None].double(), self.chosen_rank[:, None].double(),
                          self.top_ids.double(), self.top_logprobs.double()], dim=1)

    @staticmethod
    def rows_from(packed: list[list[float]]) -> list[tuple[float, int, list[int], list[float]]]:
        n = (len(packed[0]) - 2) // 2 if packed else 0
        return [(row[0], int(row[1]), [int(t) for t in row[2:2 + n]], row[2 + n:]) for row in packed]

    def host_rows(self) -> list[tuple[float, int, list[int], list[float]]]:
        """Per row (chosen logprob, rank, top ids, top logprobs) on the host, in one read back."""
        return self.rows_from(self.packed().tolist())


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: int) -> TopLogprobs:
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
    rank = (logprobs > chosen_lp[:, None]).sum(-1) + 1
    values, ids = logprobs.topk(n, dim=-1) if n > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    return TopLogprobs(chosen_lp, rank, ids, values)


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, per row. Returns filtered logits (-inf where removed)."""
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # capped: a huge top_k is "all"
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove = ranks >= torch.tensor(top_k, device=logits.device)[:, None]
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        remove |= before >= torch.tensor(top_p, dtype=probs.dtype, device=logits.device)[:, None]
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(m > 0 for m in min_p):
        probs = logits.softmax(-1)
        threshold = (torch.tensor(min_p, dtype=probs.dtype, device=logits.device)[:, None]
                     * probs.max(-1, keepdim=True).values)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [N, V] fp32 → token ids [N] int64."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    probs = apply_filters(logits[index], [params[i] for i in rows]).softmax(-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens
