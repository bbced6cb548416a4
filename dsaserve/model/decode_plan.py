"""The decode plan: a decode step's decoder layers as one chain of native pieces, built once from the modules.

For a few tokens with packed weights every operation of a layer has a native function (the norm, MLA's query,
latent rows and output, the indexer's keys and selection, the attention kernel, the router and experts); what
remained around them was Python deciding per piece and per step, and one dispatch per call. The plan binds each
piece's weights once into a native object (native/decode_plan.cpp) and runs ranges of pieces in one call.

Where the order comes from: a layer's own forward, traced once with torch.fx with its submodules as leaves (so
DecoderLayer.forward is the one place that says norm, attention, norm, MLP, addition), and each submodule's
`decode_pieces`, which lists its own forward's operations as `Piece`s, each with a typed binding of its native
arguments (a dataclass in the module's file). A module without `decode_pieces`, or one that returns None (weights
not packed, a bias, tensor parallelism), leaves the model without a plan: every step then runs through the modules,
with the same bits. Whether a plan is built at all is `EngineArgs.enforce_eager` (off: the modules only).

Per step (`run`): where every request of a decode batch is past index_topk and every full layer's queries and keys
are bound, one call runs the whole step and makes each full layer's selection itself. Otherwise Python does the
pieces native code cannot here, between calls: a selection that needs the indexer in Python (its keys not in
the plan, page mode, a prompt row), and attention whose rows are not one kernel call's (a batch whose requests
split between whole contexts and selections, fp32 activations); the attention backend chooses the slots once per
selection.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.fx

from dsaserve.attention.indexer_selection import QUERY_TILE, chunk_and_window, selects_every_position
from dsaserve.native import index_scores as native_scores
from dsaserve.native import torch_ops
from dsaserve.native.selected_rows import fits as attention_fits
from dsaserve.native.selected_rows import head_lanes
from dsaserve.native.selected_rows import takes_dtype as attention_takes
from dsaserve.quantization.quantized_weight import KERNEL_ROWS

NewRegister = Callable[[], int]


@dataclass(frozen=True)
class BoundCaches:
    """The engine's caches as the native plan holds them (set once: they live as long as the engine)."""

    first: torch.Tensor  # layer 0's latent cache, by which a set of caches is recognised
    count: int
    indexer: list  # per layer its indexer key cache (None: no selection of its own)
    keys_here: set[int] | None  # the layers whose keys the plan writes (packed caches); None: not the plan's dtype
    scored_here: bool = False  # every selecting layer's keys have a scoring kernel for the plan's queries


@dataclass(frozen=True)
class Piece:
    """One native operation of a module's forward: `kind` names the plan's native method (add_<kind>), `binding`
    the arguments fixed at load (a dataclass whose native_args the method takes after the registers), `reads` and
    `writes` the registers of its tensor inputs and outputs."""

    kind: str
    binding: object | None
    reads: tuple[int, ...]
    writes: tuple[int, ...] = ()


