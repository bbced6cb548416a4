"""The lightning indexer's projections (full layers only).

    q = rope(wq_b(q_resid))        [T, index_n_heads, index_head_dim]
    k = rope(LayerNorm(wk(x)))     [T, index_head_dim]
    w = weights_proj(x) in fp32    [T, index_n_heads], times index_head_dim^-0.5 · index_n_heads^-0.5

RoPE acts on the first qk_rope_head_dim dims of q and k (the main attention's rope dims are its last).
What the scores are and how the top-k is taken from them is the attention layer's (attention/indexer_selection.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from dsaserve.attention.indexer_selection import Selection, select_topk, select_written
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.model.decode_plan import Piece
from dsaserve.model.layers import apply_rope, one_operator
from dsaserve.model.linear import Linear
from dsaserve.quantization.quantized_weight import QuantizedWeight, packed_args


@dataclass(frozen=True)
class IndexKeysBinding:
    """keys() as one native chain: wk packed, the LayerNorm's weight and bias, the rotary layout."""

    wk: QuantizedWeight
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor
    eps: float
    interleaved: bool

    @cached_property
    def native_args(self) -> tuple:
        return *packed_args(self.wk), self.norm_weight, self.norm_bias, self.eps, self.interleaved


@dataclass(frozen=True)
class SelectionBinding:
    """queries() as one native chain, for a decode step's selection made natively: wq_b packed, weights_proj in
    fp32, both scales folded into weight_scale. Fields None where the selection is always made in Python."""

    wq: QuantizedWeight | None = None
    weights_proj: torch.Tensor | None = None
    weight_scale: float = 0.0
    heads: int = 0
    head_dim: int = 0
    interleaved: bool = False

    @cached_property
    def native_args(self) -> tuple:
        wq = packed_args(self.wq) if self.wq is not None else (None, None, [])
        return *wq, self.weights_proj, self.weight_scale, self.heads, self.head_dim, self.interleaved


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, selection: Selection):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.selection = selection
        self.rope_interleave = cfg.indexer_rope_interleave
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)  # kept in fp32
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: BatchMetadata, key_cache) -> torch.Tensor:
        """Selected logical positions int32 [T, width] (-1 = empty); this step's keys go to `key_cache`.
        The queries are projected only when the selection needs scores."""
        return select_topk(self.keys(x, cos, sin), lambda: self.queries(x, q_resid, cos, sin), key_cache, meta,
                           self.selection)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: BatchMetadata, key_cache) -> torch.Tensor:
        """`forward` once this step's keys are in `key_cache` (a decode plan's keys piece writes them)."""
        return select_written(lambda: self.queries(x, q_resid, cos, sin), key_cache, meta, self.selection)

    def decode_pieces(self, h: int, q_resid: int) -> list[Piece]:
        """forward() as native pieces (model/decode_plan.py): the keys, where they have a native form, and the
        selection (made natively where its queries have one, else by select() in Python)."""
        keys = self.keys_binding()
        pieces = [Piece("index_keys", keys, (h,))] if keys is not None else []
        return pieces + [Piece("select", self.selection_binding(), (h, q_resid))]

    def keys_binding(self) -> IndexKeysBinding | None:
        """The keys' native arguments, or None where wk is not packed (or has a bias) or the norm's dtype differs."""
        wk, norm = self.wk.weight, self.k_norm
        if not (isinstance(wk, QuantizedWeight) and self.wk.bias is None and norm.weight is not None
                and norm.bias is not None and norm.weight.dtype == norm.bias.dtype):
            return None
        return IndexKeysBinding(wk, norm.weight, norm.bias, norm.eps, self.rope_interleave)

    def selection_binding(self) -> SelectionBinding:
        """The queries' native arguments where wq_b is packed and weights_proj fp32 (token top-k only: page
        selection stays in Python); else an empty binding."""
        wq, proj = self.wq_b.weight, self.weights_proj
        if not (isinstance(wq, QuantizedWeight) and self.wq_b.bias is None and proj.bias is None
                and proj.weight.dtype == torch.float32 and not self.selection.pages):
            return SelectionBinding()
        return SelectionBinding(wq, proj.weight, self.weight_scale, self.n_heads, self.head_dim, self.rope_interleave)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.rope(self.k_norm(self.wk(x)), cos, sin)

    def write_keys(self, x: torch.Tensor, cos, sin, meta: BatchMetadata, cache) -> None:
        """What forward() writes to the key cache, alone."""
        cache.write(meta.slot_mapping, meta.rows_to_write(self.keys(x, cos, sin)))

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, heads, head_dim], per-head weights [T, heads] fp32 with both scales folded in)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weight_scale
        return self.rope(q, cos, sin), weights

    def dense_scores(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     shape: tuple[int, int]) -> torch.Tensor:
        """Every query's score of every key of its row in a padded [B, S] batch: [B, S, S], unmasked (training,
        model/training_pass.py). The scores attention/indexer_selection.py takes from the cache."""
        b, s = shape
        keys = self.keys(x, cos, sin).view(b, s, self.head_dim)
        q, weights = self.queries(x, q_resid, cos, sin)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2).reshape(b, self.n_heads * s, self.head_dim)
        per_head = torch.bmm(q, keys.transpose(1, 2)).view(b, self.n_heads, s, s)
        weights = weights.view(b, s, self.n_heads).transpose(1, 2)[..., None].to(per_head.dtype)  # (bf16 in autocast)
        return (per_head.relu() * weights).sum(1)

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rope_dim dims, the rest unchanged."""
        if t.shape[0] and cos.shape[1] * 2 == self.rope_dim and one_operator(t, cos, sin):
            return torch.ops.dsaserve.apply_rope.default(t, cos, sin, self.rope_interleave)  # rotates the first dims
        rotated = apply_rope(t[..., : self.rope_dim], cos, sin, self.rope_interleave)
        return torch.cat([rotated, t[..., self.rope_dim :]], -1)
