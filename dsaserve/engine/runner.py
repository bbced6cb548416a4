"""Turns a scheduled batch into BatchMetadata, runs the model, and returns the logits rows asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.engine.kv_cache import KVCache
from dsaserve.engine.scheduler import ScheduledBatch


@dataclass
class RunnerOutput:
    sample_logits: torch.Tensor  # [len(sample_requests), V] fp32, one row per request that samples now
    sample_requests: list[int]  # batch positions of those requests
    # batch position → (first position p, [k, V] rows predicting prompt tokens p+1 … p+k)
    prompt_logits: dict[int, tuple[int, torch.Tensor]]


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        token_ids, context_lens, tables, logits_rows = [], [], [], []
        sample_requests, sample_rows, prompt_rows = [], [], {}
        offset = 0
        for b, (request, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = request.num_computed_tokens
            token_ids.append(request.token_ids(start, start + n))
            context_lens.append(start)
            tables.append(request.block_table)
            if request.prompt_logprobs is not None:
                # Row at position p predicts prompt token p + 1; skip positions already recorded
                # (a preempted request recomputes its prompt).
                first = max(start, len(request.prompt_logprobs) - 1)
                last = min(start + n, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows[b] = (first, list(range(len(logits_rows), len(logits_rows) + last - first)))
                    logits_rows.extend(range(offset + first - start, offset + last - start))
            if start + n == request.num_tokens:
                sample_requests.append(b)
                sample_rows.append(len(logits_rows))
                logits_rows.append(offset + n - 1)
            offset += n
        meta = BatchMetadata.build(
            token_ids, context_lens, tables, self.kv_cache.block_size, logits_rows, device=self.device
        )
        hidden = self.model(meta, self.kv_cache.latent, self.kv_cache.indexer)
        logits = self.model.compute_logits(hidden)
        return RunnerOutput(
            sample_logits=logits[sample_rows],
            sample_requests=sample_requests,
            prompt_logits={b: (first, logits[rows]) for b, (first, rows) in prompt_rows.items()},
        )

