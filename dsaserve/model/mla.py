"""Multi-head Latent Attention in absorbed form over the paged latent cache.

The cache row of a token is `[kv_a_layernorm(latent) | rope(k_rope)]`. W_UK (from kv_b_proj) is folded
into the query so scores are taken against cached rows directly, and W_UV is applied after the
weighted sum of latents: the cache is never re-expanded into per-head keys and values.

With tensor parallelism a rank computes its own heads (q_b_proj, W_UK, W_UV split by head) against the
full latent cache, and o_proj all-reduces; the latent, the rope key and the indexer are the same on
every rank. With decode context parallelism the cache holds this rank's share of the tokens only
(attention/context_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from dsaserve import triton_ops
from dsaserve.attention.context_parallel import attend_context_shard
from dsaserve.attention.indexer_selection import Selection
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext, check_same_on_ranks
from dsaserve.model.decode_plan import NewRegister, Piece
from dsaserve.model.indexer import Indexer
from dsaserve.model.layers import RMSNorm, apply_rope, attention_scale, one_operator
from dsaserve.model.linear import Linear, linear
from dsaserve.model.parallel_layers import RowParallelLinear
from dsaserve.model.pooled_indexer import PooledIndexer
from dsaserve.model.training_pass import TrainingPass
from dsaserve.native import torch_ops
from dsaserve.prepared_calls import PreparedCalls
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, PackedMatrix, QuantizedWeight, packed_args


@dataclass(frozen=True)
class MlaQueryBinding:
    """The absorbed query's native arguments (native/mla_projections.cpp mla_query), its weights packed."""

    q_a: QuantizedWeight
    q_norm: torch.Tensor  # q_a_layernorm's weight
    q_eps: float
    q_b: QuantizedWeight
    w_uk: QuantizedWeight
    interleaved: bool
    heads: int
    nope: int
    rope: int

    @cached_property
    def native_args(self) -> tuple:
        return (*packed_args(self.q_a), self.q_norm, self.q_eps, *packed_args(self.q_b), *packed_args(self.w_uk),
                self.interleaved, self.heads, self.nope, self.rope)


@dataclass(frozen=True)
class LatentRowsBinding:
    """What writes the latent cache rows: kv_a_proj_with_mqa (its packed matrix where packed) and bias, the norm."""

    kv: PackedMatrix | torch.Tensor
    bias: torch.Tensor | None
    norm: torch.Tensor
    eps: float
    interleaved: bool

    @cached_property
    def native_args(self) -> tuple:
        return *packed_args(self.kv), self.norm, self.eps, self.interleaved


@dataclass(frozen=True)
class AttendBinding:
    """Attention over a step's cache rows (native/selected_rows.cpp): the softmax scale and the latent width; the
    heads and the cache row's width say whether the kernel takes the shape."""

    scale: float
    value_dim: int
    heads: int
    row_width: int

    @cached_property
    def native_args(self) -> tuple:
        return self.scale, self.value_dim


@dataclass(frozen=True)
class MlaOutputBinding:
    """o_proj(latent · W_UVᵀ) in one native call (mla_output), its weights packed; comm sums the ranks' parts."""

    w_uv: QuantizedWeight
    o: QuantizedWeight
    comm: object

    @cached_property
    def native_args(self) -> tuple:
        return *packed_args(self.w_uv), *packed_args(self.o)


