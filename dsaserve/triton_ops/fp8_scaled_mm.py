"""FP8 weights on the FP8 tensor cores of Hopper GPUs: torch's block-scaled matmul, with the activations quantized to
e4m3 per row and 128 columns and the weight's 128 × 128 blocks as the checkpoint ships them (the recipe FP8 DeepSeek
and GLM checkpoints were trained for).

It serves products of at least MIN_ROWS rows of bf16/fp16 activations (prefill chunks: compute-bound, where FP8
doubles the tensor cores' rate). Fewer rows keep quantized_linear.py, which reads the same FP8 bytes with exact
activations (decode is bound by those reads either way), and so do fp32 models (their parity with the CPU path is
held to 1e-3, beyond what 8-bit activations keep).

Whether this GPU and torch build run it is found once per device by `unavailable`: it multiplies a small problem and
compares the result with quantized_linear.py's; anything else (a CPU, a GPU before Hopper, a build without block-scaled
FP8, a wrong answer) keeps the Triton kernel for every product, and the log says why.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BLOCK = 128  # columns per activation scale; rows and columns per weight scale
MIN_ROWS = 64
FP8_MAX = 448.0  # largest finite e4m3 value
PROBE_TOLERANCE = 0.05  # relative to the product's largest value: 8-bit activations' rounding, not a wrong layout


def takes(rows: torch.Tensor, k: int, n: int, col_offset: int) -> bool:
    """Whether a product of `rows` by an [n, k] FP8 weight (its slice starting col_offset into a block) fits this
    path's shapes and dtypes (the block scales and the device are checked apart)."""
    return (rows.shape[0] >= MIN_ROWS and rows.dtype in (torch.bfloat16, torch.float16) and not col_offset
            and k % BLOCK == 0 and n % BLOCK == 0)


def block_scales(scale: torch.Tensor) -> torch.Tensor | None:
    """A weight's scales per 128 × 128 block, [N / 128, G] (G padded to a multiple of 4, as torch's kernel reads
    them), from the rows layout [N, G] (a scale per row and 128 columns) when every 128 rows share theirs: an FP8
    checkpoint's blocks, sliced at block edges. None for other scales (e.g. --quantization fp8's, one per row)."""
    n, groups = scale.shape
    if n % BLOCK:
        return None
    blocks = scale[::BLOCK]
    if not torch.equal(blocks.repeat_interleave(BLOCK, dim=0), scale):
        return None
    return F.pad(blocks, (0, -groups % 4), value=1.0).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 [M', K], scales [M', K / 128] with unit row stride), M' = M rounded up to 4 (zero rows), each
    row's 128 columns scaled by their largest magnitude to the e4m3 range."""
    m, k = x.shape
    groups = F.pad(x, (0, 0, 0, -m % 4)).float().view(-1, k // BLOCK, BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    quantized = (groups / scale[..., None]).to(torch.float8_e4m3fn).view(-1, k)
    return quantized, scale.t().contiguous().t()


def scaled_matmul(x: torch.Tensor, qweight: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] by an FP8 weight (its bytes, uint8 [N, K]) with its block scales (block_scales): [M, N] in x's
    dtype."""
    quantized, scale = quantize_activations(x)
    y = F.scaled_mm(quantized, qweight.view(torch.float8_e4m3fn).t(), scale, _scaling("BlockWise1x128"),
                    blocks.t(), _scaling("BlockWise128x128"), output_dtype=x.dtype)
    return y[: x.shape[0]]


def _scaling(name: str):
    """torch's ScalingType member `name` (BlockWise1x128); releases before 2.13 spell it Blockwise_1x128. A build
    with neither raises AttributeError, which the probe reports."""
    kinds = F.ScalingType
    return getattr(kinds, name, None) or getattr(kinds, name.replace("BlockWise", "Blockwise_"))


@functools.cache
def unavailable(device: torch.device) -> str | None:
    """None where scaled_matmul runs on `device` and agrees with quantized_linear.py, else why not (logged once)."""
    reason = _probe(device)
    if reason is None:
        logger.info("FP8 weights: products of %d rows or more on the FP8 tensor cores (torch's block-scaled matmul, "
                    "activations quantized per 128 columns); fewer rows by the Triton kernel", MIN_ROWS)
    elif device.type == "cuda":
        logger.info("FP8 weights: every product by the Triton kernel (torch's block-scaled FP8 matmul: %s)", reason)
    return reason


def _probe(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "it runs on CUDA only"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return f"it needs compute capability 9.0 (Hopper), this GPU has {torch.cuda.get_device_capability(device)}"
    from dsaserve.triton_ops.quantized_linear import quantized_matmul

    g = torch.Generator().manual_seed(0)
    # Blocks of different magnitudes, so a scale read from the wrong block shows.
    row_scales = (torch.rand(2, 3, generator=g) * 4 + 0.1).repeat_interleave(BLOCK, dim=0).to(device)
    q = fp8_bytes(torch.randn(256, 384, generator=g).to(device) * row_scales.repeat_interleave(BLOCK, dim=1) * 100,
                  row_scales)
    blocks = block_scales(row_scales)
    x = torch.randn(MIN_ROWS, 384, generator=g).to(device=device, dtype=torch.bfloat16)
    try:
        got = scaled_matmul(x, q, blocks).float()
    except Exception as error:  # a build or driver without block-scaled FP8
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    expected = quantized_matmul(x, q, row_scales, "fp8").float()
    difference = float((got - expected).abs().max() / expected.abs().max())
    if difference > PROBE_TOLERANCE:
        return f"its product differs from the Triton kernel's by {difference:.2g} of the largest value"
    return None


def fp8_bytes(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as e4m3 bytes (uint8) at the given scales, one per row and 128 columns [N, K / 128]."""
    n, k = weight.shape
    scaled = weight.view(n, k // BLOCK, BLOCK) / scales[..., None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, k).view(torch.uint8)
