"""The indexer's paged key cache (full layers only), plain or quantized.

`int8`: one int8 per dimension plus one fp16 scale per token (amax / 127). `fp8`: float8 e4m3 plus one
fp32 scale per token (amax / 448). `model`: the model dtype. The engine option `indexer_cache_dtype` auto
resolves to int8 for FP8 weights and to `model` otherwise (indexer_key_kind). Scoring
(attention/indexer_selection.py) reads whole blocks and dequantizes only those, tile by tile. The engine
allocates one per full layer (engine/workers/kv_cache.py); the model only hands it through to the scoring.

`packed` (bf16 keys where the native scoring kernel runs): each block holds its keys in the layout that
kernel reads, 16 keys at a time as pairs of columns (`groups[block][g][p][lane]` is key 16g + lane's
columns 2p, 2p + 1, as int32), so a decode step scores them in place instead of gathering and repacking
every visible key in every full layer (native/index_scores.cpp). Same bytes per token, same values.
`packed` int8 keys (where the CPU has AVX-512 VNNI) are kept for the int8 kernel (native/index_scores_int8.cpp):
`int8_groups[block][g][p][lane]` holds key 16g + lane's dims 4p .. 4p+3 as bytes value + 128; the scales stay
one per token. Same bytes per token, same values.
"""

from __future__ import annotations

import torch

from dsaserve import triton_ops
from dsaserve.native import torch_ops

INDEXER_CACHE_DTYPES = ("auto", "model", "int8", "fp8")  # what a user may ask for
KEY_KINDS = ("model", "int8", "fp8")  # what a cache holds: auto resolved
_FP8_MAX = 448.0


def indexer_key_kind(choice: str, fp8_weights: bool) -> str:
    """The key kind `indexer_cache_dtype` asks for. auto: 8-bit keys (int8) where the weights are FP8, as
    DeepSeek-V3.2's and GLM-5's FP8 releases are served (their indexers keep FP8 keys with a scale per 128
    values; int8 with one per key here), the model dtype otherwise."""
    if choice not in INDEXER_CACHE_DTYPES:
        raise ValueError(f"indexer_cache_dtype={choice!r} is not supported; "
                         f"use one of {', '.join(INDEXER_CACHE_DTYPES)}")
    if choice == "auto":
        return "int8" if fp8_weights else "model"
    return choice


def describe_indexer_keys(kind: str, choice: str, dtype: torch.dtype) -> str:
    """The startup log's line: what the indexer key cache holds and why."""
    what = {"model": str(dtype).removeprefix("torch."), "int8": "int8 + an fp16 scale per key",
            "fp8": "fp8 e4m3 + an fp32 scale per key"}[kind]
    if choice == "auto" and kind == "int8":
        return f"{what} (indexer_cache_dtype auto with FP8 weights; 'model' keeps them in the model dtype)"
    return f"{what} (indexer_cache_dtype {choice})"


