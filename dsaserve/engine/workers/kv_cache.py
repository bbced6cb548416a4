"""The paged KV cache tensors: per-layer latent pages and indexer key pages on full layers only.

Layout (see DESIGN.md): latent cache `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` on every
layer; indexer key cache `[num_blocks, block_size, index_head_dim]` only on full layers. Block ids are
physical and shared by all layers: block b of a request holds its tokens b*block_size … in every layer.
With speculative decoding the MTP layer (index num_hidden_layers, a full layer) has both as well.

A hybrid model (glm5_next) has latent pages on its indexed-attention layers only; each KDA layer has a
LinearStateCache instead (a fixed-size state per request slot, one slot per running request), and the full layers'
indexer cache is the pooled one (attention/pooled_keys.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve import triton_ops
from dsaserve.attention.context_shard import ContextShard
from dsaserve.attention.indexer_cache import IndexerKeyCache, can_pack
from dsaserve.attention.linear_state import LinearStateCache
from dsaserve.attention.pooled_keys import PooledKeyCache
from dsaserve.config import ModelConfig
from dsaserve.native import index_scores


@dataclass(frozen=True)
class KVCacheLayout:
    """Bytes one token occupies in the cache, split by part."""

    latent_bytes_per_token: int  # all (attention) layers
    indexer_bytes_per_token: int  # full layers only
    state_bytes_per_request: int = 0  # a hybrid model's KDA layers: per running request, whatever its length

    @property
    def bytes_per_token(self) -> int:
        return self.latent_bytes_per_token + self.indexer_bytes_per_token

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, indexer_dtype: str = "model", with_indexer: bool = True,
           with_mtp: bool = False, tp_size: int = 1) -> "KVCacheLayout":
        """tp_size: a rank's share of a hybrid model's KDA state (its heads); the latent cache is every rank's."""
        item = torch.empty((), dtype=dtype).element_size()
        if cfg.hybrid is not None:
            per_layer = PooledKeyCache.bytes_per_token(cfg.index_head_dim, cfg.hybrid.index_kpool, dtype)
        else:
            per_layer = IndexerKeyCache.bytes_per_token(cfg.index_head_dim, indexer_dtype, dtype)
        attending = [i for i in cache_layers(cfg, with_mtp) if cfg.is_attention(i)]
        return cls(
            latent_bytes_per_token=len(attending) * cfg.kv_cache_dim * item,
            indexer_bytes_per_token=len(indexer_layers(cfg, with_mtp)) * per_layer if with_indexer else 0,
            state_bytes_per_request=cfg.hybrid.state_bytes_per_request() // tp_size if cfg.hybrid is not None else 0,
        )


class KVCache:
    """The cache tensors. Allocated once at load time; written at `slot_mapping`, read via block tables.

    Under decode context parallelism (`shard`) this rank's tensors hold `block_size` of each block's
    shard.size × block_size tokens; `self.block_size` is then the scheduler's tokens per block."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, with_indexer: bool = True, indexer_dtype: str = "model", with_mtp: bool = False,
                 shard: ContextShard | None = None, state_slots: int = 0, state_snapshots: int = 0,
                 tp_size: int = 1, draft_states: int = 0):
        """state_slots: requests a hybrid model's KDA layers hold state for (the running ones, max_num_seqs);
        state_snapshots: copies of it kept at prefix positions for prefix caching; draft_states: per state slot,
        copies kept after each draft's row while speculating (after the prefix snapshots in the same tensors)."""
        self.num_blocks, self.device = num_blocks, device
        self.state_snapshots, self.draft_states = state_snapshots, draft_states
        self.shard = shard
        self.block_size = block_size if shard is None else shard.tokens_per_block
        # Layer i's cache: latent pages, or a KDA layer's state slots.
        self.latent = [
            torch.zeros(num_blocks, block_size, cfg.kv_cache_dim, dtype=dtype, device=device) if cfg.is_attention(i)
            else LinearStateCache(cfg.hybrid, state_slots, device, state_snapshots + state_slots * draft_states,
                                  tp_size)
            for i in cache_layers(cfg, with_mtp)
        ]
        if cfg.hybrid is not None:
            self.indexer = {layer: PooledKeyCache(num_blocks, block_size, cfg.index_head_dim, cfg.hybrid.index_kpool,
                                                  dtype, device)
                            for layer in (indexer_layers(cfg, with_mtp) if with_indexer else ())}
            return
        packed = packs_indexer_keys(cfg, block_size, dtype, device, indexer_dtype)
        self.indexer = {
            layer: IndexerKeyCache(num_blocks, block_size, cfg.index_head_dim, indexer_dtype, dtype, device, packed)
            for layer in (indexer_layers(cfg, with_mtp) if with_indexer else ())
        }

    def draft_snapshot(self, slot: int, draft: int) -> int:
        """The snapshot holding a request's KDA state after the row of its draft `draft` (0-based)."""
        return self.state_snapshots + slot * self.draft_states + draft

    def roll_back_state(self, slot: int, accepted: int) -> None:
        """After verification kept `accepted` of a request's drafts (fewer than it ran): every KDA layer's state
        becomes the one after the last accepted draft's row."""
        for cache in self.latent:
            if isinstance(cache, LinearStateCache):
                cache.restore(slot, self.draft_snapshot(slot, accepted))

    def tensors(self) -> list[torch.Tensor]:
        layers = [t for cache in self.latent for t in ([cache] if isinstance(cache, torch.Tensor) else cache.tensors())]
        return layers + [t for cache in self.indexer.values() for t in cache.tensors()]

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())


def packs_indexer_keys(cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                       indexer_dtype: str) -> bool:
    """Whether the indexer key caches are kept in a native scoring kernel's layout: where that kernel scores
    this model's indexer (bf16 keys of bf16 models; int8 keys of bf16 or fp32 models) and the cache holds plain
    bf16 keys or int8 ones."""
    fits = index_scores.fits_int8 if indexer_dtype == "int8" else index_scores.fits
    return (device.type == "cpu" and triton_ops.active_device() is None
            and can_pack(indexer_dtype, dtype, block_size, cfg.index_head_dim)
            and fits(cfg.index_n_heads, cfg.index_head_dim))


def cache_layers(cfg: ModelConfig, with_mtp: bool) -> range:
    return range(cfg.num_hidden_layers + (1 if with_mtp else 0))


def indexer_layers(cfg: ModelConfig, with_mtp: bool) -> tuple[int, ...]:
    return cfg.full_layers + ((cfg.num_hidden_layers,) if with_mtp else ())


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
