"""Joining the ranks: the rendezvous store, the process groups, and leaving them again.

Rank 0 (the driver, in the engine process) hosts a TCPStore at master_addr:master_port, or under
torchrun every rank uses the store of torchrun's agent. Phases that can fail on one rank (reading the
config, loading weights, allocating the cache) report through the store, so the driver learns which
rank failed and why instead of waiting in a collective that will never complete. The model's
collectives run on the world group (gloo on CPU, NCCL for CUDA tensors) with a timeout; the driver's
per-step messages run on a gloo group of their own whose timeout is long, because an idle server
sends none.
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import torch.distributed as dist

from dsaserve.distributed.communicator import Communicator
from dsaserve.distributed.parallel_config import ParallelConfig
from dsaserve.distributed.parallel_context import ParallelContext

STORE_TIMEOUT = timedelta(seconds=600)  # how long a rank waits to reach the rendezvous store
CONTROL_TIMEOUT = timedelta(days=30)  # how long workers wait, idle, for the driver's next message
PREFIX = "dsaserve/"
LOST_PEER = "lost a peer: "  # how a rank reports an error that another rank's failure caused


def lost_peer(error: BaseException) -> bool:
    """Whether a collective failed because another rank went away (not this rank's own fault)."""
    text = str(error)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "Timed out waiting", "NCCL communicator was aborted"))


class RankFailure(RuntimeError):
    """A rank failed or died; the message names it and the cause."""


def under_torchrun() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def connect_store(addr: str, port: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store; under torchrun its agent's store, which every rank joins as a client."""
    if under_torchrun():
        is_master = False
    try:
        return dist.TCPStore(addr, port, is_master=is_master, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        what = "host the rendezvous store on" if is_master else "reach the rendezvous store at"
        raise RankFailure(f"cannot {what} master_addr={addr} master_port={port} ({e}); check the address and that "
                          "the port is free on node 0 and open to the other nodes") from e


def report(store, phase: str, rank: int, error: str | None = None) -> None:
    store.set(f"{PREFIX}{phase}/{rank}", "ok" if error is None else "error:" + error)


def publish(store, key: str, value) -> None:
    store.set(PREFIX + key, pickle.dumps(value))


def fetch(store, key: str):
    return pickle.loads(store.get(PREFIX + key))


def reported_error(store, rank: int) -> str | None:
    """What rank `rank` reported when it failed (in any phase or step), if anything."""
    for phase in ("error", "hello", "loaded", "ready"):
        key = f"{PREFIX}{phase}/{rank}"
        if store.check([key]):
            value = store.get(key).decode()
            if value.startswith("error:"):
                return value.removeprefix("error:")
    return None


def wait_for_ranks(store, phase: str, ranks, dead=lambda: None, timeout: float | None = None) -> None:
    """Until every rank in `ranks` reported `phase`; raises RankFailure naming the first failed one.
    `dead()` returns the cause when a rank's process is known to have ended."""
    keys = {rank: f"{PREFIX}{phase}/{rank}" for rank in ranks}
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(keys)
    while pending:
        for rank, key in list(pending.items()):
            if store.check([key]):
                value = store.get(key).decode()
                if value.startswith("error:"):
                    raise RankFailure(f"rank {rank} failed ({phase}): {value.removeprefix('error:')}")
                del pending[rank]
        if not pending:
            return
        cause = dead()
        if cause:
            raise RankFailure(cause)
        if deadline is not None and time.monotonic() > deadline:
            raise RankFailure(f"rank(s) {sorted(pending)} did not report '{phase}' within {timeout:g}s "
                              "(started? same --master-addr/--master-port on every node?)")
        time.sleep(0.05)


def join(store, rank: int, config: ParallelConfig, device_type: str) -> tuple[ParallelContext, Communicator]:
    """Create the process groups; returns this rank's ParallelContext and the driver's message channel."""
    world = config.world_size
    backend = "gloo" if device_type == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, store=dist.PrefixStore(PREFIX + "pg/", store), rank=rank, world_size=world,
                            timeout=config.collective_timeout)
    everyone = tuple(range(world))
    control = dist.new_group(list(everyone), backend="gloo", timeout=CONTROL_TIMEOUT)
    dcp_size = config.decode_context_parallel_size
    dcp = Communicator.single()
    if dcp_size > 1:
        for first in range(0, world, dcp_size):  # every rank creates every group, in the same order
            ranks = tuple(config.dcp_group_of(first))
            group = dist.new_group(list(ranks))
            if rank in ranks:
                dcp = Communicator(group, ranks, ranks.index(rank))
    parallel = ParallelContext(Communicator(None, everyone, rank), dcp, config.enable_expert_parallel,
                               config.check_ranks)
    return parallel, Communicator(control, everyone, rank)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
