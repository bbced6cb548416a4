"""Per-request logits edits before sampling: the structured-output grammar, logit_bias, min_tokens, and
repetition penalties.

Applied in that order, to every row (greedy ones included), before temperature and filtering.
Presence and frequency penalties follow OpenAI (over generated tokens); the repetition penalty follows
vLLM/HF (over prompt and generated tokens: positive logits divided, negative multiplied).
"""

from __future__ import annotations

import torch

from dsaserve.sampling.sampling_request import SamplingRequest
from dsaserve.structured_output.request_grammar import apply_grammars


def process_logits(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """logits [N, V] fp32, one row per request."""
    if not any(_needs_processing(r) for r in requests):
        return logits
    logits = logits.clone()
    apply_grammars(logits, [r.grammar for r in requests])
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        params = request.params
        if params.logit_bias:
            ids, bias = request.bias_tensors(vocab, logits.dtype, logits.device)
            logits[row, ids] += bias
        if len(request.output_token_ids) < params.min_tokens and request.stop_token_ids:
            stop = [t for t in request.stop_token_ids if t < vocab]
            logits[row, stop] = float("-inf")
        if params.has_penalties:
            _apply_penalties(logits[row], request)
    return logits


def _needs_processing(request: SamplingRequest) -> bool:
    params = request.params
    return (bool(params.logit_bias) or params.has_penalties or len(request.output_token_ids) < params.min_tokens
            or (request.grammar is not None and request.grammar.constrains_next))


def _apply_penalties(row: torch.Tensor, request: SamplingRequest) -> None:
    params = request.params
    counts = request.token_counts(row.shape[0], row.device)
    if request.output_token_ids:
        generated = counts.output.to(row.dtype)
        row -= params.frequency_penalty * generated + params.presence_penalty * (generated > 0)
    if params.repetition_penalty != 1:
        penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row.copy_(torch.where(counts.seen, penalized, row))
