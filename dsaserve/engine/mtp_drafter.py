"""Drafting with the MTP layer, after each verified step.

Catch-up: every row the target just computed and kept (prompt chunks; the last known token and the
accepted drafts) runs through the MTP layer with the token that follows it and the target's hidden
state, which fills the MTP layer's own caches at those positions and gives the first draft from the
last row. Draft steps 2…N then run one row per request at the next positions, feeding back the MTP
layer's hidden state. Their cache entries are speculative: the next catch-up rewrites those positions
with verified rows, so nothing unverified is ever attended by a verified row.

With `index_share_for_mtp_iteration`, steps 2…N skip the MTP indexer and attend to the selection the
first step made for the request's last row, plus the positions drafted since (always visible).
"""

from __future__ import annotations

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


def propose(model, kv_cache, inputs: list[DraftInput], hidden: torch.Tensor, share_index: bool) -> dict[str, list[int]]:
    """Draft tokens per request (those with num_drafts > 0)."""
    inputs = [item for item in inputs if item.hidden_rows]
    if not inputs:
        return {}
    block_size = kv_cache.block_size
    ends = []
    for item in inputs:
        ends.append((ends[-1] if ends else 0) + len(item.next_tokens))
    last_rows = [end - 1 for end in ends]
    meta = BatchMetadata.build([item.next_tokens for item in inputs], [item.start for item in inputs],
                               [item.block_table for item in inputs], block_size, last_rows, device=hidden.device,
                               shard=kv_cache.shard)
    rows = torch.tensor([r for item in inputs for r in item.hidden_rows], dtype=torch.long, device=hidden.device)
    out, topk = model.draft(meta, hidden[rows], kv_cache.latent, kv_cache.indexer)
    drafting = [i for i, item in enumerate(inputs) if item.num_drafts > 0]
    if not drafting:
        return {}
    last = torch.tensor([last_rows[i] for i in drafting], device=hidden.device)
    prev = out[last]
    tokens = model.draft_logits(prev).argmax(-1).tolist()
    drafts = {inputs[i].request_id: [t] for i, t in zip(drafting, tokens)}
    shared = topk[last] if (share_index and topk is not None) else None
    positions = [inputs[i].start + len(inputs[i].next_tokens) - 1 for i in drafting]  # each request's last row
    for step in range(1, max(inputs[i].num_drafts for i in drafting)):
        active = [j for j, i in enumerate(drafting) if inputs[i].num_drafts > step]
        if not active:
            break
        ids = [inputs[drafting[j]].request_id for j in active]
        meta = BatchMetadata.build([[drafts[r][-1]] for r in ids], [positions[j] + step for j in active],
                                   [inputs[drafting[j]].block_table for j in active], block_size,
                                   list(range(len(active))), device=hidden.device, shard=kv_cache.shard)
        select = None
        if shared is not None:
            pick = torch.tensor(active, device=hidden.device)
            new = torch.tensor([[positions[j] + s for s in range(1, step + 1)] for j in active], dtype=shared.dtype,
                               device=hidden.device)
            select = torch.cat([shared[pick], new], dim=1)
        prev, _ = model.draft(meta, prev[torch.tensor(active, device=hidden.device)], kv_cache.latent,
                              kv_cache.indexer, select)
        for r, t in zip(ids, model.draft_logits(prev).argmax(-1).tolist()):
            drafts[r].append(t)
        if shared is not None:
            shared = shared[torch.tensor(active, device=hidden.device)]
        positions = [positions[j] for j in active]
        drafting = [drafting[j] for j in active]
    return drafts
