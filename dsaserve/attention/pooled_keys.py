"""GLM-5.3-Flash's pooled indexer cache and selection: the indexer scores pools of `kpool` consecutive tokens, not
tokens.

A pool's key is a per-channel softmax-weighted mean of its tokens' keys, the weights from a learned gate on each
token plus a position-in-pool table:  K_pool[c] = Σ_j softmax_j(gate_j[c] + ape[j, c]) · k_j[c]. Only complete pools
have keys. A query at position p sees the (p + 1) // kpool complete pools before it; it keeps the top
index_topk / kpool of them by score Σ_h w_h · relu(q_h · K_pool), and always its own unfinished pool's tokens
(the tail). Its selection is then those pools' tokens plus the tail: at most index_topk + kpool - 1 positions.

The cache keeps, per layer, every token's key and gate logits (paged like the latent cache) and, per complete pool,
its key, computed once when the pool's last token is written. Scoring reads pool keys only: a 16th of the tokens.
A batch of decode rows (one per request) is scored in a few batched steps (select_decode_pools); other batches request
by request.
"""

from __future__ import annotations

import torch

from dsaserve.attention.metadata import BatchMetadata

SCORE_BUDGET = 1 << 24  # fp32 [rows, heads, pools] scores held at once while selecting (64 MiB)


