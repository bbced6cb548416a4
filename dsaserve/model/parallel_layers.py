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
from dsaserve.model.linear import linear


class RowParallelLinear(nn.Module):
    QUANTIZABLE = ("weight",)

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Communicator | None = None,
                 first_column: int | None = None):
        """in_features: this rank's share of the input features, starting at first_column of the full weight
        (by default comm's rank × in_features)."""
        super().__init__()
        self.comm = comm or Communicator.single()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        first = self.comm.rank * in_features if first_column is None else first_column
        self.column_offsets = {"weight": first}  # where a checkpoint's FP8 blocks put this rank's columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return linear(x, self.weight, self.bias)
        y = self.comm.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    ROW_QUANTIZABLE = ("weight",)  # int8 rows under --quantization (quantization/int8_rows.py)

    def __init__(self, vocab_size: int, hidden_size: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None):
        super().__init__()
        self.comm = comm or Communicator.single()
        plan = plan or ShardPlan()
        self.start, stop = plan.vocab_rows(vocab_size)
        # An explicit tensor skips nn.Embedding's random init (slow, and overwritten by the checkpoint).
        self.weight = nn.Parameter(torch.empty(stop - self.start, hidden_size))

    def forward(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """dtype: of the rows of a quantized table (the model's; a float table's own otherwise)."""
        if self.comm.size == 1:
            return self._rows(ids, dtype)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = self._rows(local.masked_fill(outside, 0), dtype).masked_fill(outside[:, None], 0)
        return self.comm.all_reduce(rows)

    def _rows(self, ids: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight)
        return self.weight.lookup(ids, dtype or torch.get_default_dtype())


class ParallelLMHead(nn.Module):
    QUANTIZABLE = ("weight",)

    def __init__(self, vocab_size: int, hidden_size: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None):
        super().__init__()
        self.comm = comm or Communicator.single()
        self.vocab_size = vocab_size
        start, stop = (plan or ShardPlan()).vocab_rows(vocab_size)
        self.weight = nn.Parameter(torch.empty(stop - start, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.comm.size == 1:
            return logits
        return self.comm.all_gather(logits, dim=-1)[..., : self.vocab_size]
