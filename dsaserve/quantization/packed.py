"""What counts as a packed weight: the forms that hold a weight instead of a float Parameter."""

from __future__ import annotations

from torch import nn

from dsaserve.quantization.int8_rows import Int8Rows
from dsaserve.quantization.quantized_weight import QuantizedWeight


def is_packed(module: nn.Module) -> bool:
    """A weight in a quantized or packed form (it has load_rows and nbytes) rather than a Parameter."""
    return isinstance(module, (QuantizedWeight, Int8Rows))
