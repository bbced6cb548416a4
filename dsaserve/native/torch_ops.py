"""The native kernels that are torch operators (`torch.ops.dsaserve.*`), built from their C++ sources.

They are compiled on first use (build.py: one object per source, kept by its content, so an edit recompiles what it
touches) into the dsaserve cache: the packed-weight products (quant_linear.cpp), the sparse per-query attention
(selected_rows.cpp; its AVX2 body, fp32 or bf16, in selected_rows_avx2.cpp), the indexer's scores (index_scores.cpp;
index_scores_int8.cpp for int8 keys), its top-k (topk.cpp) and a decode batch's selection made of them
(decode_selection.cpp), the small per-token operators a decode step calls dozens of times (rms_norm.cpp, rope.cpp,
latent_write.cpp, moe_route.cpp, mla_projections.cpp, context_slots.cpp), and the decode plan that chains those into
a decode step's layers (decode_plan.cpp, a class: torch.classes.dsaserve.DecodePlan). Each operator's schema and its
Meta kernel (shapes without computing, for meta tensors and tracing) sit together in its source. The sources pick
their AVX-512 bodies at run time from the CPU's flags and have portable ones for other CPUs; the sparse attention
and indexer scores also have AMX tile bodies, which amx.py turns on at load where the CPU has AMX and they agree
with the AVX-512 ones.

Which of them a process uses is the engine's `native_kernels` option (`configure`): all it has (auto), the AVX-512
bodies without the AMX tiles and the VNNI/VBMI product paths (avx512), or none (off: torch's operators). Without a
compiler `load()` is False, `unavailable()` says why, and callers keep their torch path.

Which body family runs is the engine's `cpu_isa` option, chosen once at load: auto (the best this CPU has), amx,
avx512_bf16, avx512 (AVX-512 without BF16: the AVX2 family's operators, its packed-weight products' blocks in 512-bit
registers, quant_linear_avx512f.cpp), avx2 (runs on any AVX-512 CPU too: how its bodies are tested there), none (no
body: what a CPU without AVX2 gets, torch's operators, the library's portable code converting weights while
loading). Operators without a body in the chosen family run torch's operators (`runs(operator)` says which have
one: BODIES).
"""

from __future__ import annotations

import logging

import torch

from dsaserve.native import amx, build

logger = logging.getLogger(__name__)

NATIVE_KERNELS = ("auto", "avx512", "off")
CPU_ISAS = ("auto", "amx", "avx512_bf16", "avx512", "avx2", "none")
# The operators each body family has; the others run torch's operators under that family.
BODIES = {
    "avx512_bf16": frozenset({"packed_products", "selected_rows", "index_scores", "index_scores_int8",
                              "decode_plan", "mla_projections"}),
    "avx2": frozenset({"packed_products", "mla_projections", "index_scores", "selected_rows", "index_scores_f32",
                       "index_scores_int8", "decode_plan"}),
}
BODIES["avx512"] = BODIES["avx2"]  # the same operators, the products' blocks 512 bits wide
AVX2_FAMILY = ("avx2", "avx512")  # the families that run the AVX2 bodies (fp32 activations under dtype auto)
_loaded: bool | None = None
_kernels: str | None = None
_choice = "auto"
_isa = "auto"
_unavailable: str | None = None  # why the operators are not loaded


def library_path():
    """Where this machine's build of the operators is (or will be) kept."""
    return build.library_path()


def configure(choice: str, cpu_isa: str = "auto") -> None:
    """The engine's native_kernels and cpu_isa options, for this process (the last engine made sets them). A
    cpu_isa this CPU cannot run is a ValueError naming what it lacks."""
    global _choice, _kernels, _isa
    if choice not in NATIVE_KERNELS:
        raise ValueError(f"native_kernels={choice!r} is not one of {', '.join(NATIVE_KERNELS)}")
    check_cpu_isa(cpu_isa)
    previous = _choice, _isa
    _choice, _isa, _kernels = choice, cpu_isa, None
    try:
        if _loaded:
            _apply_choice()
        elif cpu_isa != "auto" and choice != "off" and not load():
            raise ValueError(f"cpu_isa={cpu_isa!r}: the native operators are unavailable here ({_unavailable})")
    except ValueError:  # a refused family leaves the process as it was
        _choice, _isa = previous
        if _loaded:
            _apply_choice()
        raise


def check_cpu_isa(cpu_isa: str) -> None:
    if cpu_isa not in CPU_ISAS:
        raise ValueError(f"cpu_isa={cpu_isa!r} is not one of {', '.join(CPU_ISAS)}")


