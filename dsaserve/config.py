"""Model configuration: read a config.json (glm_moe_dsa or deepseek_v32) once and resolve everything derived
from it.

The indexer schedule is the part real deployments got wrong, so it is resolved here, once, from the
checkpoint's own fields in a fixed order of authority (see `resolve_indexer_types`), validated, and
logged as a pattern string.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field

from dsaserve.hybrid_config import HybridConfig, HybridConfigError, resolve_hybrid, text_fields
from dsaserve.model_family import FAMILIES, ModelFamily

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
FULL, SHARED = "full", "shared"
_LETTER_TO_TYPE = {"F": FULL, "S": SHARED, FULL: FULL, SHARED: SHARED}


class CheckpointError(ValueError):
    """The checkpoint's files or tensors do not match what the config describes."""


class ConfigError(ValueError):
    """A config.json field is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class IndexerSchedule:
    types: tuple[str, ...]  # "full" / "shared" per layer
    source: str  # which config field decided it
    warnings: tuple[str, ...] = ()

    @property
    def pattern(self) -> str:
        return "".join("F" if t == FULL else "S" for t in self.types)

    @property
    def num_full(self) -> int:
        return sum(t == FULL for t in self.types)

    @property
    def num_shared(self) -> int:
        return len(self.types) - self.num_full

    def hf_override(self) -> str:
        """The `--hf-overrides` value that pins this schedule explicitly."""
        return json.dumps({"index_topk_pattern": self.pattern})


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_rope_interleave: bool
    rope_interleave: bool
    rope: RopeConfig
    indexer_schedule: IndexerSchedule
    mlp_layer_types: tuple[str, ...]  # "dense" / "sparse" (MoE) per layer
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int
    index_share_for_mtp_iteration: bool  # later draft steps of a round reuse the MTP indexer's first selection
    checkpoint_dtype: str  # e.g. "bfloat16"
    quantization_config: dict | None
    raw: dict = field(repr=False, compare=False)
    hybrid: HybridConfig | None = None  # glm5_next: KDA layers, mHC streams, pooled indexer (hybrid_config.py)

    @property
    def family(self) -> ModelFamily:
        return FAMILIES[self.model_type]

    @property
    def indexer_types(self) -> tuple[str, ...]:
        return self.indexer_schedule.types

    @property
    def fp8_checkpoint(self) -> bool:
        """The checkpoint ships FP8 weights (block-scaled, `weight_scale_inv`)."""
        return (self.quantization_config or {}).get("quant_method") == "fp8"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one latent cache row: normalized KV latent followed by the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_attention(self, layer: int) -> bool:
        """Whether the layer is (MLA) attention with a latent cache; a hybrid model's KDA layers are not."""
        return self.hybrid is None or layer >= self.num_hidden_layers or layer in self.hybrid.attention_layers

    def is_full(self, layer: int) -> bool:
        return self.indexer_types[layer] == FULL and self.is_attention(layer)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == FULL and self.is_attention(i))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_attention(i))

    @property
    def latent_norm_eps(self) -> float:
        """eps of q_a_layernorm and kv_a_layernorm: 1e-6 in GLM-5.2 and DeepSeek-V3.2, rms_norm_eps in glm5_next."""
        return self.rms_norm_eps if self.hybrid is not None else 1e-6

    @property
    def index_width(self) -> int:
        """Positions a query's selection holds: index_topk, plus the unfinished pool's tokens (pooled indexer)."""
        return self.index_topk + (self.hybrid.index_kpool - 1 if self.hybrid is not None else 0)

    @classmethod
    def from_pretrained(cls, model_dir: str, hf_overrides: dict | str | None = None) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json in {model_dir!r}: point dsaserve at a Hugging Face checkpoint directory")
        with open(path) as f:
            raw = json.load(f)
        gen_eos = _generation_config_eos(model_dir)
        return cls.from_dict(raw, hf_overrides=hf_overrides, extra_eos=gen_eos)

    @classmethod
    def from_dict(cls, raw: dict, hf_overrides: dict | str | None = None, extra_eos=()) -> "ModelConfig":
        raw = apply_hf_overrides(raw, hf_overrides)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; dsaserve serves {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(GLM-5.x and DeepSeek-V3.2, with DeepSeek Sparse Attention)"
            )
        family = FAMILIES[model_type]
        hybrid = None
        try:
            if model_type == "glm5_next":
                raw = text_fields(raw)
            raw = {**family.defaults, **raw}
            num_layers = _require_int(raw, "num_hidden_layers")
            if model_type == "glm5_next":
                hybrid = resolve_hybrid(raw, num_layers)
        except HybridConfigError as e:
            raise ConfigError(str(e)) from e
        attention = hybrid.attention_layers if hybrid is not None else None
        schedule = (resolve_indexer_types(raw, num_layers, attention) if family.index_share
                    else every_layer_full(raw, num_layers, family))
        for note in schedule.warnings:
            logger.info(note)
        if attention is None:
            logger.info("indexer schedule from %s: %s (%d full / %d shared)",
                        schedule.source, schedule.pattern, schedule.num_full, schedule.num_shared)
        else:
            indexed = "".join(schedule.pattern[i] for i in attention)
            logger.info("indexer schedule from %s over the %d indexed layers: %s (%d full / %d shared; the KDA layers "
                        "have no indexer)", schedule.source, len(attention), indexed, indexed.count("F"),
                        indexed.count("S"))
        cfg = cls(
            model_type=model_type,
            vocab_size=_require_int(raw, "vocab_size"),
            hidden_size=_require_int(raw, "hidden_size"),
            intermediate_size=_require_int(raw, "intermediate_size"),
            moe_intermediate_size=_require_int(raw, "moe_intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=_require_int(raw, "num_attention_heads"),
            q_lora_rank=_require_int(raw, "q_lora_rank"),
            kv_lora_rank=_require_int(raw, "kv_lora_rank"),
            qk_nope_head_dim=_require_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_require_int(raw, "qk_rope_head_dim"),
            v_head_dim=_require_int(raw, "v_head_dim"),
            n_routed_experts=_require_int(raw, "n_routed_experts"),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=_require_int(raw, "num_experts_per_tok"),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=_require_int(raw, "max_position_embeddings"),
            index_topk=_require_int(raw, "index_topk"),
            index_head_dim=_require_int(raw, "index_head_dim"),
            index_n_heads=_require_int(raw, "index_n_heads"),
            indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", True)),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            rope=resolve_rope(raw),
            indexer_schedule=schedule,
            mlp_layer_types=resolve_mlp_layer_types(raw, num_layers),
            eos_token_ids=resolve_eos_ids(raw, extra_eos),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            index_share_for_mtp_iteration=bool(raw.get("index_share_for_mtp_iteration", False)),
            checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            quantization_config=raw.get("quantization_config"),
            raw=raw,
            hybrid=hybrid,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        act = self.raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported; GLM-MoE-DSA uses 'silu'")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most "
                f"index_head_dim={self.index_head_dim} (the indexer rotates its first qk_rope_head_dim dims)"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={self.n_routed_experts} must be divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("each expert group needs at least 2 experts (group score = sum of its top-2)")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in "
                f"topk_group={self.topk_group} groups"
            )
        if self.index_topk < 1:
            raise ConfigError(f"index_topk={self.index_topk} must be positive")
        if self.hybrid is not None:
            if self.qk_rope_head_dim:
                raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim}: glm5_next attention is NoPE; set it to 0")
            if self.index_topk % self.hybrid.index_kpool:
                raise ConfigError(f"index_topk={self.index_topk} must be a multiple of index_kpool="
                                  f"{self.hybrid.index_kpool} (the indexer keeps index_topk / index_kpool pools)")


