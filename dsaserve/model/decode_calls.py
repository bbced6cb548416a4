"""A decoder layer's few-token step as two native operators, with its selection between them.

For a few tokens with packed weights, every piece of a layer runs as one native call (norms, MLA's query,
latent rows and output, the attention kernel, the router, the experts); what remained around them was
Python deciding, per piece and per step, that it may make that call, gathering its arguments, and one
argument conversion and dispatch per call. Here a layer gathers its arguments once (`decode_calls`), checks
per step only what depends on the tokens (`applies`), and runs as `decode_layer_in` (norm, query, latent
rows) and `decode_layer_out` (attention over the slots its backend chose for the step, output projection,
norm, MLP), which chain the same pieces in C++ (native/decode_layer.cpp): the same bits as its modules.
The indexer runs between the two as it is. Where the step's rows are not one kernel call's (prompt rows, a
batch whose requests split between whole-context and selected rows, fp32 activations, a shape the kernel
refuses), the attention backend and the later pieces are called one by one instead. Where any piece would
take another path (weights not packed, a bias, tensor or context parallelism, no kernels), `decode_calls`
is None and the layer runs through its modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.native import torch_ops
from dsaserve.native.selected_rows import FEW_HEADS_PADDED, fits as attention_fits
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, PackedMatrix, QuantizedWeight


@dataclass(frozen=True)
class DecodeCalls:
    dtype: torch.dtype  # of the norms' weights: the activations must be in it
    layer_in: tuple  # decode_layer_in's arguments after x up to cos, sin; then those after them up to the cache
    index_keys: tuple | None  # decode_layer_in's indexer-key arguments before the packed key cache (full layers)
    output: tuple  # mla_output's weight arguments
    post_norm: tuple  # (weight, eps)
    route: tuple | None  # moe_route's arguments after x (MoE layers)
    experts: tuple | None  # moe_experts' (tensors, tail) with the shared experts in the call (MoE layers)
    dense_mlp: tuple | None  # gated_mlp's arguments after x (dense layers)
    layer_out: tuple | None  # decode_layer_out's mlp arguments (tensors, ints, scaling); None: not for this layer


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
    weights, shape = query[1:]
    layer_in = ((norm.weight, norm.eps, *weights),
                (*shape, kv_weight.qweight, kv_weight.scale, list(kv_weight.args), latent_norm, latent_eps,
                 attn.rope_interleave))
    out_fits = dtype == torch.bfloat16 and attention_fits(max(attn.num_heads, FEW_HEADS_PADDED),
                                                          attn.kv_lora_rank + attn.rope_dim, attn.kv_lora_rank)
    return DecodeCalls(dtype, layer_in, _index_key_arguments(attn, dtype), output[0], (post.weight, post.eps), route,
                       experts, dense, _mlp_arguments(route, experts, dense) if out_fits else None)


def _index_key_arguments(attn, dtype: torch.dtype) -> tuple | None:
    """decode_layer_in's (wk_q, wk_s, wk_args, k_norm_weight, k_norm_bias, k_norm_eps, index_interleaved): the
    indexer's keys as model/indexer.py computes them, where its wk is packed and its norm in the layer's dtype."""
    indexer = attn.indexer
    if indexer is None or not attn.backend.uses_indexer:
        return None
    wk, norm = indexer.wk.weight, indexer.k_norm
    if not (isinstance(wk, QuantizedWeight) and indexer.wk.bias is None
            and norm.weight is not None and norm.bias is not None and norm.weight.dtype == norm.bias.dtype == dtype
            and indexer.rope_dim == attn.rope_dim):
        return None
    return wk.qweight, wk.scale, list(wk.args), norm.weight, norm.bias, norm.eps, indexer.rope_interleave


def _mlp_arguments(route, experts, dense) -> tuple[list, list, float]:
    """decode_layer_out's (mlp, mlp_args, routed_scaling): the router's and the experts' (routed, then shared)
    tensors and integers, or the dense MLP's (native/decode_layer.cpp lays them out)."""
    if dense is not None:
        return list(dense[:4]), list(dense[4:]), 0.0
    weight, bias, top_k, n_group, topk_group, normalize, scaling = route
    tensors, tail = experts
    kind, inter, gate_up_group, down_group, down_col_offset, *shared = tail
    shared_tensors, shared_ints = shared[:4], shared[4:]
    return ([weight, bias, *tensors, *shared_tensors],
            [top_k, n_group, topk_group, int(normalize), kind, inter, gate_up_group, down_group, down_col_offset,
             *shared_ints], float(scaling))


