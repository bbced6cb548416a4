"""The MTP drafter's rounds replayed from CUDA graphs: a round's draft steps (the first from each request's last kept
row, then one row per request and step, each fed the step before's token and hidden state) captured at start-up once
per batch size and context bucket, beside the decode graphs and in their memory pool.

A round takes each request's last kept row (the token after it, its position, the target's hidden state there) and
its block table. The host knows every position the round writes (the last kept row's and the num_speculative_tokens
- 1 after it), so they travel in the static inputs as a verify step's rows do; only the tokens come from the device,
each step's argmax feeding the next inside the graph. Padding requests draft from the padding block. With
`index_share_for_mtp_iteration`, steps after the first attend to the first step's selection plus the positions drafted
since, as eager rounds do (mtp_drafter.py).

Every round of at most the largest size replays, also where a request drafts fewer tokens (near its max_tokens or the
end of its blocks): it drafts num_speculative_tokens all the same, the positions past its block table writing into
the padding block (decode_graphs.slot_of), and only its first drafts are kept (a draft depends only on the steps
before it). Rounds that would reach past max_model_len run eagerly.

The catch-up before a round (the MTP layer's cache entries of the rows verification kept, but each drafting request's
last) replays graphs of its own (CatchUpGraphs): num_speculative_tokens rows per request, a request with fewer kept
rows padded after them. Those padding rows write at the positions the round writes next (a drafting request's last
kept row and after), or at positions no row attends to before a later catch-up rewrites them.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from dsaserve.engine.speculative.mtp_drafter import DraftInput
from dsaserve.engine.workers import decode_graphs
from dsaserve.engine.workers.decode_graphs import CapturedSteps, CudaGraph, Shape

logger = logging.getLogger(__name__)


def capture(model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int, num_drafts: int,
            share_index: bool, pool=None) -> "DraftGraphs | None":
    """The drafter's graphs, in `pool` (the decode graphs'); None, with a warning saying why, where a capture fails
    (drafting then runs eagerly)."""
    try:
        return DraftGraphs(model, kv_cache, sizes, max_model_len, pad_block, num_drafts, share_index,
                           make_graph=decode_graphs.CudaGraph, pool=pool)  # (looked up here: tests replace it)
    except RuntimeError as error:  # an operation the capture refused
        logger.warning("CUDA graphs: capturing the drafter's rounds failed, so they run eagerly: %s", error)
        return None


class DraftGraphs(CapturedSteps):
    what = "draft rounds"

    def __init__(self, model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int, num_drafts: int,
                 share_index: bool, make_graph: Callable[[object], object] = CudaGraph, pool=None):
        super().__init__(model, kv_cache, sizes, max_model_len, pad_block, rows=(num_drafts,))
        self.num_drafts, self.share_index = num_drafts, share_index
        # The target's hidden state at each request's last kept row (after the final norm), copied in before a replay.
        self.hidden = torch.zeros(sizes[-1], model.config.hidden_size, dtype=model.model.norm.weight.dtype,
                                  device=kv_cache.device)
        self.capture_all(make_graph, pool)
        self.catch_up = CatchUpGraphs(model, kv_cache, sizes, max_model_len, pad_block, num_drafts, make_graph,
                                      self.pool)

    def replayed(self) -> str:
        return (f"rounds of up to {self.sizes[-1]} requests replay them, a request that drafts fewer tokens drafting "
                f"{self.num_drafts} and keeping its first")

    def takes(self, drafting: list[DraftInput]) -> bool:
        return (0 < len(drafting) <= self.sizes[-1] and all(item.num_drafts <= self.num_drafts for item in drafting)
                and max(item.last_position for item in drafting) + self.num_drafts <= self.contexts[-1])

    def run(self, drafting: list[DraftInput], hidden: torch.Tensor) -> dict[str, list[int]]:
        """Each request's drafts (read back once), from the target's hidden states `hidden` (after the final norm) at
        the rows DraftInput.hidden_rows name."""
        n, k = len(drafting), self.num_drafts
        last = torch.tensor([item.hidden_rows[-1] for item in drafting], dtype=torch.long, device=hidden.device)
        self.hidden[:n].copy_(hidden[last])
        self._replay(n, k, max(item.last_position for item in drafting) + k,
                     [([item.next_tokens[-1]] + [0] * (k - 1), item.last_position, item.block_table, -1)
                      for item in drafting])
        rows = self.outputs[0][:n].tolist()
        return {item.request_id: row[:item.num_drafts] for item, row in zip(drafting, rows)}

    def _body(self, shape: Shape) -> Callable[[], tuple[torch.Tensor, ...]]:
        return lambda: (self._round(shape),)

    def _round(self, shape: Shape) -> torch.Tensor:
        """The staged rows into the fields, then the draft steps: tokens [size, num_drafts]."""
        self.inputs.unstage(shape)
        size, k = shape.size, shape.rows
        positions = self.inputs.positions[:shape.tokens].view(size, k)
        slots = self.inputs.slots[:shape.tokens].view(size, k)
        tokens, prev = self.inputs.ids[:shape.tokens].view(size, k)[:, 0], self.hidden[:size]
        shared = select = None
        drafted = []
        for step in range(k):
            meta = self._metadata(shape, 1, tokens, positions[:, step].contiguous(), slots[:, step].contiguous())
            self._fresh_batch(meta, 1)
            if shared is not None:  # the first step's selection and the positions drafted since
                select = torch.cat([shared, positions[:, 1:step + 1].to(shared.dtype)], dim=1)
            prev, topk = self.model.draft(meta, prev, self.kv_cache.latent, self.kv_cache.indexer, select)
            if step == 0 and self.share_index:
                shared = topk
            tokens = self.model.draft_logits(prev).argmax(-1)
            drafted.append(tokens)
        return torch.stack(drafted, dim=1)


class CatchUpGraphs(CapturedSteps):
    what = "MTP cache catch-ups"

    def __init__(self, model, kv_cache, sizes: tuple[int, ...], max_model_len: int, pad_block: int, num_drafts: int,
                 make_graph: Callable[[object], object] = CudaGraph, pool=None):
        super().__init__(model, kv_cache, sizes, max_model_len, pad_block, rows=(num_drafts,))
        # The target's hidden states at the rows each request fills (then padding rows'), copied in before a replay.
        self.hidden = torch.zeros(sizes[-1] * num_drafts, model.config.hidden_size,
                                  dtype=model.model.norm.weight.dtype, device=kv_cache.device)
        self.capture_all(make_graph, pool)

    def replayed(self) -> str:
        return (f"catch-ups of up to {self.sizes[-1]} requests of at most {self.rows[0]} kept rows each replay them; "
                "the rest (prompt rows) run eagerly")

    def takes(self, fill: list[tuple[DraftInput, int]]) -> bool:
        """fill: (request, how many of its kept rows to fill), as mtp_drafter.propose makes them."""
        k = self.rows[0]
        return (0 < len(fill) <= self.sizes[-1] and all(n <= k for _, n in fill)
                and max(item.start for item, _ in fill) + k <= self.contexts[-1])

    def run(self, fill: list[tuple[DraftInput, int]], hidden: torch.Tensor) -> None:
        n, k = len(fill), self.rows[0]
        rows = [row for item, m in fill for row in item.hidden_rows[:m] + [item.hidden_rows[0]] * (k - m)]
        self.hidden[:n * k].copy_(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])
        self._replay(n, k, max(item.start for item, _ in fill) + k,
                     [(item.next_tokens[:m], item.start, item.block_table, -1) for item, m in fill])

    def _body(self, shape: Shape) -> Callable[[], tuple[torch.Tensor, ...]]:
        n = shape.tokens
        meta = self._metadata(shape, shape.rows, self.inputs.ids[:n], self.inputs.positions[:n], self.inputs.slots[:n])

        def catch_up() -> tuple[torch.Tensor, ...]:
            self.inputs.unstage(shape)
            self._fresh_batch(meta, shape.rows)
            self.model.fill_draft_caches(meta, self.hidden[:n], self.kv_cache.latent, self.kv_cache.indexer)
            return ()  # (it only writes the caches)
        return catch_up
