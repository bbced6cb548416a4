"""Small building blocks shared by attention, indexer and MLPs: norms, rotary embedding, gated MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.config import RopeConfig
from dsaserve.model.decode_plan import NewRegister, Piece
from dsaserve.model.linear import linear
from dsaserve.model.parallel_layers import RowParallelLinear
from dsaserve.native import torch_ops
from dsaserve.quantization.packed_experts import fused_applies, gated_mlp
from dsaserve.quantization.quantized_weight import QuantizedWeight, packed_args


@dataclass(frozen=True)
class NormBinding:
    """An RMSNorm's native arguments (native/rms_norm.cpp)."""

    weight: torch.Tensor
    eps: float

    @cached_property
    def native_args(self) -> tuple:
        return self.weight, self.eps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (norm(x + residual), x + residual): the residual addition before the norm."""
        if residual is not None:
            if x.dim() == 2 and one_operator(x, residual, self.weight):  # one native call, the same bits
                return torch.ops.dsaserve.add_rms_norm.default(x, residual, self.weight, self.eps)
            total = x + residual
            return self(total), total
        if one_operator(x, self.weight):  # the same arithmetic in one native call
            return torch.ops.dsaserve.rms_norm.default(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def decode_pieces(self, reads: tuple[int, ...], new: NewRegister) -> tuple[list[Piece], object] | None:
        """forward() as a native piece (model/decode_plan.py): the norm, or with a residual the addition and norm."""
        if self.weight.dtype not in (torch.bfloat16, torch.float32):
            return None
        binding = NormBinding(self.weight, self.eps)
        if len(reads) == 1:
            h = new()
            return [Piece("rms_norm", binding, reads, (h,))], h
        h, total = new(), new()
        return [Piece("add_rms_norm", binding, reads, (h, total))], (h, total)


def one_operator(*tensors: torch.Tensor) -> bool:
    """Whether the native norm and rotary operators take these: CPU tensors of one dtype, bf16 or fp32,
    with the operators built. They compute what the torch operators below them do, rounding included
    (only the order of the norm's fp32 sum differs); a decode step calls them dozens of times, where
    each torch operator's own cost outweighs its arithmetic. Not for tensors that need gradients."""
    first = tensors[0]
    dtype = first.dtype
    if not (first.is_cpu and (dtype is torch.bfloat16 or dtype is torch.float32) and torch_ops.load()):
        return False
    grad = torch.is_grad_enabled()  # the operators have no backward: a training pass takes the torch ones
    for t in tensors:  # (a loop: a generator costs more than the check, dozens of times a step)
        if t.dtype is not dtype or (grad and t.requires_grad):
            return False
    return True


@dataclass(frozen=True)
class GatedMlpBinding:
    """A gated MLP's packed weights, as native/quant_linear.cpp's gated_mlp takes them (gate|up fused)."""

    gate_up: QuantizedWeight
    down: QuantizedWeight

    @cached_property
    def native_args(self) -> tuple:
        return *packed_args(self.gate_up), *packed_args(self.down)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections fused into one weight at load time.

    With tensor parallelism each rank holds `intermediate_size` (its share) of the gate, up and down
    projections; the partial outputs are summed over `comm` (None: the caller sums them, as MoE does
    once for its routed and shared experts together)."""

    QUANTIZABLE = ("gate_up_proj",)

    def __init__(self, hidden_size: int, intermediate_size: int, comm=None, first_column: int | None = None,
                 swiglu_limit: float | None = None):
        """first_column: where this rank's share starts in the full intermediate dimension (default: comm's
        rank × intermediate_size). swiglu_limit: gate ≤ limit and |up| ≤ limit before the product (GLM-5.3-Flash)."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, comm=comm,
                                           first_column=first_column)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        if fused_applies(x, self.gate_up_proj, down.weight):  # one native call, the same bits
            y = gated_mlp(x, self.gate_up_proj, down.weight, self.intermediate_size, self.swiglu_limit)
            return y if down.comm.size == 1 else down.comm.all_reduce(y)
        gate, up = linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return down(swiglu(gate, up, self.swiglu_limit))

    def binding(self) -> GatedMlpBinding | None:
        """Its packed weights for one native call, or None: not packed alike, a share of a split MLP, or clamped."""
        gate_up, down = self.gate_up_proj, self.down_proj.weight
        if self.swiglu_limit is not None:
            return None
        if not (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight) and gate_up.kind == down.kind
                and gate_up.col_offset == 0 and down.col_offset == 0):
            return None
        return GatedMlpBinding(gate_up, down)

    def decode_pieces(self, reads: tuple[int, ...], new: NewRegister) -> tuple[list[Piece], object] | None:
        """forward() as a native piece (model/decode_plan.py), where its weights are packed and not split."""
        binding = self.binding()
        if binding is None or self.down_proj.comm.size != 1:
            return None
        out = new()
        return [Piece("gated_mlp", binding, reads, (out,))], out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) · up; with a limit, gate clamped to ≤ limit and up to [-limit, limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for `dim` rotary dims and the factor that scales cos/sin (1 unless yarn)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def attention_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """Softmax scale of the main attention: head_dim^-0.5, times yarn mscale² when `mscale_all_dim` is set."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


class RotaryEmbedding:
    """cos/sin per position, applied as pairs. `interleaved` pairs (x0,x1),(x2,x3)…; otherwise halves.

    The rotated output is written in half-split order (all first elements, then all second elements).
    Queries and keys get the same permutation, so every dot product equals the interleaved one; the
    transformers reference does the same, which keeps cache contents comparable.
    """

    def __init__(self, rope: RopeConfig, dim: int):
        # Computed on the host even when the model is built on the "meta" device.
        self.inv_freq, self.scaling = rope_inv_freq(rope, dim)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, dim/2] of `positions`. With `upto` (every position is below it, known on the host)
        they are rows of a table made once for positions 0…upto and grown when a longer one comes:
        two lookups per forward instead of a handful of operators, with the same values."""
        if upto is None:
            return self._compute(positions, dtype)
        table = getattr(self, "_table", None)
        if table is None or table[0].shape[0] < upto or table[0].dtype != dtype or table[0].device != positions.device:
            size = max(4096, 1 << (upto - 1).bit_length())
            table = self._table = self._compute(torch.arange(size, device=positions.device), dtype)
        return table[0][positions], table[1][positions]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [T, ..., dim]; cos/sin: [T, dim/2]. No rotary dims (NoPE): x itself."""
    if not cos.shape[-1]:
        return x
    if x.shape[0] and one_operator(x, cos, sin):
        return torch.ops.dsaserve.apply_rope.default(x, cos, sin, interleaved)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
