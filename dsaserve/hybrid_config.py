"""What GLM-5.3-Flash (`glm5_next`) adds to the config: which layers are KDA (linear attention) and which indexed
attention, the KDA geometry, the mHC residual streams, the pooled indexer and the SwiGLU clamp.

Resolved once from config.json (the text fields sit under `text_config`, or at the top level in a flat config), with
transformers' Glm5NextTextConfig as the reference for fields left out: `layer_types` (default: every fourth layer,
3, 7, …, indexed, the rest KDA; a legacy `full_attention` means indexed), and the KDA fields from
`linear_attn_config` as shipped (`head_dim`, `num_heads`, `short_conv_kernel_size`, `gate_lower_bound`), which
override the flat `linear_*` fields.
"""

from __future__ import annotations

from dataclasses import dataclass

LINEAR, INDEXED = "linear_attention", "indexed_attention"
STATE_DTYPE_BYTES = 4  # the recurrent state and the convolution tail are kept in fp32


class HybridConfigError(ValueError):
    """A glm5_next field is missing, malformed or inconsistent (a ConfigError re-raises it by name)."""


@dataclass(frozen=True)
class HybridConfig:
    layer_types: tuple[str, ...]  # LINEAR (KDA) or INDEXED (NoPE MLA with the pooled indexer) per layer
    linear_head_dim: int
    linear_num_heads: int
    conv_kernel: int
    gate_lower_bound: float | None  # None: softplus decay without a bound
    hc_mult: int  # parallel residual streams (mHC)
    hc_eps: float
    hc_sinkhorn_iters: int
    index_kpool: int  # tokens per indexer pool
    always_select_tail: bool  # the unfinished pool is always attended
    swiglu_limit: float | None  # gate ≤ limit, |up| ≤ limit in every gated MLP

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED)

    @property
    def pattern(self) -> str:
        """One letter per layer: K (KDA) or A (indexed attention)."""
        return "".join("K" if t == LINEAR else "A" for t in self.layer_types)

    @property
    def qkv_dim(self) -> int:
        return self.linear_head_dim * self.linear_num_heads

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 3 * self.qkv_dim

    def state_bytes_per_layer(self) -> int:
        """One request's state in one KDA layer: the recurrent state [heads, head_dim, head_dim] and the last
        conv_kernel - 1 inputs of the convolution."""
        recurrent = self.linear_num_heads * self.linear_head_dim * self.linear_head_dim
        return (recurrent + (self.conv_kernel - 1) * self.conv_dim) * STATE_DTYPE_BYTES

    def state_bytes_per_request(self) -> int:
        return len(self.linear_layers) * self.state_bytes_per_layer()


def text_fields(raw: dict) -> dict:
    """A glm5_next config.json's text model fields: `text_config` over the top level (ids such as eos, given at the
    top level, are kept when text_config leaves them out)."""
    text = raw.get("text_config")
    if text is None:
        return dict(raw)
    if not isinstance(text, dict):
        raise HybridConfigError(f"text_config must be an object, got {text!r}")
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update({k: v for k, v in text.items() if v is not None or k not in merged})
    merged["model_type"] = raw["model_type"]
    return merged


def resolve_hybrid(raw: dict, num_layers: int) -> HybridConfig:
    layer_types = raw.get("layer_types")
    if layer_types is None:
        layer_types = [INDEXED if i % 4 == 3 else LINEAR for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise HybridConfigError(f"layer_types must be a list of {num_layers} entries (one per layer), "
                                f"got {layer_types!r}")
    layer_types = [INDEXED if t == "full_attention" else t for t in layer_types]
    bad = [(i, t) for i, t in enumerate(layer_types) if t not in (LINEAR, INDEXED)]
    if bad:
        i, t = bad[0]
        raise HybridConfigError(f"layer_types[{i}]={t!r} is not a layer kind; use {LINEAR!r} or {INDEXED!r}")
    if INDEXED not in layer_types:
        raise HybridConfigError("layer_types has no indexed_attention layer; GLM-5.3-Flash attends every fourth layer")
    linear = raw.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise HybridConfigError(f"linear_attn_config must be an object, got {linear!r}")
    bound = linear.get("gate_lower_bound", raw.get("linear_lower_bound", -5.0))
    if bound is None and linear.get("safe_gate", True) and linear:
        bound = -5.0
    cfg = HybridConfig(
        layer_types=tuple(layer_types),
        linear_head_dim=_positive(linear.get("head_dim", raw.get("linear_head_dim", 128)),
                                  "linear_attn_config.head_dim"),
        linear_num_heads=_positive(linear.get("num_heads", raw.get("linear_num_heads", 64)),
                                   "linear_attn_config.num_heads"),
        conv_kernel=_positive(linear.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4)),
                              "linear_attn_config.short_conv_kernel_size"),
        gate_lower_bound=None if bound is None else float(bound),
        hc_mult=_positive(raw.get("hc_mult", 4), "hc_mult"),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        hc_sinkhorn_iters=_positive(raw.get("hc_sinkhorn_iters", 20), "hc_sinkhorn_iters"),
        index_kpool=_positive(raw.get("index_kpool", 16), "index_kpool"),
        always_select_tail=bool(raw.get("index_kpool_always_select_tail", True)),
        swiglu_limit=None if raw.get("swiglu_limit", 10.0) is None else float(raw.get("swiglu_limit", 10.0)),
    )
    if not cfg.always_select_tail:
        raise HybridConfigError(
            "index_kpool_always_select_tail=false leaves a query whose own pool is unfinished with nothing to attend "
            "(the first index_kpool - 1 tokens see no key); dsaserve serves checkpoints with true")
    return cfg


def _positive(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HybridConfigError(f"{name}={value!r} must be a positive integer")
    return value
