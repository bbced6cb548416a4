"""The KDA state slots of a hybrid model (glm5_next): one per running request.

A request takes a slot when it is admitted and gives it back when it finishes, is aborted or preempted. There are
max_num_seqs slots, allocated with the cache at load time (and counted in kv_cache_memory), so admitting a request
never overcommits state memory: the limit on running requests is the limit on slots.
"""

from __future__ import annotations

from dsaserve.engine.scheduling.request import Request


class StateSlots:
    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self, request: Request) -> None:
        if request.state_slot < 0:
            if not self.free:
                raise RuntimeError("no KDA state slot is free although fewer than max_num_seqs requests run")
            request.state_slot = self.free.pop()

    def give_back(self, request: Request) -> None:
        if request.state_slot >= 0:
            self.free.append(request.state_slot)
            request.state_slot = -1
