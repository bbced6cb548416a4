"""Prefix caching for a hybrid model (glm5_next): snapshots of the KDA state at prefix positions.

A KDA layer's state after a prefix cannot be rebuilt from the prefix's cached KV blocks, so a prefix-cache hit is
usable only where the state after it was kept too. While a request is computed, its state is copied into a snapshot
slot every `interval` tokens (a multiple of the block size), keyed by the prefix-cache key of the block ending there
(which names the whole prefix). A later request resumes from the longest cached prefix that ends at a snapshot:
its state slot is filled from the snapshot, and only the rest is computed.

Slots are a fixed pool (allocated with the cache, counted in kv_cache_memory); the least recently used ready
snapshot is overwritten when none is free. A snapshot becomes usable only after the step that computed it
succeeded, and a slot some request restores from in the coming step is never overwritten by that step.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, num_slots: int, interval: int, block_size: int):
        if interval % block_size:
            raise ValueError(f"state_snapshot_interval={interval} must be a multiple of block_size={block_size}")
        self.interval, self.block_size = interval, block_size
        self.ready: OrderedDict[bytes, int] = OrderedDict()  # key → slot, least recently used first
        self.pending: dict[str, list[tuple[bytes, int]]] = {}  # request → snapshots its running step writes
        self.free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    def lookup(self, keys: list[bytes], num_blocks: int) -> tuple[int, int]:
        """(blocks, slot) of the longest prefix of at most num_blocks blocks that ends at a ready snapshot; (0, -1)
        when none does."""
        per = self.interval // self.block_size
        for blocks in range(num_blocks - num_blocks % per, 0, -per):
            slot = self.ready.get(keys[blocks - 1])
            if slot is not None:
                self.ready.move_to_end(keys[blocks - 1])
                return blocks, slot
        return 0, -1

    def plan(self, request_id: str, keys: list[bytes], start: int, end: int, keep: set[int]
             ) -> tuple[tuple[int, int], ...]:
        """The snapshots the step computing positions [start, end) of a request takes: (position, slot) for each
        multiple of the interval in (start, end] not yet kept; `keep`: slots this step restores from."""
        taken = []
        first = (start // self.interval + 1) * self.interval
        for position in range(first, end + 1, self.interval):
            key = keys[position // self.block_size - 1]
            if key in self.ready or any(key == k for plans in self.pending.values() for k, _ in plans):
                continue
            slot = self._take(keep)
            if slot is None:
                break
            taken.append((position, slot))
            self.pending.setdefault(request_id, []).append((key, slot))
        return tuple(taken)

    def commit(self, request_id: str, ok: bool) -> None:
        """After the step: its snapshots become usable (ok) or their slots free again."""
        for key, slot in self.pending.pop(request_id, ()):
            if ok:
                self.ready[key] = slot
            else:
                self.free.append(slot)

    def _take(self, keep: set[int]) -> int | None:
        if self.free:
            return self.free.pop()
        for key, slot in self.ready.items():  # least recently used first
            if slot not in keep:
                del self.ready[key]
                return slot
        return None
