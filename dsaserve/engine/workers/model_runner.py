"""ModelRunner: one step of the model on a SchedulerOutput, sampled into a ModelRunnerOutput.

It owns the batch metadata, the logits processors and the sampler, and knows requests only by id: no
scheduler or KV-cache-manager state, so the same runner can run on every rank of a parallel executor.
With speculative decoding it verifies each request's drafts (engine/speculative/rejection_sampler.py),
commits a list of tokens per request, and drafts the next ones with the MTP layer
(engine/speculative/mtp_drafter.py).
"""

from __future__ import annotations

import torch

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.engine.scheduling.scheduler_output import SchedulerOutput
from dsaserve.engine.speculative.draft_graphs import DraftGraphs
from dsaserve.engine.speculative.mtp_drafter import DraftInput, propose
from dsaserve.engine.speculative.rejection_sampler import (
    plain_greedy,
    plain_random,
    verify_drafts,
    verify_greedy,
    verify_random,
)
from dsaserve.engine.workers.decode_graphs import DecodeGraphs
from dsaserve.engine.workers.kv_cache import KVCache
from dsaserve.engine.workers.runner_output import ModelRunnerOutput, TokenLogprobs
from dsaserve.engine.workers.runner_state import RunnerRequest
from dsaserve.sampling.isolated_sampling import NON_FINITE, sample_isolated
from dsaserve.sampling.sampler import top_logprobs


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, device: torch.device, seed: int = 0, share_draft_index: bool = False,
                 graphs: DecodeGraphs | None = None, draft_graphs: DraftGraphs | None = None):
        self.model = model
        self.graphs = graphs  # decode steps replayed from CUDA graphs (engine/workers/decode_graphs.py)
        self.draft_graphs = draft_graphs  # the drafter's rounds replayed (engine/speculative/draft_graphs.py)
        self.kv_cache = kv_cache
        self.device = device
        self.share_draft_index = share_draft_index  # the config's index_share_for_mtp_iteration
        self.requests: dict[str, RunnerRequest] = {}
        self.rng = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = RunnerRequest.from_new(new, self.device)
        output = ModelRunnerOutput()
        if not scheduler_output.scheduled:
            return output
        logits_rows, sample_ids, sample_rows, prompt_rows, offsets = [], [], [], {}, []
        offset = 0
        for s in scheduler_output.scheduled:
            offsets.append(offset)
            n = len(s.token_ids)
            state = self.requests[s.request_id]
            if state.want_prompt_logprobs:
                # Row at position p predicts prompt token p + 1; positions already returned are skipped
                # (a preempted request recomputes its prompt).
                first = max(s.num_computed_tokens, state.num_prompt_logprobs)
                last = min(s.num_computed_tokens + n, len(state.prompt_token_ids) - 1)
                if last > first:
                    prompt_rows[s.request_id] = (first, range(len(logits_rows), len(logits_rows) + last - first))
                    logits_rows.extend(range(offset + first - s.num_computed_tokens,
                                             offset + last - s.num_computed_tokens))
            if s.sample and state.error:
                output.errors[s.request_id] = state.error
            elif s.sample:  # the last known token's row, then one row per draft
                k = len(s.spec_token_ids)
                sample_ids.append(s.request_id)
                sample_rows.append(list(range(len(logits_rows), len(logits_rows) + k + 1)))
                logits_rows.extend(range(offset + n - 1 - k, offset + n))
            offset += n
        if self.graphs is not None and self.graphs.takes(scheduler_output.scheduled, logits_rows):
            logits, hidden = self.graphs.run(scheduler_output.scheduled)
        else:
            hidden, logits = self._forward(scheduler_output, logits_rows)
        for request_id, (first, rows) in prompt_rows.items():
            output.prompt_logprobs[request_id] = self._prompt_logprobs(self.requests[request_id], first,
                                                                       logits[list(rows)])
        plain = [(r, rows[0]) for r, rows in zip(sample_ids, sample_rows) if len(rows) == 1]
        if plain:
            self._sample([r for r, _ in plain], logits[[row for _, row in plain]], output)
        verifying = [(request_id, rows) for request_id, rows in zip(sample_ids, sample_rows) if len(rows) > 1]
        if verifying:
            self._verify_all(verifying, {s.request_id: s for s in scheduler_output.scheduled}, logits, output)
        if self.model.mtp is not None:
            self._draft(scheduler_output, offsets, hidden, output)
        return output

    def _forward(self, scheduler_output: SchedulerOutput, logits_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of every row, logits of `logits_rows`) of the step, run eagerly."""
        meta = BatchMetadata.build(
            [s.token_ids for s in scheduler_output.scheduled],
            [s.num_computed_tokens for s in scheduler_output.scheduled],
            [s.block_table for s in scheduler_output.scheduled],
            self.kv_cache.block_size, logits_rows, device=self.device, shard=self.kv_cache.shard,
            state_slots=[s.state_slot for s in scheduler_output.scheduled],
            state_restore=[s.state_restore for s in scheduler_output.scheduled],
            state_snapshots=[self._state_snapshots(s) for s in scheduler_output.scheduled],
        )
        hidden = self.model.forward_hidden(meta, self.kv_cache.latent, self.kv_cache.indexer)
        return hidden, self.model.compute_logits(self.model.final_norm(hidden[meta.logits_indices]))

    def _state_snapshots(self, s) -> tuple[tuple[int, int], ...]:
        """The KDA state copies a request's rows take (position, snapshot): the prefix-cache snapshots the scheduler
        planned, and while speculating the state after each draft's row (for a rollback after verification)."""
        k = len(s.spec_token_ids)
        if not k or s.state_slot is None or not self.kv_cache.draft_states:
            return s.state_snapshots
        after_known = s.num_computed_tokens + len(s.token_ids) - k
        drafts = tuple((after_known + j, self.kv_cache.draft_snapshot(s.state_slot, j)) for j in range(k))
        return tuple(sorted(s.state_snapshots + drafts))

    def _roll_back_state(self, s, output: ModelRunnerOutput) -> None:
        """A hybrid model's KDA state ran through every draft: back to the state after the last accepted one."""
        committed = output.sampled_token_ids.get(s.request_id)
        if s.state_slot is None or not self.kv_cache.draft_states or committed is None:
            return
        accepted = len(committed) - 1
        if accepted < len(s.spec_token_ids):
            self.kv_cache.roll_back_state(s.state_slot, accepted)

    def _verify_all(self, verifying: list[tuple[str, list[int]]], by_id: dict, logits: torch.Tensor,
                    output: ModelRunnerOutput) -> None:
        """Each request's drafts verified against its rows of `logits`: the plain greedy ones together and the plain
        random ones together, each group's rows read back once (on a GPU one synchronisation, not one a row or draw);
        requests whose logits are edited one by one (a row's edits depend on the drafts accepted before it)."""
        done = self._verify_greedy([(r, rows) for r, rows in verifying if plain_greedy(self.requests[r])], by_id,
                                   logits, output)
        done |= self._verify_random([(r, rows) for r, rows in verifying if plain_random(self.requests[r])], by_id,
                                    logits, output)
        for request_id, rows in verifying:
            if request_id not in done:
                self._verify(request_id, list(by_id[request_id].spec_token_ids), logits[rows], output)
            self._roll_back_state(by_id[request_id], output)

    def _verify_greedy(self, greedy: list[tuple[str, list[int]]], by_id: dict, logits: torch.Tensor,
                       output: ModelRunnerOutput) -> set[str]:
        if not greedy:
            return set()
        drafts = [list(by_id[request_id].spec_token_ids) for request_id, _ in greedy]
        verdicts = verify_greedy(logits[[row for _, rows in greedy for row in rows]], drafts,
                                 most_logprobs([self.requests[r] for r, _ in greedy]))
        first = 0
        for (request_id, rows), committed in zip(greedy, verdicts.committed):
            if committed is None:
                output.errors[request_id] = f"verifying drafted tokens failed: ValueError: {NON_FINITE}"
            else:
                top = verdicts.top[first:first + len(committed)] if verdicts.top is not None else None
                self._commit(request_id, committed, logits[rows], output, top)
            first += len(rows)
        return {request_id for request_id, _ in greedy}

    def _verify_random(self, random: list[tuple[str, list[int]]], by_id: dict, logits: torch.Tensor,
                       output: ModelRunnerOutput) -> set[str]:
        if not random:
            return set()
        states = [self.requests[request_id] for request_id, _ in random]
        drafts = [list(by_id[request_id].spec_token_ids) for request_id, _ in random]
        try:
            verdicts = verify_random(logits[[row for _, rows in random for row in rows]], drafts, states, self.rng)
        except Exception:  # (e.g. a filter that cannot run) verified one by one, each request's fault its own
            return set()
        for (request_id, rows), verdict in zip(random, verdicts):
            if isinstance(verdict, str):
                output.errors[request_id] = f"verifying drafted tokens failed: ValueError: {verdict}"
            else:
                self._commit(request_id, verdict, logits[rows], output)
        return {request_id for request_id, _ in random}

    def _verify(self, request_id: str, drafts: list[int], logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        try:
            committed = verify_drafts(logits, drafts, self.requests[request_id], self.rng)
        except Exception as e:  # this request's fault stays its own
            output.errors[request_id] = f"verifying drafted tokens failed: {type(e).__name__}: {e}"
            return
        self._commit(request_id, committed, logits, output)

    def _commit(self, request_id: str, committed: list[int], logits: torch.Tensor, output: ModelRunnerOutput,
                host: list | None = None) -> None:
        """A verified request's tokens (the accepted drafts and the target's), with their logprobs where asked (`host`:
        TopLogprobs.host_rows() of its committed rows when verification read them back already)."""
        state = self.requests[request_id]
        state.output_token_ids.extend(committed)
        output.sampled_token_ids[request_id] = committed
        if state.params.logprobs is not None:  # the target's, as without speculation
            if host is None:
                rows = logits[: len(committed)]
                host = top_logprobs(rows.log_softmax(-1), torch.tensor(committed, device=rows.device),
                                    state.params.logprobs).host_rows()
            output.logprobs[request_id] = [position_logprobs(host, j, t, state.params.logprobs)
                                           for j, t in enumerate(committed)]

    def _draft(self, scheduler_output: SchedulerOutput, offsets: list[int], hidden: torch.Tensor,
               output: ModelRunnerOutput) -> None:
        """Fill the MTP layer's caches with this step's kept rows and draft the next tokens."""
        inputs = []
        for s, offset in zip(scheduler_output.scheduled, offsets):
            n, k = len(s.token_ids), len(s.spec_token_ids)
            if s.request_id in output.errors:
                continue
            state = self.requests[s.request_id]
            if s.sample:
                committed = output.sampled_token_ids[s.request_id]
                kept = n - k + len(committed) - 1  # the known tokens and the accepted drafts
                follow = committed[-1]
                last = s.num_computed_tokens + kept - 1
                num_drafts = min(s.num_drafts, len(s.block_table) * self.kv_cache.block_size - last)
            else:  # a prompt chunk: the token after it is the next prompt (or recomputed output) token
                kept, num_drafts = n, 0
                follow = state.token_at(s.num_computed_tokens + n)
            inputs.append(DraftInput(s.request_id, s.num_computed_tokens, list(s.token_ids[1:kept]) + [follow],
                                     list(range(offset, offset + kept)), s.block_table, max(num_drafts, 0)))
        # The target's hidden states after its final norm, as vLLM feeds its MTP layer (the model's output).
        normed = self.model.final_norm(hidden)
        output.draft_token_ids = propose(self.model, self.kv_cache, inputs, normed, self.share_draft_index,
                                         self.draft_graphs)

    def _sample(self, request_ids: list[str], logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        states = [self.requests[r] for r in request_ids]
        result = sample_isolated(logits, states, self.rng, most_logprobs(states))
        output.errors.update({request_ids[i]: message for i, message in result.errors.items()})
        for j, (i, token) in enumerate(zip(result.rows, result.tokens)):
            if states[i].grammar is not None and not _grammar_accepts(states[i], token):
                output.errors[request_ids[i]] = f"the structured-output grammar rejected sampled token {token}"
                continue
            states[i].output_token_ids.append(token)
            output.sampled_token_ids[request_ids[i]] = [token]
            if states[i].params.logprobs is not None:
                output.logprobs[request_ids[i]] = [position_logprobs(result.top, j, token, states[i].params.logprobs)]

    def _prompt_logprobs(self, state: RunnerRequest, first: int, logits: torch.Tensor) -> list[TokenLogprobs]:
        targets = state.prompt_token_ids[first + 1 : first + 1 + logits.shape[0]]
        state.num_prompt_logprobs = first + len(targets)
        n = state.params.prompt_logprobs
        top = top_logprobs(logits.log_softmax(-1), torch.tensor(targets, device=logits.device), n)
        host = top.host_rows()
        return [position_logprobs(host, j, token, n) for j, token in enumerate(targets)]


def most_logprobs(states: list[RunnerRequest]) -> int | None:
    """The most top logprobs any of these requests asks for (None: none asks for logprobs)."""
    wanted = [state.params.logprobs for state in states if state.params.logprobs is not None]
    return max(wanted) if wanted else None


def _grammar_accepts(state: RunnerRequest, token: int) -> bool:
    try:
        return state.grammar.accept(token)
    except Exception:  # a matcher fault fails its request only
        return False


def position_logprobs(host: list, j: int, token: int, n: int) -> TokenLogprobs:
    """Row j of TopLogprobs.host_rows() as the output's entry for `token` (its top n)."""
    chosen, rank, ids, values = host[j]
    return TokenLogprobs(token, chosen, rank, ids[:n], values[:n])
