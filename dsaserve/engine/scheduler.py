"""Continuous batching: which sequences run in the next step, and how many of their tokens.

There are no prefill and decode phases, only a per-step token budget. Running sequences come first,
decodes before those still in their prompt, in admission order; then waiting sequences are admitted
(reusing their longest cached prefix) while budget, sequence slots and blocks last. A prompt longer
than the remaining budget is computed in chunks over several steps. Blocks are allocated as tokens
need them; when none is free, the most recently admitted running sequence is preempted: its blocks
are released and it is recomputed later, producing the same output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsaserve.engine.block_manager import KVCacheManager
from dsaserve.engine.kv_cache import blocks_needed
from dsaserve.engine.request import Request, RequestStatus


class RequestRejected(ValueError):
    """The request can never run with this engine's limits."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this size could never be scheduled."""
        limit = self.config.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise RequestRejected(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
                f"exceeds max_model_len={limit}; shorten the prompt or lower max_tokens",
            )
        need = blocks_needed(num_prompt_tokens + max_tokens, self.kv.block_size)
        if need > self.kv.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"the request needs {need} KV blocks but the whole cache has {self.kv.num_blocks}; "
                "raise kv_cache_memory or lower max_tokens",
            )
        if not self.config.enable_chunked_prefill and num_prompt_tokens + max_tokens > self.config.max_num_batched_tokens:
            raise RequestRejected(
                "prompt",
                f"without chunked prefill a request must fit max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}; enable chunked prefill or raise the budget",
            )

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A forked sample joins right after its parent was admitted; it already holds blocks."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted = False
        for request in sorted(self.running, key=lambda r: r.in_prompt):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            n = self._chunk(request, budget)
            if n == 0:
                continue
            while not self.kv.allocate(request, request.num_computed_tokens + n):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled[request] = n
                budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = self.kv.cached_prefix(request)
            cached_tokens = len(prefix) * self.kv.block_size
            request.num_computed_tokens = cached_tokens
            n = self._chunk(request, budget)
            if n == 0 or not self.kv.allocate(request, cached_tokens + n, prefix):
                request.num_computed_tokens = 0
                break
            request.num_prefix_hit_tokens = cached_tokens
            self.kv.record_admission(request, cached_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = n
            budget -= n
        return ScheduledBatch(list(scheduled), list(scheduled.values()))

    def _chunk(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted sequence's blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
