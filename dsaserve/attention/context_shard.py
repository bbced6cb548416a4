"""ContextShard: which tokens of every request one rank holds under decode context parallelism (DCP).

The N ranks of a DCP group split each request's context token by token: position p lives on member
p mod N, at local index p // N, so each holds 1/N of every context, balanced whatever its length. A
member's local indices form an ordinary paged sequence: local index c sits at slot
table[c // block_size] · block_size + c mod block_size of its own cache, where `table` is the
request's block table, the same block ids on every member. So the scheduler sees blocks of
N × block_size tokens (block b holds positions [b·N·bs, (b+1)·N·bs)), each member stores
block_size of them per block, and the KV capacity per rank grows N-fold. `merge_best` makes the group's indexer
selection from each member's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve.distributed.communicator import Communicator


@dataclass(frozen=True)
class ContextShard:
    rank: int  # within the DCP group
    size: int
    block_size: int  # tokens per block in this rank's cache tensors
    comm: Communicator = field(default_factory=Communicator.single, compare=False, repr=False)

    @property
    def tokens_per_block(self) -> int:
        """Tokens of a request per scheduler block (across the group)."""
        return self.block_size * self.size

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.size == self.rank

    def local_count(self, length: int) -> int:
        """How many of positions 0 … length-1 this rank holds."""
        return max(0, (length - self.rank + self.size - 1) // self.size)

    def to_global(self, local_index: torch.Tensor) -> torch.Tensor:
        return local_index * self.size + self.rank

    def merge_best(self, values: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        """The group's indexer selection, int32 [T, width] (-1 empty), from each member's best `width` candidates
        among the tokens it holds: values fp32 [T, width] (-inf: none) and their global positions int64 [T, width].
        The top-k of the union is the top-k of the whole context: each of its tokens is in its own member's."""
        every_value = self.comm.all_gather(values, dim=1)  # [T, N · width]
        every_position = self.comm.all_gather(positions, dim=1)
        best, order = every_value.topk(width, dim=1, sorted=False)
        return torch.where(best == float("-inf"), -1, every_position.gather(1, order)).to(torch.int32)

    def local_slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of owned global `positions` of a request whose block table is `table` (1-D, or
        one row per position)."""
        local = positions // self.size
        block = local // self.block_size
        ids = table[block] if table.dim() == 1 else table.gather(-1, block)
        return ids * self.block_size + local % self.block_size
