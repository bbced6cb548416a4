"""mHC (manifold-constrained hyper-connections): `hc_mult` residual streams per token instead of one.

Before a block (attention or MLP) a one-layer perceptron over the RMS-normalised streams gives three weights: `pre`
collapses the streams into the block's input, `post` spreads the block's output over the streams, and `comb` mixes
the input streams into the output ones. `comb` is made doubly stochastic by Sinkhorn iterations, so mixing never
grows the streams' norm:

    streams ← post ⊗ block(Σ_n pre_n · stream_n) + combᵀ · streams

The weights are computed in fp32 whatever the model dtype, as in the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.hybrid_config import HybridConfig


class HyperConnection(nn.Module):
    def __init__(self, hybrid: HybridConfig, hidden_size: int, rms_eps: float):
        super().__init__()
        n = self.n = hybrid.hc_mult
        self.iters = hybrid.hc_sinkhorn_iters
        self.eps = hybrid.hc_eps
        self.rms_eps = rms_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))  # kept in fp32
        self.scale = nn.Parameter(torch.empty(3))  # kept in fp32

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] → (post [T, n], comb [T, n, n], the block's input [T, hidden])."""
        n = self.n
        flat = streams.reshape(streams.shape[0], -1).float()
        # RMS-normalising the streams scales each row: applied to the few mixed values instead of the streams.
        rms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True) * flat.shape[-1] ** -0.5
        mixed = (flat @ self.fn.float().T) * torch.rsqrt(rms.square() + self.rms_eps)
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        comb = self.sinkhorn(comb)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed

    def sinkhorn(self, comb: torch.Tensor) -> torch.Tensor:
        """Columns, then (rows, columns) iters - 1 more times, normalised to sum to one."""
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return comb

    @staticmethod
    def mix(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The streams after the block: post ⊗ block_out + combᵀ · streams, in the streams' dtype."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams
