"""One request's grammar state: the matcher, and where it starts when the model reasons first."""

from __future__ import annotations

import torch

from dsaserve.structured_output.params import ReasoningMarkers

REASONING, MAY_OPEN, ACTIVE = "reasoning", "may_open", "active"


class RequestGrammar:
    """accept() every sampled token; fill_bitmask() before sampling while `constrains_next`."""

    def __init__(self, compiled, stop_token_ids, reasoning: ReasoningMarkers | None = None):
        import xgrammar

        # The grammar may end only on this request's stop tokens (the model's eos ids when it has none, as
        # with ignore_eos), and only where it is complete.
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids) or None)
        self.reasoning = reasoning
        if reasoning is None:
            self.state = ACTIVE
        elif reasoning.in_reasoning:
            self.state = REASONING
        else:  # the first token opens the reasoning (`<think>`) or starts the constrained answer
            self.state = MAY_OPEN if reasoning.start_token_id is not None else ACTIVE

    @property
    def constrains_next(self) -> bool:
        """False inside the reasoning, and once the grammar has ended (with ignore_eos the output goes on)."""
        return self.state != REASONING and not self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.state == MAY_OPEN:
            allow(bitmask, row, self.reasoning.start_token_id)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        if self.state == REASONING:
            if token == self.reasoning.end_token_id:
                self.state = ACTIVE
            return True
        if self.state == MAY_OPEN:
            if token == self.reasoning.start_token_id:
                self.state = REASONING
                return True
            self.state = ACTIVE
        return self.matcher.is_terminated() or self.matcher.accept_token(token)


def allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Set token's bit in an xgrammar bitmask (int32 words, bit i of word w is token 32w + i)."""
    word = int(bitmask[row, token // 32]) | (1 << (token % 32))
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


def apply_grammars(logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
    """Mask (to -inf) the tokens each constrained row's grammar does not allow, in place."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.constrains_next]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # rows line up with logits
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows)
