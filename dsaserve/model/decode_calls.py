"""A decoder layer's few-token step as two native halves, its weights bound once, and runs of layers in one call.

For a few tokens with packed weights, every piece of a layer runs as one native call (norms, MLA's query,
latent rows and output, the attention kernel, the router, the experts); what remained around them was
Python deciding, per piece and per step, that it may make that call, gathering its arguments, and one
argument conversion and dispatch per call. Here a layer gathers its arguments once (`decode_calls`) and binds
them to a native handle (`BoundLayer`); per step only what depends on the tokens is checked (`applies`) and
passed. A layer runs as its `in` half (norm, query, latent rows; the indexer's keys in full layers) and its
`out` half (attention over the slots its backend chose for the step, output projection, norm, MLP), chained in
C++ (native/decode_layer.cpp): the same bits as its modules. Where every request of a decode batch is past
index_topk and each full layer's indexer queries are bound too (`_selection_arguments`), one call runs the whole
step and makes each full layer's selection between its halves (the indexer's queries, the selection and its slots
as Python would make them: `_selection_in_call`). Otherwise the indexer's selection runs between the halves in
Python, so `run_layers` hands a whole run of halves to one `decode_layers` call, up to the next full layer
whose selection needs scores (none while every request sees at most index_topk tokens, nor with the dense
backend: then one call runs the step's layers). Where the step's rows are not one kernel call's (prompt rows, a
batch whose requests split between whole-context and selected rows, fp32 activations, a shape the kernel
refuses), the attention backend and the later pieces are called one by one instead. Where any piece would
take another path (weights not packed, a bias, tensor or context parallelism, no kernels), `decode_calls`
is None and the layer runs through its modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.attention.indexer import QUERY_TILE, chunk_and_window, selects_every_position
from dsaserve.native import torch_ops
from dsaserve.native.selected_rows import FEW_HEADS_PADDED, fits as attention_fits
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, PackedMatrix, QuantizedWeight


@dataclass(frozen=True)
class DecodeCalls:
    dtype: torch.dtype  # of the norms' weights: the activations must be in it
    keys_in_call: bool  # the in half writes a full layer's indexer keys (where its key cache is packed)
    output: tuple  # mla_output's weight arguments
    post_norm: tuple  # (weight, eps)
    route: tuple | None  # moe_route's arguments after x (MoE layers)
    experts: tuple | None  # moe_experts' (tensors, tail) with the shared experts in the call (MoE layers)
    dense_mlp: tuple | None  # gated_mlp's arguments after x (dense layers)
    out_in_call: bool  # the out half is bound (else the backend and the out's operators run one by one)
    bound: "BoundLayer"  # the layer's weights and constants as a native handle (its halves' arguments)
    selects_in_call: bool = False  # a full layer's indexer queries are bound: a decode step may select in the call


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
    index_keys = _index_key_arguments(attn, dtype)
    layer_out = _mlp_arguments(route, experts, dense) if out_fits else None
    selection = _selection_arguments(attn) if index_keys is not None and layer_out is not None else None
    bound = BoundLayer(layer_in, index_keys, (attn.scale, attn.kv_lora_rank, *output[0], post.weight, post.eps,
                                             *layer_out) if layer_out is not None else None,
                       (attn.num_heads, attn.kv_lora_rank + attn.rope_dim, query[0].shape[0]), selection)
    return DecodeCalls(dtype, index_keys is not None, output[0], (post.weight, post.eps), route, experts, dense,
                       layer_out is not None, bound, selection is not None)


class BoundLayer:
    """A layer's halves' weights and constants bound to a native handle (decode_layer_bind), released with this
    object: decode_layers takes the handle instead of some forty arguments per half."""

    def __init__(self, layer_in: tuple, index_keys: tuple | None, layer_out: tuple | None, shapes: tuple,
                 selection: tuple | None = None):
        ops = torch.ops.dsaserve
        head, tail = layer_in
        self.handle = ops.decode_layer_bind(*head, *tail, *(index_keys or ()))
        self._release = ops.decode_layer_release
        if layer_out is not None:
            ops.decode_layer_bind_out(self.handle, *layer_out)
        if selection is not None:
            ops.decode_layer_bind_selection(self.handle, *selection)
        torch_ops.BOUND_LAYER_SHAPES[self.handle] = shapes

    def __del__(self):
        try:
            torch_ops.BOUND_LAYER_SHAPES.pop(self.handle, None)
            self._release(self.handle)
        except Exception:  # interpreter exit: the module or the library may be gone already
            pass


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


def _selection_arguments(attn) -> tuple | None:
    """decode_layer_bind_selection's (wq_q, wq_s, wq_args, weights_proj, weight_scale, heads, head_dim, interleaved):
    the indexer's queries as model/indexer.py `queries` makes them, where its wq_b is packed, its weights_proj an
    fp32 matrix and its rotary the native operator; token top-k only (page selection stays in Python)."""
    indexer = attn.indexer
    wq, proj = indexer.wq_b.weight, indexer.weights_proj
    if not (isinstance(wq, QuantizedWeight) and indexer.wq_b.bias is None and proj.bias is None
            and proj.weight.dtype == torch.float32 and not indexer.selection.pages and indexer.rope_dim == attn.rope_dim):
        return None
    return (wq.qweight, wq.scale, list(wq.args), proj.weight, indexer.weight_scale, indexer.n_heads, indexer.head_dim,
            indexer.rope_interleave)


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
    """The decoder layers' output (model: GlmMoeDsaModel) through their bound halves, where every layer has them
    and they apply to this step (else None: the layers run one by one). Runs of halves go to one decode_layers
    call each: a run ends at a full layer's `in` whose selection Python makes (scores needed, or keys not in the
    call) or where the next `out` needs other slots; the backend's slot choice is made once per top-k tensor."""
    plan = model.prepared("decode calls", lambda: _layer_calls(model.layers))
    if plan is None or not applies(plan[0][1], x, cos, meta, kv_caches[0]):
        return None
    ops = torch.ops.dsaserve
    rows, groups, scales = [], [], []
    for i, (layer, calls, memo) in enumerate(plan):
        kv_cache = kv_caches[i]
        if memo[0] is not kv_cache:  # a cache not seen before: its rows as a view, kept while it lasts
            if kv_cache.dtype is not x.dtype:
                return None
            memo[:] = kv_cache, kv_cache.view(-1, kv_cache.shape[-1])
        rows.append(memo[1])
        key_groups, key_scales = _key_groups(layer.self_attn, calls, indexer_caches.get(i), True)
        groups.append(key_groups)
        scales.append(key_scales)
    handles = [calls.bound.handle for _, calls, _ in plan]
    int8_keys = any(s is not None for s in scales)
    key_scales = scales if int8_keys else []
    selection = _selection_in_call(plan, groups, meta)
    if selection is not None:  # the whole step, selections included, in one call
        return ops.decode_layers.default(handles, x, cos, sin, rows, meta.slot_mapping, groups, key_scales, None, None,
                                         True, meta.block_tables, meta.seq_lens_host, selection)[0]

    def call(run: list[int], x, query, slots, finish: bool = False):
        return ops.decode_layers.default([handles[j] for j in run], x, cos, sin, [rows[j] for j in run],
                                         meta.slot_mapping, [groups[j] for j in run],
                                         [key_scales[j] for j in run] if key_scales else [], query, slots, finish)

    made, run, run_slots, query, topk = {}, [], None, None, None  # query: the run's first layer's, if its in ran
    for i, (layer, calls, _) in enumerate(plan):
        attn = layer.self_attn
        selects = _selects(attn)
        every = selects_every_position(meta, attn.indexer.selection) if selects and groups[i] is not None else None
        selects_here = selects and every is None  # Python selects after this layer's in: the run ends there
        if selects_here:
            x, h, layer_query, q_resid = call(run + [i], x, query, run_slots)
            topk = _select(attn, groups[i], h, q_resid, cos, sin, meta, indexer_caches.get(i))
        elif selects:
            topk = every
        slots = _decode_slots(attn.backend, meta, topk, made) if calls.out_in_call else None
        if not selects_here and slots is not None and (not run or slots is run_slots):
            run.append(i)
            run_slots = slots
            continue
        if not selects_here:  # this layer's out cannot join the run (other slots, or none): the run ends here
            x, _, layer_query, _ = call(run + [i], x, query, run_slots)
        run, run_slots, query = [i], slots, layer_query
        if slots is None:  # the backend's own calls attend; the next run starts with an in
            x = _out_without_kernel(layer, calls, query, x, meta, kv_caches[i], topk)
            run, run_slots, query = [], None, None
    if run:
        x = call(run, x, query, run_slots, finish=True)[0]
    return x


