"""The lightning indexer's projections (full layers only).

    q = rope(wq_b(q_resid))        [T, index_n_heads, index_head_dim]
    k = rope(LayerNorm(wk(x)))     [T, index_head_dim]
    w = weights_proj(x) in fp32    [T, index_n_heads], times index_head_dim^-0.5 · index_n_heads^-0.5

RoPE acts on the first qk_rope_head_dim dims of q and k (the main attention's rope dims are its last).
What the scores are and how the top-k is taken from them is the attention layer's (attention/indexer.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.attention.indexer import Selection, select_topk, select_written
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.model.layers import apply_rope, one_operator
from dsaserve.model.linear import Linear


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, selection: Selection):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.selection = selection
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: BatchMetadata, key_cache) -> torch.Tensor:
        """Selected logical positions int32 [T, width] (-1 = empty); this step's keys go to `key_cache`.
        The queries are projected only when the selection needs scores."""
        return select_topk(self.keys(x, cos, sin), lambda: self.queries(x, q_resid, cos, sin), key_cache, meta,
                           self.selection)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: BatchMetadata, key_cache) -> torch.Tensor:
        """`forward` once this step's keys are in `key_cache` (native/decode_layer.cpp writes them)."""
        return select_written(lambda: self.queries(x, q_resid, cos, sin), key_cache, meta, self.selection)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, heads, head_dim], per-head weights [T, heads] fp32 with both scales folded in)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        return self.rope(q, cos, sin), weights

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rope_dim dims, the rest unchanged."""
        if t.shape[0] and cos.shape[1] * 2 == self.rope_dim and one_operator(t, cos, sin):
            return torch.ops.dsaserve.apply_rope.default(t, cos, sin, self.rope_interleave)  # rotates the first dims
        rotated = apply_rope(t[..., : self.rope_dim], cos, sin, self.rope_interleave)
        return torch.cat([rotated, t[..., self.rope_dim :]], -1)
