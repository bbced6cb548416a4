"""Dense MLA attention over the paged latent cache: every causal token, no indexer.

The query is already absorbed (`[q_nope·W_UK | q_rope]`, width kv_lora_rank + rope), so keys are the
cached latent rows themselves and values are their first kv_lora_rank columns. This is the backend
for isolating attention bugs, and the exact path the sparse backend takes for queries that see at
most the selection width (every visible token is selected then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.attention.selected_rows import attend_selected_rows
from dsaserve.native import torch_ops

# Upper bound on score elements materialized at once ([query tile, heads, keys]).
SCORE_BUDGET = 1 << 24


def attend_latent(
    q: torch.Tensor, keys: torch.Tensor, invalid: torch.Tensor | None, scale: float, value_dim: int
) -> torch.Tensor:
    """Softmax attention of q [t, H, D] over latent rows keys [S, D] (shared) or [t, K, D] (per query).

    invalid: [t, S] or [t, K], True where a key must not be attended; None when every key counts.
    Returns [t, H, value_dim].
    """
    if keys.dim() == 3:
        return attend_own_keys(q * scale, keys, invalid)[..., :value_dim]
    scores = torch.matmul(q, keys.T).float().mul_(scale)
    if invalid is not None:
        scores.masked_fill_(invalid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, keys[:, :value_dim])


def attend_own_keys(
    scaled_q: torch.Tensor, keys: torch.Tensor, invalid: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of queries [t, H, D], already multiplied by the softmax scale, over their own keys
    [t, K, D]; returns the products with whole rows [t, H, D], the value columns first (into `out`
    when given). CPU costs that shaped it (measured in docs/architecture.md#measurements): keys · qᵀ puts the long
    operand first, so its keys are not repacked as in q · keysᵀ; the softmax reads the model-dtype
    scores and accumulates in fp32 itself; and multiplying whole rows beats copying the value columns
    out first."""
    scores = torch.bmm(keys, scaled_q.transpose(1, 2)).transpose(1, 2)  # [t, H, K]
    if invalid is not None:
        scores.masked_fill_(invalid.unsqueeze(1), float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), keys, out=out)


def attend_latent_online(
    q: torch.Tensor, keys: torch.Tensor, invalid: torch.Tensor, scale: float, value_dim: int, key_chunk: int
) -> torch.Tensor:
    """attend_latent over shared keys [S, D], `key_chunk` rows at a time with an online softmax (running
    maximum, running sum, rescaled accumulator), so the scratch is [t, H, key_chunk] whatever S is.
    Each query needs at least one valid key."""
    if keys.shape[0] <= key_chunk:
        return attend_latent(q, keys, invalid, scale, value_dim)
    t, heads = q.shape[:2]
    running_max = torch.full((t, heads, 1), float("-inf"), device=q.device)
    total = torch.zeros(t, heads, 1, device=q.device)
    acc = torch.zeros(t, heads, value_dim, device=q.device)
    for c0 in range(0, keys.shape[0], key_chunk):
        chunk = keys[c0:c0 + key_chunk]
        scores = torch.matmul(q, chunk.T).float().mul_(scale)
        scores.masked_fill_(invalid[:, None, c0:c0 + key_chunk], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)  # no valid key yet: keep zeros
        probs = scores.sub_(shift).exp_()
        rescale = (running_max - shift).exp_()
        total = total * rescale + probs.sum(dim=-1, keepdim=True)
        acc = acc * rescale + torch.matmul(probs.to(q.dtype), chunk[:, :value_dim]).float()
        running_max = new_max
    return (acc / total).to(q.dtype)


# Requests with at most this many new tokens (a verification round of drafted tokens, a short chunk) go
# through the batched single-query path row by row rather than the per-request prefill path.
FEW_ROWS = 8


@dataclass(frozen=True)
class DecodeRows:
    """Where single-query requests' queries and keys are: the requests' rows of the batch [R] and the
    cache slots of the positions each attends to [R, W] (-1 for padding). every_row: the requests' rows
    are the batch's first R rows in order; where the query holds no others (a decode-only batch), queries
    and outputs need no gather or scatter."""

    query_rows: torch.Tensor
    slots: torch.Tensor
    every_row: bool = False

    @classmethod
    def of(cls, meta: BatchMetadata, reqs: list[int], positions: torch.Tensor, invalid: torch.Tensor) -> "DecodeRows":
        """positions [R, W] of requests reqs; entries under `invalid` are padding (but valid positions)."""
        req_index = torch.tensor(reqs, device=positions.device)
        return cls(meta.query_start_loc[req_index], meta.slots_of(req_index, positions).masked_fill_(invalid, -1),
                   cls.are_every_row(meta, reqs))

    @staticmethod
    def are_every_row(meta: BatchMetadata, reqs: list[int]) -> bool:
        """Whether reqs are every request of the batch, in order, each a single row."""
        return meta.num_tokens == len(reqs) and list(reqs) == list(range(meta.num_reqs))

    @classmethod
    def whole_contexts(cls, meta: BatchMetadata, reqs: list[int]) -> "DecodeRows":
        """Requests reqs over every position of their contexts."""
        host_lens = [meta.seq_lens_host[i] for i in reqs]
        device = meta.block_tables.device
        if device.type == "cpu" and torch_ops.load():  # one native call for the operators below
            if cls.are_every_row(meta, reqs):
                rows, tables = meta.query_start_loc[:-1], meta.block_tables
            else:
                req_index = torch.tensor(reqs, device=device)
                rows, tables = meta.query_start_loc[req_index], meta.block_tables[req_index]
            slots = torch.ops.dsaserve.context_slots.default(tables, host_lens, meta.block_size)
            return cls(rows, slots, cls.are_every_row(meta, reqs))
        lens = torch.tensor(host_lens, device=device)
        width = torch.arange(max(host_lens), device=device)[None, :]
        positions = torch.minimum(width, lens[:, None] - 1)  # padding points at a written row
        return cls.of(meta, reqs, positions, width >= lens[:, None])


