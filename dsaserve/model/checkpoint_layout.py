"""The tensor names and shapes of a glm_moe_dsa checkpoint, derived from its config.

This is the single description of the real layout (per-expert tensors, indexer tensors only on full
layers, MTP layers after the decoder). The loader checks checkpoints against it, `doctor` counts
parameters with it, and the demo builder writes checkpoints from it.
"""

from __future__ import annotations

from dsaserve.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]


def attention_shapes(cfg: ModelConfig, prefix: str, full: bool) -> Shapes:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes = {
        f"{prefix}.q_a_proj.weight": (cfg.q_lora_rank, h),
        f"{prefix}.q_a_layernorm.weight": (cfg.q_lora_rank,),
        f"{prefix}.q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
        f"{prefix}.kv_a_proj_with_mqa.weight": (cfg.kv_cache_dim, h),
        f"{prefix}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        f"{prefix}.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        f"{prefix}.o_proj.weight": (h, heads * cfg.v_head_dim),
    }
    if cfg.attention_bias:
        shapes[f"{prefix}.q_a_proj.bias"] = (cfg.q_lora_rank,)
        shapes[f"{prefix}.kv_a_proj_with_mqa.bias"] = (cfg.kv_cache_dim,)
        shapes[f"{prefix}.o_proj.bias"] = (h,)
    if full:
        idx = f"{prefix}.indexer"
        shapes.update({
            f"{idx}.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            f"{idx}.wk.weight": (cfg.index_head_dim, h),
            f"{idx}.k_norm.weight": (cfg.index_head_dim,),
            f"{idx}.k_norm.bias": (cfg.index_head_dim,),
            f"{idx}.weights_proj.weight": (cfg.index_n_heads, h),
        })
    return shapes