class PooledKeyCache:
    def __init__(self, num_blocks: int, block_size: int, dim: int, kpool: int, dtype: torch.dtype,
                 device: torch.device):
        if block_size % kpool:
            raise ValueError(f"block_size={block_size} must be a multiple of index_kpool={kpool} "
                             "(a pool's tokens stay in one block)")
        self.dim, self.kpool, self.block_size = dim, kpool, block_size
        self.tokens = torch.zeros(num_blocks, block_size, 2 * dim, dtype=dtype, device=device)  # key | gate logits
        self.pools = torch.zeros(num_blocks, block_size // kpool, dim, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(dim: int, kpool: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return (2 * dim * kpool + dim) * item // kpool

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.pools]

    def write(self, meta: BatchMetadata, keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> None:
        """This step's tokens' keys and gate logits [T, dim] at their slots; then the key of every pool whose last
        token is among them."""
        rows = self.tokens.view(-1, 2 * self.dim)
        rows.index_copy_(0, meta.slot_mapping, torch.cat([keys, gates], -1).to(rows.dtype))
        ends = pool_ends(meta, self.kpool)
        if ends.numel() == 0:  # (known on the host: no read back)
            return
        last = meta.slot_mapping[ends]
        # (clamped: a captured step gathers for every row, and a row near the cache's start has no kpool before it)
        members = rows[(last[:, None] + torch.arange(1 - self.kpool, 1, device=last.device)).clamp(min=0)]
        key, gate = members.split(self.dim, dim=-1)  # [P, kpool, dim] each
        weights = torch.softmax(gate.float() + ape.float(), dim=1).to(key.dtype)
        into = meta.derived.get(("pool into", self.kpool))
        self.pools.view(-1, self.dim).index_copy_(0, last // self.kpool if into is None else into,
                                                  (weights * key).sum(1))

    def pool_keys(self, meta: BatchMetadata, i: int, count: int) -> torch.Tensor:
        """Request i's first `count` pool keys [count, dim], in order."""
        per_block = self.block_size // self.kpool
        pools = torch.arange(count, device=meta.block_tables.device)
        blocks = meta.block_tables[i][pools // per_block]
        return self.pools.view(-1, self.dim)[blocks * per_block + pools % per_block]


def pool_ends(meta: BatchMetadata, kpool: int) -> torch.Tensor:
    """The batch's rows whose token completes a pool (position % kpool == kpool - 1), int64 on the device: from the
    host's lengths, once per step (a mask of the positions would be read back to size the pools on a GPU)."""
    def make():
        rows = []
        for i in range(meta.num_reqs):
            start, end = meta.query_range(i)
            context = meta.context_len(i)
            first = context + (kpool - 1 - context) % kpool  # the first position at or after context that ends a pool
            rows.extend(range(start + first - context, end, kpool))
        return torch.tensor(rows, dtype=torch.long, device=meta.positions.device)
    return meta.once(("pool ends", kpool), make)


def every_row_writes_a_pool(meta: BatchMetadata, kpool: int, spare_pool: int) -> None:
    """The pool writes of a captured step, whose rows the host does not know: every row computes the key of the pool
    its token would complete, and one that completes none writes it to `spare_pool` (a pool of the padding block)."""
    rows = torch.arange(meta.positions.shape[0], device=meta.positions.device)
    ends = meta.positions % kpool == kpool - 1
    meta.derived[("pool ends", kpool)] = rows
    meta.derived[("pool into", kpool)] = torch.where(ends, meta.slot_mapping // kpool, spare_pool)


def select_pools(queries: torch.Tensor, weights: torch.Tensor, cache: PooledKeyCache, meta: BatchMetadata,
                 index_topk: int) -> torch.Tensor:
    """Selected logical positions int32 [T, index_topk + kpool - 1] (-1 = empty) of every row: its top pools' tokens,
    then its unfinished pool's. queries [T, heads, dim], weights [T, heads] fp32 (both scales folded in)."""
    kpool = cache.kpool
    out = torch.full((queries.shape[0], index_topk + kpool - 1), -1, dtype=torch.int32, device=queries.device)
    positions = meta.positions
    tail = ((positions + 1) // kpool * kpool)[:, None] + torch.arange(kpool - 1, device=positions.device)
    out[:, index_topk:] = torch.where(tail <= positions[:, None], tail, -1).to(torch.int32)
    select = select_decode_pools if len(meta.decode_requests()) == meta.num_reqs else select_request_pools
    select(queries, weights, cache, meta, index_topk // kpool, out)
    return out


def select_request_pools(queries: torch.Tensor, weights: torch.Tensor, cache: PooledKeyCache, meta: BatchMetadata,
                         keep: int, out: torch.Tensor) -> None:
    """The top `keep` pools' tokens of every row into out[:, :keep · kpool], request by request (its pool keys
    gathered once for all its rows), in groups of rows that keep the scores within SCORE_BUDGET."""
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        count = meta.seq_lens_host[i] // cache.kpool
        if count == 0:
            continue
        keys = cache.pool_keys(meta, i, count).float()
        step = max(1, SCORE_BUDGET // (queries.shape[1] * count))
        for r0 in range(start, end, step):
            r1 = min(r0 + step, end)
            scores = torch.einsum("thd,pd->thp", queries[r0:r1].float(), keys)
            keep_top(scores, weights[r0:r1], meta.positions[r0:r1], keep, cache.kpool, out[r0:r1])


def select_decode_pools(queries: torch.Tensor, weights: torch.Tensor, cache: PooledKeyCache, meta: BatchMetadata,
                        keep: int, out: torch.Tensor) -> None:
    """select_request_pools for a batch whose every request has one row (row i is request i's), in a few batched
    steps instead of a few a request: every request's pool keys up to the longest context's (past a request's own
    count they are masked, so each row keeps what it would alone), scored together in groups of requests that keep
    the scores and the gathered keys each within SCORE_BUDGET."""
    kpool, per_block = cache.kpool, cache.block_size // cache.kpool
    count = max(meta.seq_lens_host) // kpool
    if count == 0:
        return
    pools = torch.arange(count, device=queries.device)
    step = max(1, SCORE_BUDGET // (max(queries.shape[1], cache.dim) * count))
    for r0 in range(0, queries.shape[0], step):
        r1 = min(r0 + step, queries.shape[0])
        blocks = meta.block_tables[r0:r1, pools // per_block]  # [rows, count]
        keys = cache.pools.view(-1, cache.dim)[blocks * per_block + pools % per_block].float()  # [rows, count, dim]
        scores = torch.einsum("rhd,rpd->rhp", queries[r0:r1].float(), keys)
        keep_top(scores, weights[r0:r1], meta.positions[r0:r1], keep, kpool, out[r0:r1])


def keep_top(scores: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, keep: int, kpool: int,
             out: torch.Tensor) -> None:
    """From the rows' q·K_pool [rows, heads, count]: each row's top `keep` pools by Σ_h w_h · relu(q_h · K_pool)
    among the complete ones it sees, as their tokens, into out[:, :keep · kpool] (left as they are past the count)."""
    count = scores.shape[-1]
    seen = ((positions + 1) // kpool)[:, None]  # the complete pools each row sees
    scores = (scores.relu() * weights[:, :, None]).sum(1)
    pools = torch.arange(count, device=scores.device)
    top = scores.masked_fill(pools >= seen, float("-inf")).topk(min(keep, count), dim=-1).indices  # [rows, chosen]
    tokens = top[..., None] * kpool + torch.arange(kpool, device=top.device)  # [rows, chosen, kpool]
    tokens = torch.where((top < seen)[..., None], tokens, -1)
    out[:, : tokens.shape[1] * kpool] = tokens.flatten(1).to(torch.int32)
