"""StructuredOutputsParams: what the output must match, shaped like vLLM's `structured_outputs` request field."""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar; compiling is per-request CPU work
MAX_CHOICES = 256
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class ReasoningMarkers:
    """Where the constraint starts when the model reasons first: after the reasoning, never inside it."""

    end_token_id: int  # `</think>`: the constraint starts after the output's first one
    start_token_id: int | None = None  # `<think>`: the first output token may open reasoning instead
    in_reasoning: bool = False  # the prompt itself opened the reasoning


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool = False  # any JSON object
    reasoning: ReasoningMarkers | None = None  # None: constrain from the first output token

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False)  # canonical text: the cache key
        if self.choice is not None:
            if not (isinstance(self.choice, list) and 0 < len(self.choice) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{kind} must be a string")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{kind} has {len(value)} characters; "
                                 f"give at most {MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by (the reasoning markers do not change the grammar)."""
        value = getattr(self, self.kind)
        return self.kind, json.dumps(value) if isinstance(value, (list, bool)) else value
