"""Outputs shaped like vLLM's RequestOutput / CompletionOutput, so vLLM users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


# Per position: token id → Logprob (the chosen token plus the top-n).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request. From the engine's step(): only what is new since the last output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop_token_ids entry or stop string that ended it, if any

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None  # set when a sample ended with finish_reason "error"
    metrics: dict = field(default_factory=dict)

    def add(self, delta: "RequestOutput") -> None:
        """Fold a later incremental output of the same request into this one."""
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            mine = by_index.get(new.index)
            if mine is None:
                self.outputs.append(new)
                continue
            mine.text += new.text
            mine.token_ids = mine.token_ids + new.token_ids
            if new.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + new.logprobs
            mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.prompt_logprobs = delta.prompt_logprobs
        self.error = delta.error
        self.metrics = delta.metrics
