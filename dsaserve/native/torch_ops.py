"""The native kernels that are torch operators (`torch.ops.dsaserve.*`), built from their C++ sources.

They are compiled with torch.utils.cpp_extension once per machine, on first use (a log line says so;
about a minute on 2 cores), into the dsaserve cache, keyed by the sources, the torch version and
the CPU: the packed-weight products (quant_linear.cpp), the sparse per-query attention
(selected_rows.cpp), the indexer's scores (index_scores.cpp; index_scores_int8.cpp for int8 keys), its
top-k (topk.cpp) and a decode batch's selection made of them (decode_selection.cpp), the small per-token
operators a decode step calls dozens of times (rms_norm.cpp, rope.cpp, latent_write.cpp, moe_route.cpp,
mla_projections.cpp, context_slots.cpp), and a decoder layer's decode step chained from those in two
halves, with runs of layers in one call (decode_layer.cpp). The sources pick their AVX-512 bodies at run time
from the CPU's flags and have portable ones for other CPUs; the sparse attention and indexer scores also have
AMX tile bodies, which amx.py turns on at load where the CPU has AMX and they agree with the AVX-512 ones.
Without a compiler, or with DSASERVE_NATIVE=0, `load()` is False and callers keep their torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from dsaserve import native

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_loaded: bool | None = None
# Per bound layer handle (decode_layer_bind), (heads, query width, q_lora_rank): decode_layers' fake reads them.
BOUND_LAYER_SHAPES: dict[int, tuple[int, int, int]] = {}
_kernels: str | None = None


FLAGS = "-O3 -fopenmp"


def _build_dir() -> Path:
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + FLAGS.encode()
    key = hashlib.sha256(source + torch.__version__.encode() + native.cpu_signature().encode()).hexdigest()[:16]
    return native.cache_dir() / f"torch_ops_{key}"


def library_path() -> Path:
    """Where this machine's build of the operators is (or will be) kept."""
    build_dir = _build_dir()
    return build_dir / f"dsaserve_{build_dir.name}.so"


