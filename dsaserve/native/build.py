"""Building the native operators: one object per C++ source, kept by its own content, linked into one library.

An object is keyed by its source, the local headers it includes (followed through their includes), the flags, the
torch version and the CPU, so an edit recompiles the sources it touches and links again; the rest come from the
cache. The library is keyed by its objects' keys: a process loads the library its own sources make, never one a
concurrent build is writing (every file is written under a temporary name and renamed into place when complete).
Sources compile in parallel, one per core.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsaserve import native

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
# -fopenmp: at::parallel_for is inline OpenMP code (torch's CPU build), serial without it; the library then binds
# to the libgomp torch already loaded, so it runs on torch's own threads.
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c++20"]
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def object_key(source: Path) -> str:
    """What the source's object depends on, hashed: its text, its local headers', the flags, torch, the CPU."""
    digest = hashlib.sha256()
    seen: set[Path] = set()
    pending = [source]
    while pending:
        path = pending.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        text = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + text)
        pending += [SOURCE_DIR / name for name in _INCLUDE.findall(text.decode("utf-8", "replace"))]
    digest.update(" ".join(FLAGS + [compiler()]).encode() + torch.__version__.encode())
    digest.update(native.cpu_signature().encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """Where the library of the current sources is (or will be) kept."""
    key = hashlib.sha256("".join(object_key(s) for s in SOURCES).encode()).hexdigest()[:16]
    return native.cache_dir() / f"torch_ops_{key}" / f"dsaserve_torch_ops_{key}.so"


def build(library: Path) -> None:
    """Compile the sources whose objects are not cached, then link them into `library`."""
    objects_dir = native.cache_dir() / "objects"
    objects_dir.mkdir(parents=True, exist_ok=True)
    objects = {source: objects_dir / f"{source.stem}-{object_key(source)}.o" for source in SOURCES}
    missing = [source for source, obj in objects.items() if not obj.exists()]
    if missing:
        logger.info("compiling %d of dsaserve's %d native sources (%s; once per change, on %d cores)", len(missing),
                    len(SOURCES), ", ".join(s.name for s in missing), os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(lambda source: _compile(source, objects[source]), missing))
    library.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    _run([compiler(), *map(str, objects.values()), "-shared", "-fopenmp", f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
          "-ltorch", f"-Wl,-rpath,{torch_lib}"], library)


def _compile(source: Path, obj: Path) -> None:
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    includes = [torch_include, os.path.join(torch_include, "torch", "csrc", "api", "include")]
    _run([compiler(), *FLAGS, *(f"-isystem{path}" for path in includes), "-c", str(source)], obj)


def _run(command: list[str], output: Path) -> None:
    """Runs a compiler command writing to a temporary name beside `output`, then renames it into place."""
    fd, partial = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    os.close(fd)
    try:
        done = subprocess.run([*command, "-o", partial], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:2])}… failed:\n{done.stderr[-4000:]}")
        os.replace(partial, output)
    except FileNotFoundError as e:  # no compiler
        raise RuntimeError(f"no C++ compiler ({e.filename}); set CXX or install g++") from None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)

