"""What the scheduler hands the model runner each step: everything the runner needs, nothing it must look up.

The runner holds no scheduler or KV-cache-manager state, so this is the whole contract between them (and
what a multi-process executor would send to every rank). A request's fixed facts (prompt, sampling
parameters, resolved stop ids) travel once, in `new_requests`, the first time it is scheduled; every
step then names the tokens to compute, where its context starts and its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]  # eos ids (unless ignore_eos) and params.stop_token_ids; min_tokens masks them
    seed: int | None  # the request's own sampling seed (params.seed + sample index), None = the engine's generator
    want_prompt_logprobs: bool
    grammar: object | None = None  # compiled structured-output grammar; the runner keeps a matcher per request


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens computed this step, at positions num_computed_tokens …
    num_computed_tokens: int  # tokens already in the cache: the context these attend to
    block_table: list[int]
    sample: bool  # this step reaches the request's last known token: sample the next one
    spec_token_ids: tuple[int, ...] = ()  # drafts to verify: the last len() of token_ids
    num_drafts: int = 0  # tokens to draft after this step (0: none); blocks are allocated for their positions
    state_slot: int = -1  # a hybrid model's KDA state slot (engine/scheduling/state_slots.py); -1: none
    state_restore: int = -1  # fill the state slot from this snapshot first (a prefix-cache hit); -1: none
    state_snapshots: tuple[tuple[int, int], ...] = ()  # (position, snapshot slot): keep the state after `position`


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests that ended since the previous step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    def __len__(self) -> int:
        return len(self.scheduled)
