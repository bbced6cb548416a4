"""How many KV blocks to allocate, and the max_model_len that fits them: decided once at load time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dsaserve.byte_sizes import human
from dsaserve.engine.workers.kv_cache import KVCacheLayout, blocks_needed

logger = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, when the caller does not say
# Without kv_cache_memory a hybrid model's KDA states take at most this share of the memory available once the
# weights are loaded (GLM-5.3-Flash's 256 requests and 256 snapshots would otherwise ask for about 74 GB).
DEFAULT_STATE_SHARE = 0.25


@dataclass(frozen=True)
class StateCounts:
    """How many KDA states a hybrid model keeps: one per running request (so also max_num_seqs) and the prefix
    cache's snapshots."""

    slots: int
    snapshots: int


def plan_state_counts(layout: KVCacheLayout, memory: int | None, max_num_seqs: int, state_snapshots: int,
                      draft_states: int, available: int | None) -> StateCounts:
    """With kv_cache_memory given, the states asked for (plan_num_blocks checks they fit). Without it, as many as
    fit in DEFAULT_STATE_SHARE of `available` bytes: max_num_seqs and state_snapshots are lowered together, keeping
    their ratio, and the log says so."""
    asked = StateCounts(max_num_seqs, state_snapshots)
    per = layout.state_bytes_per_request
    if not per or memory is not None or available is None:
        return asked
    budget = int(available * DEFAULT_STATE_SHARE)
    per_slot = 1 + draft_states + state_snapshots / max_num_seqs  # states each running request brings
    if per * (max_num_seqs * (1 + draft_states) + state_snapshots) <= budget:
        return asked
    fit = budget // per
    slots = min(max_num_seqs, int(fit // per_slot))
    if slots < 1:
        raise ValueError(f"one request's KDA state ({human(per)}, × {1 + draft_states} with its drafts) does not fit "
                         f"in {DEFAULT_STATE_SHARE:.0%} of the {human(available)} available; set kv_cache_memory to "
                         "the memory the cache may take")
    counts = StateCounts(slots, min(state_snapshots, fit - slots * (1 + draft_states)))
    logger.warning("KDA states of %s each: max_num_seqs lowered from %d to %d and state_snapshots from %d to %d, "
                   "what fits in %.0f%% of the %s available; set kv_cache_memory for more", human(per),
                   max_num_seqs, counts.slots, state_snapshots, counts.snapshots, DEFAULT_STATE_SHARE * 100,
                   human(available))
    return counts


def plan_num_blocks(layout: KVCacheLayout, block_size: int, memory: int | None, max_model_len: int,
                    max_num_seqs: int, tokens_per_block: int | None = None, state_snapshots: int = 0,
                    draft_states: int = 0) -> int:
    """Blocks of `block_size` stored tokens each in `memory` bytes (per rank); a block holds
    `tokens_per_block` tokens of a request (more than it stores under decode context parallelism). A hybrid model's
    KDA states (per running request its own and, speculating, one per draft; plus state_snapshots) come out of
    `memory` first."""
    per_block = layout.bytes_per_token * block_size
    if memory is not None and layout.state_bytes_per_request:
        state = layout.state_bytes_per_request * (max_num_seqs * (1 + draft_states) + state_snapshots)
        if memory - state < per_block:
            drafts = f" with {draft_states} draft state(s) each (num_speculative_tokens)" if draft_states else ""
            raise ValueError(f"kv_cache_memory={memory} bytes does not hold the KDA state of "
                             f"max_num_seqs={max_num_seqs} requests{drafts} and state_snapshots={state_snapshots} "
                             f"({layout.state_bytes_per_request} bytes each) and one KV block ({per_block} bytes); "
                             "raise kv_cache_memory or lower max_num_seqs or state_snapshots")
        memory -= state
    if memory is None:
        wanted = blocks_needed(max_model_len, tokens_per_block or block_size) * max_num_seqs
        return max(1, min(wanted, DEFAULT_KV_CACHE_MEMORY // per_block))
    if memory < per_block:
        raise ValueError(f"kv_cache_memory={memory} bytes is smaller than one KV block ({per_block} bytes)")
    return memory // per_block


def fit_max_model_len(max_model_len: int, capacity: int, bytes_per_token: float, explicit: bool) -> int:
    """One sequence of max_model_len tokens must fit in the cache, or no long request could ever run."""
    if max_model_len <= capacity:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len={max_model_len} needs {max_model_len} tokens of KV cache but the cache holds {capacity} "
            f"({bytes_per_token:g} bytes per token per rank); raise kv_cache_memory or lower max_model_len"
        )
    logger.info("max_model_len lowered from %d to %d, what the KV cache holds (set kv_cache_memory for more)",
                max_model_len, capacity)
    return capacity


def requested_max_model_len(requested: int | None, cfg) -> int:
    """The max_model_len asked for (the model's max_position_embeddings by default), checked against it."""
    max_model_len = requested or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}; lower it")
    return max_model_len
