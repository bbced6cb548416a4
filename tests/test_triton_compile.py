"""Every Triton kernel compiled for real GPUs (no GPU needed): the interpreter runs a kernel's Python, the GPU's
compiler is stricter (a kernel that passes every interpreted test failed to compile for bf16 models until this check
ran), and a GPU has a fixed amount of shared memory. triton_ops/compile_check.py compiles each specialization the
wrappers launch down to machine code with the ptxas that ships with Triton."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest
from triton.runtime.interpreter import InterpretedFunction

from dsaserve import triton_ops
from dsaserve.triton_ops import compile_check

# Every case for H100/H200 and the RTX PRO 6000 (99 KiB of shared memory a block); on the A100 the cases that decode
# fp8 bytes (by integer operations there; its other kernels are the H100's, with more shared memory than sm120's).
ARCHES = ("sm90", "sm120")
FP8_ARCH, FP8_CASES = "sm80", "float8_e4m3fn,fp8"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    results = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (compiled kernels, not interpreted)
    for arches, only in ((ARCHES, ""), ((FP8_ARCH,), FP8_CASES)):
        out = tmp_path_factory.mktemp("compile") / "results.json"
        run = subprocess.run([sys.executable, "-m", "dsaserve.triton_ops.compile_check", "--arch", ",".join(arches),
                              "--only", only, "--jobs", "2", "--json", str(out)], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.exists(), run.stderr[-3000:]
        results += json.loads(out.read_text())
    return results


def test_every_launched_kernel_compiles_and_fits_in_shared_memory(compiled):
    failed = [f"{r['arch']} {r['case']}: {r['error'] or str(r['shared_bytes']) + ' bytes of shared memory'}"
              for r in compiled if not r["fits"]]
    assert not failed, "\n".join(failed)
    assert {r["arch"] for r in compiled} == {*ARCHES, FP8_ARCH}


def test_the_check_launches_every_kernel_for_every_model_dtype(compiled):
    modules = [importlib.import_module(f"dsaserve.triton_ops.{info.name}")
               for info in pkgutil.iter_modules(triton_ops.__path__)]
    kernels = {name for module in modules for name, value in vars(module).items()
               if isinstance(value, InterpretedFunction) and name.endswith("_kernel")}
    assert {"_selected_rows_kernel", "_union_rows_kernel"} <= kernels  # (the search finds them)
    for arch in ARCHES:
        for dtype in ("bfloat16", "float32"):
            seen = {r["kernel"] for r in compiled
                    if r["arch"] == arch and r["case"].endswith((dtype, compile_check.ANY_DTYPE))}
            assert seen == kernels, f"{arch} {dtype}: no case launches {sorted(kernels - seen)}"


def test_fp8_bytes_are_decoded_as_the_target_gpu_decodes_them(compiled):
    # Hopper and Blackwell convert fp8 themselves: the launches compiled for them must take that path, and an A100's
    # the shifts and masks (the check runs on a CPU, where the wrappers would otherwise choose the latter for all).
    for arch, native in (("sm90", True), ("sm120", True), ("sm80", False)):
        flags = [r["flags"]["NATIVE_FP8"] for r in compiled if r["arch"] == arch and "NATIVE_FP8" in r["flags"]]
        assert flags and all(flag == native for flag in flags), arch


RECORD_AND_LOOK = """
from triton import knobs
from triton.runtime.driver import driver
from dsaserve import triton_ops
from dsaserve.triton_ops import compile_check, fp8_e4m3, moe, quantized_linear
from dsaserve.triton_ops.quantized_linear import _quantized_linear_kernel
assert compile_check.launches("sm90", "fp8 weights 4")
print(quantized_linear.native_fp8 is moe.native_fp8 is fp8_e4m3.native_fp8, driver._active is None,
      knobs.runtime.jit_cache_hook is None, triton_ops.active_device() is None,
      sorted(map(str, _quantized_linear_kernel.device_caches)))
"""


def test_recording_launches_leaves_the_process_as_it_found_it():
    # The fp8 check, Triton's driver and hook, the kernels' device: a process with a GPU that ran the check goes on
    # launching for its own GPU, and its device 0 never meets the stand-in target's binder.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", RECORD_AND_LOOK], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.stdout.split("\n")[0] == "True True True True ['compile-check-sm90']", run.stderr[-2000:]