def _layer_calls(layers) -> list | None:
    """Each layer with its gathered calls and a place for its cache's rows view; None where a layer has none."""
    calls = [layer.prepared("decode calls", layer._decode_calls) for layer in layers]
    return None if not calls or any(c is None for c in calls) else [(l, c, [None, None]) for l, c in zip(layers, calls)]


def _selection_in_call(plan, groups: list, meta) -> list[int] | None:
    """decode_layers' (width, chunk_blocks, window_blocks, block_size) where the step's selections can all be made in
    one call: a decode batch whose every request is past the selection's width, every layer's out bound, and every
    full layer's queries bound with its keys written by its in half (a packed key cache); else None."""
    if meta.num_tokens != meta.num_reqs:
        return None
    width = heads = None
    for (layer, calls, _), key_groups in zip(plan, groups):
        attn = layer.self_attn
        if not calls.out_in_call:
            return None
        if _selects(attn):
            if not calls.selects_in_call or key_groups is None:
                return None
            width, heads = attn.indexer.selection.width(meta.block_size), attn.indexer.n_heads
    if width is None or min(meta.seq_lens_host) <= width:
        return None
    chunk_blocks, window_blocks = chunk_and_window(min(QUERY_TILE, meta.num_tokens), heads, meta.block_size)
    return [width, chunk_blocks, window_blocks, meta.block_size]


