"""Layers whose weights are split across tensor-parallel ranks, and combine their results.

On one rank each is exactly the plain layer it replaces (nn.Linear, nn.Embedding), with no extra work.

    RowParallelLinear       input features split; partial products all-reduced, then the bias added
    VocabParallelEmbedding  vocabulary rows split; a token's row comes from its rank, all-reduced
    ParallelLMHead          vocabulary rows split; every rank gets all logits (all-gathered), so all
                            ranks sample, and draft, the same tokens
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.distributed.communicator import Communicator
from dsaserve.distributed.sharding import ShardPlan


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Communicator | None = None):
        """in_features: this rank's share of the input features."""
        super().__init__()
        self.comm = comm or Communicator.single()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None):
        super().__init__()
        self.comm = comm or Communicator.single()
        plan = plan or ShardPlan()
        self.start, stop = plan.vocab_rows(vocab_size)
        # An explicit tensor skips nn.Embedding's random init (slow, and overwritten by the checkpoint).
        self.weight = nn.Parameter(torch.empty(stop - self.start, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.comm.all_reduce(rows)


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None):
        super().__init__()
        self.comm = comm or Communicator.single()
        self.vocab_size = vocab_size
        start, stop = (plan or ShardPlan()).vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(stop - start, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.comm.size == 1:
            return logits
        return self.comm.all_gather(logits, dim=-1)[..., : self.vocab_size]
