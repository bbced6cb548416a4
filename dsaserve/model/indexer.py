"""The lightning indexer (full layers only): scores past tokens and picks each query's top-k.

score(t, s) = Σ_h relu(q_h(t)·k(s)) · index_head_dim^-0.5 · w_h(t) · index_n_heads^-0.5, in fp32,
with the causal mask applied before top-k. Keys go to this layer's own paged key cache.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.model.layers import apply_rope

# Upper bound on fp32 score elements materialized at once ([query tile, index heads, keys]).
INDEXER_SCORE_BUDGET = 1 << 24


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.index_topk = cfg.index_topk
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        meta: BatchMetadata, key_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's indexer keys, return top-k logical positions int32 [T, index_topk]."""
        k = self.k_norm(self.wk(x))
        k = torch.cat([apply_rope(k[..., : self.rope_dim], cos, sin, self.rope_interleave), k[..., self.rope_dim :]], -1)
        key_cache.view(-1, self.head_dim).index_copy_(0, meta.slot_mapping, k.to(key_cache.dtype))
        if max(meta.seq_lens_host) <= self.index_topk:
            # Every request sees at most index_topk tokens, so all of them are selected: no scoring.
            return all_visible(meta.positions, self.index_topk)
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = torch.cat([apply_rope(q[..., : self.rope_dim], cos, sin, self.rope_interleave), q[..., self.rope_dim :]], -1)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        return select_topk(q, weights, key_cache, meta, self.index_topk)


def invisible(key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """[queries, keys] True where the key lies in the query's future (the causal mask)."""
    return key_pos[None, :] > query_pos[:, None]


def all_visible(positions: torch.Tensor, index_topk: int) -> torch.Tensor:
    """Top-k rows selecting every causal-visible position, for contexts that fit in index_topk."""
    columns = torch.arange(index_topk, device=positions.device)
    return torch.where(columns[None, :] <= positions[:, None], columns[None, :], -1).to(torch.int32)


def select_topk(
    q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, meta: BatchMetadata, index_topk: int
) -> torch.Tensor:
    """Top-k per query over its causal-visible cached keys. q [T, H, D], weights [T, H] fp32."""
    out = torch.full((q.shape[0], index_topk), -1, dtype=torch.int32, device=q.device)
    key_rows = key_cache.view(-1, key_cache.shape[-1])
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        split = meta.split_at_position(i, index_topk)  # rows before it see ≤ index_topk tokens
        out[start:split] = all_visible(meta.positions[start:split], index_topk)
        if split == end:
            continue
        seq_len = meta.seq_lens_host[i]
        keys = key_rows[meta.slots(i, torch.arange(seq_len, device=q.device))].float()
        key_pos = torch.arange(seq_len, device=q.device)
        tile = max(1, INDEXER_SCORE_BUDGET // (q.shape[1] * seq_len))
        for t0 in range(split, end, tile):
            t1 = min(t0 + tile, end)
            per_head = torch.relu(torch.matmul(q[t0:t1].float(), keys.T))  # [t, H, S]
            scores = torch.matmul(weights[t0:t1, None, :], per_head).squeeze(1)  # [t, S]
            scores.masked_fill_(invisible(key_pos, meta.positions[t0:t1]), float("-inf"))
            values, indices = scores.topk(index_topk, dim=-1)
            out[t0:t1] = torch.where(values == float("-inf"), -1, indices).to(torch.int32)
    return out
