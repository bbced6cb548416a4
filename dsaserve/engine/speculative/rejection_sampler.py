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
from dataclasses import dataclass

import torch

from dsaserve.engine.workers.runner_state import RunnerRequest
from dsaserve.sampling.isolated_sampling import NON_FINITE, rows_finite
from dsaserve.sampling.logits_processors import process_logits
from dsaserve.sampling.sampler import TopLogprobs, apply_filters, top_logprobs


def plain_greedy(state: RunnerRequest) -> bool:
    """Whether a request's verification is argmax alone, whatever it commits: greedy, and no edit of its logits."""
    return state.params.greedy and unedited(state)


def plain_random(state: RunnerRequest) -> bool:
    """Whether a sampled request's rows are distributions of their own, whatever it commits (no edit of its logits), so
    that every row is verified at once (verify_random)."""
    return not state.params.greedy and unedited(state)


def unedited(state: RunnerRequest) -> bool:
    """No edit of the request's logits now or after more tokens: no bias, penalties or grammar; min_tokens reached."""
    params = state.params
    return (not params.logit_bias and not params.has_penalties and state.grammar is None
            and len(state.output_token_ids) >= params.min_tokens)


@dataclass
class GreedyVerdicts:
    committed: list[list[int] | None]  # per request, its committed tokens (None: its rows are not finite)
    top: list | None  # TopLogprobs.host_rows() of every row, its argmax the chosen token (when logprobs are asked for)


def verify_greedy(logits: torch.Tensor, drafts: list[list[int]], num_logprobs: int | None = None) -> GreedyVerdicts:
    """verify_drafts for plain_greedy requests, all in one read back: logits holds each request's k + 1 rows in
    turn (fp32 [Σ (k + 1), V]). A row's committed token is its argmax, so its logprobs (of the raw distribution, top
    num_logprobs) travel in the same read."""
    argmax = logits.argmax(-1)
    fields = [argmax[:, None].double(), torch.isfinite(logits.sum(-1))[:, None].double()]
    if num_logprobs is not None:
        fields.append(top_logprobs(logits.log_softmax(-1), argmax, num_logprobs).packed())
    host = torch.cat(fields, dim=1).tolist()
    committed = _by_request(host, drafts, logits, 1, _commit_greedy, None)
    top = TopLogprobs.rows_from([row[2:] for row in host]) if num_logprobs is not None else None
    return GreedyVerdicts(committed, top)


def verify_random(logits: torch.Tensor, drafts: list[list[int]], states: list[RunnerRequest],
                  rng: torch.Generator) -> list[list[int] | str]:
    """verify_drafts for plain_random requests, all in one read back: logits holds each request's k + 1 rows in turn
    (fp32 [Σ (k + 1), V]). Every row's acceptance draw, and the token it would give on a rejection (its distribution
    without its draft; the last row's, the bonus token, without removal), are computed on the device before anything
    is read. Per request: the committed tokens, or why it fails. A request draws k uniforms, then k + 1 rows of
    exponential noise, from its own generator (else the batch's), in request order."""
    device = logits.device
    params = [state.params for state, request_drafts in zip(states, drafts) for _ in range(len(request_drafts) + 1)]
    probs = apply_filters(logits, params).softmax(-1)
    draft_ids = torch.tensor([t for request_drafts in drafts for t in request_drafts + [-1]], device=device)
    has_draft = draft_ids >= 0
    column = draft_ids.clamp(min=0)[:, None]
    uniforms, noise = [], []
    for state, request_drafts in zip(states, drafts):
        generator = state.generator or rng
        k = len(request_drafts)
        uniforms += [torch.rand(k, generator=generator, device=device), torch.ones(1, device=device)]
        noise.append(torch.empty(k + 1, probs.shape[1], device=device).exponential_(generator=generator))
    accept = has_draft & (torch.cat(uniforms) < probs.gather(1, column).squeeze(1))
    residual = torch.where(has_draft[:, None], probs.scatter(1, column, 0.0), probs)
    recovered = (residual / torch.cat(noise)).argmax(-1)
    checks = [accept, recovered, (residual > 0).any(-1), torch.isfinite(logits.sum(-1))]
    host = torch.stack([c.long() for c in checks], dim=1).tolist()
    return _by_request(host, drafts, logits, 3, _commit_random, NON_FINITE)


def _by_request(host: list[list], drafts: list[list[int]], logits: torch.Tensor, finite: int, commit, failed) -> list:
    """Per request (its k + 1 rows in turn): `failed` where a row is not finite (the host rows' column `finite`, a row
    sum's; a sum that overflowed is checked exactly), else commit(its drafts, its host rows)."""
    out, start = [], 0
    for request_drafts in drafts:
        end = start + len(request_drafts) + 1
        rows = host[start:end]
        if not all(row[finite] for row in rows) and not bool(torch.isfinite(logits[start:end]).all()):
            out.append(failed)
        else:
            out.append(commit(request_drafts, rows))
        start = end
    return out


def _commit_greedy(drafts: list[int], rows: list[list[float]]) -> list[int]:
    """The drafts while each is its row's argmax (column 0), then the first row's argmax that differs (or the bonus)."""
    tokens = []
    for draft, row in zip(drafts + [None], rows):
        tokens.append(int(row[0]))
        if tokens[-1] != draft:
            break
    return tokens


def _commit_random(drafts: list[int], rows: list[list[int]]) -> list[int] | str:
    """The accepted drafts, then the first rejecting row's token (or the bonus row's after k acceptances)."""
    committed = []
    for j, (accepted, token, left, _) in enumerate(rows):
        if j < len(drafts) and accepted:
            committed.append(drafts[j])
            continue
        if not left:
            return "nothing left to sample after rejecting the draft"
        return committed + [token]
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
