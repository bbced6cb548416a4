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

import torch
from torch import nn

from dsaserve.attention.context_parallel import attend_context_shard
from dsaserve.attention.indexer import Selection
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext, check_same_on_ranks
from dsaserve.model.indexer import Indexer
from dsaserve.model.layers import RMSNorm, apply_rope, attention_scale, one_operator
from dsaserve.model.linear import Linear, linear
from dsaserve.model.parallel_layers import RowParallelLinear
from dsaserve.model.prepared_calls import PreparedCalls
from dsaserve.native import torch_ops
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, QuantizedWeight


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
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        # kv_b_proj split per head at load time: W_UK [H, nope, rank] and W_UV [H, v, rank].
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope_dim, cfg.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.v_dim, cfg.kv_lora_rank))
        self.o_proj = RowParallelLinear(self.num_heads * self.v_dim, cfg.hidden_size, bias, parallel.tp)
        full = cfg.is_full(layer_idx) if full is None else full
        self.indexer = Indexer(cfg, selection) if full else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
        kv_cache: torch.Tensor, indexer_cache, prev_topk: torch.Tensor | None, run_indexer: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (attention output [T, hidden], top-k produced or reused here). With run_indexer off, a
        full layer attends with prev_topk instead (the MTP layer's later draft steps)."""
        q_resid, query = self.absorbed_query(x, cos, sin)
        self.write_latents(x, cos, sin, meta, kv_cache)

        topk = prev_topk
        if self.backend.uses_indexer and self.indexer is not None and run_indexer:
            topk = self.indexer(x, q_resid, cos, sin, meta, indexer_cache)
            if self.parallel.check_ranks:
                check_same_on_ranks(self.parallel.tp, topk, f"layer {self.layer_idx} top-k")

        if meta.shard is None:
            out_latent = self.backend.forward(query, kv_cache, meta, self.scale, self.kv_lora_rank, topk)
        else:  # this rank holds 1/N of the context: attend to it, merge with the other ranks' parts
            out_latent = attend_context_shard(query, kv_cache, meta, self.scale, self.kv_lora_rank,
                                              topk if self.backend.uses_indexer else None)
        return self.attention_output(out_latent), topk

    def attention_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """o_proj of each head's attended latent [T, H, rank] times W_UVᵀ: [T, hidden]."""
        call = self.prepared("output", self._output_call)
        if call is not None and 0 < out_latent.shape[0] <= KERNEL_ROWS and torch_ops.cpu_kernels() == "avx512_bf16":
            # A few tokens, packed weights: one native call, the same bits as the two products.
            args, comm = call
            y = torch.ops.dsaserve.mla_output.default(out_latent, *args)
            return y if comm.size == 1 else comm.all_reduce(y)
        out = per_head(out_latent, self.w_uv)  # [T, H, v]
        return self.o_proj(out.reshape(out_latent.shape[0], -1))

    def _output_call(self):
        """(mla_output's weight arguments, o_proj's communicator), or None where its weights are not packed."""
        o_proj, w_uv = self.o_proj, self.w_uv
        o = o_proj.weight
        if not (o_proj.bias is None and isinstance(w_uv, QuantizedWeight) and isinstance(o, QuantizedWeight)):
            return None
        return (w_uv.qweight, w_uv.scale, w_uv.args, o.qweight, o.scale, o.args), o_proj.comm

    def absorbed_query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_resid [T, q_lora_rank], query [T, H, rank + rope] = [q_nope · W_UK | rope(q_rope)])."""
        if self._one_call_query(x, cos, sin):  # a few tokens, packed weights: one native call, the same bits
            _, weights, shape = self.prepared("query", self._query_call)
            query, q_resid = torch.ops.dsaserve.mla_query.default(x, *weights, cos, sin, *shape)
            return q_resid, query
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, -1)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = per_head(q_nope, self.w_uk, transposed=True)  # [T, H, rank]
        return q_resid, torch.cat([q_latent, apply_rope(q_rope, cos, sin, self.rope_interleave)], dim=-1)

    def _one_call_query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        call = self.prepared("query", self._query_call)
        return (call is not None and 0 < x.shape[0] <= KERNEL_ROWS and torch_ops.cpu_kernels() == "avx512_bf16"
                and one_operator(x, call[0], cos, sin))

    def _query_call(self):
        """(q_a_layernorm's weight, mla_query's weight arguments, its shape arguments), or None where the
        query's weights are not all packed."""
        qa, qb, uk = self.q_a_proj.weight, self.q_b_proj.weight, self.w_uk
        if not (self.q_a_proj.bias is None and all(isinstance(w, QuantizedWeight) for w in (qa, qb, uk))):
            return None
        norm = self.q_a_layernorm
        weights = (qa.qweight, qa.scale, qa.args, norm.weight, norm.eps, qb.qweight, qb.scale, qb.args, uk.qweight,
                   uk.scale, uk.args)
        return norm.weight, weights, (self.rope_interleave, self.num_heads, self.nope_dim, self.rope_dim)

    def write_latents(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
                      kv_cache: torch.Tensor) -> None:
        """The cache rows of these tokens, `[kv_a_layernorm(latent) | rope(k_rope)]`, at their slots."""
        weight, bias, norm_weight, eps = self.prepared("latents", self._latents_call)
        kv = linear(x, weight, bias)
        if meta.write_rows is None and kv.dtype == kv_cache.dtype and one_operator(kv, norm_weight, cos, sin):
            # One native call: the same bits as the operators below.
            torch.ops.dsaserve.write_latent_rows.default(kv, norm_weight, eps, cos, sin, self.rope_interleave,
                                                         kv_cache.view(-1, kv.shape[-1]), meta.slot_mapping)
            return
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        row = torch.cat([self.kv_a_layernorm(latent), apply_rope(k_rope, cos, sin, self.rope_interleave)], dim=-1)
        kv_cache.view(-1, row.shape[-1]).index_copy_(0, meta.slot_mapping, meta.rows_to_write(row).to(kv_cache.dtype))

    def _latents_call(self):
        """(kv_a_proj_with_mqa's weight (its packed matrix where packed) and bias, kv_a_layernorm's weight and eps)."""
        weight = self.kv_a_proj_with_mqa.weight
        norm = self.kv_a_layernorm
        return (weight.matrix() if isinstance(weight, QuantizedWeight) else weight, self.kv_a_proj_with_mqa.bias,
                norm.weight, norm.eps)

    def write_caches(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata,
                     kv_cache: torch.Tensor, indexer_cache) -> None:
        """What forward() leaves in the caches (the latent rows, and the indexer's keys where the backend
        reads them), without attending: for rows whose outputs nobody needs."""
        self.write_latents(x, cos, sin, meta, kv_cache)
        if self.backend.uses_indexer and self.indexer is not None:
            indexer_cache.write(meta.slot_mapping, meta.rows_to_write(self.indexer.keys(x, cos, sin)))


def per_head(x: torch.Tensor, weight, transposed: bool = False) -> torch.Tensor:
    """x [T, H, K] by each head's weight: [T, H, N]. A float weight is [H, N, K] ([H, K, N] when
    `transposed`, as W_UK is stored unpacked); a packed one is [H, N, K] either way."""
    rows = x.transpose(0, 1)
    if isinstance(weight, torch.Tensor):
        return torch.bmm(rows, weight if transposed else weight.transpose(1, 2)).transpose(0, 1)
    return weight.batched_matmul(rows).transpose(0, 1)
