"""A sequence as the engine schedules it: tokens, cache blocks, progress, and what it has produced.

A client request with `n` parallel samples becomes `n` sequences sharing one request id; sample 0
prefills the prompt and the others fork from it (sharing its full blocks) when it first samples.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.outputs import PositionLogprobs
from dsaserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int  # resolved against max_model_len
    detokenizer: IncrementalDetokenizer
    index: int = 0  # which of the request's n samples this is
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks
    num_cached_blocks: int = 0  # leading blocks of block_table already registered in the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    first_token_time: float | None = None
    # What the last output already reported, so outputs carry only what is new.
    num_reported_tokens: int = 0
    num_reported_logprobs: int = 0
    finish_reported: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prompt(self) -> bool:
        """Still computing tokens it already knows (prompt, or prompt + outputs after a preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < p else []) + self.output_token_ids[max(start - p, 0) : end - p]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
