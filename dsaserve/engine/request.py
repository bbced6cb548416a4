"""A request as the engine tracks it: tokens, cache blocks, progress, and what it has produced."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from dsaserve.outputs import PositionLogprobs
from dsaserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int  # resolved against max_model_len
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    generator: torch.Generator | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < p else []) + self.output_token_ids[max(start - p, 0) : end - p]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
