"""The GLM-MoE-DSA decoder: embed → [RMSNorm → MLA → RMSNorm → MLP|MoE] × L → norm → lm_head.

Module names mirror the checkpoint's, so most tensors load by name; the few that are fused or split
at load time are routed in `_load_tensor`.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from dsaserve.attention import make_attention_backend
from dsaserve.attention.indexer_selection import Selection
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import FULL, ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.model.decode_plan import DecodePlan
from dsaserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from dsaserve.model.mla import MLAAttention
from dsaserve.model.moe import MoE
from dsaserve.model.mtp import Drafting, MTPLayer, mtp_param_name
from dsaserve.model.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from dsaserve.model.training_pass import TrainingPass
from dsaserve.prepared_calls import PreparedCalls
from dsaserve.quantization.fp8_blocks import as_float
from dsaserve.quantization.packed import is_packed
from dsaserve.quantization.quantized_weight import QuantizedWeight

# Parameters computed in fp32 whatever the model dtype (as in the reference implementation).
FP32_PARAM_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")

_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_GATE_UP = re.compile(r"^(.*)\.(gate|up)_proj\.weight$")
_KV_B = re.compile(r"^(.*\.self_attn)\.kv_b_proj\.weight$")
# Vocabulary-split parameters: the last rank's shard may end in rows past the vocabulary (zeros).
_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight", "mtp.head.weight", "mtp.embed.weight")


class DecoderLayer(nn.Module):
    """One decoder layer; `full` and `moe` default to the config's schedule for layer_idx (the MTP layer,
    past the schedule, is always both). Its forward is the one statement of the layer's order of operations:
    the decode plan (model/decode_plan.py) traces it."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend, selection: Selection, full: bool | None = None,
                 moe: bool | None = None, parallel: ParallelContext | None = None):
        super().__init__()
        parallel = parallel or ParallelContext.single()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_idx, backend, selection, full, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mlp_layer_types[layer_idx] == "sparse" if moe is None else moe:  # (glm5_next's MTP layer clamps)
            self.mlp = MoE(cfg, parallel, swiglu_limit=cfg.hybrid.swiglu_limit if cfg.hybrid is not None else None)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, parallel.plan.local(cfg.intermediate_size), parallel.tp)

    def forward(self, x, cos, sin, meta, kv_cache, indexer_cache, prev_topk, run_indexer: bool = True):
        attn, topk = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache, indexer_cache, prev_topk,
                                    run_indexer)
        h, x = self.post_attention_layernorm(attn, residual=x)
        return x + self.mlp(h), topk


