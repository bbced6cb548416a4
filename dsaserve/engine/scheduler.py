"""Which requests run in the next step, and how many of their tokens.

Every step spends a token budget: requests already running come first (one token each once their
prompt is in the cache, otherwise the next prompt chunk), then waiting requests are admitted while
blocks, sequence slots and budget last. Long prompts are split across steps (chunked prefill).

Admission reserves every block a request can ever need (prompt + max_tokens), so a running request
never waits for memory and is never preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsaserve.engine.kv_cache import BlockPool, blocks_needed
from dsaserve.engine.request import Request, RequestStatus


class RequestRejected(ValueError):
    """The request can never run with this engine's limits."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    block_size: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this size could never be scheduled."""
        limit = self.config.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise RequestRejected(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
                f"exceeds max_model_len={limit}; shorten the prompt or lower max_tokens",
            )
        need = blocks_needed(num_prompt_tokens + max_tokens, self.config.block_size)
        if need > self.pool.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"the request needs {need} KV blocks but the whole cache has {self.pool.num_blocks}; "
                "raise kv_cache_memory or lower max_tokens",
            )

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        # Decodes first, then requests still in their prompt, each in admission order.
        for request in sorted(self.running, key=lambda r: r.num_computed_tokens < r.num_prompt_tokens):
            if budget == 0:
                break
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n > 0:
                batch.requests.append(request)
                batch.num_new_tokens.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            need = blocks_needed(request.num_prompt_tokens + request.max_tokens, self.config.block_size)
            if need > self.pool.num_free_blocks:
                break
            self.waiting.popleft()
            request.block_table = self.pool.allocate(need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_table)
        request.block_table = []
        request.status = RequestStatus.FINISHED
