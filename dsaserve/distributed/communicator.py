"""Collectives over one process group: what the model calls to combine its ranks' partial results.

A group of one rank does nothing (every call returns its input), so the single-device model runs the
same code with no torch.distributed at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


GATHER_SUM_LIMIT = 1 << 16  # elements up to which a CPU all-reduce is an all-gather and a local sum


class Communicator:
    def __init__(self, group=None, ranks: tuple[int, ...] = (0,), rank_in_group: int = 0):
        self.group = group
        self.ranks = ranks  # global ranks, in group order
        self.rank = rank_in_group
        self.size = len(ranks)

    @classmethod
    def single(cls) -> "Communicator":
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (the same values on every rank)."""
        if self.size == 1:
            return x
        if x.device.type == "cpu" and x.numel() <= GATHER_SUM_LIMIT:
            # gloo's all-reduce of a decode step's few rows takes 2-3× as long as gathering them (measured
            # in docs/benchmarks.md); every rank then sums the parts in rank order, so all get the same bits.
            x.copy_(self.all_gather(x.reshape(1, -1), dim=0).sum(0).view(x.shape))
        else:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order (the same tensor on every rank)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        flat = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))  # ranks one after the other
        _all_gather_flat(flat, x, group=self.group)
        if dim == 0:
            return flat
        return torch.cat(flat.view((self.size,) + tuple(x.shape)).unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum over ranks of x, of which this rank keeps its 1/size part along `dim`."""
        if self.size == 1:
            return x
        parts = torch.cat(x.chunk(self.size, dim=dim), dim=0) if dim else x.contiguous()
        out = parts.new_empty((parts.shape[0] // self.size,) + tuple(parts.shape[1:]))
        _reduce_scatter_flat(out, parts, group=self.group)
        return out

    def broadcast_object(self, obj=None, src: int = 0):
        """`obj` from the group's rank `src` to every rank (pickled); returns it."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
