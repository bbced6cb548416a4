"""Load safetensors checkpoints (single file or sharded) strictly, streaming, with FP8 kept or converted;
under tensor parallelism each rank reads only its slices.

Strict means: the set of tensors must equal the layout derived from the config (indexer weights on
every full layer and on no shared layer, per-expert MoE tensors; the MTP layers are skipped),
shapes must match, and a truncated or corrupt file is reported by name.

Streaming means: every tensor goes from the file to its resident form (packed FP8, int8, int4, bf16, or a float
Parameter) a chunk of rows at a time, read from the memory-mapped file and converted in one bounded scratch per
loading thread (SCRATCH_PER_THREAD): no whole tensor is ever held in full precision. Each file's tensors are read
in file order, and the threads (one file each) are as many as the scratch budget allows.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dsaserve.config import CheckpointError, ModelConfig
from dsaserve.distributed.sharding import ShardPlan, TensorSlice, tensor_slice
from dsaserve.model.checkpoint_layout import (
    VISION_PREFIX,
    checkpoint_shapes,
    is_mtp_tensor,
    optional_mtp_shapes,
    text_prefix,
)
from dsaserve.model.glm5_next import param_of as hybrid_param_of
from dsaserve.model.glm_moe_dsa import param_of
from dsaserve.quantization.fp8_blocks import Fp8Slice, dequantize_fp8  # noqa: F401 (dequantize_fp8: the loader's rule)

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SCRATCH_PER_THREAD = 64 << 20  # bytes of conversion temporaries a loading thread may hold
SCRATCH_COPIES = 8  # fp32 copies of a chunk the conversions make at most (dequantize, scale, round, pack)
CHUNK_ALIGN = 128  # rows: an FP8 block row, and a whole number of the packed layout's 16-row blocks
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` holds the block scales of an FP8 `X.weight`
FP8_DTYPES = ("F8_E4M3",)
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
                "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    offset: int = 0  # where its bytes start in the file
    nbytes: int = 0


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint: those named by the index, else every *.safetensors."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise CheckpointError(f"{INDEX_FILE} names shard files that do not exist in {model_dir}: {missing}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    return [os.path.join(model_dir, f) for f in files]


def read_tensor_infos(files: list[str]) -> dict[str, TensorInfo]:
    """Names, dtypes, shapes and places from the file headers, without reading tensor data."""
    infos: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                places = _data_offsets(path)
                for name in f.keys():
                    if name in infos:
                        raise CheckpointError(f"tensor {name!r} is stored twice: in {infos[name].file} and {path}")
                    piece = f.get_slice(name)
                    begin, end = places.get(name, (0, 0))
                    infos[name] = TensorInfo(path, piece.get_dtype(), tuple(piece.get_shape()), begin, end - begin)
        except SafetensorError as e:
            raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-download this file") from e
    return infos


def _data_offsets(path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file (from the file's start), from its header (safe_open has
    checked the header)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    data = 8 + length  # the data section follows the header; its offsets count from there
    return {name: (data + entry["data_offsets"][0], data + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def map_file(path: str) -> torch.Tensor:
    """The whole file as uint8, memory-mapped (private: nothing is copied unless written, and nothing is written
    back), advised for sequential reading: row chunks are views of it (mapped_rows)."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_SEQUENTIAL"):
        mapping.madvise(mmap.MADV_SEQUENTIAL)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def mappable(info: TensorInfo, part: TensorSlice) -> bool:
    """Whether row chunks of this part can be views of the mapped file: whole rows (all columns), of a dtype torch
    has, starting where its elements may (safetensors does not align a tensor to its element size)."""
    dtype = TORCH_DTYPES.get(info.dtype)
    return (len(info.shape) >= 2 and part.dim in (None, 0) and dtype is not None
            and info.offset % dtype.itemsize == 0)


