"""What the model runner keeps per request between steps: sampling inputs that outlive one step.

The generator, the output history and the grammar matcher stay across preemption (a recomputed request
continues its seeded draws, its penalties and its grammar where it left off); the state is dropped when the
scheduler reports the request finished. RunnerRequest is what dsaserve.sampling reads as a SamplingRequest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve.engine.scheduling.scheduler_output import NewRequestData
from dsaserve.sampling.token_counts import TokenCounts
from dsaserve.sampling_params import SamplingParams
from dsaserve.structured_output.request_grammar import RequestGrammar


@dataclass(eq=False)
class RunnerRequest:
    params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    want_prompt_logprobs: bool
    output_token_ids: list[int] = field(default_factory=list)  # what this runner sampled for it
    num_prompt_logprobs: int = 0  # prompt positions whose logprobs were already returned
    grammar: RequestGrammar | None = None  # the structured-output matcher
    error: str | None = None  # why this request cannot be sampled (set when its state could not be built)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # Not an init field: a copy made by dataclasses.replace (speculative verification's view with drafts
    # appended) starts its own counts instead of adding its drafts to this request's.
    _counts: TokenCounts | None = field(default=None, init=False, repr=False)

    def bias_tensors(self, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """params.logit_bias as (token ids, values) tensors, built once for the request's life."""
        if self._bias is None:
            bias = {t: v for t, v in self.params.logit_bias.items() if t < vocab}
            self._bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                          torch.tensor(list(bias.values()), dtype=dtype, device=device))
        return self._bias

    def token_counts(self, vocab: int, device: torch.device) -> TokenCounts:
        """The penalties' counts, kept across steps and brought up to date with output_token_ids."""
        if self._counts is None:
            self._counts = TokenCounts(self.prompt_token_ids, vocab, device)
        self._counts.update(self.output_token_ids)
        return self._counts

    def token_at(self, position: int) -> int:
        """The known token at a position of prompt + what this runner sampled."""
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < prompt else self.output_token_ids[position - prompt]

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device) -> "RunnerRequest":
        generator = None
        if new.seed is not None:
            generator = torch.Generator(device=device).manual_seed(new.seed)
        grammar, error = None, None
        if new.grammar is not None:
            try:
                grammar = RequestGrammar(new.grammar, new.stop_token_ids, new.params.structured_outputs.reasoning)
            except Exception as e:  # this request fails, not the step
                error = f"the structured-output grammar could not start: {type(e).__name__}: {e}"
        return cls(new.params, new.prompt_token_ids, new.stop_token_ids, generator, new.want_prompt_logprobs,
                   grammar=grammar, error=error)
