"""Every Triton kernel compiled for NVIDIA GPUs on a machine without one: `python -m dsaserve.triton_ops.compile_check`.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python, not what the GPU compiler accepts: a kernel can pass
every interpreted test and still fail to compile, or ask for more shared memory than the GPU has, at its first launch
on CUDA. This check compiles each kernel as the engine launches it, down to the GPU's machine code with the ptxas
that ships with Triton, for the GPUs named (`--arch`), and reads the registers, spilled bytes and shared memory of
each. The launches are the wrappers' own (triton_ops/*.py) called with CPU tensors of the served models' geometry
(GLM-5.2, GLM-5.3-Flash, DeepSeek-V3.2; bf16 and fp32 models; bf16, int8 and fp8 indexer keys; FP8 weights), so the
block sizes, dtypes and flags are those the dispatch chooses: Triton is pointed at a stand-in driver that reports
the target GPU, and a compile hook records each launch instead of compiling and running it.

It runs in a process of its own without the interpreter (kernels made under TRITON_INTERPRET=1 are not compilable
objects); tests/test_triton_compile.py runs it for sm90, sm120 and sm80.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

# The wrappers, imported before any recording so that _recording finds (and points at the target GPU) the fp8 check
# each of them imported.
from dsaserve.triton_ops.cache_write import write_rows
from dsaserve.triton_ops.index_scores import index_scores
from dsaserve.triton_ops.latent_write import write_latent_rows
from dsaserve.triton_ops.moe import routed_experts
from dsaserve.triton_ops.quantized_linear import quantized_matmul
from dsaserve.triton_ops.row_topk import row_topk
from dsaserve.triton_ops.selected_rows import attend_selected_rows
from dsaserve.triton_ops.union_rows import attend_union_rows
from dsaserve.triton_ops.union_tiles import TileUnions, tile_queries

# name: (compute capability, shared memory a block may use in bytes (CUDA programming guide), GPUs)
ARCHES = {
    "sm80": (80, 166912, "A100"),
    "sm89": (89, 101376, "L40S, RTX 6000 Ada"),
    "sm90": (90, 232448, "H100, H200"),
    "sm100": (100, 232448, "B200"),
    "sm120": (120, 101376, "RTX PRO 6000 Blackwell"),
}

# Ends the names of cases whose kernels take the same dtypes in every model (the row top-k: fp32 scores).
ANY_DTYPE = "any model dtype"

# The quantized weight forms (triton_ops/weight_tiles.py) of a [N, 256] weight: (kind, columns a byte, scale columns).
WEIGHT_FORMS = (("fp8", 1, 2), ("int8", 1, 1), ("int4", 2, 2))
WEIGHT_BYTES = {"fp8": torch.uint8, "int8": torch.int8, "int4": torch.uint8}

# The served families' attention geometry: (name, latent width, rope width, indexer heads, indexer dim).
GEOMETRIES = (("GLM-5.2", 512, 64, 32, 128), ("GLM-5.3-Flash", 512, 0, 32, 128), ("DeepSeek-V3.2", 512, 64, 64, 128))


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel specialization as a wrapper launched it."""

    case: str
    kernel: object  # triton JITFunction
    compile: dict

    def key(self) -> tuple:
        return (self.kernel.fn.__qualname__, repr(self.compile["signature"]), repr(self.compile["constants"]),
                repr(self.compile["configs"]), self.compile["num_warps"], self.compile["num_stages"])


@dataclasses.dataclass
class Compiled:
    """What the GPU compiler made of one launch for one GPU."""

    arch: str
    case: str
    kernel: str
    flags: dict = dataclasses.field(default_factory=dict)  # the launch's constexpr arguments by name
    error: str | None = None
    shared_bytes: int = 0
    shared_limit: int = 0
    registers: int | None = None
    spilled_bytes: int | None = None
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.error is None and self.shared_bytes <= self.shared_limit


class _TargetDriver:
    """Answers Triton's launch path with the GPU to compile for; nothing is launched (see _recording). Its device is
    a name of its own: Triton keeps a binder per kernel and device, which a real GPU's device 0 must not meet."""

    def __init__(self, arch: str):
        self.target = _target(arch)
        self.device = f"compile-check-{arch}"

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _target(arch: str):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", ARCHES[arch][0], 32)


