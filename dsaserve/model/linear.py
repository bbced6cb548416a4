"""Linear layers whose weight is either a float tensor or a QuantizedWeight (packed, 8/4-bit or bf16).

`linear(x, w)` is what every projection calls: F.linear for a float weight, the packed product
otherwise. Stacked expert weights are [E, N, K] either way; `expert_weight(w, e)` picks one in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.quantization.quantized_weight import PackedMatrix, QuantizedWeight


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    matrix = weight.matrix() if isinstance(weight, QuantizedWeight) else weight
    y = matrix.matmul(x)
    return y if bias is None else y + bias


def expert_weight(weight, expert: int):
    """Expert `expert`'s [N, K] of a stacked [E, N, K] weight: a view, never a copy."""
    return weight[expert] if isinstance(weight, torch.Tensor) else weight.matrix(expert)


class Linear(nn.Module):
    """nn.Linear's parameters and names (`weight` [out, in], optional `bias`), with a weight that may be packed."""

    QUANTIZABLE = ("weight",)

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


__all__ = ["Linear", "PackedMatrix", "QuantizedWeight", "expert_weight", "linear"]
