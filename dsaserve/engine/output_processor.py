"""From the scheduler's per-sequence updates to RequestOutputs: text, stop strings, logprob dicts.

It owns everything about a request the model does not need: the prompt text, each sample's incremental
detokenizer, its logprob dicts and what was already reported, and how samples group under their parent
id. A stop string that appears in the text ends that sample; `process` returns those ids so the engine
finishes them in the scheduler within the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dsaserve.engine.admission import EngineRequest
from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.scheduling.request_update import RequestUpdate
from dsaserve.engine.workers.runner_output import TokenLogprobs
from dsaserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from dsaserve.tokenizer import Tokenizer


@dataclass(eq=False)
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    num_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # since the last output
    num_reported_logprobs: int = 0
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    finish_reported: bool = False
    num_preemptions: int = 0


@dataclass(eq=False)
class ParentState:
    request: EngineRequest
    sequence_ids: list[str]
    samples: list[SampleState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    arrival_time: float
    first_token_time: float | None = None
    num_prefix_hit_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.samples: dict[str, tuple[ParentState, SampleState]] = {}  # sequence id → its parent and sample

    def add(self, request: EngineRequest, sequence_ids: list[str]) -> None:
        params = request.params
        samples = [
            SampleState(index, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                      params.skip_special_tokens, params.stop,
                                                      params.include_stop_str_in_output),
                        [] if params.logprobs is not None else None)
            for index in range(len(sequence_ids))
        ]
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        parent = ParentState(request, sequence_ids, samples, prompt_logprobs, time.monotonic())
        self.parents[request.request_id] = parent
        for sequence_id, sample in zip(sequence_ids, samples):
            self.samples[sequence_id] = (parent, sample)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished sequence ids for the scheduler to end."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        unfinished = self.unfinished(request_id)
        del self.parents[request_id]
        for sequence_id in parent.sequence_ids:
            del self.samples[sequence_id]
        return unfinished

    def parent_id(self, sequence_id: str) -> str | None:
        entry = self.samples.get(sequence_id)
        return entry[0].request.request_id if entry else None

    def unfinished(self, request_id: str) -> list[str]:
        parent = self.parents[request_id]
        return [sid for sid, s in zip(parent.sequence_ids, parent.samples) if s.finish_reason is None]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of every request that progressed, and the sequences a stop string ended."""
        touched: dict[str, ParentState] = {}
        stopped = []
        now = time.monotonic()
        for update in updates:
            parent, sample = self.samples[update.request_id]
            touched[parent.request.request_id] = parent
            if update.prompt_logprobs:
                parent.prompt_logprobs.extend(self._logprob_dict(e) for e in update.prompt_logprobs)
            if sample.index == 0:
                parent.num_prefix_hit_tokens = update.num_prefix_hit_tokens
            sample.num_preemptions = update.num_preemptions
            if update.new_token_ids and parent.first_token_time is None and sample.index == 0:
                parent.first_token_time = now
            if self._add_tokens(parent, sample, update):
                stopped.append(update.request_id)
        outputs = [self._output(parent) for parent in touched.values()]
        return outputs, stopped

    def _add_tokens(self, parent: ParentState, sample: SampleState, update: RequestUpdate) -> bool:
        """Detokenize the new tokens; True when a stop string ended the sample."""
        params = parent.request.params
        last = len(update.new_token_ids) - 1
        for i, token in enumerate(update.new_token_ids):
            sample.num_tokens += 1
            sample.new_token_ids.append(token)
            if update.new_logprobs is not None and sample.logprobs is not None:
                entry = update.new_logprobs[i]
                sample.cumulative_logprob += entry.logprob
                sample.logprobs.append(self._logprob_dict(entry))
            if i == last and update.stopped_on_token:
                if params.include_stop_str_in_output:
                    sample.detokenizer.add(token)  # otherwise the stop token's text stays out, as in vLLM
                break
            grown = sample.detokenizer.add(token)
            if sample.num_tokens >= params.min_tokens and (stop := sample.detokenizer.find_stop(grown)) is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                return update.finish_reason is None  # already ended by length in the scheduler otherwise
        if update.finish_reason is not None:
            sample.finish_reason, sample.stop_reason, sample.error = (update.finish_reason, update.stop_reason,
                                                                      update.error)
            sample.detokenizer.flush()
        return False

    def _logprob_dict(self, entry: TokenLogprobs) -> PositionLogprobs:
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, self._piece(entry.token_id))}
        for rank, (tid, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs), 1):
            out.setdefault(tid, Logprob(lp, rank, self._piece(tid)))
        return out

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _output(self, parent: ParentState) -> RequestOutput:
        completions = []
        for sample in parent.samples:
            finished = sample.finish_reason is not None
            text = sample.detokenizer.delta(finished)
            if not sample.new_token_ids and not text and not (finished and not sample.finish_reported):
                continue
            new_logprobs = None
            if sample.logprobs is not None:
                new_logprobs = sample.logprobs[sample.num_reported_logprobs :]
                sample.num_reported_logprobs = len(sample.logprobs)
            completions.append(CompletionOutput(
                index=sample.index, text=text, token_ids=sample.new_token_ids,
                cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
                logprobs=new_logprobs, finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
            ))
            sample.new_token_ids = []
            sample.finish_reported = finished
        request = parent.request
        finished = parent.finished
        if finished:
            self.abort(request.request_id)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=completions, finished=finished, prompt_logprobs=parent.prompt_logprobs,
            error="; ".join(s.error for s in parent.samples if s.error) or None,
            metrics={"arrival_time": parent.arrival_time, "first_token_time": parent.first_token_time,
                     "num_prefix_hit_tokens": parent.num_prefix_hit_tokens,
                     "num_preemptions": sum(s.num_preemptions for s in parent.samples)},
        )
