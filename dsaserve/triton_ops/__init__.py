"""Triton kernels: the CUDA path's sparse MLA (per query, or over tile unions), indexer scores and their top-k, cache
writes, routed experts and quantized weight products, each with a torch fallback (and fp8_scaled_mm.py: prefill's FP8
products on torch's block-scaled matmul; compile_check.py: every kernel compiled for GPUs without one;
interpreter_calls.py: the interpreter's device-function calls made cheaper where kernels run on CPU tensors).

Which process runs them is the engine's `triton_kernels` option (`configure`, once at load): `auto` runs them where
the engine's device is CUDA and Triton imports, `off` keeps torch's operators there, and `on` also runs them on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1: slow, for tests and for checking the CUDA path without a
GPU). Callers ask `runs_on(tensor)`: a kernel is only handed tensors of the device the engine was configured for.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

TRITON_KERNELS = ("auto", "on", "off")
_device: torch.device | None = None  # where the kernels run for this process, None: nowhere


@functools.cache
def triton_imports() -> str | None:
    """None where Triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton does not import ({error})"
    return None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def configure(choice: str, device: torch.device) -> None:
    """The engine's triton_kernels option for this process (the last engine made sets it). `on` where the kernels
    cannot run is a ValueError naming what is missing."""
    global _device
    if choice not in TRITON_KERNELS:
        raise ValueError(f"triton_kernels={choice!r} is not one of {', '.join(TRITON_KERNELS)}")
    _device = None
    if choice == "off":
        return
    missing = triton_imports()
    if device.type == "cpu" and choice == "on" and not interpreting():
        missing = missing or "on CPU tensors they run only under Triton's interpreter: set TRITON_INTERPRET=1"
    if device.type not in ("cuda", "cpu"):
        missing = missing or f"device {device.type!r} has no Triton backend here"
    if missing:
        if choice == "on":
            raise ValueError(f"triton_kernels='on': {missing}; or use triton_kernels='auto'")
        return
    if device.type == "cuda" or choice == "on":
        _device = device
    if _device is not None and _device.type == "cpu":
        from dsaserve.triton_ops import interpreter_calls

        interpreter_calls.install()


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether this process's Triton kernels take `tensor` (it is on the device they were configured for)."""
    return _device is not None and tensor.device.type == _device.type


def active_device() -> torch.device | None:
    return _device


@contextlib.contextmanager
def launching_on(device: torch.device | None):
    """The kernels take `device`'s tensors inside (compile_check.py's recorded launches, which run nothing)."""
    global _device
    saved, _device = _device, device
    try:
        yield
    finally:
        _device = saved


def summary() -> str:
    """Which Triton kernels run: the startup log line's and doctor's words."""
    if _device is None:
        return "off (torch's operators on CUDA; native ones on CPU)"
    where = "CUDA" if _device.type == "cuda" else "CPU tensors, under Triton's interpreter"
    return (f"on ({where}): sparse MLA over selected rows (prompt rows by tile unions at up to 8 heads per rank), "
            "indexer scores over the paged key cache with each row's top-k by radix selection, latent rows "
            "(norm, rope, write) and indexer key writes, routed experts (grouped GEMMs), quantized weights multiplied "
            "in their stored form (FP8 as shipped, block-scaled, prefill rows on Hopper's FP8 tensor cores where "
            "torch's block-scaled matmul passes its check; int8 and int4 from --quantization)")
