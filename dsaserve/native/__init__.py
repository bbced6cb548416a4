"""Native CPU kernels, compiled from their C source on first use with the machine's C compiler.

`-march=native` lets the compiler use what this CPU has (AVX-512 BF16 where present); the shared
library is cached per source, compiler flags and CPU, so it is built once per machine. Without a
compiler, or with DSASERVE_NATIVE=0, `library()` is None and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

SOURCES = sorted(Path(__file__).parent.glob("*.c"))  # one shared library for all of them
# -fopenmp links libgomp.so.1 by soname: after `import torch` that is torch's own copy, so the kernels'
# parallel regions run on torch's threads instead of competing with them for the cores.
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp"]

I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

_library: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    root = os.environ.get("DSASERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dsaserve")
    return Path(root) / "native"


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def build(compiler: str | None = None) -> Path:
    """Compile the kernels (or reuse the cached build) and return the shared library's path."""
    compiler = compiler or os.environ.get("CC", "cc")
    source = b"".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode() + cpu_signature().encode()).hexdigest()[:16]
    target = cache_dir() / f"dsaserve_native_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", partial, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they are disabled or cannot be built here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if os.environ.get("DSASERVE_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        import logging

        detail = getattr(e, "stderr", "") or e
        logging.getLogger(__name__).warning("native kernels unavailable, using torch: %s", detail)
        return None
    _library = lib
    return lib


def function(name: str, *argtypes):
    """The kernels' C function `name` (returning int) with its argument types declared, or None when
    the library is not available. Declaring them matters: an undeclared int64 goes in as a C int."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:  # first use
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn
