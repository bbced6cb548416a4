"""FP8 weights as checkpoints ship them: float8 e4m3 values with one fp32 scale per block (128 × 128 by
default), which despite its name (`weight_scale_inv`) is multiplied in. Each tensor's tile is derived
from its own scale grid (ceil division: a 576-row weight has 5 row blocks, the last one partial), so a
slice of it (a rank's rows or columns) keeps the scales of the blocks it cuts through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsaserve.config import CheckpointError
from dsaserve.native import torch_ops

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8: returns (float8_e4m3fn weight, float32 weight_scale_inv [ceil(r/b), ceil(c/b)])."""
    rows, cols = weight.shape
    grid_r, grid_c = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(grid_r * block[0], grid_c * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid_r, block[0], grid_c, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).view(grid_r * block[0], grid_c * block[1])[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str,
                   full_shape: tuple[int, int] | None = None, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """weight (float8_e4m3fn) × its per-block scale, fp32. The tile is derived from the tensor's own scale grid.
    weight may be the part of a [full_shape] tensor starting at row, column `offset` (a chunk, a rank's slice)."""
    grid, tile_r, tile_c = scale_grid(scale_inv, full_shape or weight.shape, block, name)
    if weight.device.type == "cpu" and torch_ops.load():  # a table per byte: torch's float8 → float is slow
        return torch.ops.dsaserve.fp8_block_dequantize(weight.contiguous().view(torch.uint8), grid, tile_r, tile_c,
                                                      offset[0], offset[1])
    row_block = (torch.arange(weight.shape[0], device=grid.device) + offset[0]) // tile_r
    col_block = (torch.arange(weight.shape[1], device=grid.device) + offset[1]) // tile_c
    return weight.float() * grid[row_block][:, col_block]


def scale_grid(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int], name: str = "weight"
               ) -> tuple[torch.Tensor, int, int]:
    """(the scales as a contiguous fp32 grid [grid_r, grid_c], rows per scale, columns per scale) of an FP8 tensor
    of `shape`: what the native operators take."""
    tile_r, tile_c = fp8_tiles(shape, scale_inv, block, name)
    grid_r, grid_c = scale_inv.shape if scale_inv.dim() == 2 else (1, 1)
    return scale_inv.float().reshape(grid_r, grid_c).contiguous(), tile_r, tile_c


def fp8_tiles(shape: tuple[int, int], scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"
              ) -> tuple[int, int]:
    """Rows and columns per scale of an FP8 tensor of `shape`, from its own scale grid."""
    grid_r, grid_c = scale_inv.shape if scale_inv.dim() == 2 else (1, 1)
    return _tile(shape[0], grid_r, block[0], name), _tile(shape[1], grid_c, block[1], name)


def _tile(size: int, grid: int, block: int, name: str) -> int:
    if math.ceil(size / block) == grid:
        return block
    tile = math.ceil(size / grid)
    if grid < 1 or math.ceil(size / tile) != grid:
        raise CheckpointError(f"{name}: a scale grid of {grid} blocks cannot cover {size} rows/columns")
    return tile


def fp8_row_scales(scale_inv: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], full_shape: tuple[int, int],
                   block: tuple[int, int]) -> torch.Tensor:
    """The block scales of rows [r0, r1) and columns [c0, c1) of an FP8 tensor, per row: fp32 [r1 - r0, G].
    Tiles come from the tensor's own scale grid (its last block may be partial)."""
    tile_r, tile_c = fp8_tiles(full_shape, scale_inv, block)
    grid = scale_inv.float().reshape(-(-full_shape[0] // tile_r), -1)
    return grid[torch.arange(rows[0], rows[1], device=grid.device) // tile_r][:, cols[0] // tile_c:
                                                                           (cols[1] - 1) // tile_c + 1]


@dataclass(frozen=True)
class Fp8Slice:
    """Rows and columns of a checkpoint's FP8 tensor as shipped: the slice's float8 values, the tensor's
    scale grid, and where the slice sits in the tensor."""

    weight: torch.Tensor  # float8_e4m3fn [n, k]
    scale_inv: torch.Tensor  # [grid_r, grid_c]
    full_shape: tuple[int, int]
    offset: tuple[int, int]  # first row and column of the slice
    block: tuple[int, int]
    name: str

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def col_offset(self) -> int:
        """The slice's first column inside its 128-column block."""
        return self.offset[1] % FP8_BLOCK

    def row_scales(self) -> torch.Tensor:
        n, k = self.weight.shape
        return fp8_row_scales(self.scale_inv, (self.offset[0], self.offset[0] + n),
                                      (self.offset[1], self.offset[1] + k), self.full_shape, self.block)

    def dequantized(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale_inv, self.block, self.name, self.full_shape, self.offset)

    def native_args(self) -> tuple:
        """(bytes, scale grid, tile_r, tile_c, first row, first column): the slice as the native operators take it."""
        grid, tile_r, tile_c = scale_grid(self.scale_inv, self.full_shape, self.block, self.name)
        return self.weight.contiguous().view(torch.uint8), grid, tile_r, tile_c, self.offset[0], self.offset[1]


def as_float(source) -> torch.Tensor:
    return source.dequantized() if isinstance(source, Fp8Slice) else source


def is_fp8_quantizable(name: str) -> bool:
    """Whether a GLM FP8 checkpoint stores this tensor in FP8: linear projections do; embeddings, lm_head, norms,
    the router, the indexer's weights_proj and KDA's convolutions stay in their dtype."""
    if not name.endswith(".weight") or "norm" in name or "embed_tokens" in name or name.startswith("lm_head"):
        return False
    if name.endswith("mlp.gate.weight") or "weights_proj" in name or "shared_head" in name:
        return False
    if "conv1d" in name:  # a KDA layer's convolution taps (GLM-5.3-Flash): not a projection
        return False
    return True
