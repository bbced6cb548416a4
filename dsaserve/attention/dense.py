"""Dense MLA attention over the paged latent cache: every causal token, no indexer.

The query is already absorbed (`[q_nope·W_UK | q_rope]`, width kv_lora_rank + rope), so keys are the
cached latent rows themselves and values are their first kv_lora_rank columns. This is the backend
for isolating attention bugs, and the exact path the sparse backend takes when a request's context
fits inside `index_topk` (every visible token is selected then).
"""

from __future__ import annotations

import torch

from dsaserve.attention.metadata import BatchMetadata

# Upper bound on score elements materialized at once ([query tile, heads, keys]).
SCORE_BUDGET = 1 << 24


def attend_latent(
    q: torch.Tensor, keys: torch.Tensor, invalid: torch.Tensor, scale: float, value_dim: int
) -> torch.Tensor:
    """Softmax attention of q [t, H, D] over latent rows keys [S, D] (shared) or [t, K, D] (per query).

    invalid: [t, S] or [t, K], True where a key must not be attended. Returns [t, H, value_dim].
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    scores.masked_fill_(invalid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, keys[..., :value_dim])


def gather_context(cache: torch.Tensor, meta: BatchMetadata, i: int) -> torch.Tensor:
    """All cached rows of request i in logical order: [seq_len, row width]."""
    positions = torch.arange(meta.seq_lens_host[i], device=cache.device)
    return cache.view(-1, cache.shape[-1])[meta.slots(i, positions)]


def dense_request(
    query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, i: int, scale: float, value_dim: int,
    out: torch.Tensor,
) -> None:
    """Causal attention for request i's queries, written into out[its rows]."""
    start, end = meta.query_range(i)
    keys = gather_context(cache, meta, i)
    key_pos = torch.arange(keys.shape[0], device=keys.device)
    heads = query.shape[1]
    tile = max(1, SCORE_BUDGET // (heads * keys.shape[0]))
    for t0 in range(start, end, tile):
        t1 = min(t0 + tile, end)
        invalid = key_pos[None, :] > meta.positions[t0:t1, None]
        out[t0:t1] = attend_latent(query[t0:t1], keys, invalid, scale, value_dim)


class DenseAttention:
    name = "dense"
    uses_indexer = False

    def forward(
        self, query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_dim: int,
        topk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = query.new_empty(query.shape[0], query.shape[1], value_dim)
        for i in range(meta.num_reqs):
            dense_request(query, cache, meta, i, scale, value_dim, out)
        return out