def load() -> bool:
    """Build (the first time on this machine) and load the operators; False where that is not possible."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if os.environ.get("DSASERVE_NATIVE", "1") == "0":
        return False
    library = library_path()
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(library.stem, library)
    except Exception as e:  # no compiler, no ninja, a failed build: the torch paths remain
        logger.warning("dsaserve's torch operators are unavailable, using torch: %s", str(e).strip()[:500])
        return False
    _register_fakes()
    _loaded = True
    from dsaserve.native import amx

    amx.choose_at_load(str(library))
    return True


def _build(name: str, library: Path) -> None:
    """Compile and load the operators, then move the library to `library`. Each build has a directory of
    its own: torch's builder waits for any lock file in its directory, so a build killed halfway (a
    Ctrl-C on the first start) would otherwise leave every later start waiting forever."""
    from torch.utils.cpp_extension import load as build

    logger.info("compiling dsaserve's torch operators (once per machine, about a minute) for %s", library.parent)
    native.cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=native.cache_dir(), prefix="building_") as scratch:
        # -fopenmp: at::parallel_for is inline OpenMP code (torch's CPU build), serial without it; the
        # library then binds to the libgomp torch already loaded, so it runs on torch's own threads.
        build(name=name, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS.split(), extra_ldflags=["-fopenmp"],
              build_directory=scratch, is_python_module=False, verbose=False)
        library.parent.mkdir(parents=True, exist_ok=True)
        os.replace(Path(scratch) / f"{name}.so", library)  # atomic: a concurrent start sees all of it or none


def _register_fakes() -> None:
    """Shapes and dtypes without computing, so torch.compile and meta tensors can trace the operators."""
    @torch.library.register_fake("dsaserve::quant_linear")
    def _(x, qweight, scale, kind, group, col_offset, N, K):
        return x.new_empty(*x.shape[:-1], N)

    @torch.library.register_fake("dsaserve::index_scores")
    def _(q, weights, packed, keys, out):
        return None

    @torch.library.register_fake("dsaserve::index_scores_blocks")
    def _(q, weights, cache, blocks, keys, out):
        return None

    @torch.library.register_fake("dsaserve::index_scores_int8_blocks")
    def _(q, weights, cache, scales, blocks, keys, out):
        return None

    @torch.library.register_fake("dsaserve::write_int8_keys")
    def _(cache, scales, slots, keys):
        return None

    @torch.library.register_fake("dsaserve::write_packed_keys")
    def _(cache, slots, keys):
        return None

    @torch.library.register_fake("dsaserve::attend_selected_rows")
    def _(q, rows, slots, scale, out):
        return None

    @torch.library.register_fake("dsaserve::decode_selection")
    def _(q, weights, cache, block_tables, seq_lens, width, chunk_blocks, window_blocks, scales=None):
        return q.new_empty(q.shape[0], width, dtype=torch.int32)

    @torch.library.register_fake("dsaserve::topk_rows")
    def _(x, k):
        return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)

    @torch.library.register_fake("dsaserve::moe_experts")
    def _(x, gate_up_q, gate_up_s, down_q, down_s, ids, weights, out, kind, inter, gate_up_group, down_group,
          down_col_offset, shared_gate_up_q=None, shared_gate_up_s=None, shared_down_q=None, shared_down_s=None,
          shared_inter=0, shared_gate_up_group=0, shared_down_group=0, shared_down_col_offset=0):
        return None

    @torch.library.register_fake("dsaserve::gated_mlp")
    def _(x, gate_up_q, gate_up_s, down_q, down_s, kind, inter, gate_up_group, down_group, down_col_offset):
        return x.new_empty(x.shape)  # down maps the intermediate back to hidden

    @torch.library.register_fake("dsaserve::moe_route")
    def _(x, weight, bias, top_k, n_group, topk_group, normalize, scaling):
        return weight.new_empty(x.shape[0], top_k), weight.new_empty(x.shape[0], top_k, dtype=torch.long)

    @torch.library.register_fake("dsaserve::write_latent_rows")
    def _(kv, weight, eps, cos, sin, interleaved, rows, slots):
        return None

    @torch.library.register_fake("dsaserve::mla_query")
    def _(x, q_a_q, q_a_s, q_a_args, norm_weight, eps, q_b_q, q_b_s, q_b_args, w_uk_q, w_uk_s, w_uk_args, cos, sin,
          interleaved, heads, nope, rope):
        return x.new_empty(x.shape[0], heads, w_uk_args[3] + rope), x.new_empty(x.shape[0], q_a_args[3])

    @torch.library.register_fake("dsaserve::mla_output")
    def _(latent, w_uv_q, w_uv_s, w_uv_args, o_q, o_s, o_args):
        return latent.new_empty(latent.shape[0], o_args[3])

    @torch.library.register_fake("dsaserve::add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("dsaserve::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("dsaserve::apply_rope")
    def _(x, cos, sin, interleaved):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dsaserve::decode_layers")
    def _(layers, x, cos, sin, rows, slot_mapping, key_groups, key_scales, query=None, slots=None, finish=False,
          block_tables=None, seq_lens=(), selection=()):
        if finish or (query is not None and len(layers) == 1):  # the run ends with an out
            return torch.empty_like(x), x.new_empty(0), x.new_empty(0), x.new_empty(0)
        heads, width, lora = BOUND_LAYER_SHAPES[layers[-1]]
        return (torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[0], heads, width),
                x.new_empty(x.shape[0], lora))

    @torch.library.register_fake("dsaserve::context_slots")
    def _(block_tables, lens, block_size):
        return block_tables.new_empty(len(lens), max(lens))

    @torch.library.register_fake("dsaserve::position_slots")
    def _(block_tables, positions, block_size):
        return block_tables.new_empty(positions.shape)

    @torch.library.register_fake("dsaserve::dequantize_t")
    def _(qweight, scale, kind, group, col_offset, N, K, dtype):
        return scale.new_empty(K, N, dtype=dtype)


def cpu_kernels() -> str:
    """What the kernels run here: 'avx512_bf16', or 'none' (no such CPU, or not built: torch paths).
    Asked once: the products call this on every step."""
    global _kernels
    if _kernels is None or _loaded is None:
        _kernels = torch.ops.dsaserve.cpu_kernels() if load() else "none"
    return _kernels
