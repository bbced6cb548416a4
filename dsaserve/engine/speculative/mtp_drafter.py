"""Drafting with the MTP layer, after each verified step.

Catch-up: every row the target just computed and kept (prompt chunks; the last known token and the
accepted drafts), with the token that follows it and the target's hidden state, fills the MTP layer's
own caches at those positions: only their latent rows and indexer keys, since only later rows attend
to them. A request that drafts then runs its last row through the whole layer, which gives the first
draft. Draft steps 2…N then run one row per request at the next positions, feeding back the MTP
layer's hidden state. Their cache entries are speculative: the next catch-up rewrites those positions
with verified rows, so nothing unverified is ever attended by a verified row.

With `index_share_for_mtp_iteration`, steps 2…N skip the MTP indexer and attend to the selection the
first step made for the request's last row, plus the positions drafted since (always visible).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dsaserve.attention.metadata import BatchMetadata


@dataclass(frozen=True)
class DraftInput:
    request_id: str
    start: int  # position of the first kept row
    next_tokens: list[int]  # for each kept row, the token that follows it
    hidden_rows: list[int]  # rows of the target's hidden states, in order
    block_table: list[int]
    num_drafts: int  # drafts wanted after the last row (0: only fill the cache)

    @property
    def last_position(self) -> int:
        """The position of the last kept row (the first draft step's)."""
        return self.start + len(self.next_tokens) - 1


def propose(model, kv_cache, inputs: list[DraftInput], hidden: torch.Tensor, share_index: bool,
            graphs=None) -> dict[str, list[int]]:
    """Draft tokens per request (those with num_drafts > 0); the catch-up and the draft steps replayed from `graphs`
    (DraftGraphs) where they take them."""
    inputs = [item for item in inputs if item.hidden_rows]
    if not inputs:
        return {}
    block_size, device = kv_cache.block_size, hidden.device

    def batch(items, tokens, starts, logits_rows):
        return BatchMetadata.build(tokens, starts, [item.block_table for item in items], block_size, logits_rows,
                                   device=device, shard=kv_cache.shard)

    # Rows that only later rows attend to (every kept row but a drafting request's last): their cache
    # entries, without the layer's attention and MoE.
    fill = [(item, len(item.next_tokens) - (item.num_drafts > 0)) for item in inputs]
    fill = [(item, n) for item, n in fill if n > 0]
    if fill and graphs is not None and graphs.catch_up.takes(fill):
        graphs.catch_up.run(fill, hidden)
    elif fill:
        rows = torch.tensor([r for item, n in fill for r in item.hidden_rows[:n]], dtype=torch.long, device=device)
        meta = batch([item for item, _ in fill], [item.next_tokens[:n] for item, n in fill],
                     [item.start for item, _ in fill], [])
        model.fill_draft_caches(meta, hidden[rows], kv_cache.latent, kv_cache.indexer)
    drafting = [item for item in inputs if item.num_drafts > 0]
    if not drafting:
        return {}
    if graphs is not None and graphs.takes(drafting):
        return graphs.run(drafting, hidden)
    # The first draft: each drafting request's last kept row through the whole layer.
    positions = [item.last_position for item in drafting]
    meta = batch(drafting, [[item.next_tokens[-1]] for item in drafting], positions, list(range(len(drafting))))
    last = torch.tensor([item.hidden_rows[-1] for item in drafting], dtype=torch.long, device=device)
    prev, topk = model.draft(meta, hidden[last], kv_cache.latent, kv_cache.indexer)
    tokens = model.draft_logits(prev).argmax(-1)
    # Each step's drafts stay on the device and feed the next step there: one read back at the end, not one a step.
    steps = [(list(range(len(drafting))), tokens)]  # (the drafting requests it covers, their tokens)
    active = steps[0][0]
    shared = topk if (share_index and topk is not None) else None
    for step in range(1, max(item.num_drafts for item in drafting)):
        kept = [j for j, previous in enumerate(active) if drafting[previous].num_drafts > step]
        pick = torch.tensor(kept, device=device)
        active = [active[j] for j in kept]
        meta = batch([drafting[j] for j in active], [[0]] * len(active), [positions[j] + step for j in active],
                     list(range(len(active))))
        meta = dataclasses.replace(meta, input_ids=tokens[pick], derived={})
        select = None
        if shared is not None:
            shared = shared[pick]
            new = torch.tensor([[positions[j] + s for s in range(1, step + 1)] for j in active], dtype=shared.dtype,
                               device=device)
            select = torch.cat([shared, new], dim=1)
        prev, _ = model.draft(meta, prev[pick], kv_cache.latent, kv_cache.indexer, select)
        tokens = model.draft_logits(prev).argmax(-1)
        steps.append((active, tokens))
    read = iter(torch.cat([t for _, t in steps]).tolist())
    drafts = {item.request_id: [] for item in drafting}
    for covered, _ in steps:
        for j in covered:
            drafts[drafting[j].request_id].append(next(read))
    return drafts
