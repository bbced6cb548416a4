"""Native CPU kernels: C++ sources in this folder, built into torch operators (`torch.ops.dsaserve.*`)
on first use by torch_ops.py. This module holds what that build is keyed by: where the cache lives
and which CPU it is for.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("DSASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsaserve")
    return Path(root) / "native"


def cpu_signature() -> str:
    """What the build depends on besides its sources: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()