@contextlib.contextmanager
def _recording(arch: str) -> Iterator[list[tuple[object, dict]]]:
    """Launches inside record (kernel, compile arguments) and return without compiling or running; the kernels see
    `arch`'s fp8 support (fp8_e4m3.native_fp8, as each module imported it)."""
    from triton import knobs
    from triton.runtime.driver import driver

    from dsaserve import triton_ops
    from dsaserve.triton_ops import fp8_e4m3

    seen: list[tuple[object, dict]] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        seen.append((fn.jit_function, compile))
        return True  # skips the compile, and with it the launch

    native = ARCHES[arch][0] >= 89
    check = fp8_e4m3.native_fp8
    patched = [m for name, m in sys.modules.items() if name.startswith("dsaserve.triton_ops.")
               and m is not fp8_e4m3 and getattr(m, "native_fp8", None) is check]
    saved_driver, saved_hook = driver._active, knobs.runtime.jit_cache_hook  # (_active: None without a GPU)
    driver.set_active(_TargetDriver(arch))
    knobs.runtime.jit_cache_hook = hook
    for module in patched:
        module.native_fp8 = lambda device: native
    try:
        with triton_ops.launching_on(torch.device("cpu")):
            yield seen
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        driver.set_active(saved_driver)
        for module in patched:
            module.native_fp8 = check


def _cases() -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, a call of a wrapper) for every specialization the engine launches on a GPU."""
    z = torch.zeros
    for counted in (True, False):  # token top-k takes the scoring kernel's first histogram; page top-k counts its own
        yield (f"row top-k{' counted' if counted else ''} {ANY_DTYPE}", lambda: row_topk(
            z(2, 4096), 2048, z(2, 2048, dtype=torch.int32), z(2, 256, dtype=torch.int32) if counted else None))
    for model in (torch.bfloat16, torch.float32):
        dt = str(model).removeprefix("torch.")
        for family, latent, rope, index_heads, index_dim in GEOMETRIES:
            width = latent + rope
            for heads in (8, 64):  # a TP=8 rank's GLM-5.2 heads, and a whole model's (or a DCP group's, with lse)
                yield (f"selected rows {family} {heads} heads {dt}", lambda: attend_selected_rows(
                    z(2, heads, width, dtype=model), z(64, width, dtype=model), z(2, 40, dtype=torch.int64), 0.1,
                    z(2, heads, latent, dtype=model)))
            yield (f"selected rows with log-sum-exp (DCP) {family} {dt}", lambda: attend_selected_rows(
                z(2, 64, width, dtype=model), z(64, width, dtype=model), z(2, 40, dtype=torch.int64), 0.1,
                z(2, 64, latent), z(2, 64)))
            for heads in (8, 16):  # GLM-5.2's heads at TP=8 (the engine's tile unions); 16, which gpu_check times
                yield (f"union rows {family} {heads} heads {dt}", lambda: attend_union_rows(
                    z(8, heads, width, dtype=model), z(64, width, dtype=model), _tiles(tile_queries(heads), 2), 0.1,
                    z(8, heads, latent, dtype=model)))
            for interleaved in (True, False):
                yield (f"latent rows {family} {'interleaved' if interleaved else 'half-split'} {dt}",
                       lambda: write_latent_rows(z(3, width, dtype=model), z(latent, dtype=model), 1e-6,
                                                 z(3, rope // 2), z(3, rope // 2), interleaved,
                                                 z(16, width, dtype=model), z(3, dtype=torch.int64)))
            for keys, scales in ((model, None), (torch.int8, torch.float16), (torch.float8_e4m3fn, torch.float32)):
                key_name = str(keys).removeprefix("torch.")
                yield (f"index scores {family} {key_name} keys {dt}", lambda: index_scores(
                    z(2, index_heads, index_dim, dtype=model), z(2, index_heads), z(4, 64, index_dim, dtype=keys),
                    None if scales is None else z(4, 64, dtype=scales), z(1, 4, dtype=torch.int32),
                    z(2, dtype=torch.int32), z(2, dtype=torch.int64), z(2, 256), z(2, 256, dtype=torch.int32)))
                yield (f"indexer key writes {family} {key_name} keys {dt}", lambda: write_rows(
                    z(32, index_dim, dtype=keys), None if scales is None else z(32, dtype=scales),
                    z(3, dtype=torch.int64), z(3, index_dim, dtype=model)))
        for kind, stored, groups in WEIGHT_FORMS:
            for rows in (4, 100):  # decode rows and prefill rows take different tiles
                yield (f"{kind} weights {rows} rows {dt}", lambda: quantized_matmul(
                    z(rows, 256, dtype=model), z(192, 256 // stored, dtype=WEIGHT_BYTES[kind]), z(192, groups), kind))
        for kind, stored, groups in (("float", 1, 0), *WEIGHT_FORMS):
            for limit in (None, 7.0):
                experts = model if kind == "float" else WEIGHT_BYTES[kind]
                yield (f"routed experts {dt if kind == 'float' else kind} weights{' swiglu limit' if limit else ''} "
                       f"{dt}", lambda: routed_experts(
                           z(5, 256, dtype=model), torch.tensor([[0, 1]] * 5), z(5, 2),
                           z(2, 256, 256 // stored, dtype=experts), z(2, 256, 128 // stored, dtype=experts), 0, limit,
                           None if kind == "float" else (z(2, 256, groups), z(2, 256, -(-groups // 2))), 0,
                           "fp8" if kind == "float" else kind))


def _tiles(queries: int, count: int) -> TileUnions:
    """`count` tiles of `queries` rows with unions 40 wide (their values are never read: nothing runs)."""
    z = torch.zeros
    return TileUnions(queries, z(count, dtype=torch.int64), z(count, dtype=torch.int32),
                      z(count, 40, dtype=torch.int32), z(count, 40, dtype=torch.int32), z(count, dtype=torch.int32))


def launches(arch: str, only: str = "") -> list[Launch]:
    """The distinct kernel specializations the engine's wrappers launch for `arch` (of the cases whose names hold
    `only`, or one of its comma-separated texts)."""
    found: dict[tuple, Launch] = {}
    with _recording(arch) as seen:
        for case, call in _cases():  # each call made as it is yielded: the lambdas read the loop's variables
            if not any(text in case for text in only.split(",")):
                continue
            start = len(seen)
            call()
            if len(seen) == start:
                raise RuntimeError(f"compile check: {case!r} launched no kernel (its wrapper changed?)")
            for kernel, compile_args in seen[start:]:
                launch = Launch(case, kernel, compile_args)
                found.setdefault(launch.key(), launch)
    return list(found.values())


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, spilled bytes) of a cubin, from cuobjdump beside Triton's ptxas (None where it is missing)."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run([tool, "--dump-resource-usage", file.name], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)  # registers spilled go to the thread's stack
    return (int(registers.group(1)) if registers else None, int(stack.group(1)) if stack else None)


def _reason(error: Exception) -> str:
    """The compiler's error in one line: where in the kernel (Triton's "at line:column") and the innermost cause."""
    where = str(error).strip().splitlines()[0] if str(error).strip() else ""
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    words = " ".join(str(cause).split()) if cause is not error else " ".join(str(error).split()[-40:])
    return f"{type(error).__name__} {where} {type(cause).__name__}: {words[:300]}"


def compile_launch(launch: Launch, arch: str) -> Compiled:
    import triton
    from triton.compiler import ASTSource

    c = launch.compile
    names = launch.kernel.arg_names
    flags = {names[path[0]]: value for path, value in c["constants"].items() if len(path) == 1}
    result = Compiled(arch, launch.case, launch.kernel.fn.__name__, flags, shared_limit=ARCHES[arch][1])
    options = {name: c[name] for name in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion",
                                         "launch_cooperative_grid")}
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(launch.kernel, c["signature"], c["constants"], c["configs"][0]),
                                target=_target(arch), options=options)
    except Exception as error:  # the compiler's own words are the report
        result.error = _reason(error)
    else:
        result.shared_bytes = kernel.metadata.shared
        result.registers, result.spilled_bytes = _resources(kernel.asm["cubin"])
    result.seconds = time.perf_counter() - start
    return result


def _compile_share(arch: str, only: str, jobs: int, index: int) -> list[Compiled]:
    """Every jobs-th launch from the index-th: one worker's share (kernels do not pickle; each worker finds them)."""
    return [compile_launch(launch, arch) for launch in launches(arch, only)[index::jobs]]


