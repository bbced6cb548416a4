"""GLM-5.3-Flash's indexer (full indexed-attention layers): the lightning indexer's projections without RoPE, plus
the pool compression's gate and position table. Scoring and selection are attention/pooled_keys.py's.

    q = wq_b(q_resid)               [T, index_n_heads, index_head_dim]
    k = LayerNorm(wk(x))            [T, index_head_dim]
    gate = x · index_kpool_compress_gateᵀ   [T, index_head_dim]   (a pool's softmax logits, with the position table)
    w = weights_proj(x) in fp32 · index_head_dim^-0.5 · index_n_heads^-0.5
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.attention.pooled_keys import PooledKeyCache, select_pools
from dsaserve.config import ModelConfig
from dsaserve.model.linear import Linear, linear


class PooledIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.index_topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(cfg.hybrid.index_kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, cfg.hidden_size))
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos, sin, meta: BatchMetadata,
                cache: PooledKeyCache) -> torch.Tensor:
        """Selected logical positions int32 [T, index_topk + kpool - 1] (-1 = empty); this step's keys, gate logits
        and completed pools go to `cache` first."""
        self.write_keys(x, cos, sin, meta, cache)
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        return select_pools(q, weights, cache, meta, self.index_topk)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self.wk(x))

    def write_keys(self, x: torch.Tensor, cos, sin, meta: BatchMetadata, cache: PooledKeyCache) -> None:
        """This step's keys and gate logits, and the pools they complete (no RoPE: cos/sin unused)."""
        cache.write(meta, self.keys(x), linear(x, self.index_kpool_compress_gate), self.index_kpool_compress_ape)
