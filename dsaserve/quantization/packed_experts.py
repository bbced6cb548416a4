"""A MoE layer's routed experts for a few tokens in one native call, their packed weights read in place.

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
    """Whether add_routed_experts takes these: packed weights, a CPU with the kernels, few tokens."""
    return (isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)
            and gate_up.kind == down.kind and gate_up.col_offset == 0
            and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and 0 < x.shape[0] <= KERNEL_ROWS and torch_ops.cpu_kernels() == "avx512_bf16")


def add_routed_experts(x: torch.Tensor, gate_up: QuantizedWeight, down: QuantizedWeight, ids: torch.Tensor,
                       weights: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, hidden] += Σ_j weights[t, j] · expert ids[t, j] applied to x[t]; ids are this rank's expert
    indices (-1: an expert held elsewhere), weights fp32 [T, top_k]. Only where fused_applies."""
    torch.ops.dsaserve.moe_experts(
        x.contiguous(), gate_up.qweight, gate_up.scale, down.qweight, down.scale, ids.contiguous(),
        weights.float().contiguous(), out, gate_up.args[0], down.in_features, gate_up.args[1], down.args[1],
        down.col_offset)
