"""The one admission check: can this prompt with these parameters ever run on this engine?

It reads only limits fixed at load time (and compiles a structured-output grammar, cached per spec), so a
server calls it off the engine thread before a response starts; nothing downstream repeats it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.engine.workers.kv_cache import blocks_needed
from dsaserve.sampling_params import SamplingParams
from dsaserve.structured_output.compiler import GrammarCompiler, GrammarError


class RequestRejected(ValueError):
    """The request can never run with this engine's limits."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed admission, ready to be added to the engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    grammar: object | None = None  # the compiled params.structured_outputs (an xgrammar CompiledGrammar)


@dataclass(frozen=True)
class AdmissionLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    enable_chunked_prefill: bool
    max_num_batched_tokens: int
    eos_token_ids: tuple[int, ...] | list[int] = ()

    def check(self, ids: list[int], params: SamplingParams) -> int:
        """Raise RequestRejected naming the field if the request can never run; returns max_tokens."""
        if not ids:
            raise RequestRejected("prompt", "the prompt is empty; give at least one token")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestRejected("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        for name, tokens in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or [])):
            outside = [t for t in tokens if not 0 <= t < vocab]
            if outside:
                raise RequestRejected(name, f"{name} has token ids {outside[:5]} outside the vocabulary [0, {vocab})")
        stop = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.min_tokens > 0 and len(stop) >= vocab:
            raise RequestRejected("stop_token_ids",
                                  f"with min_tokens={params.min_tokens} every token of the vocabulary "
                                  "would be masked (all are stop tokens); drop min_tokens or stop ids")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1:
            raise RequestRejected(
                "prompt", f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; shorten it"
            )
        self._check_fits(len(ids), max_tokens)
        return max_tokens

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens",
            )
        need = blocks_needed(total, self.block_size)
        if need > self.num_blocks:
            raise RequestRejected(
                "max_tokens",
                f"the request needs {need} KV blocks but the whole cache has {self.num_blocks}; "
                "raise kv_cache_memory or lower max_tokens",
            )
        if not self.enable_chunked_prefill and total > self.max_num_batched_tokens:
            raise RequestRejected(
                "prompt",
                f"without chunked prefill a request must fit max_num_batched_tokens="
                f"{self.max_num_batched_tokens}; enable chunked prefill or raise the budget",
            )


def compile_grammar(compiler: GrammarCompiler, params: SamplingParams):
    """params' structured-output grammar, compiled (once per spec); a spec that cannot compile is rejected."""
    if params.structured_outputs is None:
        return None
    try:
        return compiler.compile(params.structured_outputs)
    except GrammarError as e:
        raise RequestRejected("structured_outputs", str(e)) from None