def mlp_shapes(prefix: str, hidden: int, inter: int) -> Shapes:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def moe_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
    h = cfg.hidden_size
    shapes = {
        f"{prefix}.gate.weight": (cfg.n_routed_experts, h),
        f"{prefix}.gate.e_score_correction_bias": (cfg.n_routed_experts,),
    }
    for e in range(cfg.n_routed_experts):
        shapes.update(mlp_shapes(f"{prefix}.experts.{e}", h, cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        shapes.update(mlp_shapes(f"{prefix}.shared_experts", h, cfg.moe_intermediate_size * cfg.n_shared_experts))
    return shapes


VISION_PREFIX = "model.visual."  # glm5_next's vision tower: not served, its tensors are skipped


def text_prefix(cfg: ModelConfig) -> str:
    """Where the text model's tensors live: `model.` (GLM-5.2, DeepSeek-V3.2), `model.language_model.` (glm5_next,
    a multimodal checkpoint)."""
    return "model.language_model." if cfg.hybrid is not None else "model."


def kda_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
    """A KDA (Kimi Delta Attention) layer's tensors as GLM-5.3-Flash ships them: q/k/v convolutions apart, the
    forget gate's tensors directly under self_attn."""
    hybrid, h = cfg.hybrid, cfg.hidden_size
    qkv, dk, heads = hybrid.qkv_dim, hybrid.linear_head_dim, hybrid.linear_num_heads
    shapes = {f"{prefix}.{p}_proj.weight": (qkv, h) for p in "qkv"}
    shapes.update({f"{prefix}.{p}_conv1d.weight": (qkv, 1, hybrid.conv_kernel) for p in "qkv"})
    shapes.update({
        f"{prefix}.f_a_proj.weight": (dk, h),
        f"{prefix}.f_b_proj.weight": (qkv, dk),
        f"{prefix}.dt_bias": (qkv,),
        f"{prefix}.A_log": (heads,),
        f"{prefix}.b_proj.weight": (heads, h),
        f"{prefix}.g_a_proj.weight": (dk, h),
        f"{prefix}.g_b_proj.weight": (qkv, dk),
        f"{prefix}.o_norm.weight": (dk,),
        f"{prefix}.o_proj.weight": (h, qkv),
    })
    return shapes


def hyper_connection_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
    """The mHC mixing weights around a layer's attention (`hc_attn_*`) and its MLP (`hc_ffn_*`)."""
    n = cfg.hybrid.hc_mult
    shapes = {}
    for block in ("attn", "ffn"):
        shapes.update({
            f"{prefix}.hc_{block}_fn": ((2 + n) * n, n * cfg.hidden_size),
            f"{prefix}.hc_{block}_base": ((2 + n) * n,),
            f"{prefix}.hc_{block}_scale": (3,),
        })
    return shapes


def pooled_indexer_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
    d = cfg.index_head_dim
    return {f"{prefix}.indexer.index_kpool_compress_ape": (cfg.hybrid.index_kpool, d),
            f"{prefix}.indexer.index_kpool_compress_gate": (d, cfg.hidden_size)}


def decoder_layer_shapes(cfg: ModelConfig, layer: int, full: bool, moe: bool) -> Shapes:
    prefix = f"{text_prefix(cfg)}layers.{layer}"
    shapes = {
        f"{prefix}.input_layernorm.weight": (cfg.hidden_size,),
        f"{prefix}.post_attention_layernorm.weight": (cfg.hidden_size,),
    }
    if cfg.hybrid is not None and layer < cfg.num_hidden_layers:  # (an MTP layer has a plain residual)
        shapes.update(hyper_connection_shapes(cfg, prefix))
    if not cfg.is_attention(layer):
        shapes.update(kda_shapes(cfg, f"{prefix}.self_attn"))
    else:
        shapes.update(attention_shapes(cfg, f"{prefix}.self_attn", full))
        if full and cfg.hybrid is not None:
            shapes.update(pooled_indexer_shapes(cfg, f"{prefix}.self_attn"))
    if moe:
        shapes.update(moe_shapes(cfg, f"{prefix}.mlp"))
    else:
        shapes.update(mlp_shapes(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size))
    return shapes


def mtp_layer_shapes(cfg: ModelConfig, layer: int) -> Shapes:
    """A next-token-prediction layer: projections joining embedding and hidden state, then a decoder layer."""
    h, prefix = cfg.hidden_size, f"{text_prefix(cfg)}layers.{layer}"
    shapes = decoder_layer_shapes(cfg, layer, full=True, moe=True)
    shapes.update({
        f"{prefix}.enorm.weight": (h,),
        f"{prefix}.hnorm.weight": (h,),
        f"{prefix}.eh_proj.weight": (h, 2 * h),
        f"{prefix}.shared_head.norm.weight": (h,),
    })
    return shapes


def checkpoint_shapes(cfg: ModelConfig, include_mtp: bool = False) -> Shapes:
    text = text_prefix(cfg)
    shapes: Shapes = {f"{text}embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        shapes.update(decoder_layer_shapes(cfg, i, cfg.is_full(i), cfg.mlp_layer_types[i] == "sparse"))
    shapes[f"{text}norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if include_mtp:
        for k in range(cfg.num_nextn_predict_layers):
            shapes.update(mtp_layer_shapes(cfg, cfg.num_hidden_layers + k))
    return shapes


def optional_mtp_shapes(cfg: ModelConfig) -> Shapes:
    """MTP tensors a checkpoint may carry or leave out (the main model's are used when absent)."""
    prefix = f"{text_prefix(cfg)}layers.{cfg.num_hidden_layers}"
    return {f"{prefix}.shared_head.head.weight": (cfg.vocab_size, cfg.hidden_size),
            f"{prefix}.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}


def is_mtp_tensor(cfg: ModelConfig, name: str) -> bool:
    layers = f"{text_prefix(cfg)}layers."
    if not name.startswith(layers):
        return False
    layer = name[len(layers):].split(".", 1)[0]
    first = cfg.num_hidden_layers
    return layer.isdigit() and first <= int(layer) < first + cfg.num_nextn_predict_layers


def component_of(name: str) -> str:
    """Coarse component of a tensor name, for parameter accounting."""
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".indexer." in name:
        return "indexer"
    if ".self_attn." in name:
        return "attention"
    if ".hc_" in name:
        return "mHC streams"
    if ".experts." in name and ".shared_experts." not in name:
        return "routed experts"
    if ".shared_experts." in name:
        return "shared experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense mlp"
    return "norms"