class GlmMoeDsaModel(PreparedCalls):
    def __init__(self, cfg: ModelConfig, backend, selection: Selection, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel.plan, parallel.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, selection, parallel=parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GlmMoeDsaForCausalLM(Drafting, nn.Module):
    FP32_PARAM_SUFFIXES = FP32_PARAM_SUFFIXES
    def __init__(self, cfg: ModelConfig, attention_backend: str = "sparse", page_budget: int | None = None,
                 mtp: tuple[bool, bool] | None = None, parallel: ParallelContext | None = None,
                 decode_plan: bool = True):
        """mtp: build the MTP layer, as (its own shared_head.head?, its own embed_tokens?); None skips it.
        parallel: this rank's share of a tensor-parallel model (None: all of it). decode_plan: a few decode tokens
        run as the layers' native pieces where they have them (model/decode_plan.py); off, always the modules."""
        super().__init__()
        self.decode_plan = decode_plan
        check_shared_layers_have_producer(cfg.indexer_types)
        self.config = cfg
        self.parallel = parallel = parallel or ParallelContext.single()
        self.backend = make_attention_backend(attention_backend)
        self.selection = Selection(cfg.index_topk, pages=page_budget if attention_backend == "page" else None)
        self.model = GlmMoeDsaModel(cfg, self.backend, self.selection, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel.plan, parallel.tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
        self.mtp = None
        if mtp is not None:
            block = DecoderLayer(cfg, cfg.num_hidden_layers, self.backend, self.selection, full=True, moe=True,
                                 parallel=parallel)
            self.mtp = MTPLayer(cfg, block, own_head=mtp[0], own_embed=mtp[1], parallel=parallel,
                                decode_plan=decode_plan)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after moving devices)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, meta: BatchMetadata, kv_caches: list[torch.Tensor], indexer_caches: dict):
        """Runs the flattened batch; returns final hidden states of the `meta.logits_indices` rows."""
        return self.model.norm(self.forward_hidden(meta, kv_caches, indexer_caches)[meta.logits_indices])

    @torch.inference_mode()
    def forward_hidden(self, meta: BatchMetadata, kv_caches: list[torch.Tensor], indexer_caches: dict) -> torch.Tensor:
        """Hidden states of every row [T, hidden], before the final norm."""
        return self.hidden_states(meta, kv_caches, indexer_caches)

    def hidden_states(self, meta: BatchMetadata | TrainingPass, kv_caches: list, indexer_caches: dict) -> torch.Tensor:
        """forward_hidden's computation, differentiable: the demo trainer runs it over a TrainingPass (no caches)."""
        x = self.model.embed_tokens(meta.input_ids, self.model.norm.weight.dtype)
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype, max(meta.seq_lens_host))
        plan = self.model.prepared("decode plan", self._plan)
        out = plan.run(x, cos, sin, meta, kv_caches, indexer_caches) if plan is not None else None
        if out is not None:
            return out[0]
        topk = None
        for i, layer in enumerate(self.model.layers):
            x, topk = layer(x, cos, sin, meta, kv_caches[i], indexer_caches.get(i), topk)
        return x

    def _plan(self) -> DecodePlan | None:
        return DecodePlan.build(self.model.layers) if self.decode_plan else None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (after the final norm)."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    # ---- weight loading -------------------------------------------------------------------------

    def weight_loader(self) -> Callable[[str, torch.Tensor], None]:
        """A function copying one checkpoint tensor (already dequantized) into its parameter.

        Made once the parameters are on their device; safe to call from several threads.
        """
        params = dict(self.named_parameters())
        params.update((name, module) for name, module in self.named_modules() if is_packed(module))
        first_mtp = f"model.layers.{self.config.num_hidden_layers}."
        first_expert, _ = self.parallel.plan.local_experts(self.config.n_routed_experts)

        def load(name: str, tensor: torch.Tensor, first: int = 0, rows: int | None = None) -> None:
            """tensor: rows [first, first + n) of this rank's part of checkpoint tensor `name`, which has `rows`
            rows in all (None: tensor is the whole part)."""
            if name.startswith(first_mtp):
                name = mtp_param_name(name, self.config.num_hidden_layers)
            _load_tensor(params, name, tensor, first_expert, first, tensor.shape[0] if rows is None else rows)

        return load


def param_of(checkpoint_name: str, num_hidden_layers: int) -> str:
    """The model parameter (or packed weight) a checkpoint tensor is loaded into."""
    name = checkpoint_name
    if name.startswith(f"model.layers.{num_hidden_layers}."):
        name = mtp_param_name(name, num_hidden_layers)
    if m := _EXPERT.match(name):
        return f"{m.group(1)}.experts_{'down' if m.group(3) == 'down' else 'gate_up'}"
    if (m := _GATE_UP.match(name)) and ".mlp." in name and not name.endswith("mlp.gate.weight"):
        return f"{m.group(1)}.gate_up_proj"
    return name


