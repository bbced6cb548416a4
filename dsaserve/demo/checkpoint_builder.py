"""Write random-weight checkpoints (glm_moe_dsa, deepseek_v32 or glm5_next) in the real layout (demo model and test
fixtures).

The tensors come from `checkpoint_layout`, so what is written is exactly what the loader expects and
what the transformers reference loads: per-expert tensors, indexer tensors only on full layers,
optional MTP layer, optional sharding and optional FP8 block quantization.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from dsaserve.config import ModelConfig
from dsaserve.demo.tokenizer import GLM_STYLE, STYLES, TokenizerStyle, build_tokenizer, save_tokenizer, stop_token_ids
from dsaserve.model.checkpoint_layout import VISION_PREFIX, checkpoint_shapes, text_prefix
from dsaserve.quantization.fp8_blocks import FP8_MAX, is_fp8_quantizable, quantize_fp8  # noqa: F401 (tests and scripts import them here)

# Fields only GLM's config carries: the IndexShare schedule and its RoPE layouts (DeepSeek-V3.2 fixes both).
GLM_ONLY_FIELDS = ("indexer_types", "index_topk_pattern", "indexer_rope_interleave", "rope_interleave")


def small_config(model_type: str = "glm_moe_dsa", **overrides) -> dict:
    """A small config.json to build on: GLM-MoE-DSA (mixed F/S schedule, dense prefix, MoE), or DeepSeek-V3.2 (the
    same geometry, every layer full, with YaRN RoPE as DeepSeek ships it)."""
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "head_dim": 8,
        "qk_head_dim": 24,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "index_topk": 16,
        "index_head_dim": 32,
        "index_n_heads": 8,
        "indexer_rope_interleave": True,
        "rope_interleave": True,
        "indexer_types": ["full", "full", "shared", "shared"],
        "index_topk_pattern": None,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "num_nextn_predict_layers": 0,
        "dtype": "float32",
        "use_cache": True,
    }
    if model_type == "deepseek_v32":
        for key in GLM_ONLY_FIELDS:
            del cfg[key]
        cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", rms_norm_eps=1e-6,
                   bos_token_id=0,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 1.0, "mscale_all_dim": 1.0})
    elif model_type == "glm5_next":
        return glm5_next_config(cfg, overrides)
    elif model_type != "glm_moe_dsa":
        raise ValueError(f"model_type={model_type!r}: the builder writes glm_moe_dsa, deepseek_v32 or glm5_next "
                         "checkpoints")
    cfg.update(overrides)
    # Fields the published configs carry that follow from the others (MLA has as many KV heads as heads).
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg["head_dim"] = cfg["qk_rope_head_dim"]
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return cfg


# A small GLM-5.3-Flash: KDA and indexed layers mixed so that a shared indexed layer follows a full one (the
# reference passes a selection only from one layer to the next), NoPE MLA, pools of 4 tokens.
GLM5_NEXT_LAYERS = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                    "linear_attention", "indexed_attention"]
GLM5_NEXT_TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 128, "intermediate_size": 64,
                         "projection_intermediate_size": 64, "patch_size": 14, "temporal_patch_size": 2}


def glm5_next_config(base: dict, overrides: dict) -> dict:
    """A glm5_next config.json as transformers writes it: the text fields under text_config, a vision_config."""
    text = {k: v for k, v in base.items() if k not in GLM_ONLY_FIELDS + ("architectures", "first_k_dense_replace",
                                                                            "moe_layer_freq", "rope_parameters",
                                                                            "head_dim", "qk_head_dim")}
    text.update(model_type="glm5_next_text", qk_rope_head_dim=0, qk_nope_head_dim=32, v_head_dim=32,
                num_hidden_layers=len(GLM5_NEXT_LAYERS), layer_types=list(GLM5_NEXT_LAYERS),
                indexer_types=["full", "full", "shared", "full", "full", "full"],
                mlp_layer_types=["dense"] + ["sparse"] * (len(GLM5_NEXT_LAYERS) - 1),
                linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                    "gate_lower_bound": -5.0},
                hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=3, index_kpool=4, index_kpool_always_select_tail=True,
                swiglu_limit=2.0)  # low enough that random weights reach it; few Sinkhorn iterations, each matters
    vision = dict(GLM5_NEXT_TINY_VISION, out_hidden_size=text["hidden_size"])
    text.update({k: v for k, v in overrides.items() if k not in ("model_type",)})
    text["num_key_value_heads"] = text["num_attention_heads"]
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "vision_config": vision, "tie_word_embeddings": text.get("tie_word_embeddings", False),
            "dtype": text.get("dtype", "float32")}


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    """Weights with enough spread that every component visibly matters (norm gains are not all ones)."""
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("k_norm.bias"):
        return 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=gen)
    if name.endswith(("hc_attn_base", "hc_ffn_base", "dt_bias", "A_log")):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith(("hc_attn_scale", "hc_ffn_scale")):
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) * (std if std > 0 else fan_in**-0.5)


SEPARATION_CHANNEL = 0  # hidden channel kept large and positive so indexer head weights stay positive


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.0,
                   include_mtp: bool = False) -> dict[str, torch.Tensor]:
    """std 0 means fan-in scaling (activations keep unit size through every layer).

    Indexer scores are made well separated: every embedding carries a large positive value on one
    channel and `weights_proj` reads mostly that channel, so each head's weight w_h(t) is positive and
    a score is zero only when every head's relu is. Ties at the top-k boundary would otherwise let two
    correct implementations pick different tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(cfg, include_mtp=include_mtp)
    weights = {name: random_tensor(name, shape, gen, std) for name, shape in shapes.items()}
    weights[f"{text_prefix(cfg)}embed_tokens.weight"][:, SEPARATION_CHANNEL] = 8.0
    for name, w in weights.items():
        if name.endswith("indexer.weights_proj.weight"):
            w.mul_(0.05)
            w[:, SEPARATION_CHANNEL] = 1.0
        elif name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "indexer.wk.weight")):
            w[:, SEPARATION_CHANNEL] = 0.0  # else every query and key would point the same way
    if cfg.hybrid is not None:  # a few vision tensors, which the loader must skip
        weights[f"{VISION_PREFIX}blocks.0.norm1.weight"] = torch.ones(GLM5_NEXT_TINY_VISION["hidden_size"])
        weights[f"{VISION_PREFIX}blocks.0.norm2.weight"] = torch.ones(GLM5_NEXT_TINY_VISION["hidden_size"])
    return weights