def mapped_rows(mapped: torch.Tensor, info: TensorInfo, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a 2-D or higher tensor as a view of its mapped file: its bytes are read where the
    conversion reads them, once, with no copy in between."""
    row_bytes = info.nbytes // info.shape[0]
    start = info.offset + r0 * row_bytes
    return mapped[start: start + (r1 - r0) * row_bytes].view(TORCH_DTYPES[info.dtype]).view(r1 - r0, *info.shape[1:])


def check_tensors(cfg: ModelConfig, infos: dict[str, TensorInfo], with_mtp: bool = False) -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped tensors (MTP layers are checked
    only with_mtp, and skipped otherwise)."""
    expected = checkpoint_shapes(cfg, include_mtp=with_mtp)
    optional = optional_mtp_shapes(cfg) if with_mtp else {}
    present = {}
    unexpected = []
    for name, info in infos.items():
        if name.endswith(SCALE_SUFFIX):
            weight = infos.get(name[: -len(SCALE_SUFFIX)])
            if weight is None or weight.dtype not in FP8_DTYPES:
                unexpected.append(name)
            continue
        if (is_mtp_tensor(cfg, name) and not with_mtp) or is_vision_tensor(cfg, name):
            continue
        if name in optional:
            expected[name] = optional[name]
        present[name] = info
    missing = sorted(set(expected) - set(present))
    unexpected += sorted(set(present) - set(expected))
    unscaled = sorted(n for n, i in present.items() if i.dtype in FP8_DTYPES and n + SCALE_SUFFIX not in infos)
    misshaped = [
        f"{n}: {present[n].shape} (expected {tuple(expected[n])})"
        for n in sorted(set(expected) & set(present))
        if tuple(present[n].shape) != tuple(expected[n])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    if unscaled:
        problems.append(f"FP8 tensors without {SCALE_SUFFIX.lstrip('_')} ({len(unscaled)}): {_listing(unscaled)}")
    if misshaped:
        problems.append(f"tensors with the wrong shape ({len(misshaped)}): {_listing(misshaped)}")
    if problems:
        raise CheckpointError(
            f"checkpoint does not match config.json (indexer schedule {cfg.indexer_schedule.pattern} from "
            f"{cfg.indexer_schedule.source}): " + "; ".join(problems)
        )


def is_vision_tensor(cfg: ModelConfig, name: str) -> bool:
    """A tensor of a multimodal checkpoint's vision tower (glm5_next's `model.visual.*`): image input is not served,
    so these are skipped."""
    return cfg.hybrid is not None and name.startswith(VISION_PREFIX)


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … and {len(names) - limit} more" if len(names) > limit else "")


def _fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    qc = cfg.quantization_config or {}
    block = qc.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def mtp_extras(cfg: ModelConfig, model_dir: str) -> tuple[bool, bool]:
    """(has its own shared_head.head, has its own embed_tokens) of the checkpoint's MTP layer; raises
    CheckpointError when there is no MTP layer."""
    infos = read_tensor_infos(checkpoint_files(model_dir))
    layer = cfg.num_hidden_layers
    if cfg.num_nextn_predict_layers < 1 or not any(is_mtp_tensor(cfg, n) for n in infos):
        raise CheckpointError(
            f"{model_dir!r} has no MTP layer (no {text_prefix(cfg)}layers.{layer}.* tensors; config "
            f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}), so it cannot draft tokens; "
            "drop --speculative-config")
    optional = list(optional_mtp_shapes(cfg))
    return optional[0] in infos, optional[1] in infos


