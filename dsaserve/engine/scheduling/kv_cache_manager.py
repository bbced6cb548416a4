"""KV block allocation with reference counts and prefix caching.

A full block is identified by its content and everything before it: key = sha256(parent block's key
+ its token ids). A cryptographic digest, so no request can be made to adopt blocks computed under a
different prefix by a colliding hash. A new request reuses the cached blocks of its longest cached prefix (latent and
indexer caches alike, since block ids are shared by every layer) and computes only the rest.
Blocks nobody references stay cached in a free queue and are evicted least-recently-freed first
when a fresh block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from dsaserve.engine.scheduling.request import Request
from dsaserve.engine.workers.kv_cache import blocks_needed

ROOT_KEY = b""  # parent of a request's first block


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full block: chained through the parent so equal blocks at
    different prefixes never share."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 share_samples: bool = True):
        """share_samples: with caching off, the samples of one request still share their prompt's blocks (not where
        a request's state lives beside its blocks, as a hybrid model's KDA state does)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_samples = share_samples
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        # Unreferenced blocks, evicted from the front. Cached ones keep their key until evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- prefix cache ----------------------------------------------------------------------------

    def keys_upto(self, request: Request, num_tokens: int) -> list[bytes]:
        """The request's block keys, made to cover every full block among its first num_tokens tokens."""
        self._update_keys(request, num_tokens)
        return request.block_keys

    def _update_keys(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_keys to cover every full block among its first num_tokens tokens."""
        bs = self.block_size
        while len(request.block_keys) < num_tokens // bs:
            i = len(request.block_keys)
            parent = request.block_keys[-1] if request.block_keys else ROOT_KEY
            request.block_keys.append(block_key(parent, request.token_ids(i * bs, (i + 1) * bs)))

    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix. The last token is always left to compute: its
        logits are needed, and recomputing it must not write into a shared block."""
        if not self._shares(request) or request.want_prompt_logprobs:
            return []  # prompt logprobs need every prompt position computed
        self._update_keys(request, request.num_tokens)
        usable = (request.num_tokens - 1) // self.block_size
        blocks = []
        for key in request.block_keys[:usable]:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_admission(self, request: Request, hit_tokens: int) -> None:
        if self.enable_prefix_caching and request.index == 0:  # samples 1…n-1 are not client lookups
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks so later requests can reuse them."""
        if not self._shares(request):
            return
        self._update_keys(request, request.num_computed_tokens)
        for i in range(request.num_cached_blocks, request.num_computed_tokens // self.block_size):
            block, key = request.block_table[i], request.block_keys[i]
            if key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key
        request.num_cached_blocks = request.num_computed_tokens // self.block_size

    def _shares(self, request: Request) -> bool:
        """Whether the request takes part in the prefix cache. With caching off, the samples of one
        request still share their prompt's full blocks (sample 0 registers them, the others look them up)."""
        return self.enable_prefix_caching or (request.shares_prompt and self.share_samples)

    # ---- allocation ------------------------------------------------------------------------------

    def allocate(self, request: Request, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Make request.block_table cover num_tokens tokens, first adopting `prefix` blocks.
        Returns False (changing nothing) when there are not enough free blocks."""
        fresh = blocks_needed(num_tokens, self.block_size) - len(request.block_table) - len(prefix)
        taken_from_free = sum(1 for b in prefix if self.ref_counts[b] == 0)
        if fresh > self.num_free_blocks - taken_from_free:
            return False
        for block in prefix:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        if prefix:  # adopted blocks are registered already; blocks taken in earlier steps may not be
            request.block_table.extend(prefix)
            request.num_cached_blocks = len(request.block_table)
        for _ in range(max(fresh, 0)):
            request.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:  # evict its cached content
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_keys[block] = None
        self.ref_counts[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Drop the request's references. Uncached blocks go to the front of the queue (reused first);
        cached ones to the back, tail blocks before head blocks, so shared prefixes live longest."""
        for block in reversed(request.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_keys[block] is None:
                    self.free_queue.move_to_end(block, last=False)
        request.block_table = []
        request.num_cached_blocks = 0
