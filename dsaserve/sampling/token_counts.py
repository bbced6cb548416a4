"""TokenCounts: what the penalties read of a request's history, kept on the logits' device.

Counts of each token in the output (frequency and presence penalties) and which tokens the prompt or the
output holds (repetition penalty). Each step adds only the tokens sampled since the last one, so a step
copies a token or a few to the device, not the request's whole history, and nothing is read back.
"""

from __future__ import annotations

import torch


class TokenCounts:
    def __init__(self, prompt_token_ids: list[int], vocab: int, device: torch.device):
        self.output = torch.zeros(vocab, dtype=torch.float32, device=device)  # times each token was generated
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # in the prompt or the output
        if prompt_token_ids:
            self.seen[torch.tensor(prompt_token_ids, device=device)] = True
        self.counted = 0  # output tokens already added

    def update(self, output_token_ids: list[int]) -> None:
        new = output_token_ids[self.counted:]
        if not new:
            return
        ids = torch.tensor(new, device=self.output.device)
        self.output.scatter_add_(0, ids, torch.ones(len(new), device=self.output.device))
        self.seen[ids] = True
        self.counted = len(output_token_ids)
