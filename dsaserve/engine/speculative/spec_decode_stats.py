"""Counters of speculative decoding, named as vLLM names them in /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verification rounds (a request's drafts checked in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # how often draft position j was accepted

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def snapshot(self) -> "SpecDecodeStats":
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification round: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
