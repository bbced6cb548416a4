"""Weights in transparent huge pages, where Linux allows them.

A decode step reads every active weight once, tens to hundreds of MiB in order; in 4 KiB pages that is a TLB
miss and a page walk every 4 KiB, and the hardware prefetchers stop at each page's end. In 2 MiB pages both
nearly vanish. Linux gives a mapping huge pages when it is advised so (MADV_HUGEPAGE) before it is first
written, under the usual "madvise" setting of /sys/kernel/mm/transparent_hugepage/enabled ("always" needs no
advice, "never" refuses). torch's own allocator does so only with THP_MEM_ALLOC_ENABLE=1 set before its first
allocation, which a library cannot count on; so the model's large tensors get memory of their own here, right
after they are made and before the checkpoint is written into them. The engine option huge_pages (--no-huge-pages)
turns this off.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    """Whether weights can be placed in advised mappings here (Linux's madvise, huge pages not refused)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def region(nbytes: int) -> torch.Tensor:
    """Uninitialized bytes [nbytes] in a private anonymous mapping advised for huge pages, starting on a 2 MiB
    boundary; the mapping is unmapped with the last tensor that views it."""
    # Private: a shared anonymous mapping is shmem, whose huge pages are another setting (usually never).
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # shares the mapping and keeps it alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def place_weights(model: nn.Module, min_bytes: int = 64 << 10) -> int:
    """Move every CPU parameter and buffer of `model` of at least `min_bytes` into one region advised for huge
    pages, each on a 64-byte boundary, before anything is written to them (their values are not kept): the
    model's weights as few huge pages as they fill. Returns the bytes so placed."""
    if not enabled():
        return 0
    tensors, seen = [], set()
    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for tensor in group.values():
                if (tensor is not None and tensor.device.type == "cpu" and tensor.nbytes >= min_bytes
                        and id(tensor) not in seen):  # (tied weights: one place)
                    seen.add(id(tensor))
                    tensors.append(tensor)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.nbytes // 64) * 64
    if not tensors:
        return 0
    memory = region(total)
    for tensor, offset in zip(tensors, offsets):
        tensor.data = memory[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
    return total