def run_layer(layer, calls: DecodeCalls, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer: bool):
    """DecoderLayer.forward's result, through the bound halves (only where `applies`)."""
    ops = torch.ops.dsaserve
    attn = layer.self_attn
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    groups, scales = _key_groups(attn, calls, indexer_cache, run_indexer)
    handle = [calls.bound.handle]
    _, h, query, q_resid = ops.decode_layers.default(handle, x, cos, sin, [rows], meta.slot_mapping, [groups],
                                                     [scales] if scales is not None else [])
    topk = prev_topk
    if run_indexer and _selects(attn):
        topk = _select(attn, groups, h, q_resid, cos, sin, meta, indexer_cache)
    slots = attn.backend.decode_slots(meta, topk) if calls.out_in_call else None
    if slots is not None:
        return ops.decode_layers.default(handle, x, cos, sin, [rows], meta.slot_mapping, [None], [], query, slots,
                                         True)[0], topk
    return _out_without_kernel(layer, calls, query, x, meta, kv_cache, topk), topk


def _key_groups(attn, calls: DecodeCalls, indexer_cache, run_indexer: bool):
    """(groups, scales) of the packed key cache the layer's in writes this step's indexer keys to: bf16 keys
    (scales None) or int8 ones in the int8 kernel's layout; (None, None) where it writes none (a shared layer, the
    dense backend, keys not packed: the indexer's modules write them)."""
    if not (run_indexer and _selects(attn) and calls.keys_in_call):
        return None, None
    if indexer_cache.packed:
        return indexer_cache.groups, None
    if indexer_cache.int8_groups is not None:
        return indexer_cache.int8_groups, indexer_cache.scale
    return None, None


def _selects(attn) -> bool:
    """Whether the layer's attention reads its own indexer's selection (a full layer, a sparse backend)."""
    return attn.backend.uses_indexer and attn.indexer is not None


def _select(attn, groups, h, q_resid, cos, sin, meta, indexer_cache) -> torch.Tensor:
    """The full layer's selection after its in: its keys already written (groups), or written by its indexer."""
    if groups is not None:
        return attn.indexer.select(h, q_resid, cos, sin, meta, indexer_cache)
    return attn.indexer(h, q_resid, cos, sin, meta, indexer_cache)


def _out_without_kernel(layer, calls: DecodeCalls, query, x, meta, kv_cache, topk) -> torch.Tensor:
    """The layer's out where its rows are not one attention kernel call's: the backend attends, then the
    operators of the out half one by one."""
    ops = torch.ops.dsaserve
    attn = layer.self_attn
    latent = attn.backend.forward(query, kv_cache, meta, attn.scale, attn.kv_lora_rank, topk)
    attended = ops.mla_output.default(latent, *calls.output)
    h, x = ops.add_rms_norm.default(x, attended, *calls.post_norm)
    if calls.dense_mlp is not None:
        return x + ops.gated_mlp.default(h, *calls.dense_mlp)
    expert_weights, ids = ops.moe_route.default(h, *calls.route)
    out = torch.empty_like(h)
    tensors, tail = calls.experts
    ops.moe_experts.default(h.contiguous(), *tensors, ids.contiguous(), expert_weights.float().contiguous(), out,
                            *tail)
    return x + out


def _decode_slots(backend, meta, topk, made: dict):
    """backend.decode_slots(meta, topk), asked once per (backend, top-k tensor) in a step (`made` keeps the
    answers, and holds each tensor, so no other can take its id during the step)."""
    key = (id(backend), id(topk))
    if key not in made:
        made[key] = (topk, backend.decode_slots(meta, topk))
    return made[key][1]