def _load_tensor(params: dict, name: str, tensor, first_expert: int = 0, first: int = 0,
                 rows: int | None = None) -> None:
    """tensor: rows [first, first + n) of this rank's part of checkpoint tensor `name` (distributed/sharding.py),
    which has `rows` rows (all of them when None); a float tensor or, from an FP8 checkpoint, an Fp8Slice. A target
    is a Parameter or a QuantizedWeight (packed). kv_b_proj arrives in whole heads."""
    rows = tensor.shape[0] if rows is None else rows
    if m := _EXPERT.match(name):
        moe, expert, kind = m.group(1), int(m.group(2)) - first_expert, m.group(3)
        if kind == "down":
            _copy_rows(params[f"{moe}.experts_down"], first, tensor, name, expert)
        else:
            _copy_rows(params[f"{moe}.experts_gate_up"], first + (0 if kind == "gate" else rows), tensor, name, expert)
    elif (m := _GATE_UP.match(name)) and f"{m.group(1)}.gate_up_proj" in params:
        fused = params[f"{m.group(1)}.gate_up_proj"]
        _copy_rows(fused, first + (0 if m.group(2) == "gate" else fused.shape[0] // 2), tensor, name)
    elif m := _KV_B.match(name):
        w_uk, w_uv = params[f"{m.group(1)}.w_uk"], params[f"{m.group(1)}.w_uv"]
        v = w_uv.shape[1]
        nope = w_uk.shape[2] if isinstance(w_uk, QuantizedWeight) else w_uk.shape[1]
        rank = tensor.shape[1]
        per_head = as_float(tensor).view(-1, nope + v, rank)
        h0 = first // (nope + v)
        if isinstance(w_uk, QuantizedWeight):  # packed per head, W_UK transposed
            for h in range(per_head.shape[0]):
                w_uk.load_rows(0, per_head[h, :nope].T, h0 + h, name)
                w_uv.load_rows(0, per_head[h, nope:], h0 + h, name)
        else:
            heads = slice(h0, h0 + per_head.shape[0])
            _copy(w_uk[heads], per_head[:, :nope], name)
            _copy(w_uv[heads], per_head[:, nope:], name)
    elif name in params:
        dst = params[name]
        if name.endswith(_VOCAB_PARAMS) and first == 0 and rows < dst.shape[0]:  # the last rank's padding rows
            if isinstance(dst, torch.Tensor):
                with torch.no_grad():
                    dst[rows:].zero_()
        _copy_rows(dst, first, tensor, name)
    else:
        raise KeyError(f"checkpoint tensor {name!r} has no place in the model")


def checkpoint_tensor(params: dict[str, torch.Tensor], name: str, num_hidden_layers: int) -> torch.Tensor:
    """Checkpoint tensor `name` rebuilt from an unpacked, unsplit model's parameters (by name, tied ones
    included): _load_tensor's inverse, with which the demo trainer writes its checkpoints."""
    if name.startswith(f"model.layers.{num_hidden_layers}."):
        name = mtp_param_name(name, num_hidden_layers)
    if m := _EXPERT.match(name):
        moe, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down":
            return params[f"{moe}.experts_down"][expert]
        gate, up = params[f"{moe}.experts_gate_up"][expert].chunk(2)
        return gate if kind == "gate" else up
    if (m := _GATE_UP.match(name)) and f"{m.group(1)}.gate_up_proj" in params:
        gate, up = params[f"{m.group(1)}.gate_up_proj"].chunk(2)
        return gate if m.group(2) == "gate" else up
    if m := _KV_B.match(name):
        w_uk, w_uv = params[f"{m.group(1)}.w_uk"], params[f"{m.group(1)}.w_uv"]
        return torch.cat([w_uk, w_uv], dim=1).reshape(-1, w_uk.shape[-1])
    return params[name]


def _copy_rows(dst, first: int, src, name: str, expert: int | None = None) -> None:
    """src [n, K] into rows first … first + n of dst (of expert `expert` of a stacked one)."""
    if is_packed(dst):
        dst.load_rows(first, src, expert, name)
        return
    target = dst if expert is None else dst[expert]
    _copy(target[first : first + src.shape[0]], as_float(src), name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def check_shared_layers_have_producer(indexer_types) -> None:
    if indexer_types and indexer_types[0] != FULL:
        raise ValueError(
            f"layer 0 is {indexer_types[0]!r}: a shared layer reuses the top-k of the last full layer before it, "
            "and there is none; make layer 0 'full'"
        )
