"""Device and compute-dtype choices, made once at load time."""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but CUDA is not available here; use device='cpu'")
    return device


@functools.cache
def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX); otherwise bf16 matmuls are slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """`auto` computes in the checkpoint's dtype where the device runs it fast, else in float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    wanted = _DTYPES.get(checkpoint_dtype.removeprefix("torch."), torch.bfloat16)
    if device.type == "cpu":
        if wanted == torch.float16:
            logger.info("dtype=auto: float16 checkpoint on CPU computes in float32 (CPU float16 matmuls are slow)")
            return torch.float32
        if wanted == torch.bfloat16 and not cpu_supports_bf16():
            logger.info("dtype=auto: this CPU has no bf16 instructions, computing in float32")
            return torch.float32
    if device.type == "cuda" and wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        logger.info("dtype=auto: this GPU has no bf16 support, computing in float16")
        return torch.float16
    return wanted
