"""SamplingRequest: what sampling reads of a request, so that this layer needs nothing from the engine.

The model runner's per-request state (engine/workers/runner_state.py, RunnerRequest) has this shape.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dsaserve.sampling.token_counts import TokenCounts
from dsaserve.sampling_params import SamplingParams
from dsaserve.structured_output.request_grammar import RequestGrammar


class SamplingRequest(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None  # the request's own seeded generator, else the batch's is used
    output_token_ids: list[int]  # what was sampled for it so far (penalties and min_tokens read it)
    grammar: RequestGrammar | None  # the structured-output matcher

    def bias_tensors(self, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """params.logit_bias as (token ids, values) tensors."""
        ...

    def token_counts(self, vocab: int, device: torch.device) -> TokenCounts:
        """The penalties' counts, up to date with output_token_ids."""
        ...
