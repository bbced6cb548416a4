"""Sampling a batch so that a fault of one request stays that request's.

A row that is non-finite as the model produced it, whose logits edits (grammar, logit_bias, min_tokens,
penalties) raise, that is no longer finite after them (NaN, +inf, or nothing left to pick), or whose
draw raises fails its request alone. A failure inside the batched edits or draw is retried row by row
(the draw from the generator states it started with), so every other request gets exactly the token
it would have got.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve.sampling.logits_processors import process_logits
from dsaserve.sampling.sampler import TopLogprobs, sample, top_logprobs
from dsaserve.sampling.sampling_request import SamplingRequest

NON_FINITE = "the model produced non-finite logits for this request"
EDITED_NON_FINITE = ("this request's logits were not finite after its grammar, logit_bias, min_tokens and penalties "
                     "(nothing left to pick, e.g. a complete grammar whose stop tokens min_tokens masks)")


@dataclass
class SampledRows:
    rows: list[int] = field(default_factory=list)  # rows of the logits that produced a token
    tokens: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # row → why its request fails
    top: list | None = None  # TopLogprobs.host_rows() of `rows`, when logprobs were asked for


def sample_isolated(logits: torch.Tensor, states: list[SamplingRequest], rng: torch.Generator,
                    num_logprobs: int | None = None) -> SampledRows:
    """logits [N, V] fp32, one row per request in `states`; num_logprobs (0 or more) also gives each sampled row's
    logprob, rank and top num_logprobs of the raw distribution (as in vLLM: before edits and temperature).

    The whole batch is edited and drawn at once and read back in one copy (tokens, the checks, the logprobs);
    only when a check fails or an edit or draw raises is the step redone row by row from the generator states
    it started with, so a faulty request costs its batch a slower step, never a different token."""
    generators = [state.generator or rng for state in states]
    random = {id(g): g for g, state in zip(generators, states) if not state.params.greedy}
    saved = {key: g.get_state() for key, g in random.items()}
    together = _sample_together(logits, states, generators, num_logprobs)
    if together is not None:
        return together
    for key, g in random.items():
        g.set_state(saved[key])
    out = _sample_row_by_row(logits, states, rng)
    if num_logprobs is not None and out.rows:
        raw = logits[out.rows]
        out.top = top_logprobs(raw.log_softmax(-1), torch.tensor(out.tokens, device=raw.device),
                               num_logprobs).host_rows()
    return out


def _sample_together(logits: torch.Tensor, states: list[SamplingRequest], generators: list[torch.Generator],
                     num_logprobs: int | None) -> SampledRows | None:
    """Every row edited and drawn in one batch and read back once; None when any row needs sample_isolated's
    careful path (an edit or draw raised, a row not finite before or after its edits)."""
    try:
        edited = process_logits(logits, states)
        tokens = sample(edited, [state.params for state in states], generators)
    except Exception:
        return None
    fields = [tokens[:, None].double(), torch.isfinite(logits.sum(dim=-1))[:, None].double()]
    if edited is not logits:
        fields.append(_usable_rows(edited)[:, None].double())
    if num_logprobs is not None:
        fields.append(top_logprobs(logits.log_softmax(-1), tokens, num_logprobs).packed())
    checks = len(fields) - (num_logprobs is not None)
    host = torch.cat(fields, dim=1).tolist()
    if not all(all(row[1:checks]) for row in host):
        return None
    rows = list(range(len(states)))
    top = TopLogprobs.rows_from([row[checks:] for row in host]) if num_logprobs is not None else None
    return SampledRows(rows, [int(row[0]) for row in host], {}, top)


def _sample_row_by_row(logits: torch.Tensor, states: list[SamplingRequest], rng: torch.Generator) -> SampledRows:
    """Each check read back on its own, so a faulty row fails its request alone."""
    out = SampledRows()
    finite = rows_finite(logits)
    out.errors.update({i: NON_FINITE for i, ok in enumerate(finite) if not ok})
    rows = [i for i, ok in enumerate(finite) if ok]
    if not rows:
        return out
    raw = logits if len(rows) == len(states) else logits[rows]
    edited = _edit(raw, [states[i] for i in rows], rows, out.errors)
    keep = [j for j, i in enumerate(rows) if i not in out.errors]
    if edited is not raw:  # some request edited its logits: they must still be usable
        usable = _usable_rows(edited[keep]).tolist()
        out.errors.update({rows[j]: EDITED_NON_FINITE for j, ok in zip(keep, usable) if not ok})
        keep = [j for j, ok in zip(keep, usable) if ok]
    if keep:
        kept, out.tokens = _draw(edited, [states[rows[j]] for j in keep], keep, rng, out.errors, rows)
        out.rows = [rows[j] for j in kept]
    return out


def rows_finite(logits: torch.Tensor) -> list[bool]:
    """Per row, whether every logit is finite. A row's sum is finite when all of its entries are (a NaN or
    an infinity makes it NaN or infinite), so one pass over the logits settles every row but those whose
    sum overflowed, which get the exact check (isfinite of every logit costs 4× as much at batch 1, 19× at 16)."""
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    for i, ok in enumerate(finite):
        if not ok:
            finite[i] = bool(torch.isfinite(logits[i]).all())
    return finite


def _edit(raw: torch.Tensor, states: list[SamplingRequest], rows: list[int], errors: dict[int, str]) -> torch.Tensor:
    """raw with each request's edits applied (raw itself when nobody edits); requests whose edits raise
    go to errors (their row is left unedited)."""
    try:
        return process_logits(raw, states)
    except Exception:  # find whose: each row's edits are independent of the others
        pass
    edited = raw.clone()
    for j, state in enumerate(states):
        try:
            edited[j] = process_logits(raw[j : j + 1], [state])[0]
        except Exception as e:
            errors[rows[j]] = f"this request's logits edits failed: {type(e).__name__}: {e}"
    return edited


def _usable_rows(edited: torch.Tensor) -> torch.Tensor:
    """Per row: no NaN or +inf, and at least one token left to pick (bool [N], on the logits' device)."""
    return ((~torch.isnan(edited) & (edited != float("inf"))).all(dim=-1)
            & (edited > float("-inf")).any(dim=-1))


def _draw(edited: torch.Tensor, states: list[SamplingRequest], keep: list[int], rng: torch.Generator,
          errors: dict[int, str], rows: list[int]) -> tuple[list[int], list[int]]:
    """Tokens for edited[keep] (states in that order); returns (the positions in keep that drew, tokens)."""
    generators = [state.generator or rng for state in states]
    random = {id(g): g for g, state in zip(generators, states) if not state.params.greedy}
    saved = {key: g.get_state() for key, g in random.items()}
    batch = edited if len(keep) == edited.shape[0] else edited[keep]
    try:
        return keep, sample(batch, [state.params for state in states], generators).tolist()
    except Exception:
        for key, g in random.items():
            g.set_state(saved[key])
    drew, tokens = [], []
    for j, state, g in zip(keep, states, generators):
        try:
            tokens.append(sample(edited[j : j + 1], [state.params], [g]).item())
            drew.append(j)
        except Exception as e:
            errors[rows[j]] = f"sampling failed for this request: {type(e).__name__}: {e}"
    return drew, tokens
