"""The lightning indexer (full layers only): scores past tokens and picks what each query attends to.

score(t, s) = Σ_h relu(q_h(t)·k(s)) · index_head_dim^-0.5 · w_h(t) · index_n_heads^-0.5, with the causal
mask applied before any reduction. Keys go to this layer's own paged key cache.

Scoring streams: a tile of queries meets the context a few whole KV blocks at a time and keeps a
running top-k, so its scratch memory is bounded by the tile and the chunk, never by the context
length. Selection is either token top-k (the model's trained semantics) or, for the page backend,
whole pages ranked by the best visible token inside each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.model.layers import apply_rope

# Upper bound on score elements materialized at once ([query tile, index heads, key chunk]); with
# the tile and chunk below it, the bound on scratch memory.
INDEXER_SCORE_BUDGET = 1 << 22
QUERY_TILE = 64
MAX_KEY_CHUNK = 16384


@dataclass(frozen=True)
class Selection:
    """What the indexer returns per query: `index_topk` tokens, or `pages` whole pages."""

    index_topk: int
    pages: int | None = None  # page mode when set

    def width(self, block_size: int) -> int:
        """Positions per query row of the output."""
        return self.pages * block_size if self.pages else self.index_topk


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, selection: Selection):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.selection = selection
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: BatchMetadata, key_cache) -> torch.Tensor:
        """Write this step's keys; return selected logical positions int32 [T, width] (-1 = empty)."""
        k = self.k_norm(self.wk(x))
        k = torch.cat([apply_rope(k[..., : self.rope_dim], cos, sin, self.rope_interleave), k[..., self.rope_dim :]], -1)
        key_cache.write(meta.slot_mapping, k)
        width = self.selection.width(meta.block_size)
        if max(meta.seq_lens_host) <= width:
            # Every request sees at most `width` tokens, so all of them are selected: no scoring.
            return all_visible(meta.positions, width)
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = torch.cat([apply_rope(q[..., : self.rope_dim], cos, sin, self.rope_interleave), q[..., self.rope_dim :]], -1)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        return select(q, weights, key_cache, meta, self.selection)


def invisible(key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """[queries, keys] True where the key lies in the query's future (the causal mask)."""
    return key_pos[None, :] > query_pos[:, None]


def all_visible(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Rows selecting every causal-visible position, for queries that see at most `width` tokens."""
    columns = torch.arange(width, device=positions.device)
    return torch.where(columns[None, :] <= positions[:, None], columns[None, :], -1).to(torch.int32)


def select(q: torch.Tensor, weights: torch.Tensor, key_cache, meta: BatchMetadata, selection: Selection) -> torch.Tensor:
    """Per query, the positions its attention reads. q [T, H, D], weights [T, H] fp32."""
    width = selection.width(meta.block_size)
    out = torch.full((q.shape[0], width), -1, dtype=torch.int32, device=q.device)
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        split = meta.split_at_position(i, width)  # rows before it see ≤ width tokens
        out[start:split] = all_visible(meta.positions[start:split], width)
        for t0 in range(split, end, QUERY_TILE):
            t1 = min(t0 + QUERY_TILE, end)
            out[t0:t1] = stream_select(q[t0:t1], weights[t0:t1], key_cache, meta, i, meta.positions[t0:t1], selection,
                                       last_position=meta.position_of(i, t1 - 1))
    return out


def key_chunk_blocks(tile: int, heads: int, block_size: int) -> int:
    """Whole blocks per scoring chunk so that [tile, heads, chunk] stays within the budget."""
    tokens = max(block_size, min(MAX_KEY_CHUNK, INDEXER_SCORE_BUDGET // max(1, tile * heads)))
    return max(1, tokens // block_size)


def stream_select(q: torch.Tensor, weights: torch.Tensor, key_cache, meta: BatchMetadata, i: int,
                  positions: torch.Tensor, selection: Selection, last_position: int | None = None) -> torch.Tensor:
    """Running top-k (tokens or pages) of one query tile of request i over its visible blocks.
    `last_position` (the tile's largest position, known on the host) saves a device sync."""
    bs = meta.block_size
    keep = selection.pages or selection.index_topk
    best = torch.full((q.shape[0], keep), float("-inf"), device=q.device)
    best_ids = torch.full((q.shape[0], keep), -1, dtype=torch.long, device=q.device)
    if last_position is None:
        last_position = int(positions.max())
    visible_blocks = last_position // bs + 1  # later blocks are in every query's future
    chunk = key_chunk_blocks(q.shape[0], q.shape[1], bs)
    table = meta.block_tables[i]
    q = q.float()  # scores in fp32, as the reference computes them
    for b0 in range(0, visible_blocks, chunk):
        b1 = min(b0 + chunk, visible_blocks)
        keys = key_cache.read_blocks(table[b0:b1], torch.float32)  # [(b1-b0)*bs, D], whole pages
        key_pos = torch.arange(b0 * bs, b1 * bs, device=q.device)
        per_head = torch.relu(torch.matmul(q, keys.T))  # [t, H, c]
        scores = torch.matmul(weights[:, None, :], per_head).squeeze(1)  # [t, c]
        scores.masked_fill_(invisible(key_pos, positions), float("-inf"))  # masks before any max/top-k
        if selection.pages:
            scores = scores.view(scores.shape[0], b1 - b0, bs).amax(dim=-1)  # best visible token per page
            ids = torch.arange(b0, b1, device=q.device).expand_as(scores)
        else:
            ids = key_pos.expand_as(scores)
        merged = torch.cat([best, scores], dim=1)
        best, order = merged.topk(min(keep, merged.shape[1]), dim=1)
        best_ids = torch.cat([best_ids, ids], dim=1).gather(1, order)
    chosen = torch.where(best == float("-inf"), -1, best_ids)
    if not selection.pages:
        return chosen.to(torch.int32)
    # Pages → their tokens, each query keeping only the ones it may see.
    tokens = chosen[:, :, None] * bs + torch.arange(bs, device=q.device)
    tokens = torch.where((chosen[:, :, None] >= 0) & (tokens <= positions[:, None, None]), tokens, -1)
    return tokens.view(q.shape[0], -1).to(torch.int32)
