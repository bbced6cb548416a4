"""The paged KV cache tensors: per-layer latent pages and indexer key pages on full layers only.

Layout (see DESIGN.md): latent cache `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` on every
layer; indexer key cache `[num_blocks, block_size, index_head_dim]` only on full layers. Block ids are
physical and shared by all layers: block b of a request holds its tokens b*block_size … in every layer.
With speculative decoding the MTP layer (index num_hidden_layers, a full layer) has both as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.attention.context_shard import ContextShard
from dsaserve.attention.indexer_cache import IndexerKeyCache
from dsaserve.config import ModelConfig


@dataclass(frozen=True)
class KVCacheLayout:
    """Bytes one token occupies in the cache, split by part."""

    latent_bytes_per_token: int  # all layers
    indexer_bytes_per_token: int  # full layers only

    @property
    def bytes_per_token(self) -> int:
        return self.latent_bytes_per_token + self.indexer_bytes_per_token

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, indexer_dtype: str = "auto", with_indexer: bool = True,
           with_mtp: bool = False) -> "KVCacheLayout":
        item = torch.empty((), dtype=dtype).element_size()
        per_layer = IndexerKeyCache.bytes_per_token(cfg.index_head_dim, indexer_dtype, dtype)
        return cls(
            latent_bytes_per_token=len(cache_layers(cfg, with_mtp)) * cfg.kv_cache_dim * item,
            indexer_bytes_per_token=len(indexer_layers(cfg, with_mtp)) * per_layer if with_indexer else 0,
        )


class KVCache:
    """The cache tensors. Allocated once at load time; written at `slot_mapping`, read via block tables.

    Under decode context parallelism (`shard`) this rank's tensors hold `block_size` of each block's
    shard.size × block_size tokens; `self.block_size` is then the scheduler's tokens per block."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, with_indexer: bool = True, indexer_dtype: str = "auto", with_mtp: bool = False,
                 shard: ContextShard | None = None):
        self.num_blocks = num_blocks
        self.shard = shard
        self.block_size = block_size if shard is None else shard.tokens_per_block
        self.latent = [
            torch.zeros(num_blocks, block_size, cfg.kv_cache_dim, dtype=dtype, device=device)
            for _ in cache_layers(cfg, with_mtp)
        ]
        self.indexer = {
            layer: IndexerKeyCache(num_blocks, block_size, cfg.index_head_dim, indexer_dtype, dtype, device)
            for layer in (indexer_layers(cfg, with_mtp) if with_indexer else ())
        }

    def tensors(self) -> list[torch.Tensor]:
        return self.latent + [t for cache in self.indexer.values() for t in cache.tensors()]

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())


def cache_layers(cfg: ModelConfig, with_mtp: bool) -> range:
    return range(cfg.num_hidden_layers + (1 if with_mtp else 0))


def indexer_layers(cfg: ModelConfig, with_mtp: bool) -> tuple[int, ...]:
    return cfg.full_layers + ((cfg.num_hidden_layers,) if with_mtp else ())


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