class IndexerKeyCache:
    def __init__(self, num_blocks: int, block_size: int, dim: int, kind: str, dtype: torch.dtype,
                 device: torch.device, packed: bool = False):
        if kind not in KEY_KINDS:
            raise ValueError(f"indexer key kind {kind!r} is not one of {', '.join(KEY_KINDS)} "
                             "(indexer_key_kind resolves indexer_cache_dtype auto)")
        if packed and not can_pack(kind, dtype, block_size, dim):
            raise ValueError(f"a packed indexer key cache holds bf16 keys with an even dim or int8 keys with a dim in "
                             f"4s (indexer_cache_dtype 'model' or 'int8' in a bf16 model), in blocks of a multiple of "
                             f"16 tokens; got {kind!r}, {dtype}, block_size {block_size}, dim {dim}")
        self.kind = kind
        self.dim = dim
        self.block_size = block_size
        self.compute_dtype = dtype
        storage = {"model": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kind]
        self.data = torch.zeros(num_blocks, block_size, dim, dtype=storage, device=device)
        self.packed = packed and kind == "model"  # bf16 keys in the bf16 kernel's layout (`groups`)
        # The same bytes as [num_blocks, groups of 16 keys, column pairs, 16 keys] (int32: a pair of bf16 columns).
        self.groups = (self.data.view(torch.int32).view(num_blocks, block_size // 16, dim // 2, 16)
                       if self.packed else None)
        # int8 keys in the int8 kernel's layout: [num_blocks, groups of 16 keys, dims in 4s, 16 keys] (int32: 4 bytes).
        self.int8_groups = (self.data.view(torch.int32).view(num_blocks, block_size // 16, dim // 4, 16)
                            if packed and kind == "int8" else None)
        self.scale = None
        if kind != "model":
            scale_dtype = torch.float16 if kind == "int8" else torch.float32
            self.scale = torch.zeros(num_blocks, block_size, dtype=scale_dtype, device=device)

    @staticmethod
    def bytes_per_token(dim: int, kind: str, dtype: torch.dtype) -> int:
        if kind == "int8":
            return dim + 2
        if kind == "fp8":
            return dim + 4
        return dim * torch.empty((), dtype=dtype).element_size()

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] + ([self.scale] if self.scale is not None else [])

    def write(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [n, dim] at physical slots [n]: only those rows are touched."""
        if not self.packed and triton_ops.runs_on(keys):  # one kernel, quantizing on the way (the CUDA path)
            from dsaserve.triton_ops.cache_write import write_rows

            write_rows(self.data.view(-1, self.dim), None if self.scale is None else self.scale.view(-1), slots, keys)
            return
        if self.packed:
            keys = keys.to(self.data.dtype).contiguous()
            if keys.is_cpu and torch_ops.load():  # one call (the indexing below is a handful of operators)
                torch.ops.dsaserve.write_packed_keys.default(self.groups, slots.to(torch.int64).contiguous(), keys)
                return
            offsets = slots % self.block_size
            self.groups[slots // self.block_size, offsets // 16, :, offsets % 16] = keys.view(torch.int32)
            return
        rows = self.data.view(-1, self.dim)
        if self.kind == "model":
            rows.index_copy_(0, slots, keys.to(self.data.dtype))
            return
        if (self.int8_groups is not None and keys.is_cpu and keys.dtype in (torch.bfloat16, torch.float32)
                and torch_ops.load()):  # the rounding below, in one call
            torch.ops.dsaserve.write_int8_keys.default(self.int8_groups, self.scale, slots.to(torch.int64).contiguous(),
                                                       keys.contiguous())
            return
        keys = keys.float()
        top = 127.0 if self.kind == "int8" else _FP8_MAX
        scale = keys.abs().amax(dim=-1).clamp(min=1e-8) / top
        quantized = keys / scale[:, None]
        if self.int8_groups is not None:
            offsets = slots % self.block_size
            as_bytes = self._int8_bytes()
            as_bytes[slots // self.block_size, offsets // 16, :, offsets % 16] = (
                quantized.round().clamp(-127, 127) + 128).to(torch.uint8).view(-1, self.dim // 4, 4)
        elif self.kind == "int8":
            rows.index_copy_(0, slots, quantized.round().clamp(-127, 127).to(torch.int8))
        else:  # CPU has no fp8 index_copy: move the bytes
            rows.view(torch.uint8).index_copy_(0, slots, quantized.to(torch.float8_e4m3fn).view(torch.uint8))
        self.scale.view(-1).index_copy_(0, slots, scale.to(self.scale.dtype))

    def read_blocks(self, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys of whole blocks [len(blocks) * block_size, dim], dequantized, in `dtype`."""
        if self.packed:  # back to one key per row
            groups = torch.index_select(self.groups, 0, blocks)  # [n, block_size / 16, dim / 2, 16]
            return groups.transpose(2, 3).contiguous().view(self.data.dtype).reshape(-1, self.dim).to(dtype)
        if self.kind == "model":
            return torch.index_select(self.data, 0, blocks).reshape(-1, self.dim).to(dtype)
        if self.int8_groups is not None:  # back to one key per row, bytes back to values
            groups = torch.index_select(self._int8_bytes(), 0, blocks)  # [n, block_size / 16, dim / 4, 16, 4]
            data = groups.transpose(2, 3).reshape(-1, self.dim).to(torch.int16) - 128
        elif self.kind == "fp8":  # CPU has no fp8 index_select: move the bytes
            data = torch.index_select(self.data.view(torch.uint8), 0, blocks).view(torch.float8_e4m3fn)
        else:
            data = torch.index_select(self.data, 0, blocks)
        scale = torch.index_select(self.scale, 0, blocks).reshape(-1, 1).to(torch.float32)
        return (data.reshape(-1, self.dim).to(torch.float32) * scale).to(dtype)

    def _int8_bytes(self) -> torch.Tensor:
        """The int8 layout's bytes: [num_blocks, block_size / 16, dim / 4, 16 keys, 4 dims]."""
        return self.data.view(torch.uint8).view(self.data.shape[0], self.block_size // 16, self.dim // 4, 16, 4)


def can_pack(kind: str, dtype: torch.dtype, block_size: int, dim: int) -> bool:
    """Whether a key cache of this kind can be kept packed for a native scoring kernel (bf16 keys for the bf16
    kernel, in bf16 models; int8 keys for the int8 one, in bf16 or fp32 models)."""
    if block_size % 16:
        return False
    return ((kind == "model" and dtype == torch.bfloat16 and dim % 2 == 0)
            or (kind == "int8" and dtype in (torch.bfloat16, torch.float32) and dim % 4 == 0))
