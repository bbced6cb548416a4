"""The per-request state of a KDA layer: a second cache kind beside the paged latent cache.

Its size does not grow with the context: per request slot, the recurrent state [heads, head_dim, head_dim] and the
last conv_kernel - 1 inputs of the short convolution, both fp32. The scheduler gives a request a slot when it is
admitted and takes it back when it finishes, is aborted or preempted; a request whose context is empty starts from
zeros whatever its slot held (a new request, or one recomputed after preemption).

With prefix caching, snapshot slots keep copies of a request's state at prefix positions
(engine/scheduling/state_snapshots.py): a step copies the state after a position into one, and a request admitted
on a prefix-cache hit starts from one.
"""

from __future__ import annotations

import torch

from dsaserve.hybrid_config import HybridConfig


class LinearStateCache:
    def __init__(self, hybrid: HybridConfig, num_slots: int, device: torch.device, num_snapshots: int = 0,
                 ranks: int = 1):
        """ranks: the tensor-parallel ranks the KDA heads are split over (this cache holds one rank's heads)."""
        heads, dk = hybrid.linear_num_heads // ranks, hybrid.linear_head_dim
        channels = hybrid.conv_dim // ranks
        self.recurrent = torch.zeros(num_slots, heads, dk, dk, dtype=torch.float32, device=device)
        self.conv = torch.zeros(num_slots, hybrid.conv_kernel - 1, channels, dtype=torch.float32, device=device)
        self.snapshot_recurrent = torch.zeros(num_snapshots, heads, dk, dk, dtype=torch.float32, device=device)
        self.snapshot_conv = torch.zeros(num_snapshots, hybrid.conv_kernel - 1, channels, dtype=torch.float32,
                                         device=device)

    @property
    def num_slots(self) -> int:
        return self.recurrent.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.recurrent, self.conv, self.snapshot_recurrent, self.snapshot_conv]

    def restore(self, slot: int, snapshot: int) -> None:
        self.recurrent[slot] = self.snapshot_recurrent[snapshot]
        self.conv[slot] = self.snapshot_conv[snapshot]
