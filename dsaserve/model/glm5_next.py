"""GLM-5.3-Flash (`glm5_next`), text: a 3:1 hybrid of KDA and indexed attention, with mHC residual streams.

    embed → hc_mult streams → [mHC(RMSNorm → KDA | NoPE MLA + pooled indexer) → mHC(RMSNorm → MLP|MoE)] × L
          → mean of the streams → norm → lm_head

Indexed layers are GLM-5.2's MLA (model/mla.py) with no rotary part and the pooled indexer (model/pooled_indexer.py);
their latent cache is paged as GLM-5.2's. KDA layers (model/kda.py) keep a fixed-size state per request instead
(attention/linear_state.py). IndexShare: a shared indexed layer attends with the selection of the last full one,
across the KDA layers between them. The gated MLPs clamp at `swiglu_limit`.

Under tensor parallelism the MLA heads, the KDA heads (with their state), the MLPs and the experts are split as
GLM-5.2's are (distributed/sharding.py); the mHC weights, norms and the pooled indexer run on every rank.

The MTP layer (model/mtp.py) drafts for speculative decoding: an indexed MLA + MoE layer with a plain residual
(no mHC streams), its output fed back after shared_head.norm. A verified step keeps the KDA state after each
draft's row and rolls back to the one after the last accepted row (engine/workers/kv_cache.py).

Not served yet on this model: the `page` backend, refused at construction naming the option; decode context
parallelism, refused by ParallelConfig.check_model.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn

from dsaserve.attention import make_attention_backend
from dsaserve.attention.indexer_selection import Selection
from dsaserve.attention.metadata import BatchMetadata
from dsaserve.config import ModelConfig
from dsaserve.distributed.parallel_context import ParallelContext
from dsaserve.model.glm_moe_dsa import FP32_PARAM_SUFFIXES, DecoderLayer, _copy_rows, _load_tensor
from dsaserve.model.hyper_connection import HyperConnection
from dsaserve.model.kda import KimiDeltaAttention
from dsaserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from dsaserve.model.mla import MLAAttention
from dsaserve.model.moe import MoE
from dsaserve.model.mtp import Drafting, MTPLayer, mtp_param_name
from dsaserve.model.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from dsaserve.quantization.packed import is_packed

_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")
_HC = re.compile(r"^(.*)\.hc_(attn|ffn)_(fn|base|scale)$")


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend, selection: Selection, parallel: ParallelContext):
        super().__init__()
        hybrid = cfg.hybrid
        self.attends = cfg.is_attention(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.attends:
            self.self_attn = MLAAttention(cfg, layer_idx, backend, selection, parallel=parallel)
        else:
            self.self_attn = KimiDeltaAttention(cfg, parallel)
        if cfg.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = MoE(cfg, parallel, swiglu_limit=hybrid.swiglu_limit)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, parallel.plan.local(cfg.intermediate_size), parallel.tp,
                                swiglu_limit=hybrid.swiglu_limit)
        self.attn_hc = HyperConnection(hybrid, cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(hybrid, cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor, cos, sin, meta: BatchMetadata, cache, indexer_cache, prev_topk):
        """streams [T, hc_mult, hidden] → (the streams after the layer, the top-k for the layers after it)."""
        post, comb, h = self.attn_hc.weights(streams)
        h = self.input_layernorm(h)
        if self.attends:
            out, topk = self.self_attn(h, cos, sin, meta, cache, indexer_cache, prev_topk)
        else:
            out, topk = self.self_attn(h, meta, cache), prev_topk
        streams = HyperConnection.mix(post, comb, out, streams)
        post, comb, h = self.ffn_hc.weights(streams)
        out = self.mlp(self.post_attention_layernorm(h))
        return HyperConnection.mix(post, comb, out, streams), topk


class Glm5NextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, selection: Selection, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel.plan, parallel.tp)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(cfg, i, backend, selection, parallel)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm5NextForCausalLM(Drafting, nn.Module):
    # Computed in fp32 whatever the model dtype, as in the reference.
    FP32_PARAM_SUFFIXES = FP32_PARAM_SUFFIXES + ("conv_weight", "dt_bias", "A_log", "_hc.base", "_hc.scale")

    def __init__(self, cfg: ModelConfig, attention_backend: str = "sparse", page_budget: int | None = None,
                 mtp: tuple[bool, bool] | None = None, parallel: ParallelContext | None = None,
                 decode_plan: bool = True):
        super().__init__()
        parallel = parallel or ParallelContext.single()
        refuse_unserved(attention_backend)
        self.config = cfg
        self.parallel = parallel
        self.decode_plan = False  # the decode plan traces GLM-5.2's layer; this layer runs through its modules
        self.backend = make_attention_backend(attention_backend)
        self.selection = Selection(cfg.index_topk)
        self.model = Glm5NextModel(cfg, self.backend, self.selection, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel.plan, parallel.tp)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)  # (NoPE: no rotary dims)
        self.mtp = None
        if mtp is not None:
            block = DecoderLayer(cfg, cfg.num_hidden_layers, self.backend, self.selection, full=True, moe=True,
                                 parallel=parallel)
            self.mtp = MTPLayer(cfg, block, own_head=mtp[0], own_embed=mtp[1], parallel=parallel, decode_plan=False,
                                normed_output=True)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, meta: BatchMetadata, caches: list, indexer_caches: dict):
        return self.model.norm(self.forward_hidden(meta, caches, indexer_caches)[meta.logits_indices])

    @torch.inference_mode()
    def forward_hidden(self, meta: BatchMetadata, caches: list, indexer_caches: dict) -> torch.Tensor:
        """Hidden states of every row [T, hidden] (the streams' mean), before the final norm. caches[i] is layer i's:
        latent pages for an indexed layer, a LinearStateCache for a KDA layer."""
        x = self.model.embed_tokens(meta.input_ids, self.model.norm.weight.dtype)
        streams = x.unsqueeze(1).expand(-1, self.config.hybrid.hc_mult, -1).contiguous()
        no_rope = x.new_empty(x.shape[0], 0)
        topk = None
        for i, layer in enumerate(self.model.layers):
            streams, topk = layer(streams, no_rope, no_rope, meta, caches[i], indexer_caches.get(i), topk)
        return streams.mean(1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def weight_loader(self) -> Callable[[str, torch.Tensor], None]:
        """A function copying one checkpoint tensor (in the shipped layout) into its parameter."""
        params = dict(self.named_parameters())
        params.update((name, module) for name, module in self.named_modules() if is_packed(module))
        qkv = self.parallel.plan.local(self.config.hybrid.linear_num_heads) * self.config.hybrid.linear_head_dim
        first_expert, _ = self.parallel.plan.local_experts(self.config.n_routed_experts)

        def load(name: str, tensor: torch.Tensor, first: int = 0, rows: int | None = None) -> None:
            name = param_of(name, self.config.num_hidden_layers)
            if m := _CONV.match(name):
                offset = "qkv".index(m.group(2)) * qkv
                _copy_rows(params[f"{m.group(1)}.conv_weight"], offset + first, tensor.reshape(tensor.shape[0], -1),
                           name)
                return
            _load_tensor(params, name, tensor, first_expert, first, tensor.shape[0] if rows is None else rows)

        return load


def param_of(checkpoint_name: str, num_hidden_layers: int) -> str:
    """The model's name for a checkpoint tensor (the q/k/v convolutions are still apart: the loader joins them)."""
    name = checkpoint_name.replace("model.language_model.", "model.", 1)
    if name.startswith(f"model.layers.{num_hidden_layers}."):
        return mtp_param_name(name, num_hidden_layers)
    if m := _HC.match(name):
        return f"{m.group(1)}.{m.group(2)}_hc.{m.group(3)}"
    return name


def refuse_unserved(attention_backend: str) -> None:
    if attention_backend == "page":
        raise ValueError("attention_backend='page' is not served on glm5_next (its indexer selects pools); "
                         "use 'sparse' or 'dense'")