def apply_hf_overrides(raw: dict, overrides: dict | str | None) -> dict:
    """Patch config.json with `--hf-overrides` (vLLM semantics: nested dicts merge, other values replace)."""
    raw = copy.deepcopy(raw)
    if overrides is None:
        return raw
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hf-overrides {overrides!r} is not valid JSON ({e}); pass a JSON object") from e
    if not isinstance(overrides, dict):
        raise ConfigError(f"--hf-overrides must be a JSON object, got {type(overrides).__name__}")
    _merge(raw, overrides)
    return raw


def _merge(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


def _require_int(raw: dict, key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _parse_types(value, field_name: str) -> list[str]:
    items = list(value) if isinstance(value, (str, list, tuple)) else None
    if items is None:
        raise ConfigError(f"{field_name} must be a list of 'full'/'shared' or a string of F/S, got {value!r}")
    out = []
    for i, item in enumerate(items):
        kind = _LETTER_TO_TYPE.get(item) if isinstance(item, str) else None
        if kind is None:
            raise ConfigError(
                f"{field_name}[{i}]={item!r} is not a layer kind; use 'full'/'shared' (or 'F'/'S' in a pattern)"
            )
        out.append(kind)
    return out


def _freq_offset_types(raw: dict, num_layers: int) -> list[str]:
    # Defaults follow the transformers reference: freq 1 (every layer full), offset 2.
    freq = raw.get("index_topk_freq", 1)
    offset = raw.get("index_skip_topk_offset", 2)
    if not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"index_topk_freq={freq!r} must be a positive integer")
    if not isinstance(offset, int):
        raise ConfigError(f"index_skip_topk_offset={offset!r} must be an integer")
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]


