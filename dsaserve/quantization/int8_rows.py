"""Int8Rows: an embedding table kept in int8 with one scale per row (symmetric, amax / 127).

A lookup reads only the rows it needs and dequantizes them; the table is not a matrix product, so it
is not packed for the kernels. Used for the embedding under --quantization (its rows are 8% of a
small model's weights, 0.1% of GLM-5.2's).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.quantization import formats


class Int8Rows(nn.Module):
    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.out_features, self.in_features = rows, cols
        self.register_buffer("qweight", torch.empty(rows, cols, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(rows, 1))

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scale[ids]).to(dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    @torch.no_grad()
    def load_rows(self, first: int, source, expert=None, name: str = "weight") -> None:
        n, k = source.shape
        if k != self.in_features or first + n > self.out_features:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(source.shape)}, which does not fit rows "
                             f"{first}… of a [{self.out_features}, {self.in_features}] table")
        q, scale = formats.quantize("int8", source)
        self.qweight[first:first + n] = q
        self.scale[first:first + n] = scale
