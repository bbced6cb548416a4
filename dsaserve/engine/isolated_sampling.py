"""Sampling a batch so that a fault of one request stays that request's.

A row that is non-finite as the model produced it, whose logits edits (logit_bias, min_tokens,
penalties) raise, that is no longer finite after them (NaN, +inf, or nothing left to pick), or whose
draw raises fails its request alone. A failure inside the batched edits or draw is retried row by row
(the draw from the generator states it started with), so every other request gets exactly the token
it would have got.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve.engine.logits_processors import process_logits
from dsaserve.engine.runner_state import RunnerRequest
from dsaserve.engine.sampler import sample

NON_FINITE = "the model produced non-finite logits for this request"
EDITED_NON_FINITE = "this request's logits were not finite after logit_bias, min_tokens and penalties"


@dataclass
class SampledRows:
    rows: list[int] = field(default_factory=list)  # rows of the logits that produced a token
    tokens: list[int] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # row → why its request fails


def sample_isolated(logits: torch.Tensor, states: list[RunnerRequest], rng: torch.Generator) -> SampledRows:
    """logits [N, V] fp32, one row per request in `states`."""
    out = SampledRows()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out.errors.update({i: NON_FINITE for i, ok in enumerate(finite) if not ok})
    rows = [i for i, ok in enumerate(finite) if ok]
    if rows:
        edited = _edit(logits, states, rows, out.errors)
        rows = [i for i in rows if i not in out.errors]
        usable = _usable(edited[rows]) if rows else []
        out.errors.update({i: EDITED_NON_FINITE for i, ok in zip(rows, usable) if not ok})
        rows = [i for i, ok in zip(rows, usable) if ok]
    if rows:
        out.rows, out.tokens = _draw(edited, states, rows, rng, out.errors)
    return out


def _edit(logits: torch.Tensor, states: list[RunnerRequest], rows: list[int], errors: dict[int, str]) -> torch.Tensor:
    """Edited logits for `rows` (other rows are left as they are); rows whose edits raise go to errors."""
    edited = logits.clone()
    try:
        edited[rows] = process_logits(logits[rows], [states[i] for i in rows])
        return edited
    except Exception:  # find whose: each row's edits are independent of the others
        pass
    for i in rows:
        try:
            edited[i] = process_logits(logits[i : i + 1], [states[i]])[0]
        except Exception as e:
            errors[i] = f"this request's logits edits failed: {type(e).__name__}: {e}"
    return edited


def _usable(edited: torch.Tensor) -> list[bool]:
    """No NaN or +inf, and at least one token left to pick."""
    return ((~torch.isnan(edited) & (edited != float("inf"))).all(dim=-1)
            & (edited > float("-inf")).any(dim=-1)).tolist()


def _draw(edited: torch.Tensor, states: list[RunnerRequest], rows: list[int], rng: torch.Generator,
          errors: dict[int, str]) -> tuple[list[int], list[int]]:
    generators = [states[i].generator or rng for i in rows]
    random = {id(g): g for g, i in zip(generators, rows) if not states[i].params.greedy}
    saved = {key: g.get_state() for key, g in random.items()}
    try:
        tokens = sample(edited[rows], [states[i].params for i in rows], generators).tolist()
        return rows, tokens
    except Exception:
        for key, g in random.items():
            g.set_state(saved[key])
    kept, tokens = [], []
    for i, g in zip(rows, generators):
        try:
            tokens.append(sample(edited[i : i + 1], [states[i].params], [g]).item())
            kept.append(i)
        except Exception as e:
            errors[i] = f"sampling failed for this request: {type(e).__name__}: {e}"
    return kept, tokens