def _packed(weight, kind: str) -> bool:
    return isinstance(weight, QuantizedWeight) and weight.kind == kind and weight.col_offset == 0


def applies(calls: DecodeCalls, x: torch.Tensor, cos: torch.Tensor, meta, kv_cache: torch.Tensor) -> bool:
    """What the modules check per step, for these tokens: few rows on the CPU in the weights' dtype, the
    kernels here, every row written to this rank's caches."""
    dtype = x.dtype
    return (0 < x.shape[0] <= KERNEL_ROWS and dtype is calls.dtype and x.is_cpu and cos.dtype is dtype
            and kv_cache.dtype is dtype and meta.shard is None and meta.write_rows is None
            and torch_ops.cpu_kernels() == "avx512_bf16")


def run_layers(model, x, cos, sin, meta, kv_caches, indexer_caches) -> torch.Tensor | None:
    """The decoder layers' output (model: GlmMoeDsaModel) through their gathered calls one after another, where
    every layer has them and they apply to this step (else None: the layers run one by one). The same calls as
    each layer's forward without a module call, a check and a cache view per layer, and the backend's slot
    choice made once per top-k tensor (shared layers reuse their full layer's): the Python around a decode
    step's native calls, which costs a 200M-parameter model a few percent of its step."""
    plan = model.prepared("decode calls", lambda: _layer_calls(model.layers))
    if plan is None or not applies(plan[0][1], x, cos, meta, kv_caches[0]):
        return None
    topk, slots = None, {}
    for i, (layer, calls, rows) in enumerate(plan):
        kv_cache = kv_caches[i]
        if rows[0] is not kv_cache:  # a cache not seen before: its rows as a view, kept while it lasts
            if kv_cache.dtype is not x.dtype:
                return None
            rows[:] = kv_cache, kv_cache.view(-1, kv_cache.shape[-1])
        x, topk = run_layer(layer, calls, x, cos, sin, meta, kv_cache, indexer_caches.get(i), topk, True, slots,
                            rows[1])
    return x


def _layer_calls(layers) -> list | None:
    """Each layer with its gathered calls and a place for its cache's rows view; None where a layer has none."""
    calls = [layer.prepared("decode calls", layer._decode_calls) for layer in layers]
    return None if not calls or any(c is None for c in calls) else [(l, c, [None, None]) for l, c in zip(layers, calls)]


def run_layer(layer, calls: DecodeCalls, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer: bool,
              slots_by_topk: dict | None = None, rows: torch.Tensor | None = None):
    """DecoderLayer.forward's result, through the gathered calls (only where `applies`). slots_by_topk: the
    backend's slot choices of this step so far (run_layers), keyed by the top-k tensor they were made for;
    rows: kv_cache as [slots, width]."""
    ops = torch.ops.dsaserve
    attn = layer.self_attn
    if rows is None:
        rows = kv_cache.view(-1, kv_cache.shape[-1])
    head, tail = calls.layer_in
    selects = attn.backend.uses_indexer and attn.indexer is not None and run_indexer
    keys_in_call = selects and calls.index_keys is not None and indexer_cache.packed
    keys = (*calls.index_keys, indexer_cache.groups) if keys_in_call else ()
    h, query, q_resid = ops.decode_layer_in.default(x, *head, cos, sin, *tail, rows, meta.slot_mapping, *keys)
    topk = prev_topk
    if keys_in_call:
        topk = attn.indexer.select(h, q_resid, cos, sin, meta, indexer_cache)
    elif selects:
        topk = attn.indexer(h, q_resid, cos, sin, meta, indexer_cache)
    slots = _decode_slots(attn.backend, meta, topk, slots_by_topk) if calls.layer_out is not None else None
    if slots is not None:
        return ops.decode_layer_out.default(query, rows, slots, attn.scale, attn.kv_lora_rank, x, *calls.output,
                                            *calls.post_norm, *calls.layer_out), topk
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


def _decode_slots(backend, meta, topk, made: dict | None):
    """backend.decode_slots(meta, topk), asked once per (backend, top-k tensor) where `made` keeps the answers
    (the entry holds the tensor, so no other can take its id during the step)."""
    if made is None:
        return backend.decode_slots(meta, topk)
    key = (id(backend), id(topk))
    if key not in made:
        made[key] = (topk, backend.decode_slots(meta, topk))
    return made[key][1]
