"""A training pass: the serving modules run over a padded [batch, seq] batch, differentiably, with no cache.

The decoder layers take a TrainingPass where serving passes its BatchMetadata (`input_ids`, `positions` and
`seq_lens_host` mean the same). MLA then attends over the batch's own latent rows instead of the paged cache
(MLAAttention.train_forward): everything else, from the norms to the router and the experts, is the serving
code. What DSA training needs besides the logits is kept here: each indexer's scores and selection, the
attention probabilities of the layers that use them, and chosen heads' probabilities (with their gradients).

`sparse` restricts every attention to its indexer's top-k (the serving computation); otherwise it is causal and
dense, while full layers still score (their KL loss trains the indexers). A draft chain (demo/mtp_chain.py)
passes `earlier`: the rows its earlier steps wrote, which this pass's queries also see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class IndexerTrace:
    """One full layer's indexer scores [B, S, S] and the summed attention of the layers that use its selection."""

    scores: torch.Tensor
    selected: torch.Tensor | None  # bool [B, S, S] in sparse mode
    attention: list[torch.Tensor] = field(default_factory=list)  # each [B, S, S], summed over heads


@dataclass
class TrainingPass:
    input_ids: torch.Tensor  # [B·S], row-major
    positions: torch.Tensor  # [B·S]
    shape: tuple[int, int]  # (B, S)
    sparse: bool
    index: bool = True  # whether full layers run their indexers (a draft chain attends densely without)
    watch: tuple[tuple[str, int], ...] = ()  # (attention prefix such as "model.layers.5.self_attn", head)
    traces: list[IndexerTrace] = field(default_factory=list)
    head_attention: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # watch → [B, S, T]
    # A draft chain's earlier steps' rows [B, S, row] (one attention layer): the first seen causally, each
    # later one only at the query's own position. `rows` receives this pass's.
    earlier: list[torch.Tensor] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, ids: torch.Tensor, sparse: bool, first_position: int = 0, **fields) -> TrainingPass:
        b, s = ids.shape
        positions = torch.arange(first_position, first_position + s).repeat(b)
        return cls(ids.reshape(-1), positions, (b, s), sparse, **fields)

    @property
    def seq_lens_host(self) -> list[int]:
        return [int(self.positions.max()) + 1]

    def causal(self) -> torch.Tensor:
        s = self.shape[1]
        return torch.ones(s, s, dtype=torch.bool).tril()

    def select(self, scores: torch.Tensor, topk: int) -> torch.Tensor | None:
        """A full layer's index scores [B, S, S] (every key, unmasked): recorded, and in sparse mode each query's
        top-k visible keys (bool [B, S, S]); None in dense mode."""
        causal = self.causal()
        scores = scores.masked_fill(~causal, float("-inf"))
        selected = None
        if self.sparse:
            top = scores.topk(min(topk, self.shape[1]), dim=-1).indices
            selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & causal
        self.traces.append(IndexerTrace(scores, selected))
        return selected

    def attend(self, name: str, query: torch.Tensor, rows: torch.Tensor, scale: float, value_dim: int,
               selected: torch.Tensor | None) -> torch.Tensor:
        """Absorbed attention of query [B·S, H, row] over the batch's rows [B·S, row] (and the earlier steps'),
        the first value_dim of each row its value: the attended latents [B·S, H, value_dim]."""
        b, s = self.shape
        heads, width = query.shape[1], query.shape[2]
        q = query.view(b, s, heads, width).transpose(1, 2)  # [B, H, S, row]
        rows = rows.view(b, s, width)
        self.rows.append(rows)
        first, own = (self.earlier[0], [*self.earlier[1:], rows]) if self.earlier else (rows, [])
        visible = selected[:, None] if selected is not None else self.causal()
        # (every head against the one set of rows: one [B, H·S, row] × [B, row, S] product, the rows not repeated)
        logits = torch.bmm(q.reshape(b, heads * s, width), first.transpose(1, 2)).view(b, heads, s, s)
        logits = logits.masked_fill(~visible, float("-inf"))
        if own:  # a chain step's own rows: one key per earlier step, at the query's position
            logits = torch.cat([logits, (q[..., None, :] * torch.stack(own, dim=-2)[:, None]).sum(-1)], dim=-1)
        probs = (logits * scale).softmax(-1)
        if self.traces:
            self.traces[-1].attention.append(probs[..., :s].detach().sum(1))
        for watched, head in self.watch:
            if watched == name:
                self.head_attention[name, head] = probs[:, head]
        out = torch.bmm(probs[..., :s].reshape(b, heads * s, s), first[..., :value_dim]).view(b, heads, s, value_dim)
        if own:
            out = out + (probs[..., s:, None] * torch.stack(own, dim=-2)[:, None, ..., :value_dim]).sum(-2)
        return out.transpose(1, 2).reshape(b * s, heads, value_dim)