def _pattern_string(types) -> str:
    return "".join("F" if t == FULL else "S" for t in types)


def resolve_indexer_types(raw: dict, num_layers: int, attention_layers=None) -> IndexerSchedule:
    """`indexer_types` (authoritative) → `index_topk_pattern` → freq/offset → all full. attention_layers: the layers
    that attend (a hybrid model's; None: all); the first of them must be full, the others' entries are unused."""
    explicit = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    has_freq = "index_topk_freq" in raw or "index_skip_topk_offset" in raw
    warnings = []
    if explicit is not None:
        types, source = _parse_types(explicit, "indexer_types"), "indexer_types"
    elif pattern is not None:
        types, source = _parse_types(pattern, "index_topk_pattern"), "index_topk_pattern"
    elif has_freq:
        types, source = _freq_offset_types(raw, num_layers), "index_topk_freq/index_skip_topk_offset"
    else:
        types, source = [FULL] * num_layers, "default (no schedule fields: every layer full)"

    if len(types) != num_layers:
        raise ConfigError(
            f"{source} has {len(types)} entries but num_hidden_layers={num_layers}; give one entry per layer"
        )
    first = attention_layers[0] if attention_layers else 0
    if types[first] != FULL:
        raise ConfigError(f"{source}: layer {first} is {types[first]!r} but must be 'full' "
                          f"(a shared layer needs a full layer before it; layer {first} is the first that attends)")

    if explicit is not None and pattern is not None:
        other = _parse_types(pattern, "index_topk_pattern")
        if other != types:
            first = next((i for i, (a, b) in enumerate(zip(types, other)) if a != b), min(len(types), len(other)))
            ours = types[first] if first < len(types) else "<missing>"
            got = other[first] if first < len(other) else "<missing>"
            raise ConfigError(
                f"indexer_types and index_topk_pattern disagree at layer {first} "
                f"(indexer_types says {ours!r}, index_topk_pattern says {got!r}); "
                "remove one or pin the schedule with --hf-overrides "
                f"'{json.dumps({'index_topk_pattern': _pattern_string(types)})}'"
            )
    if explicit is not None and pattern is None and "index_topk_pattern" in raw:
        warnings.append(
            "index_topk_pattern is null; the schedule comes from indexer_types. An engine that reads only "
            "index_topk_pattern would run the indexer on every layer"
        )
    if source in ("indexer_types", "index_topk_pattern") and has_freq:
        derived = _freq_offset_types(raw, num_layers)
        if derived != types:
            first = next(i for i, (a, b) in enumerate(zip(types, derived)) if a != b)
            warnings.append(
                f"index_topk_freq/index_skip_topk_offset imply a different schedule from layer {first}; "
                f"{source} is authoritative and was used"
            )
    return IndexerSchedule(types=tuple(types), source=source, warnings=tuple(warnings))


def every_layer_full(raw: dict, num_layers: int, family: ModelFamily) -> IndexerSchedule:
    """A family without IndexShare: schedule fields that would make a layer shared are an error, not ignored."""
    if any(key in raw for key in ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")):
        given = resolve_indexer_types(raw, num_layers)
        if given.num_shared:
            raise ConfigError(f"{given.source} makes layers shared ({given.pattern}), but {family.model_type} runs "
                              "its own indexer on every layer (no IndexShare); remove the field")
    return IndexerSchedule(types=(FULL,) * num_layers, source=f"{family.model_type} (every layer runs its indexer)")


def resolve_mlp_layer_types(raw: dict, num_layers: int) -> tuple[str, ...]:
    explicit = raw.get("mlp_layer_types")
    if explicit is not None:
        if not isinstance(explicit, list) or any(t not in ("dense", "sparse") for t in explicit):
            raise ConfigError(f"mlp_layer_types must be a list of 'dense'/'sparse', got {explicit!r}")
        if len(explicit) != num_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(explicit)} entries but num_hidden_layers={num_layers}"
            )
        return tuple(explicit)
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    return tuple("sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(num_layers))


def resolve_rope(raw: dict) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError("rope_parameters.rope_theta is missing (nor is there a top-level rope_theta)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type != "yarn":
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported; use 'default' or 'yarn'")
    if "factor" not in params:
        raise ConfigError("rope_parameters.factor is required for rope_type 'yarn'")
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or raw["max_position_embeddings"]
        ),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def resolve_eos_ids(raw: dict, extra=()) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (raw.get("eos_token_id"), list(extra)):
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return tuple(ids)


def _generation_config_eos(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        value = json.load(f).get("eos_token_id")
    if value is None:
        return []
    return value if isinstance(value, list) else [value]
