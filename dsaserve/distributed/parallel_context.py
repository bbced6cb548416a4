"""ParallelContext: what one rank's model needs to know about the others (its communicators and its share).

Made once per rank when the process groups exist, handed to the model at construction; the
single-device context has groups of one, so the model runs the same code with no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsaserve.distributed.communicator import Communicator
from dsaserve.distributed.sharding import ShardPlan


@dataclass(frozen=True)
class ParallelContext:
    tp: Communicator = field(default_factory=Communicator.single)
    dcp: Communicator = field(default_factory=Communicator.single)  # the ranks sharing one copy of the KV cache
    expert_parallel: bool = False
    check_ranks: bool = False  # ranks compare every full layer's top-k, failing naming the layer where they differ

    @classmethod
    def single(cls) -> "ParallelContext":
        return cls()

    @property
    def plan(self) -> ShardPlan:
        return ShardPlan(self.tp.rank, self.tp.size, self.expert_parallel)


def check_same_on_ranks(comm: Communicator, x: torch.Tensor, what: str) -> None:
    """Raise when x differs between the ranks of comm (compared by a fingerprint of its values)."""
    if comm.size == 1:
        return
    values = x.double().flatten()
    weights = torch.arange(1, values.numel() + 1, dtype=torch.float64, device=x.device)
    fingerprint = torch.stack([values.sum(), (values * weights).sum(), values.new_tensor(float(values.numel()))])
    every = comm.all_gather(fingerprint[None], dim=0)
    differ = [comm.ranks[r] for r in range(comm.size) if not torch.equal(every[r], every[comm.rank])]
    if differ:
        raise RuntimeError(f"{what}: rank {comm.ranks[comm.rank]} and rank(s) {differ} disagree; every rank must "
                           "compute the same values here (same torch build and device kind on every rank)")
