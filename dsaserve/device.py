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


def widened_for_cpu(requested: str | torch.dtype, checkpoint_dtype: str, dtype: torch.dtype) -> bool:
    """Whether dtype=auto chose fp32 for a bf16 checkpoint because the CPU lacks bf16 instructions: its weights
    then keep their bf16 bytes where the packed products run, rather than doubling in memory."""
    return (requested == "auto" and dtype == torch.float32
            and checkpoint_dtype.removeprefix("torch.") in ("bfloat16", "bf16"))


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str, device: torch.device,
                  cpu_isa: str = "auto") -> torch.dtype:
    """`auto` computes in the checkpoint's dtype where the device runs it fast, else in float32 (on a CPU whose
    kernels keep bf16 weights in bf16: widened in registers only, widened_for_cpu). cpu_isa 'avx2' computes as a
    CPU without bf16 instructions does, whatever this one has."""
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
        if wanted == torch.bfloat16 and not (cpu_supports_bf16() and cpu_isa not in ("avx2", "avx512")):
            why = f"cpu_isa={cpu_isa!r}" if cpu_supports_bf16() else "this CPU has no bf16 instructions"
            logger.info("dtype=auto: %s, computing in float32 (bf16 weights stay bf16 where the kernels run)", why)
            return torch.float32
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_supports_bf16():
        logger.warning("dtype=bfloat16 on a CPU without bf16 instructions: torch's bf16 operators are slow here; "
                       "dtype=auto computes in float32 with the weights kept in bf16")
    if device.type == "cuda" and wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        logger.info("dtype=auto: this GPU has no bf16 support, computing in float16")
        return torch.float16
    return wanted
