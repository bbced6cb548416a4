"""How much of a GPU the KV cache may take (vLLM's gpu_memory_utilization): measured once at start-up.

After the weights load, each rank runs one step of the largest size the scheduler can give it (a prompt of
max_num_batched_tokens tokens, with the logits rows of a full batch) on a cache just large enough for it, and
records the step's peak of transient memory. Its KV cache may then take

    utilization × device memory − memory in use (weights, this process's and others') − that peak,

the smallest over the ranks. CUDA graphs' pools are captured afterwards, over the cache, out of the rest
(1 − utilization); the start-up log says how much they took. On CPU the KV cache keeps its fixed default
(kv_cache_memory): memory there is shared with everything else on the machine, and the step would cost a long
prefill at every start. The measurement still runs there (the process's peak resident memory), for tests.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaserve.attention.metadata import BatchMetadata
from dsaserve.byte_sizes import human
from dsaserve.model.load_memory import memory_available

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceMemory:
    """One rank's device after its weights loaded and the profiling step ran."""

    total: int  # bytes the device has
    in_use: int  # bytes in use once the step's memory went back: the weights, this process's and others'
    step_peak: int  # transient bytes the largest step needed
    step_tokens: int  # tokens of that step

    def kv_room(self, utilization: float) -> int:
        return int(self.total * utilization) - self.in_use - self.step_peak


def measured(device: torch.device) -> bool:
    """Whether the engine sizes its KV cache from this device's memory (CUDA), rather than kv_cache_memory's
    default."""
    return device.type == "cuda"


def device_totals(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes: a CUDA device's (free as its driver counts it, other processes included), or the
    machine's memory and what Linux says is available."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, memory_available(device) or 0


def step_peak(device: torch.device, step: Callable[[], object]) -> int:
    """Bytes held at the step's peak beyond what was held before it: the CUDA allocator's count, or on CPU the
    process's peak resident memory (Linux; 0 elsewhere)."""
    if device.type != "cuda":
        return _resident_peak(step)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _resident_peak(step: Callable[[], object]) -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident size, to the current one
    except OSError:
        step()
        return 0
    before = _status_bytes("VmRSS")
    step()
    return max(0, _status_bytes("VmHWM") - before)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def profile(device: torch.device, make_cache: Callable[[], object], step: Callable[[object], object],
            tokens: int) -> DeviceMemory:
    """Runs the profiling step on a cache of its own (not counted in the peak, released after) and returns what the
    device then has."""
    cache = make_cache()
    try:
        peak = step_peak(device, functools.partial(step, cache))
    except torch.OutOfMemoryError as error:
        raise ValueError(f"the largest step the scheduler can give ({tokens} tokens: max_num_batched_tokens, at most "
                         f"max_model_len) does not fit in the device's memory beside the weights; lower "
                         f"max_num_batched_tokens or use more ranks ({str(error).splitlines()[0]})") from error
    del cache  # before the driver is asked what stays in use
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the step's blocks back to the driver, so in_use counts only what stays
    total, free = device_totals(device)
    return DeviceMemory(total, total - free, peak, tokens)


@torch.inference_mode()
def run_largest_step(model, cache, tokens: int, logits_rows: int, block_size: int) -> torch.Tensor:
    """One prompt of `tokens` tokens written into `cache` (blocks 0, 1, …), with logits for its last `logits_rows`
    rows: the scheduler's largest step (max_num_batched_tokens) with a full batch's sampling rows. Returns the
    logits."""
    blocks = -(-tokens // block_size)
    meta = BatchMetadata.build([[0] * tokens], [0], [list(range(blocks))], block_size,
                               list(range(tokens - logits_rows, tokens)), device=cache.device, shard=cache.shard,
                               state_slots=[0] if any(not isinstance(c, torch.Tensor) for c in cache.latent) else None)
    hidden = model.forward_hidden(meta, cache.latent, cache.indexer)
    return model.compute_logits(model.final_norm(hidden[meta.logits_indices]))


def kv_cache_memory(profiles: list[DeviceMemory], utilization: float, estimate: int | None = None) -> int:
    """Bytes of KV cache per rank: what the tightest rank has left in its share. A ValueError when none is left,
    naming what to change. estimate: doctor's figure for the step's peak, logged beside the measured one."""
    tightest = min(profiles, key=lambda p: p.kv_room(utilization))
    room = tightest.kv_room(utilization)
    rank = profiles.index(tightest)
    if room <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} leaves no room for the KV cache on rank {rank}: "
            f"{human(int(tightest.total * utilization))} of its {human(tightest.total)} minus "
            f"{human(tightest.in_use)} in use (weights and other processes) and a {human(tightest.step_peak)} peak "
            f"for a step of {tightest.step_tokens} tokens; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, use more ranks, or give kv_cache_memory")
    logger.info("memory plan (rank %d of %d, the tightest): %s × %.2f (gpu_memory_utilization) − %s in use "
                "(weights and other processes) − %s peak of a %d-token step%s = %s for the KV cache; CUDA graphs "
                "come out of the rest", rank, len(profiles), human(tightest.total), utilization,
                human(tightest.in_use), human(tightest.step_peak), tightest.step_tokens,
                "" if estimate is None else f" (doctor's estimate: {human(estimate)})", human(room))
    return room
