"""What the scheduler reports per request after a step, for the output processor to turn into text."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsaserve.engine.workers.runner_output import TokenLogprobs


@dataclass
class RequestUpdate:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop_token_ids entry that ended it
    stopped_on_token: bool = False  # the last new token is a stop token (its text stays out unless asked for)
    error: str | None = None
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
