"""Which slice of each checkpoint tensor one rank holds: the single description of the split.

The model sizes its parameters from a ShardPlan, the loader reads only `tensor_slice(...)` of each
tensor from the safetensors files, and `doctor` adds up the same slices to print each rank's bytes.

    attention   q_b_proj, kv_b_proj: rows of this rank's heads; o_proj: their input columns
                (all-reduced); q_a_proj, kv_a_proj_with_mqa, norms and the whole indexer replicated
                (MLA has one latent head, so every rank computes the same latent and top-k)
    KDA         (glm5_next) q/k/v projections and convolutions, f_b_proj, g_b_proj, dt_bias, A_log and
                b_proj: rows of this rank's KDA heads; o_proj: their input columns (all-reduced); f_a_proj,
                g_a_proj, o_norm and the mHC weights replicated
    MLP         gate/up rows and down columns of this rank's share of the intermediate dimension
    experts     the same split per expert, or with expert parallelism whole experts
                [rank·E/TP, (rank+1)·E/TP); router and correction bias replicated
    vocabulary  embed_tokens, lm_head, shared_head.head: rows [rank·V', (rank+1)·V'), V' = ceil(V/TP)
                (the last rank's rows past V are zero padding)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsaserve.config import ModelConfig

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MLP = re.compile(r"\.mlp\.(?:shared_experts\.)?(gate|up|down)_proj\.weight$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")
_LAYER = re.compile(r"\.layers\.(\d+)\.self_attn\.")
_KDA_BY_HEAD = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                "v_conv1d.weight", "f_b_proj.weight", "g_b_proj.weight", "dt_bias", "A_log", "b_proj.weight")


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` tensor-parallel ranks holds."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def split(self, total: int) -> tuple[int, int]:
        """This rank's equal part [start, stop) of `total` (a multiple of size)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def local(self, total: int) -> int:
        return total // self.size

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """This rank's rows of the vocabulary [start, start + per_rank), padded: may pass `vocab`."""
        per_rank = -(-vocab // self.size)
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def local_experts(self, n_experts: int) -> tuple[int, int]:
        return self.split(n_experts) if self.expert_parallel else (0, n_experts)


@dataclass(frozen=True)
class TensorSlice:
    """Rows or columns [start, stop) along `dim` of a checkpoint tensor; dim None: all of it."""

    dim: int | None = None
    start: int = 0
    stop: int = 0
    kind: str = "replicated"  # how the doctor reports it: replicated, heads, intermediate, experts, vocab

    def clip(self, size: int) -> "TensorSlice":
        return TensorSlice(self.dim, min(self.start, size), min(self.stop, size), self.kind)

    def shape_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = self.stop - self.start
        return tuple(out)


WHOLE = TensorSlice()


def tensor_slice(cfg: ModelConfig, plan: ShardPlan, name: str, shape: tuple[int, ...]) -> TensorSlice | None:
    """The part of checkpoint tensor `name` (of `shape`) that this rank reads; None: none of it."""
    if plan.size == 1:
        return WHOLE
    if name.endswith(_VOCAB):
        start, stop = plan.vocab_rows(cfg.vocab_size)
        return TensorSlice(0, start, stop, "vocab").clip(shape[0])
    if m := _EXPERT.search(name):
        if plan.expert_parallel:
            first, last = plan.local_experts(cfg.n_routed_experts)
            return TensorSlice(kind="experts") if first <= int(m.group(1)) < last else None
        return _intermediate(plan, m.group(2), shape)
    if m := _MLP.search(name):
        return _intermediate(plan, m.group(1), shape)
    if (m := _LAYER.search(name)) and not cfg.is_attention(int(m.group(1))):
        return _kda(cfg, plan, name, shape)
    if ".self_attn." in name and ".indexer." not in name:
        heads = cfg.num_attention_heads
        if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
            per_head = shape[0] // heads
            first, last = plan.split(heads)
            return TensorSlice(0, first * per_head, last * per_head, "heads")
        if name.endswith("o_proj.weight"):
            per_head = shape[1] // heads
            first, last = plan.split(heads)
            return TensorSlice(1, first * per_head, last * per_head, "heads")
    return WHOLE


def _kda(cfg: ModelConfig, plan: ShardPlan, name: str, shape: tuple[int, ...]) -> TensorSlice:
    heads = cfg.hybrid.linear_num_heads
    first, last = plan.split(heads)
    if name.endswith(_KDA_BY_HEAD):
        per_head = shape[0] // heads
        return TensorSlice(0, first * per_head, last * per_head, "heads")
    if name.endswith("o_proj.weight"):
        per_head = shape[1] // heads
        return TensorSlice(1, first * per_head, last * per_head, "heads")
    return WHOLE


def _intermediate(plan: ShardPlan, kind: str, shape: tuple[int, ...]) -> TensorSlice:
    dim = 1 if kind == "down" else 0
    start, stop = plan.split(shape[dim])
    return TensorSlice(dim, start, stop, "intermediate")
