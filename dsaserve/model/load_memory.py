"""What loading a checkpoint needs in memory: the weights in their resident form plus the loading threads'
conversion scratch (model/loader.py streams each tensor through it), and the refusal, before anything is read,
when the machine has less memory available than that."""

from __future__ import annotations

import torch

from dsaserve.config import ModelConfig
from dsaserve.model.loader import SCRATCH_PER_THREAD, load_threads
from dsaserve.model.weight_bytes import resident_bytes

MAX_DEFAULT_BUDGET = 8 * SCRATCH_PER_THREAD  # the default budget's cap: 8 threads' scratch


class LoadMemoryError(MemoryError):
    """The weights and the load's scratch do not fit the memory available."""


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_available(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` now: the GPU's free memory, or the CPU's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def default_scratch_budget(available: int | None = None) -> int:
    """A sixteenth of the memory available, between one thread's scratch and eight threads'."""
    available = available_memory() if available is None else available
    if available is None:
        return MAX_DEFAULT_BUDGET
    return max(SCRATCH_PER_THREAD, min(MAX_DEFAULT_BUDGET, available // 16))


def scratch_bytes(files: int, budget: int) -> int:
    return load_threads(files, budget) * SCRATCH_PER_THREAD


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (meta tensors included: their size once allocated)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def check_fits(cfg: ModelConfig, resident: int, scratch: int, available: int | None, form: str | None,
               dtype: torch.dtype) -> None:
    """Raise LoadMemoryError naming the numbers and the forms that would fit, when resident + scratch exceeds the
    memory available (this rank's share: under tensor parallelism on one machine, every rank needs its own)."""
    if available is None or resident + scratch <= available:
        return
    fitting = [f"--quantization {f} ({_size(resident_bytes(cfg, f, dtype))})" for f in ("int8", "int4")
               if f != form and resident_bytes(cfg, f, dtype) + scratch <= available]
    options = ", ".join(fitting) if fitting else "none of the forms fits one process"
    raise LoadMemoryError(
        f"loading needs about {_size(resident + scratch)} (weights {_size(resident)}"
        f"{' as ' + form if form else ''}, plus {_size(scratch)} of conversion scratch) but "
        f"{_size(available)} is "
        f"available; options that fit: {options}; or more ranks (--tensor-parallel-size, --enable-expert-parallel "
        "across machines), or a smaller --load-scratch-memory")
