"""The contract between the tile unions' builder (attention/tile_unions.py) and the kernel that reads them
(union_rows.py): how many queries a tile holds, and what a tile's union is. No Triton here: the builder runs where
Triton is not installed too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE_ROWS = 32  # (query, head) pairs a union_rows program takes: its [32, 512] fp32 accumulator, 64 registers a thread


def tile_queries(heads: int) -> int:
    """Queries a tile holds at `heads` heads (at least 1, at most 16: their bits fit an int32)."""
    return max(1, min(16, TILE_ROWS // heads))


@dataclass(frozen=True)
class TileUnions:
    """Tiles of up to `queries` rows of one request: first row, rows, and the union of their selections (slots int32
    [tiles, queries × width], -1 past `counts`; members int32, bit q for the tile's q-th row)."""

    queries: int
    first: torch.Tensor
    length: torch.Tensor
    slots: torch.Tensor
    members: torch.Tensor
    counts: torch.Tensor