class MLAAttention(PreparedCalls):
    # W_UK and W_UV may be packed per head; W_UK then as its transpose [H, rank, nope], so that both are
    # products x @ Wᵀ like every other projection.
    QUANTIZABLE = ("w_uk", "w_uv")
    TRANSPOSED = ("w_uk",)

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend, selection: Selection, full: bool | None = None,
                 parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext.single()
        self.parallel = parallel
        self.layer_idx = layer_idx
        self.num_heads = parallel.plan.local(cfg.num_attention_heads)  # this rank's heads
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.v_dim = cfg.v_head_dim
        self.rope_interleave = cfg.rope_interleave
        self.scale = attention_scale(cfg.qk_head_dim, cfg.rope)
        self.backend = backend
        bias = cfg.attention_bias
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.latent_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.latent_norm_eps)
        # kv_b_proj split per head at load time: W_UK [H, nope, rank] and W_UV [H, v, rank].
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope_dim, cfg.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.v_dim, cfg.kv_lora_rank))
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, cfg.hidden_size, bias, parallel.tp)
        full = cfg.is_full(layer_idx) if full is None else full
        if full:
            self.indexer = PooledIndexer(cfg) if cfg.hybrid is not None else Indexer(cfg, selection)
        else:
            self.indexer = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
        kv_cache: torch.Tensor, indexer_cache, prev_topk: torch.Tensor | None, run_indexer: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (attention output [T, hidden], top-k produced or reused here). With run_indexer off, a
        full layer attends with prev_topk instead (the MTP layer's later draft steps). decode_pieces() below
        is this order of operations as native pieces: a change here is made there too. Given a TrainingPass for
        meta, train_forward runs instead."""
        if isinstance(meta, TrainingPass):
            return self.train_forward(x, cos, sin, meta, prev_topk, run_indexer)
        q_resid, query = self.absorbed_query(x, cos, sin)
        self.write_latents(x, cos, sin, meta, kv_cache)

        topk = prev_topk
        if self.selects() and run_indexer:
            topk = self.indexer(x, q_resid, cos, sin, meta, indexer_cache)
            if self.parallel.check_ranks:
                check_same_on_ranks(self.parallel.tp, topk, f"layer {self.layer_idx} top-k")

        if meta.shard is None:
            out_latent = self.backend.forward(query, kv_cache, meta, self.scale, self.kv_lora_rank, topk)
        else:  # this rank holds 1/N of the context: attend to it, merge with the other ranks' parts
            out_latent = attend_context_shard(query, kv_cache, meta, self.scale, self.kv_lora_rank,
                                              topk if self.backend.uses_indexer else None)
        return self.attention_output(out_latent), topk

    def train_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: TrainingPass,
                      prev_selected: torch.Tensor | None, run_indexer: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward() over a padded training batch (model/training_pass.py): the same query, rows and output, the
        attention over the batch's own rows; (output, the selection made or reused here: None where dense). The
        indexer sees its inputs detached, as in DeepSeek-V3.2's training: only its KL loss trains it."""
        q_resid, query = self.absorbed_query(x, cos, sin)
        selected = prev_selected
        if self.selects() and run_indexer and batch.index:
            scores = self.indexer.dense_scores(x.detach(), q_resid.detach(), cos, sin, batch.shape)
            selected = batch.select(scores, self.indexer.selection.index_topk)
        out_latent = batch.attend(f"model.layers.{self.layer_idx}.self_attn", query, self.latent_rows(x, cos, sin),
                                  self.scale, self.kv_lora_rank, selected)
        return self.attention_output(out_latent), selected

    def decode_pieces(self, reads: tuple[int, ...], new: NewRegister) -> tuple[list[Piece], object] | None:
        """forward()'s operations for a few decode tokens as native pieces, in forward's order (model/decode_plan.py):
        the query, the latent rows, a full layer's indexer keys and selection, the attention, the output. None where
        one of them has no native form here (weights not packed, a bias, a split output)."""
        query, latents, output = self.query_binding(), self.latents_binding(), self.output_binding()
        if (query is None or output is None or output.comm.size != 1 or self.parallel.check_ranks
                or not isinstance(latents.kv, PackedMatrix) or latents.bias is not None):
            return None
        h = reads[0]
        q, q_resid, latent, attended = new(), new(), new(), new()
        pieces = [Piece("mla_query", query, (h,), (q, q_resid)), Piece("latent_rows", latents, (h,))]
        if self.selects():
            pieces += self.indexer.decode_pieces(h, q_resid)
        pieces += [Piece("attend", AttendBinding(self.scale, self.kv_lora_rank, self.num_heads,
                                                 self.kv_lora_rank + self.rope_dim), (q,), (latent,)),
                   Piece("mla_output", output, (latent,), (attended,))]
        return pieces, (attended, None)  # (the output, the top-k: the plan carries it between layers itself)

    def selects(self) -> bool:
        """Whether this layer attends with its own indexer's selection (a full layer, a backend that reads it)."""
        return self.backend.uses_indexer and self.indexer is not None

    def attention_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """o_proj of each head's attended latent [T, H, rank] times W_UVᵀ: [T, hidden]."""
        output = self.prepared("output", self.output_binding)
        if (output is not None and 0 < out_latent.shape[0] <= KERNEL_ROWS and out_latent.is_cpu
                and torch_ops.runs("mla_projections")):
            # A few tokens, packed weights: one native call, the same bits as the two products.
            y = torch.ops.dsaserve.mla_output.default(out_latent, *output.native_args)
            return y if output.comm.size == 1 else output.comm.all_reduce(y)
        out = per_head(out_latent, self.w_uv)  # [T, H, v]
        return self.o_proj(out.reshape(out_latent.shape[0], -1))

    def output_binding(self) -> MlaOutputBinding | None:
        """W_UV and o_proj for one native call, or None where they are not packed (or o_proj has a bias)."""
        o_proj, w_uv = self.o_proj, self.w_uv
        o = o_proj.weight
        if not (o_proj.bias is None and isinstance(w_uv, QuantizedWeight) and isinstance(o, QuantizedWeight)):
            return None
        return MlaOutputBinding(w_uv, o, o_proj.comm)

    def absorbed_query(self, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_resid [T, q_lora_rank], query [T, H, rank + rope] = [q_nope · W_UK | rope(q_rope)])."""
        query = self.prepared("query", self.query_binding)
        if (query is not None and 0 < x.shape[0] <= KERNEL_ROWS and torch_ops.runs("mla_projections")
                and one_operator(x, query.q_norm, cos, sin)):  # a few tokens, packed weights: one call, the same bits
            weights, shape = query.native_args[:11], query.native_args[11:]  # the operator takes cos, sin between
            q, q_resid = torch.ops.dsaserve.mla_query.default(x, *weights, cos, sin, *shape)
            return q_resid, q
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, -1)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = per_head(q_nope, self.w_uk, transposed=True)  # [T, H, rank]
        return q_resid, torch.cat([q_latent, apply_rope(q_rope, cos, sin, self.rope_interleave)], dim=-1)

    def query_binding(self) -> MlaQueryBinding | None:
        """The query's weights for one native call, or None where they are not all packed (or q_a_proj has a bias)."""
        qa, qb, uk = self.q_a_proj.weight, self.q_b_proj.weight, self.w_uk
        if not (self.q_a_proj.bias is None and all(isinstance(w, QuantizedWeight) for w in (qa, qb, uk))):
            return None
        norm = self.q_a_layernorm
        return MlaQueryBinding(qa, norm.weight, norm.eps, qb, uk, self.rope_interleave, self.num_heads, self.nope_dim,
                               self.rope_dim)

    def write_latents(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
                      kv_cache: torch.Tensor) -> None:
        """The cache rows of these tokens, `[kv_a_layernorm(latent) | rope(k_rope)]`, at their slots."""
        latents = self.prepared("latents", self.latents_binding)
        kv = linear(x, latents.kv, latents.bias)
        if meta.write_rows is None and kv.dtype == kv_cache.dtype and one_operator(kv, latents.norm, cos, sin):
            # One native call: the same bits as the operators below.
            torch.ops.dsaserve.write_latent_rows.default(kv, latents.norm, latents.eps, cos, sin, self.rope_interleave,
                                                         kv_cache.view(-1, kv.shape[-1]), meta.slot_mapping)
            return
        if meta.write_rows is None and kv.dtype == kv_cache.dtype and triton_ops.runs_on(kv):
            from dsaserve.triton_ops.latent_write import write_latent_rows  # norm, rope and write in one kernel

            write_latent_rows(kv, latents.norm, latents.eps, cos, sin, self.rope_interleave,
                              kv_cache.view(-1, kv.shape[-1]), meta.slot_mapping)
            return
        row = self.rows_of(kv, cos, sin)
        kv_cache.view(-1, row.shape[-1]).index_copy_(0, meta.slot_mapping, meta.rows_to_write(row).to(kv_cache.dtype))

    def latent_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The cache rows of these tokens [T, rank + rope], not written anywhere."""
        latents = self.prepared("latents", self.latents_binding)
        return self.rows_of(linear(x, latents.kv, latents.bias), cos, sin)

    def rows_of(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`[kv_a_layernorm(latent) | rope(k_rope)]` of kv_a_proj_with_mqa's output."""
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(latent), apply_rope(k_rope, cos, sin, self.rope_interleave)], dim=-1)

    def latents_binding(self) -> LatentRowsBinding:
        """kv_a_proj_with_mqa's weight (its packed matrix where packed) and bias, and kv_a_layernorm's weight
        and eps."""
        weight = self.kv_a_proj_with_mqa.weight
        norm = self.kv_a_layernorm
        return LatentRowsBinding(weight.matrix() if isinstance(weight, QuantizedWeight) else weight,
                                 self.kv_a_proj_with_mqa.bias, norm.weight, norm.eps, self.rope_interleave)

    def write_caches(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
                     kv_cache: torch.Tensor, indexer_cache) -> None:
        """What forward() leaves in the caches (the latent rows, and the indexer's keys where the backend
        reads them), without attending: for rows whose outputs nobody needs."""
        self.write_latents(x, cos, sin, meta, kv_cache)
        if self.selects():
            self.indexer.write_keys(x, cos, sin, meta, indexer_cache)


def per_head(x: torch.Tensor, weight, transposed: bool = False) -> torch.Tensor:
    """x [T, H, K] by each head's weight: [T, H, N]. A float weight is [H, N, K] ([H, K, N] when
    `transposed`, as W_UK is stored unpacked); a packed one is [H, N, K] either way."""
    rows = x.transpose(0, 1)
    if isinstance(weight, torch.Tensor):
        return torch.bmm(rows, weight if transposed else weight.transpose(1, 2)).transpose(0, 1)
    return weight.batched_matmul(rows).transpose(0, 1)
