"""GLM-5.3-Flash's pooled indexer cache and selection: the indexer scores pools of `kpool` consecutive tokens, not
tokens.

A pool's key is a per-channel softmax-weighted mean of its tokens' keys, the weights from a learned gate on each
token plus a position-in-pool table:  K_pool[c] = Σ_j softmax_j(gate_j[c] + ape[j, c]) · k_j[c]. Only complete pools
have keys. A query at position p sees the (p + 1) // kpool complete pools before it; it keeps the top
index_topk / kpool of them by score Σ_h w_h · relu(q_h · K_pool), and always its own unfinished pool's tokens
(the tail). Its selection is then those pools' tokens plus the tail: at most index_topk + kpool - 1 positions.

The cache keeps, per layer, every token's key and gate logits (paged like the latent cache) and, per complete pool,
its key, computed once when the pool's last token is written. Scoring reads pool keys only: a 16th of the tokens.
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
        members = rows[(last[:, None] + torch.arange(1 - self.kpool, 1, device=last.device))]  # [P, kpool, 2·dim]
        key, gate = members.split(self.dim, dim=-1)
        weights = torch.softmax(gate.float() + ape.float(), dim=1).to(key.dtype)
        self.pools.view(-1, self.dim).index_copy_(0, last // self.kpool, (weights * key).sum(1))

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


def select_pools(queries: torch.Tensor, weights: torch.Tensor, cache: PooledKeyCache, meta: BatchMetadata,
                 index_topk: int) -> torch.Tensor:
    """Selected logical positions int32 [T, index_topk + kpool - 1] (-1 = empty) of every row: its top pools' tokens,
    then its unfinished pool's. queries [T, heads, dim], weights [T, heads] fp32 (both scales folded in)."""
    kpool = cache.kpool
    keep = index_topk // kpool
    out = torch.full((queries.shape[0], index_topk + kpool - 1), -1, dtype=torch.int32, device=queries.device)
    offsets = torch.arange(kpool, device=queries.device)
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        positions = meta.positions[start:end]
        visible = (positions + 1) // kpool  # complete pools each row sees
        count = meta.seq_lens_host[i] // kpool
        tail_start = visible * kpool
        tail = tail_start[:, None] + offsets[: kpool - 1]
        out[start:end, index_topk:] = torch.where(tail <= positions[:, None], tail, -1).to(torch.int32)
        if count == 0:
            continue
        keys = cache.pool_keys(meta, i, count).float()
        chosen = min(keep, count)
        step = max(1, SCORE_BUDGET // (queries.shape[1] * count))
        for r0 in range(start, end, step):
            r1 = min(r0 + step, end)
            scores = (torch.einsum("thd,pd->thp", queries[r0:r1].float(), keys).relu()
                      * weights[r0:r1, :, None]).sum(1)
            seen = visible[r0 - start : r1 - start, None]
            pools = torch.arange(count, device=scores.device)
            scores = scores.masked_fill(pools >= seen, float("-inf"))
            top = scores.topk(chosen, dim=-1).indices  # [rows, chosen]
            tokens = top[..., None] * kpool + offsets  # [rows, chosen, kpool]
            tokens = torch.where((top < seen)[..., None], tokens, -1)
            out[r0:r1, : chosen * kpool] = tokens.flatten(1).to(torch.int32)
    return out