def save_checkpoint(model_dir: str, config: dict, weights: dict[str, torch.Tensor], shards: int = 1,
                    dtype: torch.dtype = torch.float32, fp8: bool = False) -> None:
    os.makedirs(model_dir, exist_ok=True)
    config = dict(config)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if fp8 and is_fp8_quantizable(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(w)
        elif name.endswith(("e_score_correction_bias", "mlp.gate.weight", "dt_bias", "A_log", "_conv1d.weight",
                            "hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")):
            tensors[name] = w.float().contiguous()
        else:
            tensors[name] = w.to(dtype).contiguous()
    config["dtype"] = str(dtype).removeprefix("torch.")
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.embed_tokens", "mlp.gate", "indexer.weights_proj"],
        }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per_shard : (s + 1) * per_shard]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(model_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def build_checkpoint(model_dir: str, seed: int = 0, std: float = 0.0, shards: int = 1,
                     dtype: torch.dtype = torch.float32, fp8: bool = False, include_mtp: bool = False,
                     tokenizer_vocab: int = 1024, **config_overrides) -> str:
    """Write config.json, weights, tokenizer and generation_config.json; returns model_dir."""
    os.makedirs(model_dir, exist_ok=True)
    style = STYLES[config_overrides.get("model_type", "glm_moe_dsa")]
    tok = build_tokenizer(tokenizer_vocab, style=style)
    eos = stop_token_ids(tok, style)
    config_overrides.setdefault("vocab_size", max(64 * math.ceil(tok.get_vocab_size() / 64), 64))
    config_overrides.setdefault("eos_token_id", eos)
    config_overrides.setdefault("pad_token_id", eos[0])
    if include_mtp:
        config_overrides.setdefault("num_nextn_predict_layers", 1)
    raw = small_config(**config_overrides)
    cfg = ModelConfig.from_dict(raw)
    weights = random_weights(cfg, seed=seed, std=std, include_mtp=include_mtp)
    save_checkpoint(model_dir, raw, weights, shards=shards, dtype=dtype, fp8=fp8)
    save_tokenizer_files(tok, model_dir, eos, style)
    return model_dir


def save_tokenizer_files(tok, model_dir: str, eos: list[int], style: TokenizerStyle = GLM_STYLE) -> None:
    """tokenizer.json, tokenizer_config.json (with the family's chat template, if any) and generation_config.json."""
    save_tokenizer(tok, model_dir, style)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos, "pad_token_id": eos[0]}, f, indent=2)