def _body_family(cpu_isa: str) -> str:
    """The operators' family for a cpu_isa value ('none' where the CPU has no body), checked against the CPU."""
    have = list(torch.ops.dsaserve.cpu_isas())
    if cpu_isa == "auto":
        return have[0]
    wanted = "avx512_bf16" if cpu_isa == "amx" else cpu_isa
    if wanted not in have:
        missing = {"avx512_bf16": "AVX-512 BF16 (avx512f, avx512bw, avx512vl, avx512_bf16)",
                   "avx512": "AVX-512 (avx512f, avx512bw, avx512vl, avx512dq)",
                   "avx2": "AVX2 (avx2, fma, f16c)"}[wanted]
        raise ValueError(f"cpu_isa={cpu_isa!r}: this CPU lacks {missing}; its bodies: {', '.join(have)}")
    if cpu_isa == "amx" and not torch.ops.dsaserve.amx_available():
        raise ValueError("cpu_isa='amx': this CPU lacks AMX-BF16 and AMX-INT8 (or Linux did not grant the tile "
                         "registers); use 'avx512_bf16' or 'auto'")
    return wanted


def _apply_choice() -> None:
    family = _body_family(_isa)
    torch.ops.dsaserve.set_cpu_isa(family)
    # The paths that round activations to int8 (VNNI, and the AVX2 family's int4 products by bf16 activations)
    # run unless native_kernels asks for the exact bodies alone.
    torch.ops.dsaserve.set_isa_extensions(_choice == "auto")
    extensions = _choice == "auto" and family == "avx512_bf16"
    why_not = "native_kernels 'avx512'" if _choice != "auto" else f"cpu_isa '{_isa}'"
    amx.allow(extensions and _isa in ("auto", "amx"), why_not)


def choice() -> str:
    return _choice


def load() -> bool:
    """Build (the first time these sources are seen on this machine) and load the operators; False where that is
    not possible or native_kernels is off."""
    global _loaded, _unavailable
    if _choice == "off":
        return False
    if _loaded is not None:
        return _loaded
    _loaded = False
    library = library_path()
    try:
        if not library.exists():
            build.build(library)
        torch.ops.load_library(str(library))
    except Exception as e:  # no compiler, a failed build: the torch paths remain
        _unavailable = str(e).strip()[:500]
        logger.warning("dsaserve's native operators are unavailable, using torch: %s", _unavailable)
        return False
    _loaded = True
    amx.choose_at_load(str(library))
    _apply_choice()
    return True


def unavailable() -> str | None:
    """Why the operators are off in this process (None: they are loaded, or not asked for yet)."""
    if _choice == "off":
        return "native_kernels is 'off'"
    return _unavailable


def cpu_kernels() -> str:
    """The body family the kernels run here: 'avx512_bf16', 'avx2', or 'none' (no such CPU, or not built: torch
    paths). Asked once: the products call this on every step."""
    global _kernels
    if _kernels is None or _loaded is None:
        _kernels = torch.ops.dsaserve.cpu_kernels() if load() else "none"
    return _kernels


def avx2_family() -> bool:
    """Whether this process runs the AVX2 bodies (cpu_isa avx2 or avx512): fp32 activations under dtype auto."""
    return cpu_kernels() in AVX2_FAMILY


def runs(operator: str) -> bool:
    """Whether `operator` (a BODIES name) has a native body in the family this process runs."""
    return operator in BODIES.get(cpu_kernels(), ())


def summary() -> str:
    """Which native kernels this process runs, and why any are off: the engine's startup log line and doctor's."""
    if not load():
        return f"off ({unavailable() or 'not loaded'}): torch's operators run"
    if avx2_family():
        family = "AVX-512 without BF16" if cpu_kernels() == "avx512" else "AVX2"
        why = "chosen by cpu_isa" if _isa in AVX2_FAMILY else "this CPU has no AVX-512 BF16"
        wide = ", their blocks in 512-bit registers" if cpu_kernels() == "avx512" else ""
        int4 = {"avx2_int8": ", int4 by bf16 activations rounded to int8 (vpmaddubsw)",
                "avx512_int8": ", int4 by bf16 activations rounded to int8 (AVX-512 VNNI)"}.get(
            torch.ops.dsaserve.int4_bf16_path(), "")
        return (f"{family} ({why}): the packed-weight products{wide} (bf16 and fp8 widened in registers, int8 and "
                f"int4 by int16 products of the activations{int4}), the sparse and dense attention over selected "
                "rows (fp32 or bf16), the indexer's scores (bf16 or int8 keys, or fp32 keys read in place), and the "
                "decode plan")
    if cpu_kernels() == "none" and _isa == "none":
        return ("none (chosen by cpu_isa): no native body runs, as on a CPU without AVX2; packed weights are "
                "dequantized a slab at a time for torch's products")
    if cpu_kernels() != "avx512_bf16":
        return ("portable bodies of the small operators only (this CPU has no AVX2 or AVX-512 BF16): packed weights "
                "are dequantized a slab at a time for torch's products")
    ops = torch.ops.dsaserve
    products = "int8-rounded activations on AVX-512 VNNI" if ops.int8_bf16_path() == "avx512_vnni" else "bf16"
    fp8 = "VBMI table lookups" if ops.fp8_bf16_path() == "avx512_vbmi" else "shifts and masks"
    why = " (native_kernels 'avx512')" if _choice == "avx512" else " (no AVX-512 VNNI and VBMI here)"
    return (f"AVX-512 BF16 (native_kernels '{_choice}'); int8 and int4 weights by {products}, fp8 decoded by {fp8}"
            f"{why if products == 'bf16' else ''}; AMX tiles {amx.state()}")
