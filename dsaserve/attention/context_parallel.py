"""Attention under decode context parallelism: each rank attends to its share of the context, and the
group merges the parts by log-sum-exp.

The N ranks of a DCP group each hold 1/N of every request's cached tokens (context_shard.py). Every
rank gathers the queries of the group's heads, attends to the tokens it holds among those each query
may read (all visible tokens, or the visible ones among the selected top-k), and returns per head the
partial output and its log-sum-exp. Reweighting each part by exp(lse_rank - lse_total) and summing over
the group is exactly softmax attention over the union; each rank keeps the sum for its own heads.
"""

from __future__ import annotations

import torch

from dsaserve import triton_ops
from dsaserve.attention.dense import SCORE_BUDGET
from dsaserve.attention.metadata import BatchMetadata

NEG_INF = float("-inf")


def attend_context_shard(query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float,
                         value_dim: int, topk: torch.Tensor | None) -> torch.Tensor:
    """query [T, H, D] (this rank's heads) → [T, H, value_dim]. topk None: every causal token."""
    comm = meta.shard.comm
    group_query = comm.all_gather(query, dim=1)  # [T, N·H, D]: the group's heads in rank order
    out, lse = local_partials(group_query, cache, meta, scale, value_dim, topk)
    return merge_partials(out, lse, comm).to(query.dtype)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, comm) -> torch.Tensor:
    """out fp32 [T, N·H, V] and lse [T, N·H] of this rank's tokens → this rank's heads [T, H, V] over
    the whole context."""
    every = comm.all_gather(lse[None], dim=0)  # [N, T, N·H]
    total = torch.logsumexp(every, dim=0)
    total = torch.where(torch.isinf(total), 0.0, total)  # no visible token anywhere (not reached in practice)
    return comm.reduce_scatter(out * torch.exp(lse - total)[..., None], dim=1)


def local_partials(query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_dim: int,
                   topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [T, H, V], lse fp32 [T, H]) over the tokens this rank holds; lse -inf where none."""
    if topk is not None and triton_ops.runs_on(query):
        return selected_partials(query, cache, meta, scale, value_dim, topk)
    tokens, heads = query.shape[:2]
    out = torch.zeros(tokens, heads, value_dim, device=query.device)
    lse = torch.full((tokens, heads), NEG_INF, device=query.device)
    rows = cache.view(-1, cache.shape[-1])
    for i in range(meta.num_reqs):
        start, end = meta.query_range(i)
        # As in the sparse backend, rows that see at most the selection's width read every visible token.
        split = end if topk is None else meta.split_at_position(i, topk.shape[1])
        if split > start:
            _visible_partials(query, rows, meta, i, (start, split), scale, value_dim, out, lse)
        if end > split:
            _selected_partials(query, rows, meta, i, (split, end), topk, scale, value_dim, out, lse)
    return out, lse


def selected_partials(query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_dim: int,
                      topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """local_partials over each row's selected positions this rank holds, in one Triton call (the CUDA path: no host
    loop over requests, no host read). A row that sees at most the selection's width has every visible position in
    its selection (the scored selection keeps every candidate when there are no more than the width), so the rows
    need no split."""
    from dsaserve.triton_ops.selected_rows import attend_selected_rows

    out = query.new_empty(*query.shape[:2], value_dim, dtype=torch.float32)
    lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    attend_selected_rows(query, cache.view(-1, cache.shape[-1]), held_slots(meta, topk), scale, out, lse)
    return out, lse


def held_slots(meta: BatchMetadata, topk: torch.Tensor) -> torch.Tensor:
    """int64 [T, width]: this rank's cache slot of each row's selected positions that it holds, -1 elsewhere (made
    once per step and top-k tensor: shared layers reuse their full layer's)."""
    def derive():
        shard = meta.shard
        selected = topk.long()
        held = (selected >= 0) & shard.owns(selected) & (selected <= meta.positions[:, None])
        tables = meta.block_tables[meta.row_requests()]
        return topk, shard.local_slots(tables, torch.where(held, selected, shard.rank)).masked_fill_(~held, -1)

    return meta.once(("held slots", id(topk)), derive)[1]  # the entry holds topk: its id is not reused


def _visible_partials(query, rows, meta, i, span, scale, value_dim, out, lse) -> None:
    """Rows [r0, r1) of request i over every visible token this rank holds."""
    shard = meta.shard
    r0, r1 = span
    count = shard.local_count(meta.position_of(i, r1 - 1) + 1)
    if count == 0:
        return
    local = torch.arange(count, device=query.device)
    keys = rows[shard.local_slots(meta.block_tables[i], shard.to_global(local))]
    key_pos = shard.to_global(local)
    tile = max(1, SCORE_BUDGET // (query.shape[1] * count))
    for t0 in range(r0, r1, tile):
        t1 = min(t0 + tile, r1)
        invalid = key_pos[None, :] > meta.positions[t0:t1, None]
        out[t0:t1], lse[t0:t1] = attention_with_lse(query[t0:t1], keys, invalid, scale, value_dim)


def _selected_partials(query, rows, meta, i, span, topk, scale, value_dim, out, lse) -> None:
    """Rows [r0, r1) of request i over the selected visible tokens this rank holds."""
    shard = meta.shard
    r0, r1 = span
    width = topk.shape[1]
    tile = max(1, SCORE_BUDGET // (query.shape[1] * width))
    for t0 in range(r0, r1, tile):
        t1 = min(t0 + tile, r1)
        selected = topk[t0:t1].long()
        held = (selected >= 0) & shard.owns(selected) & (selected <= meta.positions[t0:t1, None])
        positions = torch.where(held, selected, shard.rank)  # a held position stands in for the others
        keys = rows[shard.local_slots(meta.block_tables[i], positions)]  # [t, K, D]
        out[t0:t1], lse[t0:t1] = attention_with_lse(query[t0:t1], keys, ~held, scale, value_dim)


def attention_with_lse(q: torch.Tensor, keys: torch.Tensor, invalid: torch.Tensor, scale: float, value_dim: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [t, H, D] over keys [S, D] (shared) or [t, K, D] (per query) with
    invalid [t, S|K] masked out: (out fp32 [t, H, V], log-sum-exp of the scaled scores [t, H]).
    A query with no valid key gets zeros and -inf."""
    if keys.dim() == 2:
        scores = torch.matmul(q.float(), keys.float().T)
        values = keys[:, :value_dim].float()
    else:
        scores = torch.bmm(q.float(), keys.float().transpose(1, 2))
        values = keys[..., :value_dim].float()
    scores = scores.mul_(scale).masked_fill_(invalid[:, None, :], NEG_INF)
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isinf(peak), 0.0, peak)
    probs = scores.sub_(peak).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    weighted = torch.matmul(probs, values) if keys.dim() == 2 else torch.bmm(probs, values)
    out = weighted / total.clamp(min=torch.finfo(total.dtype).tiny)
    return out, (total.log() + peak).squeeze(-1)
