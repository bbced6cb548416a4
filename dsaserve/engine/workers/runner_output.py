"""What the model runner returns each step, keyed by request id, in plain Python values."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen (or prompt) token's log-prob and rank, then the n most likely tokens."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    # Committed tokens per request that sampled this step: a list, so a speculative step can commit several.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per sampled token
    # Positions p … p+k-1 of the prompt, each predicting prompt token p+1 (recorded once, also across preemption).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests that cannot continue (e.g. non-finite logits)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # to verify in the request's next step