def attend_decode_rows(query: torch.Tensor, cache: torch.Tensor, rows_of: DecodeRows, scale: float, value_dim: int,
                       out: torch.Tensor) -> None:
    """Single-query requests together, each over its own slots. The native kernel (bf16 with AVX-512
    BF16) reads the rows in place; the torch path gathers them and makes one batched matmul per chunk
    instead of one small one per request."""
    rows = cache.view(-1, cache.shape[-1])
    slots = rows_of.slots
    if rows_of.every_row and query.shape[0] == slots.shape[0] and attend_selected_rows(query, rows, slots, scale, out):
        return  # (a few-row request's rows as single queries may be the first rows of a larger batch)
    queries = query[rows_of.query_rows]
    attended = queries.new_empty(queries.shape[0], query.shape[1], value_dim)
    if attend_selected_rows(queries, rows, slots, scale, attended):
        out[rows_of.query_rows] = attended
        return
    per_chunk = max(1, SCORE_BUDGET // (slots.shape[1] * max(rows.shape[1], query.shape[1])))
    for c0 in range(0, slots.shape[0], per_chunk):
        chunk = slots[c0:c0 + per_chunk]
        invalid = chunk < 0
        keys = torch.index_select(rows, 0, chunk.clamp(min=0).reshape(-1)).view(*chunk.shape, -1)  # [R, W, D]
        mask = invalid if bool(invalid.any()) else None
        out[rows_of.query_rows[c0:c0 + per_chunk]] = attend_latent(queries[c0:c0 + per_chunk], keys, mask, scale,
                                                                   value_dim)


def decode_causal(
    query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, reqs: list[int], scale: float, value_dim: int,
    out: torch.Tensor,
) -> None:
    """Batched causal attention for single-query requests: each sees its whole context."""
    if not reqs:
        return
    attend_decode_rows(query, cache, causal_rows(meta, reqs), scale, value_dim, out)


def causal_rows(meta: BatchMetadata, reqs: list[int]) -> DecodeRows:
    """Single-query requests `reqs` over their whole contexts (derived once per step)."""
    return meta.once(("causal rows", tuple(reqs)), lambda: DecodeRows.whole_contexts(meta, reqs))


def every_row_slots(meta: BatchMetadata, rows_of) -> torch.Tensor | None:
    """The slots of `rows_of(every request)` where every request of the batch is single-query (the backends'
    decode_slots), else None."""
    reqs = meta.decode_requests()
    if len(reqs) != meta.num_reqs:
        return None
    rows = rows_of(reqs)
    return rows.slots if rows is not None and rows.every_row else None


def gather_context(cache: torch.Tensor, meta: BatchMetadata, i: int, length: int) -> torch.Tensor:
    """Request i's first `length` cached rows in logical order: [length, row width]."""
    return torch.index_select(cache.view(-1, cache.shape[-1]), 0, meta.context_slots(i, length))


def dense_rows(
    query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, i: int, rows: tuple[int, int], scale: float,
    value_dim: int, out: torch.Tensor,
) -> None:
    """Causal attention for rows [r0, r1) of the batch (all of request i), written into out."""
    r0, r1 = rows
    if r0 >= r1:
        return
    keys = gather_context(cache, meta, i, meta.position_of(i, r1 - 1) + 1)
    key_pos = torch.arange(keys.shape[0], device=keys.device)
    tile = max(1, SCORE_BUDGET // (query.shape[1] * keys.shape[0]))
    for t0 in range(r0, r1, tile):
        t1 = min(t0 + tile, r1)
        visible = meta.position_of(i, t1 - 1) + 1  # later keys are in the future of the whole tile
        invalid = key_pos[None, :visible] > meta.positions[t0:t1, None]
        out[t0:t1] = attend_latent(query[t0:t1], keys[:visible], invalid, scale, value_dim)


class DenseAttention:
    name = "dense"
    uses_indexer = False

    def forward(
        self, query: torch.Tensor, cache: torch.Tensor, meta: BatchMetadata, scale: float, value_dim: int,
        topk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = query.new_empty(query.shape[0], query.shape[1], value_dim)
        decode = meta.decode_requests()
        decode_causal(query, cache, meta, decode, scale, value_dim, out)
        few = meta.few_row_requests(FEW_ROWS)
        if few:  # each row as its own single query: one batched pass instead of a loop over requests
            singles = meta.once(("single queries", tuple(few)), lambda: meta.rows_as_single_queries(few))
            decode_causal(query, cache, singles, list(range(singles.num_reqs)), scale, value_dim, out)
        for i in sorted(set(range(meta.num_reqs)) - set(decode) - set(few)):
            dense_rows(query, cache, meta, i, meta.query_range(i), scale, value_dim, out)
        return out

    def decode_slots(self, meta: BatchMetadata, topk: torch.Tensor | None = None) -> torch.Tensor | None:
        """Where every request of the batch is single-query: slots [T, W] such that one attend_selected_rows call
        over them is `forward` (a decode plan's attention piece makes that call); None otherwise."""
        return every_row_slots(meta, lambda reqs: causal_rows(meta, reqs))