def read_part(f, name: str, info: TensorInfo, part: TensorSlice, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Only `part` of tensor `name` from an open safetensors file (its bytes, not the whole tensor); of that part,
    only rows [r0, r1) when `rows` is given."""
    if part.dim is None and (len(info.shape) < 2 or rows is None):
        return f.get_tensor(name)
    if len(info.shape) < 2:  # a 1-D tensor split by head (a KDA layer's dt_bias, A_log)
        return f.get_slice(name)[part.start : part.stop]
    index = [slice(None)] * len(info.shape)
    if part.dim is not None:
        index[part.dim] = slice(part.start, part.stop)
    if rows is not None:
        base = part.start if part.dim == 0 else 0
        index[0] = slice(base + rows[0], base + rows[1])
    return f.get_slice(name)[tuple(index)]


def part_shape(info: TensorInfo, part: TensorSlice) -> tuple[int, ...]:
    shape = list(info.shape)
    if part.dim is not None:
        shape[part.dim] = part.stop - part.start
    return tuple(shape)


def chunk_rows(columns: int, align: int) -> int:
    """Rows per chunk of a tensor with `columns` columns: as many whole `align`s as a thread's scratch holds in fp32
    copies, at least one."""
    return max(1, SCRATCH_PER_THREAD // (columns * 4 * SCRATCH_COPIES) // align) * align


def load_threads(files: int, budget: int | None) -> int:
    """Loading threads: one per file, up to the CPUs (8 at most), and no more than the scratch budget holds."""
    cpus = min(os.cpu_count() or 1, 8)
    fit = cpus if budget is None else max(1, budget // SCRATCH_PER_THREAD)
    return max(1, min(files, cpus, fit))


def load_checkpoint(model, cfg: ModelConfig, model_dir: str, progress: bool = True,
                    max_workers: int | None = None, with_mtp: bool = False, plan: ShardPlan | None = None,
                    scratch_budget: int | None = None) -> None:
    """Load every tensor of `model_dir` into `model` (via `model.weight_loader()`), a chunk of rows at a time; FP8
    tensors arrive as Fp8Slice (kept as shipped by FP8 weights, converted by others). The MTP layer's
    tensors load with_mtp (speculative decoding) and are skipped otherwise. With a tensor-parallel
    `plan`, each tensor's slice for that rank is read (distributed/sharding.py), and none of the
    tensors the rank does not hold. scratch_budget: bytes of conversion scratch for all loading threads together
    (SCRATCH_PER_THREAD each), which caps their number."""
    plan = plan or ShardPlan()
    files = checkpoint_files(model_dir)
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir!r}")
    infos = read_tensor_infos(files)
    check_tensors(cfg, infos, with_mtp)
    vision = [name for name in infos if is_vision_tensor(cfg, name)]
    if vision:
        logger.info("skipping the vision tower's %d tensors (%s*): image input is not served", len(vision),
                    VISION_PREFIX)
        infos = {name: info for name, info in infos.items() if not is_vision_tensor(cfg, name)}
    block = _fp8_block(cfg)
    by_file: dict[str, list[str]] = {}
    drafting_layer = f"{text_prefix(cfg)}layers.{cfg.num_hidden_layers}."  # further MTP layers are not used
    parts: dict[str, TensorSlice] = {}
    for name, info in infos.items():
        wanted = not is_mtp_tensor(cfg, name) or (with_mtp and name.startswith(drafting_layer))
        if wanted and not name.endswith(SCALE_SUFFIX):
            part = tensor_slice(cfg, plan, name, info.shape)
            if part is not None:
                parts[name] = part
                by_file.setdefault(info.file, []).append(name)
    load_tensor = model.weight_loader()
    for names in by_file.values():
        names.sort(key=lambda n: infos[n].offset)  # file order: each byte read once, front to back
    total = sum(infos[n].nbytes * _share(infos[n], parts[n]) for names in by_file.values() for n in names)
    bar = tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True, unit_divisor=1024,
               disable=not progress)
    head_rows = cfg.qk_nope_head_dim + cfg.v_head_dim  # kv_b_proj is split per head: its chunks hold whole heads

    def load_file(path: str) -> None:
        try:
            with safe_open(path, "pt") as f:
                mapped = map_file(path)
                for name in by_file[path]:
                    load_one(f, mapped, name, head_rows if KV_B_NAME in name else CHUNK_ALIGN)
        except SafetensorError as e:
            raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-download this file") from e

    def load_one(f, mapped: torch.Tensor, name: str, align: int) -> None:
        info, part = infos[name], parts[name]
        shape = part_shape(info, part)
        scales = None
        if info.dtype in FP8_DTYPES:  # as shipped; the target keeps it or converts it
            with safe_open(infos[name + SCALE_SUFFIX].file, "pt") as sf:
                scales = sf.get_tensor(name + SCALE_SUFFIX)
        rows = shape[0] if len(shape) >= 2 else 1
        step = chunk_rows(shape[-1], align) if len(shape) >= 2 else 1
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            if mappable(info, part):
                first = part.start if part.dim == 0 else 0
                tensor = mapped_rows(mapped, info, first + r0, first + r1)
            else:
                tensor = read_part(f, name, info, part, (r0, r1) if len(shape) >= 2 else None)
            if scales is not None:
                offset = (r0 + (part.start if part.dim == 0 else 0), part.start if part.dim == 1 else 0)
                tensor = Fp8Slice(tensor, scales, info.shape, offset, block, name)
            load_tensor(name, tensor, r0, rows)
            bar.update(tensor.weight.nbytes if scales is not None else tensor.nbytes)

    workers = max_workers or load_threads(len(files), scratch_budget)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(load_file, path) for path in files]:
            future.result()
    bar.close()
    seconds = time.perf_counter() - start
    logger.info("loaded %.2f GiB of checkpoint in %.1f s (%.0f MB/s, %d thread%s)", total / 2**30, seconds,
                total / 1e6 / max(seconds, 1e-9), workers, "" if workers == 1 else "s")


KV_B_NAME = ".kv_b_proj."  # split per head into W_UK and W_UV at load, in floats


def _share(info: TensorInfo, part: TensorSlice) -> float:
    """The fraction of a tensor's bytes that its part holds."""
    if part.dim is None or len(info.shape) <= part.dim:
        return 1.0
    return (part.stop - part.start) / info.shape[part.dim]


def fp8_params(cfg: ModelConfig, model_dir: str) -> set[str]:
    """The model parameters that receive FP8 tensors from this checkpoint (none if it is not FP8)."""
    if not cfg.fp8_checkpoint:
        return set()
    infos = read_tensor_infos(checkpoint_files(model_dir))
    def model_param(name: str) -> str:
        return (hybrid_param_of if cfg.hybrid is not None else param_of)(name, cfg.num_hidden_layers)

    return {model_param(name) for name, info in infos.items() if info.dtype in FP8_DTYPES}
