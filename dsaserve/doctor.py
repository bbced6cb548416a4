"""`dsaserve doctor MODEL_DIR`: what an operator should know before a multi-hour load.

Works on a directory holding only config.json; reads safetensors headers (never tensor data) when
weights are present.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import torch

from dsaserve import cuda_graph_sizes, triton_ops
from dsaserve.attention.indexer_cache import indexer_key_kind
from dsaserve.byte_sizes import human
from dsaserve.config import ModelConfig
from dsaserve.device import resolve_device
from dsaserve.distributed.parallel_config import ParallelConfig
from dsaserve.engine.workers.kv_cache import KVCacheLayout
from dsaserve.engine_args import EngineArgs
from dsaserve.model import huge_pages
from dsaserve.model.checkpoint_layout import checkpoint_shapes, component_of, is_mtp_tensor, text_prefix
from dsaserve.model.load_memory import available_memory, default_scratch_budget
from dsaserve.model.loader import (
    SCRATCH_PER_THREAD,
    CheckpointError,
    check_tensors,
    checkpoint_files,
    load_threads,
    read_tensor_infos,
)
from dsaserve.model.weight_bytes import resident_bytes
from dsaserve.native import amx, index_scores, selected_rows, torch_ops
from dsaserve.parallel_plan import plan_lines, stored_items

_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "U8": 1, "I8": 1}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def count(n: int) -> str:
    for suffix, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def report(model_dir: str, hf_overrides=None, max_model_len: int | None = None, parallel: ParallelConfig | None = None,
           device_memory: int | None = None, utilization: float = 0.9, cpu_isa: str = "auto") -> tuple[str, bool]:
    """Returns (text, ok). ok is False when the checkpoint's tensors do not match its config. With a
    parallel layout, also each rank's share (parallel_plan.py), and the context that fits in
    device_memory bytes per rank. cpu_isa: the kernels' body family, as the engine option chooses it."""
    torch_ops.configure("auto", cpu_isa)
    cfg = ModelConfig.from_pretrained(model_dir, hf_overrides=hf_overrides)
    sched = cfg.indexer_schedule
    lines = [f"dsaserve doctor: {os.path.abspath(model_dir)}"]
    lines.append(
        f"model: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts ({cfg.num_experts_per_tok} per token, "
        f"{cfg.n_shared_experts} shared), vocab {cfg.vocab_size}"
    )
    if cfg.hybrid is not None:
        lines += _hybrid_lines(cfg)
    else:
        lines.append(f"indexer schedule: {sched.pattern}")
        lines.append(f"  {sched.num_full} full / {sched.num_shared} shared, from {sched.source}")
    lines.append(f"  index_topk {cfg.index_topk}, indexer {cfg.index_n_heads} heads × {cfg.index_head_dim}"
                 + (f", scored in pools of {cfg.hybrid.index_kpool} tokens ({cfg.index_topk // cfg.hybrid.index_kpool}"
                    " pools kept, plus the unfinished pool's tokens)" if cfg.hybrid is not None else ""))
    for warning in sched.warnings:
        lines.append(f"  WARNING: {warning}")
    if cfg.family.index_share:
        lines.append(f"  to pin this schedule: --hf-overrides '{sched.hf_override()}'")
    lines.append(f"native kernels: {_native_line()}")
    lines.append(f"triton kernels: {_triton_line()}")
    lines.append(f"CUDA graphs: {_graphs_line(cfg, max_model_len or cfg.max_position_embeddings)}")
    lines.append(f"sparse per-query rows: {_selected_rows_path(cfg)}")
    lines.append(f"indexer kernels: {_index_scores_path(cfg)}")
    lines.append(f"AMX tiles for those kernels: {_amx_line(cfg)}")
    lines.append(f"weight products: {_weight_kernel_path()}")
    lines.append(f"weight memory: {_weight_pages()}")
    dense = sum(t == "dense" for t in cfg.mlp_layer_types)
    lines.append(f"mlp layers: {dense} dense + {cfg.num_hidden_layers - dense} MoE")
    rope = cfg.rope
    if cfg.qk_rope_head_dim == 0:
        lines.append("rope: none (NoPE attention: qk_rope_head_dim 0)")
    else:
        lines.append(f"rope: {rope.rope_type}, theta {rope.theta:g}"
                     + (f", factor {rope.factor:g}" if rope.rope_type == "yarn" else ""))
    lines.append(f"eos token ids: {list(cfg.eos_token_ids)}")
    if cfg.quantization_config:
        qc = cfg.quantization_config
        lines.append(f"quantization: {qc.get('quant_method')} blocks {qc.get('weight_block_size')} "
                     "(kept as shipped where the native CPU or the Triton kernels run; dequantized at load elsewhere)")

    ok = True
    files = checkpoint_files(model_dir)
    if files:
        infos = read_tensor_infos(files)
        lines.append(f"weights: {len(files)} safetensors file(s), {len(infos)} tensors")
        lines += _schedule_check(cfg, infos)
        try:
            check_tensors(cfg, infos)
            lines.append("  every tensor matches the layout config.json describes")
        except CheckpointError as e:
            ok = False
            lines.append(f"  MISMATCH: {e}")
        sizes = {n: (i.shape, _BYTES.get(i.dtype, 2)) for n, i in infos.items() if not is_mtp_tensor(cfg, n)}
        lines.append(_mtp_line(cfg, infos))
        source = "checkpoint headers"
        stored = {n: v for n, v in sizes.items() if not n.endswith("_scale_inv")}  # the plan adds scales per slice
    else:
        lines.append("weights: none in this directory (sizes below are computed from config.json)")
        item = _DTYPE_BYTES.get(cfg.checkpoint_dtype, 2)
        sizes = {n: (s, item) for n, s in checkpoint_shapes(cfg).items()}
        source = f"config.json at {cfg.checkpoint_dtype}"
        stored = stored_items(cfg, checkpoint_shapes(cfg), item)
    lines += _component_table(sizes, source)
    lines += _weight_form_lines(cfg, len(files) or UNKNOWN_FILES)
    lines += _kv_lines(cfg, max_model_len)
    if parallel is not None and (parallel.distributed or device_memory):  # one device: its plan when memory is given
        parallel.check_model(cfg, "sparse")
        dtype = {"float32": torch.float32, "float16": torch.float16}.get(cfg.checkpoint_dtype, torch.bfloat16)
        layout = KVCacheLayout.of(cfg, dtype, indexer_key_kind("auto", cfg.fp8_checkpoint),
                                  tp_size=parallel.tensor_parallel_size)
        lines += plan_lines(cfg, parallel, stored, torch.empty((), dtype=dtype).element_size(),
                            str(dtype).removeprefix("torch."), layout.bytes_per_token,
                            device_memory, utilization, layout.state_bytes_per_request,
                            layout.indexer_bytes_per_token,
                            (EngineArgs.max_num_batched_tokens, EngineArgs.max_num_seqs),
                            max(cuda_graph_sizes.capture_sizes(None, EngineArgs.max_num_seqs)))
    return "\n".join(lines), ok


