"""A sequence as the scheduler sees it: tokens, cache blocks, progress, and why it ended.

A client request with `n` parallel samples becomes `n` of these, one per sample, sharing a parent id;
samples 1…n-1 wait until sample 0 has computed the prompt, then find its full blocks in the prefix cache.
Text, logprobs and output assembly live in the output processor; sampling state in the model runner.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dsaserve.engine.admission import EngineRequest
from dsaserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str  # unique per sequence (the parent id when n == 1)
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]  # eos ids unless ignore_eos, plus params.stop_token_ids
    max_tokens: int  # resolved against max_model_len
    index: int = 0  # which of the parent's n samples this is
    want_prompt_logprobs: bool = False
    grammar: object | None = None  # compiled structured-output grammar (shared by the n samples)
    waits_for: Request | None = None  # a sibling whose prompt blocks this one will reuse
    shares_prompt: bool = False  # one of n > 1 samples: its prompt blocks are shared with its siblings
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts from the last step, verified in the next
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of full blocks
    num_cached_blocks: int = 0  # leading blocks of block_table already registered in the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    state_slot: int = -1  # its KDA state slot while running (hybrid models)
    state_restore: int = -1  # the snapshot its state starts from, at admission after a prefix-cache hit

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

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < p else []) + self.output_token_ids[max(start - p, 0) : end - p]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


def samples_of(request: EngineRequest, eos_token_ids) -> list[Request]:
    """One sequence per sample (ids `ID#i` when n > 1); samples 1…n-1 wait for sample 0's prompt blocks."""
    params = request.params
    ids = [request.request_id] if params.n == 1 else [f"{request.request_id}#{i}" for i in range(params.n)]
    stop = frozenset(params.stop_token_ids or ()) | frozenset(() if params.ignore_eos else eos_token_ids)
    sequences = [Request(sid, request.prompt_token_ids, params, stop, request.max_tokens, index=i,
                         want_prompt_logprobs=i == 0 and params.prompt_logprobs is not None, grammar=request.grammar,
                         shares_prompt=params.n > 1)
                 for i, sid in enumerate(ids)]
    for sibling in sequences[1:]:
        sibling.waits_for = sequences[0]
    return sequences
