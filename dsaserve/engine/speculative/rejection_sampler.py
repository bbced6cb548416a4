"""Verifying drafted tokens against the target model, so the output distribution stays the target's.

Rows j = 0…k of a request hold the target's logits after its last known token and after each of its k
drafts. Row j is edited as the plain sampler would edit it had drafts 1…j been sampled (penalties and
min_tokens see them), then filtered and tempered as usual into p_j. The drafts are the MTP layer's
argmax, a deterministic proposal, so speculative sampling reduces to: accept draft j+1 with probability
p_j(draft); on the first rejection draw from p_j with the draft removed (renormalized); after k
acceptances draw a bonus token from p_k. Greedy requests accept exactly when the draft is the argmax.
"""

from __future__ import annotations

import dataclasses

import torch

from dsaserve.engine.workers.runner_state import RunnerRequest
from dsaserve.sampling.isolated_sampling import NON_FINITE, rows_finite
from dsaserve.sampling.logits_processors import process_logits
from dsaserve.sampling.sampler import apply_filters


def plain_greedy(state: RunnerRequest) -> bool:
    """Whether a request's verification is argmax alone, whatever it commits: greedy, and no edit of its logits now
    or after more tokens (no bias, penalties or grammar; min_tokens already reached)."""
    params = state.params
    return (params.greedy and not params.logit_bias and not params.has_penalties and state.grammar is None
            and len(state.output_token_ids) >= params.min_tokens)


def verify_greedy(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int] | None]:
    """verify_drafts for plain_greedy requests, all in one read back: logits holds each request's k + 1 rows in
    turn (fp32 [Σ (k + 1), V]); per request, the committed tokens (None: its rows are not finite)."""
    argmax, finite = torch.stack([logits.argmax(-1), torch.isfinite(logits.sum(-1)).long()]).tolist()
    committed: list[list[int] | None] = []
    start = 0
    for request_drafts in drafts:
        end = start + len(request_drafts) + 1
        if not all(finite[start:end]) and not bool(torch.isfinite(logits[start:end]).all()):  # (a sum's overflow)
            committed.append(None)
        else:
            tokens = []
            for draft, token in zip(request_drafts + [None], argmax[start:end]):
                tokens.append(token)
                if token != draft:
                    break
            committed.append(tokens)
        start = end
    return committed


def verify_drafts(logits: torch.Tensor, drafts: list[int], state: RunnerRequest, rng: torch.Generator) -> list[int]:
    """logits [k + 1, V] fp32 → the committed tokens: the accepted drafts, then one token of the target's."""
    if not all(rows_finite(logits)):
        raise ValueError(NON_FINITE)
    generator = state.generator or rng
    committed: list[int] = []
    for j in range(len(drafts) + 1):
        view = dataclasses.replace(state, output_token_ids=state.output_token_ids + committed)
        row = process_logits(logits[j : j + 1], [view])
        draft = drafts[j] if j < len(drafts) else None
        if state.params.greedy:
            token = int(row.argmax())
        else:
            probs = apply_filters(row, [state.params]).softmax(-1)[0]
            if (draft is not None
                    and float(torch.rand((), generator=generator, device=probs.device)) < float(probs[draft])):
                token = draft
            else:
                token = _draw(probs, draft, generator)
        committed.append(token)
        if token != draft:
            break
    return committed


def _draw(probs: torch.Tensor, exclude: int | None, generator: torch.Generator) -> int:
    """A token from probs (without `exclude`), by the exponential race the sampler uses."""
    if exclude is not None:
        probs = probs.clone()
        probs[exclude] = 0
    if not bool((probs > 0).any()):
        raise ValueError("nothing left to sample after rejecting the draft")
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
