"""SamplingParams: how to pick each next token and when to stop, shaped like vLLM's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsaserve.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128
# Per-request list sizes: each is worked through every step on the engine's shared thread.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
MAX_TOKEN_LIST = 1024  # logit_bias entries, stop_token_ids
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as in vLLM (dividing by them overflows)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # a logit ×/÷ this stays finite in fp32


class SamplingParamsError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # None: the checkpoint's eos ids
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probabilities per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # same, per prompt token
    skip_special_tokens: bool = True
    stop: str | list[str] | None = None  # stop strings; the text is cut before them
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # before this many tokens, stop tokens are masked and stop strings ignored
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and generated tokens (1 = off)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match

    def __post_init__(self) -> None:
        self._check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n",
                    f"n={self.n!r} must be between 1 and {MAX_N}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self._check(all(isinstance(s, str) and s for s in self.stop), "stop",
                    f"stop={self.stop!r} must be a non-empty string or a list of them")
        self._check(len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
                    f"stop has {len(self.stop)} strings; give at most {MAX_STOP_STRINGS}, each at most "
                    f"{MAX_STOP_CHARS} characters")
        self._check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
                    f"min_tokens={self.min_tokens!r} must be an integer ≥ 0")
        if self.max_tokens is not None and isinstance(self.max_tokens, int):
            self._check(self.min_tokens <= self.max_tokens, "min_tokens",
                        f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check(_number(value) and -2 <= value <= 2, name, f"{name}={value!r} must be between -2 and 2")
        low, high = REPETITION_PENALTY_RANGE
        self._check(_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
                    f"repetition_penalty={self.repetition_penalty!r} must be between {low} and {high} (1 disables it)")
        self.logit_bias = _token_bias(self.logit_bias)
        if self.max_tokens is not None:
            self._check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                        f"max_tokens={self.max_tokens!r} must be an integer ≥ 1 (or None for up to max_model_len)")
        self._check(_number(self.temperature) and self.temperature >= 0, "temperature",
                    f"temperature={self.temperature!r} must be ≥ 0 (0 means greedy)")
        self._check(_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p={self.top_p!r} must be in (0, 1]")
        self._check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
                    f"top_k={self.top_k!r} must be ≥ 1, or 0/-1 to disable")
        self._check(_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p={self.min_p!r} must be in [0, 1]")
        low, high = SEED_RANGE
        self._check(self.seed is None or (_integer(self.seed) and low <= self.seed and self.seed + self.n - 1 <= high),
                    "seed", f"seed={self.seed!r} must be an integer in [{low}, {high}] (with n={self.n}, "
                            f"seed + n - 1 too: sample i uses seed + i)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                        f"{name}={value!r} must be between 0 and {MAX_LOGPROBS}")
        if self.stop_token_ids is not None:
            self._check(all(_integer(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                        "stop_token_ids must be a list of token ids")
            self._check(len(self.stop_token_ids) <= MAX_TOKEN_LIST, "stop_token_ids",
                        f"stop_token_ids has {len(self.stop_token_ids)} ids; give at most {MAX_TOKEN_LIST}")
        if self.structured_outputs is not None:
            self._check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                        "structured_outputs must be a StructuredOutputsParams")

    @staticmethod
    def _check(ok: bool, param: str, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _token_bias(bias) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(bias) > MAX_TOKEN_LIST:
        raise SamplingParamsError("logit_bias", f"logit_bias has {len(bias)} entries; give at most {MAX_TOKEN_LIST}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise SamplingParamsError("logit_bias", f"logit_bias key {key!r} is not a token id") from None
        if not _number(value) or not -100 <= value <= 100:
            raise SamplingParamsError("logit_bias", f"logit_bias[{key!r}]={value!r} must be a number in [-100, 100]")
        out[token] = float(value)
    return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