def check(arches: list[str], only: str = "", jobs: int = 1) -> list[Compiled]:
    """Each launch compiled for each GPU, in `jobs` processes (ptxas and LLVM take one core each)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the compile check needs compiled kernels: run it without TRITON_INTERPRET")
    if jobs <= 1:
        return [result for arch in arches for result in _compile_share(arch, only, 1, 0)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        shares = [pool.submit(_compile_share, arch, only, jobs, i) for arch in arches for i in range(jobs)]
        return [result for share in shares for result in share.result()]


def table(results: list[Compiled]) -> str:
    lines = ["| GPU | kernel | case | registers | spilled bytes | shared KiB (limit) | compiled |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        state = ("yes" if r.fits else "**too much shared memory**") if r.error is None else f"**no**: {r.error}"
        lines.append(f"| {r.arch} | {r.kernel} | {r.case} | {r.registers} | {r.spilled_bytes} | "
                     f"{r.shared_bytes / 1024:.1f} ({r.shared_limit // 1024}) | {state} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="sm90", help=f"comma-separated, of {', '.join(ARCHES)} (default sm90)")
    parser.add_argument("--only", default="", help="the cases whose names hold this text, e.g. 'selected rows', or "
                        "one of several, comma-separated")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                        help="processes compiling at once (default: the cores, at most 4)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    arches = [a.strip() for a in args.arch.split(",") if a.strip()]
    unknown = [a for a in arches if a not in ARCHES]
    if unknown:
        parser.error(f"--arch {','.join(unknown)}: not one of {', '.join(ARCHES)}")
    results = check(arches, args.only, args.jobs)
    print(table(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([dataclasses.asdict(r) | {"fits": r.fits} for r in results], out, indent=1)
    failed = [r for r in results if not r.fits]
    print(f"{len(results) - len(failed)} of {len(results)} kernel specializations compile and fit"
          + (f"; {len(failed)} do not" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