def _mtp_line(cfg: ModelConfig, infos: dict) -> str:
    """Whether the checkpoint carries an MTP layer (what --speculative-config drafts with) and its size."""
    mtp = {n: i for n, i in infos.items() if is_mtp_tensor(cfg, n)}
    if not mtp:
        return (f"MTP layer: none (num_nextn_predict_layers={cfg.num_nextn_predict_layers}); "
                "--speculative-config is unavailable")
    size = sum(math.prod(i.shape) * _BYTES.get(i.dtype, 2) for i in mtp.values())
    return (f"MTP layer: {text_prefix(cfg)}layers.{cfg.num_hidden_layers} ({len(mtp)} tensors, {human(size)} more to "
            f"load with --speculative-config; index_share_for_mtp_iteration={cfg.index_share_for_mtp_iteration})")


def _selected_rows_path(cfg: ModelConfig) -> str:
    """Which implementation the sparse backend uses for queries whose selections hardly overlap."""
    avx2 = torch_ops.avx2_family()
    lanes = selected_rows.head_lanes()
    heads = -(-cfg.num_attention_heads // lanes) * lanes  # padded to the kernel's lanes
    if selected_rows.fits(heads, cfg.kv_cache_dim, cfg.kv_lora_rank):
        return ("native AVX2 kernel (fp32 and bf16 caches)" if avx2 else
                "native AVX-512 BF16 kernel (bf16 models on this CPU)")
    if selected_rows.has_bf16_kernel():
        return (f"torch (rank {cfg.kv_lora_rank}: the native kernel needs value columns in "
                f"{8 if avx2 else 32}s)")
    return ("torch (no native kernel here: it needs a C++ compiler and AVX2 or AVX-512 BF16; --native-kernels off "
            "turns it off)")


def _index_scores_path(cfg: ModelConfig) -> str:
    """Which implementations the indexer uses for its scores and its running top-k."""
    body = "AVX2" if torch_ops.avx2_family() else "AVX-512 BF16"
    scores = (f"native {body} kernel (bf16 models; their key caches kept in its layout, scored in place)"
              if index_scores.fits(cfg.index_n_heads, cfg.index_head_dim) else "torch")
    if index_scores.fits_f32(cfg.index_n_heads, cfg.index_head_dim):
        scores += "; fp32 models (dtype auto here) by the AVX2 kernel, fp32 keys read in place"
    if index_scores.fits_int8(cfg.index_n_heads, cfg.index_head_dim):
        products = "signed byte products on AVX2" if torch_ops.avx2_family() else "int8 products on AVX-512 VNNI"
        asked = "auto's choice for this FP8 checkpoint" if cfg.fp8_checkpoint else "--indexer-cache-dtype int8"
        scores += f"; int8 key caches ({asked}) by {products}, the queries rounded to int8 per head"
    return f"scores: {scores}; top-k: {'native radix select' if torch_ops.load() else 'torch'}"


def _amx_line(cfg: ModelConfig) -> str:
    """Whether the sparse attention and the indexer's scores take their AMX tile bodies, and for which shapes."""
    if not torch_ops.load():
        return "off (the native operators are not built here)"
    takes = []
    if cfg.kv_lora_rank % 64 == 0:
        takes.append("attention")
    if cfg.index_n_heads % 16 == 0 and cfg.index_head_dim % 32 == 0:
        takes.append("indexer scores (bf16 keys)")
    if cfg.index_n_heads % 16 == 0 and cfg.index_head_dim % 64 == 0:
        takes.append("int8 indexer keys")
    shapes = (f"this checkpoint's shapes fit: {', '.join(takes)}" if takes else
              "this checkpoint's shapes fit none (rank in 64s; indexer heads in 16s and dims in 32s, "
              "64s for int8 keys)")
    return f"{amx.state()}; {shapes}"


def _native_line() -> str:
    return (f"{torch_ops.summary()} (--cpu-isa auto | amx | avx512_bf16 | avx512 | avx2 | none; --native-kernels "
            "auto | avx512: the exact bodies alone, no AMX, int8-rounded activations or VBMI lookups | off: torch's "
            "operators)")


def _triton_line() -> str:
    """What the engine's default (--triton-kernels auto) runs on this machine's default device."""
    device = resolve_device("auto")
    triton_ops.configure("auto", device)
    if device.type == "cuda":
        return f"{triton_ops.summary()}; --triton-kernels off: torch's operators"
    return ("off here (no CUDA device; on CUDA they run the sparse attention and the indexer's scores); "
            "--triton-kernels on runs them on CPU tensors under TRITON_INTERPRET=1"
            + ("" if triton_ops.triton_imports() is None else f" ({triton_ops.triton_imports()})"))


def _graphs_line(cfg: ModelConfig, max_model_len: int) -> str:
    """What a CUDA engine captures at start-up with the default options (engine/workers/decode_graphs.py)."""
    sizes = cuda_graph_sizes.capture_sizes(None, EngineArgs.max_num_seqs)
    contexts = cuda_graph_sizes.context_buckets(max_model_len)
    verify = ("; verify steps run eagerly (they keep the KDA state after each draft), as do steps that keep a "
              "prefix-cache snapshot of it" if cfg.hybrid is not None
              else " (with speculative decoding as many again for verify steps, and again for each of the drafter's "
                   "catch-ups and rounds)")
    return (f"on CUDA with the Triton kernels, decode batch sizes {','.join(map(str, sizes))} (--cuda-graph-sizes; "
            f"the default for --max-num-seqs {EngineArgs.max_num_seqs}) × contexts up to "
            f"{','.join(map(str, contexts))} tokens (max_model_len {max_model_len}): {len(sizes) * len(contexts)} "
            f"graphs captured at start-up in one memory pool{verify}; --enforce-eager: none")


def _weight_pages() -> str:
    if huge_pages.enabled():
        return "one mapping advised for 2 MiB transparent huge pages (--no-huge-pages: torch's allocator)"
    return "torch's allocator, 4 KiB pages (transparent huge pages refused here)"


def _weight_kernel_path() -> str:
    """Which implementation multiplies packed (quantized or bf16) weights on this machine."""
    if not torch_ops.runs("packed_products"):
        return ("torch (the packed-weight kernels need a C++ compiler and AVX2 or AVX-512 BF16; quantized weights "
                "dequantize a slab of rows at a time)")
    body = {"avx2": "AVX2", "avx512": "AVX-512 (no BF16)"}.get(torch_ops.cpu_kernels(), "AVX-512 BF16")
    beyond = ("torch GEMM beyond on a slab of rows dequantized at a time (bf16 checkpoints keep their bytes, "
              "computing in fp32)" if torch_ops.avx2_family() else "torch GEMM beyond")
    plan = ("; a decode step runs its layers as one native plan, its sparse selections included where every request "
            "is past index_topk (model/decode_plan.py; --enforce-eager: through the modules)"
            if torch_ops.runs("decode_plan") else "")
    return f"native {body} kernels for up to 16 rows (bf16 models and --quantization), {beyond}{plan}"


def _schedule_check(cfg: ModelConfig, infos) -> list[str]:
    layers = f"{text_prefix(cfg)}layers."
    with_indexer = {int(n.removeprefix(layers).split(".")[0]) for n in infos
                    if n.startswith(layers) and ".self_attn.indexer." in n and not is_mtp_tensor(cfg, n)}
    full = set(cfg.full_layers)
    missing = sorted(full - with_indexer)
    extra = sorted(with_indexer - full)
    if not missing and not extra:
        return [f"  indexer weights on all {len(full)} full layers and on none of the "
                f"{len(cfg.attention_layers) - len(full)} shared layers"]
    out = []
    if missing:
        out.append(f"  MISMATCH: full layers without indexer weights: {missing}")
    if extra:
        out.append(f"  MISMATCH: shared layers carrying indexer weights: {extra} "
                   "(the checkpoint expects a different schedule)")
    return out


def _component_table(sizes: dict, source: str) -> list[str]:
    params, nbytes = defaultdict(int), defaultdict(int)
    for name, (shape, item) in sizes.items():
        n = 1
        for d in shape:
            n *= d
        key = "fp8 scales" if name.endswith("_scale_inv") else component_of(name)
        if not name.endswith("_scale_inv"):
            params[key] += n
        nbytes[key] += n * item
    lines = [f"parameters by component ({source}):"]
    for key in sorted(nbytes, key=lambda k: -nbytes[k]):
        lines.append(f"  {key:<16} {count(params[key]):>10} params  {human(nbytes[key]):>12}")
    lines.append(f"  {'total':<16} {count(sum(params.values())):>10} params  {human(sum(nbytes.values())):>12}")
    return lines


UNKNOWN_FILES = 64  # shards assumed for a config-only directory (a large checkpoint has more than threads)


def _weight_form_lines(cfg: ModelConfig, files: int) -> list[str]:
    """Resident weight bytes in each form dsaserve can hold them in (the MTP layer not counted), and the peak a load
    into that form reaches: those bytes plus the loading threads' conversion scratch."""
    params = resident_bytes(cfg, None, torch.float32) // 4
    available = available_memory()
    budget = default_scratch_budget(available)
    threads = load_threads(files, budget)
    scratch = threads * SCRATCH_PER_THREAD
    lines = ["resident weights by form (--quantization; an FP8 checkpoint stays fp8 where the native CPU or the Triton "
             "kernels run), and "
             f"the peak while loading ({threads} thread{'s' if threads > 1 else ''} × {human(SCRATCH_PER_THREAD)} "
             "of conversion scratch, --load-scratch-memory):"]
    for form, what in ((None, "bf16, float"), ("fp8", "fp8"), ("int8", "int8"), ("int4", "int4")):
        size = resident_bytes(cfg, form, torch.bfloat16)
        fits = "" if available is None else ("  fits here" if size + scratch <= available else "  does not fit here")
        lines.append(f"  {what:<12} {human(size):>12}  {size / params:.3f} bytes per parameter, peak while loading "
                     f"{human(size + scratch)}{fits}")
    if available is not None:
        lines.append(f"  (memory available here: {human(available)})")
    return lines


def _kv_lines(cfg: ModelConfig, max_model_len: int | None) -> list[str]:
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(cfg.checkpoint_dtype, torch.bfloat16)
    key_kind = indexer_key_kind("auto", cfg.fp8_checkpoint)
    layout = KVCacheLayout.of(cfg, dtype, key_kind)
    item = torch.empty((), dtype=dtype).element_size()
    length = max_model_len or cfg.max_position_embeddings
    d = cfg.index_head_dim
    keys = f"{d} × {item} B" if cfg.hybrid is None else f"(2 × {d} + {d} / {cfg.hybrid.index_kpool}) × {item} B"
    if cfg.hybrid is None and key_kind == "int8":  # what indexer_cache_dtype auto keeps for FP8 weights
        keys = f"({d} × 1 B + a 2 B scale: int8 keys, as FP8 weights get by default)"
    lines = [
        f"KV cache per token ({str(dtype).removeprefix('torch.')}): {human(layout.bytes_per_token)}",
        f"  latent: {len(cfg.attention_layers)} layers × {cfg.kv_cache_dim} × {item} B = "
        f"{human(layout.latent_bytes_per_token)}",
        f"  indexer keys: {len(cfg.full_layers)} full layers × {keys} = "
        f"{human(layout.indexer_bytes_per_token)}",
        f"  one sequence of {length} tokens: {human(layout.bytes_per_token * length)}",
    ]
    if cfg.hybrid is not None:
        h = cfg.hybrid
        lines += [
            f"KDA state per request (fp32, the same at any context length): "
            f"{human(layout.state_bytes_per_request)}",
            f"  {len(h.linear_layers)} layers × ({h.linear_num_heads} × {h.linear_head_dim} × {h.linear_head_dim} "
            f"+ {h.conv_kernel - 1} × {h.conv_dim}) × 4 B; one slot per running request (max_num_seqs), counted in "
            "kv_cache_memory (without it, max_num_seqs and the snapshots are lowered to fit a quarter of the memory "
            "available)",
            f"  prefix-cache snapshots: {human(layout.state_bytes_per_request)} each, one every 512 tokens of a "
            "request (--state-snapshot-interval), max-num-seqs of them kept (--state-snapshots); a hit resumes at the "
            "last snapshot inside the shared prefix",
        ]
    return lines


def _hybrid_lines(cfg: ModelConfig) -> list[str]:
    """A hybrid model's layer kinds and its indexer schedule over the layers that attend."""
    h, sched = cfg.hybrid, cfg.indexer_schedule
    attending = cfg.attention_layers
    pattern = "".join("F" if cfg.is_full(i) else "S" for i in attending)
    return [
        f"layer kinds: {h.pattern} ({len(h.linear_layers)} KDA / {len(attending)} indexed attention, from layer_types)",
        f"  KDA: {h.linear_num_heads} heads × {h.linear_head_dim}, short convolution of {h.conv_kernel}, decay "
        + (f"bounded below by {h.gate_lower_bound:g}" if h.gate_lower_bound is not None else "unbounded (softplus)"),
        f"  mHC: {h.hc_mult} residual streams, {h.hc_sinkhorn_iters} Sinkhorn iterations; SwiGLU clamp "
        + (f"{h.swiglu_limit:g}" if h.swiglu_limit is not None else "none"),
        f"indexer schedule (indexed layers {attending[0]}, {attending[1] if len(attending) > 1 else ''}…): {pattern}",
        f"  {pattern.count('F')} full / {pattern.count('S')} shared, from {sched.source} (a shared layer reuses the "
        "last full layer's selection, across the KDA layers between them)",
    ]
