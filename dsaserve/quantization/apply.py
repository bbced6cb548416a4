"""Which form the model's weights take, and swapping float weights for packed ones before loading.

    --quantization fp8 | int8 | int4   quantize every projection at load (vLLM's flag); on CUDA through Triton
    an FP8 checkpoint                   kept in FP8 as shipped, where the native or the Triton kernels run (else
                                        dequantized, as before)
    a bf16 model on a CPU with kernels  packed bf16, for the bandwidth kernel (also where dtype=auto computes in
                                        fp32 for lack of bf16 instructions: the weights keep their bf16 bytes)
    otherwise                           float weights and torch's matmuls

Packed: every projection (q_a, q_b, kv_a, o_proj; the indexer's wq_b and wk), the dense MLP, the shared
and routed experts, lm_head and the MTP layer's eh_proj and head. Kept as they are: the embedding, the
norms, the router and the indexer's weights_proj (fp32), and W_UK / W_UV (kv_b_proj split per head,
used in per-head batched products).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dsaserve import triton_ops
from dsaserve.native import torch_ops
from dsaserve.quantization.formats import FP8_BLOCK, QUANTIZATION_MODES
from dsaserve.quantization.int8_rows import Int8Rows
from dsaserve.quantization.quantized_weight import QuantizedWeight

logger = logging.getLogger(__name__)


def kernels_here(device: torch.device) -> bool:
    return device.type == "cpu" and torch_ops.load() and torch_ops.runs("packed_products")


def weight_forms(quantization: str | None, fp8_params: set[str], dtype: torch.dtype, device: torch.device,
                 keep_bf16: bool = False):
    """The packed kind of each projection, as a function of its parameter name (None: a float weight).
    fp8_params: the parameters an FP8 checkpoint ships in FP8 (they stay so; the others are not
    requantized, they take the model dtype's form). keep_bf16: a bf16 checkpoint computed in fp32 (widened_for_cpu),
    its weights packed in bf16. Where the Triton kernels run (the CUDA path), quantized weights take their row
    layouts (FP8 as shipped) and everything else is a float weight."""
    triton = triton_ops.active_device() is not None
    if quantization is not None:
        if quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization={quantization!r} is not supported; "
                             f"use one of {', '.join(QUANTIZATION_MODES)}")
        if device.type != "cpu" and not triton:
            raise ValueError(f"quantization={quantization!r} on {device.type}: quantized weights run there only "
                             "through the Triton kernels; use triton_kernels auto or on (with Triton installed), or "
                             "drop the flag")
        if not kernels_here(device) and not triton:
            how = ("int8 weights are kept in torch's row layout and multiplied by torch's int8 matmul up to 16 rows "
                   "at a time, with activations and scales rounded to bf16 for it (an error of the order of the "
                   "int8 weights' own); more rows, and other forms, dequantize" if quantization == "int8"
                   else "each product dequantizes")
            logger.warning("quantization=%s without a native body here (%s): %s a slab of rows at a time in torch, "
                           "so decode is slower than with the native kernels; the memory saved is what this buys",
                           quantization, torch_ops.unavailable() or "no AVX2 or AVX-512 BF16", how)
        return lambda name: quantization
    if triton:
        return (lambda name: "fp8" if name in fp8_params else None) if fp8_params else None
    if not kernels_here(device):
        return None
    rest = "bf16" if dtype == torch.bfloat16 or keep_bf16 else None
    return lambda name: "fp8" if name in fp8_params else rest


def pack_weights(model: nn.Module, form_of) -> int:
    """Replace every quantizable float weight of `model` (on the meta device, before loading) with a
    QuantizedWeight of the kind form_of(parameter name) gives (None: left as it is); returns how many.
    A weight tied to the embedding stays as it is."""
    embedding = model.model.embed_tokens.weight if hasattr(model, "model") else None
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    count = 0
    for prefix, module in list(model.named_modules()):
        for name in getattr(type(module), "ROW_QUANTIZABLE", ()):  # lookups: int8 rows when quantizing
            weight = getattr(module, name, None)
            if form_of(f"{prefix}.{name}") in QUANTIZATION_MODES and isinstance(weight, nn.Parameter) and not tied:
                delattr(module, name)
                setattr(module, name, Int8Rows(*weight.shape))
                count += 1
        for name in getattr(type(module), "QUANTIZABLE", ()):
            weight = getattr(module, name, None)
            kind = form_of(f"{prefix}.{name}" if prefix else name)
            if kind is None or not isinstance(weight, nn.Parameter) or weight is embedding:
                continue
            *lead, rows, cols = weight.shape
            if name in getattr(type(module), "TRANSPOSED", ()):
                rows, cols = cols, rows
            column = getattr(module, "column_offsets", {}).get(name, 0)
            packed = QuantizedWeight(kind, rows, cols, experts=lead[0] if lead else None,
                                     col_offset=column % FP8_BLOCK if kind == "fp8" else 0)
            delattr(module, name)
            setattr(module, name, packed)
            count += 1
    return count
