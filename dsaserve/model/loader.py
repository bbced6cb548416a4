"""Load safetensors checkpoints (single file or sharded) strictly, in parallel, with FP8 dequantization;
under tensor parallelism each rank reads only its slices.

Strict means: the set of tensors must equal the layout derived from the config (indexer weights on
every full layer and on no shared layer, per-expert MoE tensors; the MTP layers are skipped),
shapes must match, and a truncated or corrupt file is reported by name.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dsaserve.config import CheckpointError, ModelConfig
from dsaserve.distributed.sharding import ShardPlan, TensorSlice, tensor_slice
from dsaserve.model.checkpoint_layout import checkpoint_shapes, is_mtp_tensor, optional_mtp_shapes
from dsaserve.model.glm_moe_dsa import param_of
from dsaserve.quantization.fp8_blocks import Fp8Slice, dequantize_fp8  # noqa: F401 (dequantize_fp8: the loader's rule)

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # `X.weight_scale_inv` holds the block scales of an FP8 `X.weight`
FP8_DTYPES = ("F8_E4M3",)


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype string, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


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
    """Names, dtypes and shapes from the file headers, without reading tensor data."""
    infos: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    if name in infos:
                        raise CheckpointError(f"tensor {name!r} is stored twice: in {infos[name].file} and {path}")
                    piece = f.get_slice(name)
                    infos[name] = TensorInfo(path, piece.get_dtype(), tuple(piece.get_shape()))
        except SafetensorError as e:
            raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-download this file") from e
    return infos


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
        if is_mtp_tensor(cfg, name) and not with_mtp:
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
            f"{model_dir!r} has no MTP layer (no model.layers.{layer}.* tensors; config num_nextn_predict_layers="
            f"{cfg.num_nextn_predict_layers}), so it cannot draft tokens; drop --speculative-config")
    optional = list(optional_mtp_shapes(cfg))
    return optional[0] in infos, optional[1] in infos


def read_part(f, name: str, info: TensorInfo, part: TensorSlice) -> torch.Tensor:
    """Only `part` of tensor `name` from an open safetensors file (its bytes, not the whole tensor)."""
    if part.dim is None:
        return f.get_tensor(name)
    index = [slice(None)] * len(info.shape)
    index[part.dim] = slice(part.start, part.stop)
    return f.get_slice(name)[tuple(index)]


def load_checkpoint(model, cfg: ModelConfig, model_dir: str, progress: bool = True,
                    max_workers: int | None = None, with_mtp: bool = False, plan: ShardPlan | None = None) -> None:
    """Load every tensor of `model_dir` into `model` (via `model.weight_loader()`); FP8 tensors arrive
    as Fp8Slice (kept as shipped by FP8 weights, dequantized by others). The MTP layer's
    tensors load with_mtp (speculative decoding) and are skipped otherwise. With a tensor-parallel
    `plan`, each tensor's slice for that rank is read (distributed/sharding.py), and none of the
    tensors the rank does not hold."""
    plan = plan or ShardPlan()
    files = checkpoint_files(model_dir)
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir!r}")
    infos = read_tensor_infos(files)
    check_tensors(cfg, infos, with_mtp)
    block = _fp8_block(cfg)
    by_file: dict[str, list[str]] = {}
    drafting_layer = f"model.layers.{cfg.num_hidden_layers}."  # further MTP layers are not used
    parts: dict[str, TensorSlice] = {}
    for name, info in infos.items():
        wanted = not is_mtp_tensor(cfg, name) or (with_mtp and name.startswith(drafting_layer))
        if wanted and not name.endswith(SCALE_SUFFIX):
            part = tensor_slice(cfg, plan, name, info.shape)
            if part is not None:
                parts[name] = part
                by_file.setdefault(info.file, []).append(name)
    load_tensor = model.weight_loader()
    total = sum(len(v) for v in by_file.values())
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)

    def load_file(path: str) -> None:
        try:
            with safe_open(path, "pt") as f:
                for name in by_file[path]:
                    part = parts[name]
                    tensor = read_part(f, name, infos[name], part)
                    if infos[name].dtype in FP8_DTYPES:  # as shipped; the target keeps it or dequantizes it
                        scale_name = name + SCALE_SUFFIX
                        offset = tuple(part.start if part.dim == d else 0 for d in (0, 1))
                        with safe_open(infos[scale_name].file, "pt") as sf:
                            tensor = Fp8Slice(tensor, sf.get_tensor(scale_name), infos[name].shape, offset, block, name)
                    load_tensor(name, tensor)
                    bar.update(1)
        except SafetensorError as e:
            raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-download this file") from e

    workers = max_workers or min(len(files), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(load_file, path) for path in files]:
            future.result()
    bar.close()


def fp8_params(cfg: ModelConfig, model_dir: str) -> set[str]:
    """The model parameters that receive FP8 tensors from this checkpoint (none if it is not FP8)."""
    if (cfg.quantization_config or {}).get("quant_method") != "fp8":
        return set()
    infos = read_tensor_infos(checkpoint_files(model_dir))
    return {param_of(name, cfg.num_hidden_layers) for name, info in infos.items() if info.dtype in FP8_DTYPES}
