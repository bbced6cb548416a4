"""A decoder layer's few-token step as its native operators, called one after another.

For a few tokens with packed weights, every piece of a layer already runs as one native call (norms, MLA's
query, latent rows and output, the router, the experts); what remains around them is Python deciding, per
piece and per step, that it may make that call, and gathering its arguments. Timed on the benchmark model's
structure at tiny widths (benchmarks/step_overhead.py), that Python was over a third of a layer's time.
Here a layer gathers its calls once (`decode_calls`), checks per step only what depends on the tokens
(`applies`), and makes the same calls with the same arguments in the same order: the same bits as its
modules. The indexer and the attention backend are called as they are (their paths depend on the batch).
Where any piece would take another path (weights not packed, a bias, tensor or context parallelism, no
kernels), `decode_calls` is None and the layer runs through its modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.native import torch_ops
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, PackedMatrix, QuantizedWeight


@dataclass(frozen=True)
class DecodeCalls:
    dtype: torch.dtype  # of the norms' weights: the activations must be in it
    input_norm: tuple  # (weight, eps)
    query: tuple  # mla_query's weight arguments and its shape arguments
    latents: tuple  # quant_linear's arguments for kv_a_proj_with_mqa, then (norm weight, eps, interleaved)
    output: tuple  # mla_output's weight arguments
    post_norm: tuple  # (weight, eps)
    route: tuple | None  # moe_route's arguments after x (MoE layers)
    experts: tuple | None  # moe_experts' (tensors, tail) with the shared experts in the call (MoE layers)
    dense_mlp: tuple | None  # gated_mlp's arguments after x (dense layers)


def decode_calls(layer) -> DecodeCalls | None:
    """The layer's calls, gathered once; None where one of its pieces would not make its native call."""
    from dsaserve.model.layers import GatedMLP
    from dsaserve.model.moe import MoE
    from dsaserve.quantization.packed_experts import routed_expert_args

    attn, mlp = layer.self_attn, layer.mlp
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    query, output, latents = (attn.prepared("query", attn._query_call), attn.prepared("output", attn._output_call),
                              attn.prepared("latents", attn._latents_call))
    if query is None or output is None or output[1].size != 1 or attn.parallel.check_ranks:
        return None
    kv_weight, kv_bias, latent_norm, latent_eps = latents
    if not isinstance(kv_weight, PackedMatrix) or kv_bias is not None:
        return None
    dtype = norm.weight.dtype
    if any(w.dtype != dtype for w in (post.weight, query[0], latent_norm)) or dtype not in (torch.bfloat16,
                                                                                            torch.float32):
        return None
    route = experts = dense = None
    if isinstance(mlp, MoE):
        gate, gate_up, down, shared, shared_weights, elsewhere = mlp.prepared("parts", mlp._parts)
        route = gate.prepared("route", gate._route_call)
        if (route is None or elsewhere or shared is None or mlp.comm.size != 1
                or not all(_packed(w, gate_up.kind) for w in (gate_up, down, *shared_weights))):
            return None
        experts = routed_expert_args(gate_up, down, shared)
    elif isinstance(mlp, GatedMLP):
        gate_up, down = mlp.gate_up_proj, mlp.down_proj.weight
        if mlp.down_proj.comm.size != 1 or not (_packed(gate_up, gate_up.kind) and _packed(down, gate_up.kind)):
            return None
        dense = (gate_up.qweight, gate_up.scale, down.qweight, down.scale, gate_up.args[0], mlp.intermediate_size,
                 gate_up.args[1], down.args[1], down.col_offset)
    else:
        return None
    return DecodeCalls(dtype, (norm.weight, norm.eps), query[1:],
                       ((kv_weight.qweight, kv_weight.scale, *kv_weight.args), (latent_norm, latent_eps,
                                                                                attn.rope_interleave)),
                       output[0], (post.weight, post.eps), route, experts, dense)


def _packed(weight, kind: str) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.kind == kind and weight.col_offset == 0


def applies(calls: DecodeCalls, x: torch.Tensor, cos: torch.Tensor, meta, kv_cache: torch.Tensor) -> bool:
    """What the modules check per step, for these tokens: few rows on the CPU in the weights' dtype, the
    kernels here, every row written to this rank's caches."""
    dtype = x.dtype
    return (0 < x.shape[0] <= KERNEL_ROWS and dtype is calls.dtype and x.is_cpu and cos.dtype is dtype
            and kv_cache.dtype is dtype and meta.shard is None and meta.write_rows is None
            and torch_ops.cpu_kernels() == "avx512_bf16")


def run_layer(layer, calls: DecodeCalls, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer: bool):
    """DecoderLayer.forward's result, through the gathered calls (only where `applies`)."""
    ops = torch.ops.dsaserve
    attn = layer.self_attn
    h = ops.rms_norm.default(x, *calls.input_norm)
    weights, shape = calls.query
    query, q_resid = ops.mla_query.default(h, *weights, cos, sin, *shape)
    kv_args, (latent_norm, latent_eps, interleaved) = calls.latents
    kv = ops.quant_linear.default(h, *kv_args)
    ops.write_latent_rows.default(kv, latent_norm, latent_eps, cos, sin, interleaved, kv_cache.view(-1, kv.shape[-1]),
                                  meta.slot_mapping)
    topk = prev_topk
    if attn.backend.uses_indexer and attn.indexer is not None and run_indexer:
        topk = attn.indexer(h, q_resid, cos, sin, meta, indexer_cache)
    latent = attn.backend.forward(query, kv_cache, meta, attn.scale, attn.kv_lora_rank, topk)
    attended = ops.mla_output.default(latent, *calls.output)
    h, x = ops.add_rms_norm.default(x, attended, *calls.post_norm)
    if calls.dense_mlp is not None:
        return x + ops.gated_mlp.default(h, *calls.dense_mlp), topk
    expert_weights, ids = ops.moe_route.default(h, *calls.route)
    out = torch.empty_like(h)
    tensors, tail = calls.experts
    ops.moe_experts.default(h.contiguous(), *tensors, ids.contiguous(), expert_weights.float().contiguous(), out,
                            *tail)
    return x + out, topk
