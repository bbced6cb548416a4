"""Gated MLPs for a few tokens in one native call each, their packed weights read in place: a MoE layer's
routed experts (`add_routed_experts`), and a single gated MLP such as the shared experts or a dense layer's
MLP (`gated_mlp`: its two products with the SiLU gating between them, the bits of the three torch calls).

The per-expert loop of model/moe.py costs some 60 torch operators and two thread wake-ups per expert
and layer; for decode and draft verification that bookkeeping outweighs reading the experts' weights.
`moe_experts` (native/quant_linear.cpp) groups the tokens by expert, runs every chosen expert's gate|up
and down products with the packed-weight kernel (one parallel pass over all their blocks each), and
adds the weighted outputs into `out`, rounding as the loop does, so its results are the loop's bits.
"""

from __future__ import annotations

import torch

from dsaserve.native import torch_ops
from dsaserve.quantization.quantized_weight import KERNEL_ROWS, QuantizedWeight


def fused_applies(x: torch.Tensor, gate_up, down) -> bool:
    """Whether add_routed_experts and gated_mlp take these: packed weights, a CPU with the kernels, few tokens."""
    return (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)
            and gate_up.kind == down.kind and gate_up.col_offset == 0
            and x.is_cpu and x.dtype in (torch.bfloat16, torch.float32)
            and 0 < x.shape[0] <= KERNEL_ROWS and torch_ops.runs("packed_products"))


def gated_mlp(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, inter: int,
              swiglu_limit: float | None = None) -> torch.Tensor:
    """down(silu(gate) · up) of x [T, hidden], gate|up [2 · inter, hidden] fused (gate and up clamped at
    swiglu_limit first, where given). Only where fused_applies."""
    return torch.ops.dsaserve.gated_mlp.default(x, gate_up.qweight, gate_up.scale, down.qweight, down.scale,
                                                gate_up.args[0], inter, gate_up.args[1], down.args[1], down.col_offset,
                                                swiglu_limit or 0.0)


def add_routed_experts(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, ids: torch.Tensor,
                       weights: torch.Tensor, out: torch.Tensor, shared=None,
                       swiglu_limit: float | None = None) -> None:
    """out [T, hidden] += Σ_j weights[t, j] · expert ids[t, j] applied to x[t]; ids are this rank's expert
    indices (-1: an expert held elsewhere), weights fp32 [T, top_k]. Only where fused_applies. With `shared` (a
    GatedMLP whose packed weights are of the experts' kind), out is first set to its output in the same call. With
    swiglu_limit, every expert's gate and up are clamped at it first."""
    tensors, tail = routed_expert_args(gate_up, down, shared)
    torch.ops.dsaserve.moe_experts.default(x.contiguous(), *tensors, ids.contiguous(), weights.float().contiguous(),
                                           out, *tail, swiglu_limit=swiglu_limit or 0.0)


def routed_expert_args(gate_up: QuantizedWeight, down: QuantizedWeight, shared=None) -> tuple[tuple, tuple]:
    """moe_experts' weight arguments before the token ones, and after them: gathered once per (down, shared)
    pair and kept with gate_up (prepared_calls.py)."""
    known = gate_up.prepared("routed experts", dict)
    entry = known.get((id(down), id(shared)))
    if entry is not None and entry[0] is down and entry[1] is shared:
        return entry[2]
    extra = ()
    if shared is not None:
        s_gate_up, s_down = shared.gate_up_proj, shared.down_proj.weight
        if s_gate_up.kind != gate_up.kind:
            raise ValueError(f"shared expert weights in {s_gate_up.kind}, routed experts in {gate_up.kind}: one call "
                             "takes one kind")
        extra = (s_gate_up.qweight, s_gate_up.scale, s_down.qweight, s_down.scale, shared.intermediate_size,
                 s_gate_up.args[1], s_down.args[1], s_down.col_offset)
    args = ((gate_up.qweight, gate_up.scale, down.qweight, down.scale),
            (gate_up.args[0], down.in_features, gate_up.args[1], down.args[1], down.col_offset, *extra))
    known[(id(down), id(shared))] = (down, shared, args)
    return args
