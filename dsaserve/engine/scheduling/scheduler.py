"""Continuous batching: which sequences run in the next step, and what a step's results do to them.

There are no prefill and decode phases, only a per-step token budget. Running sequences come first,
decodes before those still in their prompt, in admission order; then waiting sequences are admitted
(reusing their longest cached prefix) while budget, sequence slots and blocks last. A prompt longer
than the remaining budget is computed in chunks over several steps. Blocks are allocated as tokens
need them; when none is free, the most recently admitted running sequence is preempted: its blocks
are released and it is recomputed later, producing the same output.

After the step, `update_from_output` advances progress, registers full blocks for prefix caching,
appends the sampled tokens and applies the token-level stops (stop ids after min_tokens, max_tokens,
max_model_len); a finished sequence's blocks are freed in that same step.

With speculative decoding a decoding sequence also sends the drafts of its previous step, to be
verified after its last token; only the accepted ones count as computed (the rejected positions are
simply computed again later, so their stale cache entries are never attended), and blocks are
allocated ahead for the positions the next drafts will be written at.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsaserve.engine.scheduling.kv_cache_manager import KVCacheManager
from dsaserve.engine.scheduling.request import Request, RequestStatus
from dsaserve.engine.scheduling.request_update import RequestUpdate
from dsaserve.engine.scheduling.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from dsaserve.engine.scheduling.state_slots import StateSlots
from dsaserve.engine.scheduling.state_snapshots import StateSnapshots
from dsaserve.engine.speculative.spec_decode_stats import SpecDecodeStats
from dsaserve.engine.workers.runner_output import ModelRunnerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0  # drafts per step (0: no speculative decoding)
    speculate_below_batch_size: int | None = None  # with this many running sequences or more, no drafting
    state_slots: bool = False  # a hybrid model: every running sequence holds a KDA state slot
    state_snapshots: int = 0  # and with prefix caching, this many snapshots of it at prefix positions
    state_snapshot_interval: int = 512  # tokens between a request's snapshots


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}  # every unfinished sequence
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of admitted requests (a request with n samples counts once)
        self.num_generation_tokens = 0
        self._sent_to_runner: set[str] = set()
        self._finished_ids: list[str] = []  # to tell the runner in the next output
        self.spec_stats = SpecDecodeStats(config.num_speculative_tokens)
        self.state_slots = StateSlots(config.max_num_seqs) if config.state_slots else None
        self.snapshots = (StateSnapshots(config.state_snapshots, config.state_snapshot_interval, kv.block_size)
                          if config.state_slots and config.state_snapshots and kv.enable_prefix_caching else None)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._count_prompt(request)

    def add_computed(self, request: Request, num_computed_tokens: int) -> None:
        """Start a request whose first num_computed_tokens tokens the caller has already written into
        its blocks (synthetic contexts for benchmarks). Allocates its whole length now."""
        if not self.kv.allocate(request, request.num_prompt_tokens + request.max_tokens):
            raise ValueError(f"not enough KV blocks for {request.num_prompt_tokens} tokens; raise kv_cache_memory")
        self.requests[request.request_id] = request
        request.num_computed_tokens = num_computed_tokens
        self._run(request)
        self._count_prompt(request)

    def _count_prompt(self, request: Request) -> None:
        if request.index == 0:
            self.num_prompt_tokens += request.num_prompt_tokens

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
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
            n += self._trim_drafts(request, n, budget - n)
            while not self.kv.allocate(request, request.num_computed_tokens + n + self._lookahead(request, n)):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled[request] = n
                budget -= n
        if not preempted:
            self._admit(scheduled, budget)
        return self._output(scheduled)

    def _admit(self, scheduled: dict[Request, int], budget: int) -> None:
        not_ready = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            sibling = request.waits_for
            if sibling and not (sibling.finished or sibling.prompt_computed):
                not_ready.append(self.waiting.popleft())  # its sibling's prompt blocks are not cached yet
                continue
            prefix = self.kv.cached_prefix(request)
            if prefix and self.config.num_speculative_tokens:
                # The MTP cache entry of a block's last position depends on the token after the block,
                # which this request may not share: recompute the last cached block.
                prefix = prefix[:-1]
            if self.snapshots is not None and prefix:  # usable only up to a kept KDA state
                blocks, request.state_restore = self.snapshots.lookup(request.block_keys, len(prefix))
                prefix = prefix[:blocks]
            cached_tokens = len(prefix) * self.kv.block_size
            request.num_computed_tokens = cached_tokens
            n = self._chunk(request, budget)
            if n == 0 or not self.kv.allocate(request, cached_tokens + n + self._lookahead(request, n), prefix):
                request.num_computed_tokens = 0
                request.state_restore = -1
                break
            request.num_prefix_hit_tokens = cached_tokens
            request.waits_for = None
            self.kv.record_admission(request, cached_tokens)
            self.waiting.popleft()
            self._run(request)
            scheduled[request] = n
            budget -= n
        self.waiting.extendleft(reversed(not_ready))

    def _trim_drafts(self, request: Request, n: int, budget: int) -> int:
        """Keep the drafts that fit the budget and the request's limits (only after its last known token)."""
        if not request.spec_token_ids or request.num_computed_tokens + n != request.num_tokens:
            request.spec_token_ids = []
            return 0
        room = min(budget, request.max_tokens - len(request.output_token_ids) - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        request.spec_token_ids = request.spec_token_ids[: max(room, 0)]
        return len(request.spec_token_ids)

    def _num_drafts(self, request: Request) -> int:
        """Drafts worth making after this step: none for grammar-constrained requests (their matcher
        would have to follow unverified tokens), and none past the request's own limits."""
        if not self.config.num_speculative_tokens or request.params.structured_outputs is not None:
            return 0
        limit = self.config.speculate_below_batch_size
        if limit is not None and len(self.running) >= limit:  # large batches verify for little gain
            return 0
        left = min(request.max_tokens - len(request.output_token_ids), self.config.max_model_len - request.num_tokens)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def _lookahead(self, request: Request, n: int) -> int:
        """Slots beyond this step's tokens that drafting writes to (the drafts after the first)."""
        if request.num_computed_tokens + n - len(request.spec_token_ids) < request.num_tokens:
            return 0  # a prompt chunk short of the end: no drafting
        limit = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        return max(0, min(self._num_drafts(request) - 1, limit - request.num_computed_tokens - n))

    def _chunk(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _run(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if self.state_slots is not None:
            self.state_slots.take(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        if self.state_slots is not None:  # its state is recomputed from the start with its tokens
            self.state_slots.give_back(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _output(self, scheduled: dict[Request, int]) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        restored = {r.state_restore for r in scheduled if r.state_restore >= 0}
        for request, n in scheduled.items():
            start = request.num_computed_tokens
            if request.request_id not in self._sent_to_runner:
                self._sent_to_runner.add(request.request_id)
                seed = None if request.params.seed is None else request.params.seed + request.index
                out.new_requests.append(NewRequestData(
                    request.request_id, request.prompt_token_ids, request.params, request.stop_token_ids, seed,
                    request.want_prompt_logprobs, request.grammar))
            known = n - len(request.spec_token_ids)
            sample = start + known == request.num_tokens
            snapshots = ()
            if self.snapshots is not None:
                keys = self.kv.keys_upto(request, start + known)
                snapshots = self.snapshots.plan(request.request_id, keys, start, start + known, restored)
            out.scheduled.append(ScheduledRequest(
                request.request_id, request.token_ids(start, start + known) + request.spec_token_ids, start,
                list(request.block_table), sample=sample, spec_token_ids=tuple(request.spec_token_ids),
                num_drafts=self._num_drafts(request) if sample else 0, state_slot=request.state_slot,
                state_restore=request.state_restore, state_snapshots=snapshots))
            request.state_restore = -1
        return out

    # ---- after the step --------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = []
        for s in scheduler_output.scheduled:
            request = self.requests[s.request_id]
            sampled = runner_output.sampled_token_ids.get(s.request_id, ())
            num_drafts = len(s.spec_token_ids)
            accepted = max(len(sampled) - 1, 0) if num_drafts else 0
            if num_drafts:
                self.spec_stats.record(num_drafts, accepted)
            request.num_computed_tokens += len(s.token_ids) - num_drafts  # the accepted drafts count below
            request.spec_token_ids = []
            if s.request_id not in runner_output.errors:  # a failed row's other caches (MTP) were not written
                self.kv.cache_computed_blocks(request)
            if self.snapshots is not None:
                self.snapshots.commit(s.request_id, ok=s.request_id not in runner_output.errors)
            update = RequestUpdate(s.request_id, prompt_logprobs=runner_output.prompt_logprobs.get(s.request_id),
                                   num_prefix_hit_tokens=request.num_prefix_hit_tokens,
                                   num_preemptions=request.num_preemptions)
            error = runner_output.errors.get(s.request_id)
            if error is not None:
                update.error = error
                self._finish(request, "error", update)
            else:
                logprobs = runner_output.logprobs.get(s.request_id)
                for i, token in enumerate(sampled):
                    self._append(request, token, update, None if logprobs is None else logprobs[i])
                    if request.finished:
                        break
                if not request.finished:
                    # The accepted drafts are tokens of the sequence now; the rejected ones roll back (their
                    # positions are computed again, with the right tokens).
                    request.num_computed_tokens += accepted
                    self.kv.cache_computed_blocks(request)
                    request.spec_token_ids = list(runner_output.draft_token_ids.get(s.request_id, ()))
            updates.append(update)
        return updates

    def _append(self, request: Request, token: int, update: RequestUpdate, logprob) -> None:
        request.output_token_ids.append(token)
        self.num_generation_tokens += 1
        update.new_token_ids.append(token)
        if logprob is not None:
            update.new_logprobs = (update.new_logprobs or []) + [logprob]
        if len(request.output_token_ids) >= request.params.min_tokens and token in request.stop_token_ids:
            update.stopped_on_token = True
            update.stop_reason = token if token in (request.params.stop_token_ids or ()) else None
            self._finish(request, "stop", update)
        elif len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            self._finish(request, "length", update)

    def _finish(self, request: Request, reason: str, update: RequestUpdate | None = None) -> None:
        request.finish_reason = reason
        if update is not None:
            update.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)  # in the step that finished it
        if self.state_slots is not None:
            self.state_slots.give_back(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        if request.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    def finish_requests(self, request_ids, reason: str) -> None:
        """End these sequences (abort, or a stop string the output processor found); unknown or
        already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)