class DecodePlan:
    """The plan of `layers` (the model's decoder layers, or the MTP layer's block alone); `build` makes one."""

    def __init__(self, layers, pieces: list[tuple[int, Piece]], dtype: torch.dtype):
        self.layers = layers
        self.pieces = pieces  # (layer, piece) in the order they run
        self.dtype = dtype
        self.native = torch.classes.dsaserve.DecodePlan()
        for layer, piece in pieces:
            args = piece.binding.native_args if piece.binding is not None else ()
            getattr(self.native, f"add_{piece.kind}")(layer, list(piece.reads), list(piece.writes), *args)
        self.selects_at = [i for i, (_, p) in enumerate(pieces) if p.kind == "select"]
        self.attends_at = [i for i, (_, p) in enumerate(pieces) if p.kind == "attend"]
        lanes = head_lanes()
        self.attends_natively = attention_takes(dtype) and all(
            attention_fits(-(-p.binding.heads // lanes) * lanes, p.binding.row_width, p.binding.value_dim)
            for _, p in pieces if p.kind == "attend")
        self.keys_bound = {layer for layer, p in pieces if p.kind == "index_keys"}
        self.queries_bound = all(p.binding.wq is not None for _, p in pieces if p.kind == "select")
        self.backend = layers[0].self_attn.backend
        self.selection = next((layers[layer].self_attn.indexer.selection for layer, p in pieces if p.kind == "select"),
                              None)
        self.caches: BoundCaches | None = None

    @classmethod
    def build(cls, layers) -> DecodePlan | None:
        """The plan of these layers, or None where a piece of one has no native form here (any device but the CPU)."""
        if not layers[0].input_layernorm.weight.is_cpu or not torch_ops.load() or not torch_ops.runs("decode_plan"):
            return None
        pieces = []
        for i, layer in enumerate(layers):
            made = layer_pieces(layer)
            if made is None:
                return None
            pieces += [(i, piece) for piece in made]
        dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in (torch.bfloat16, torch.float32) or any(t.dtype != dtype for t in norm_tensors(pieces)):
            return None
        return cls(layers, pieces, dtype)

    def applies(self, x: torch.Tensor, cos: torch.Tensor, meta) -> bool:
        """What the modules check per step, for these tokens: few rows on the CPU in the weights' dtype, every row
        written to this rank's caches, the kernels still on in this process (native_kernels)."""
        dtype = self.dtype
        return (0 < x.shape[0] <= KERNEL_ROWS and x.dtype is dtype and x.is_cpu and cos.dtype is dtype
                and meta.shard is None and meta.write_rows is None and torch_ops.runs("decode_plan"))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, kv_caches: list, indexer_caches,
            topk: torch.Tensor | None = None, need_topk: bool = False):
        """(the layers' output, the last selection) of this step, or None where the plan does not apply to it (the
        layers then run through their modules). kv_caches: a latent cache per layer; indexer_caches: per layer
        index, a key cache (full layers). With `topk` the layers attend with it and write no indexer keys (the MTP
        layer's later drafts); with need_topk the selection is made where Python sees it."""
        if not self.applies(x, cos, meta) or not self._set_caches(kv_caches, indexer_caches):
            return None
        native, n, given = self.native, len(self.pieces), topk is not None
        if not given and not need_topk and (selection := self._selection_in_call(meta)) is not None:
            return native.run(0, n, x, cos, sin, meta.slot_mapping, None, True, meta.block_tables,
                              meta.seq_lens_host, selection)[0], None
        every = None if given or not self.selects_at else selects_every_position(meta, self.selection)
        topk = topk if given else every
        slots = self.backend.decode_slots(meta, topk) if topk is not None or not self.selects_at else None
        keys_here = self.caches.keys_here
        start = 0
        while True:
            stop = self._next_stop(start, given, every is not None, slots is None)
            reads = native.run(start, stop, x if start == 0 else None, cos, sin, meta.slot_mapping, slots, not given,
                               None, [], [])
            if stop == n:
                return reads[0], topk
            layer, piece = self.pieces[stop]
            attn = self.layers[layer].self_attn
            if piece.kind == "select":  # the indexer in Python: it writes the keys too where the plan did not
                h, q_resid = reads
                key_cache = self.caches.indexer[layer]
                select = attn.indexer.select if layer in keys_here else attn.indexer
                topk = select(h, q_resid, cos, sin, meta, key_cache)
                slots = self.backend.decode_slots(meta, topk)
            else:  # attention whose rows are not one kernel call's: the backend's own
                latent = attn.backend.forward(reads[0], kv_caches[layer], meta, attn.scale, attn.kv_lora_rank, topk)
                native.set_register(piece.writes[0], latent)
            start = stop + 1

    def _next_stop(self, start: int, given: bool, every: bool, no_slots: bool) -> int:
        """The first piece from `start` that Python does: a selection that is not given or every position (or whose
        keys the indexer writes), an attention without the kernel's slots; else the end."""
        stop = len(self.pieces)
        if not given:
            keys_here = self.caches.keys_here
            for i in self.selects_at[bisect.bisect_left(self.selects_at, start):]:
                if not every or self.pieces[i][0] not in keys_here:
                    stop = i
                    break
        if no_slots or not self.attends_natively:
            at = bisect.bisect_left(self.attends_at, start)
            if at < len(self.attends_at):
                stop = min(stop, self.attends_at[at])
        return stop

    def _selection_in_call(self, meta) -> list[int] | None:
        """run's (width, chunk_blocks, window_blocks, block_size) where the step's selections can all be made in one
        call: a decode batch whose every request is past the selection's width, every attention by the kernel, and
        every full layer's queries bound with its keys written and scored here; else None."""
        keys_here = self.caches.keys_here
        if (not self.selects_at or not self.queries_bound or not self.attends_natively
                or meta.num_tokens != meta.num_reqs or not self.caches.scored_here
                or any(self.pieces[i][0] not in keys_here for i in self.selects_at)):
            return None
        width = self.selection.width(meta.block_size)
        if min(meta.seq_lens_host) <= width:
            return None
        heads = self.pieces[self.selects_at[0]][1].binding.heads
        chunk_blocks, window_blocks = chunk_and_window(min(QUERY_TILE, meta.num_tokens), heads, meta.block_size)
        return [width, chunk_blocks, window_blocks, meta.block_size]

    def _scores_keys(self, cache) -> bool:
        """Whether a native kernel scores this plan's queries against the cache's keys in place: bf16 queries take
        the packed caches the plan binds; fp32 ones int8 keys, or fp32 keys where the AVX2 body fits the shape."""
        if cache is None:
            return False
        if self.dtype != torch.float32 or cache.int8_groups is not None:
            return True
        binding = self.pieces[self.selects_at[0]][1].binding
        return native_scores.fits_f32(binding.heads, binding.head_dim)

    def _set_caches(self, kv_caches: list, indexer_caches) -> bool:
        """Hands the caches to the native plan the first time they are seen; False where their dtype is not the
        plan's. A full layer's keys are written by the plan where its key cache is packed (bf16 or int8 groups), or
        where an fp32 plan's keys are fp32 that the AVX2 body scores in place."""
        known = self.caches
        if known is not None and known.first is kv_caches[0] and known.count == len(kv_caches):
            return known.keys_here is not None
        layers = range(len(self.layers))
        selecting = {layer for layer, p in self.pieces if p.kind == "select"}
        key_caches = [indexer_caches.get(i) if i in selecting else None for i in layers]
        if any(kv_caches[i].dtype is not self.dtype for i in layers):
            self.caches = BoundCaches(kv_caches[0], len(kv_caches), key_caches, None)
            return False
        groups, scales = [None] * len(key_caches), [None] * len(key_caches)
        for i in self.keys_bound:
            cache = key_caches[i]
            groups[i], scales[i] = (cache.groups, None) if cache.packed else (cache.int8_groups, cache.scale)
            if plain_f32_keys(cache, self.dtype):
                groups[i] = cache.data
        keys_here = {i for i in layers if groups[i] is not None}
        scales = [scale if group is not None else None for group, scale in zip(groups, scales)]
        self.native.set_caches([kv_caches[i].view(-1, kv_caches[i].shape[-1]) for i in layers], groups, scales)
        self.caches = BoundCaches(kv_caches[0], len(kv_caches), key_caches, keys_here,
                                  all(self._scores_keys(key_caches[self.pieces[i][0]]) for i in self.selects_at))
        return True


def layer_pieces(layer) -> list[Piece] | None:
    """The layer's forward as pieces: its graph traced (its submodules as leaves), each submodule's call replaced by
    that module's decode_pieces, additions by `add`; the layer's input is register 0 and so is its output."""
    graph = _LeavesTracer().trace(layer)
    registers: dict = {}
    pieces: list[Piece] = []
    count = [0]

    def new() -> int:
        count[0] += 1
        return count[0]

    output = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if not registers:
                registers[node] = 0  # the layer's input: the residual stream
        elif node.op == "call_module":
            module = layer.get_submodule(node.target)
            reads = tuple(registers[a] for a in (*node.args, *node.kwargs.values())
                          if isinstance(a, torch.fx.Node) and isinstance(registers.get(a), int))
            made = module.decode_pieces(reads, new) if hasattr(module, "decode_pieces") else None
            if made is None:
                return None
            pieces += made[0]
            registers[node] = made[1]
        elif node.op == "call_function" and node.target is operator.getitem:
            registers[node] = registers[node.args[0]][node.args[1]]
        elif node.op == "call_function" and node.target is operator.add:
            registers[node] = new()
            pieces.append(Piece("add", None, (registers[node.args[0]], registers[node.args[1]]), (registers[node],)))
        elif node.op == "output":
            result = node.args[0]
            output = registers[result[0] if isinstance(result, tuple) else result]
        else:  # an operation no piece stands for
            return None
    return _output_to_register_zero(pieces, output)


def _output_to_register_zero(pieces: list[Piece], output) -> list[Piece] | None:
    """The pieces with the layer's output register renamed 0 (the next layer's input) from the piece that writes it
    on; None where no piece writes it, or a later piece still reads the layer's input."""
    writers = [i for i, p in enumerate(pieces) if isinstance(output, int) and output in p.writes]
    if not writers or any(0 in p.reads for p in pieces[writers[-1] + 1:]):
        return None

    def renamed(registers: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(0 if r == output else r for r in registers)

    last = writers[-1]
    return pieces[:last] + [replace(p, reads=renamed(p.reads), writes=renamed(p.writes)) for p in pieces[last:]]


class _LeavesTracer(torch.fx.Tracer):
    """Traces only the layer's own forward: every submodule call stays one node."""

    def is_leaf_module(self, module, qualified_name: str) -> bool:
        return True


# The fields of each kind's binding that hold a norm's tensors: they must be in the activations' dtype.
NORM_FIELDS = {"rms_norm": ("weight",), "add_rms_norm": ("weight",), "mla_query": ("q_norm",),
               "latent_rows": ("norm",), "index_keys": ("norm_weight", "norm_bias")}


def norm_tensors(pieces: list[tuple[int, Piece]]) -> list[torch.Tensor]:
    return [getattr(p.binding, name) for _, p in pieces for name in NORM_FIELDS.get(p.kind, ())]


def plain_f32_keys(cache, dtype: torch.dtype) -> bool:
    """An fp32 plan's key cache kept as fp32 rows (what the AVX2 body scores in place: index_scores_f32_avx2.cpp)."""
    return (dtype == torch.float32 and cache.kind == "model" and not cache.packed
            and cache.data.dtype == torch.float32)
