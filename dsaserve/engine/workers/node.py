"""Launching ranks on a node other than the driver's, and finding this process's rank under torchrun.

`dsaserve worker [MODEL] --tensor-parallel-size N --nnodes M --node-rank K --master-addr A --master-port P`
starts the N/M worker processes of node K (one per device) and waits for them. A rank that dies is
reported to the driver through the rendezvous store, so the server fails naming it instead of waiting.
Under torchrun every process is one rank: rank 0 serves, the others become workers.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from dsaserve.distributed import process_group as pg
from dsaserve.distributed.parallel_config import ParallelConfig
from dsaserve.engine.workers.executor import how_it_ended, start_workers

logger = logging.getLogger(__name__)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, local rank) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))


def torchrun_overrides() -> dict:
    """Engine arguments fixed by torchrun's environment (world size, nodes, where the ranks meet)."""
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {"tensor_parallel_size": world, "nnodes": world // per_node,
            "node_rank": int(os.environ.get("GROUP_RANK", 0)),
            "master_addr": os.environ["MASTER_ADDR"], "master_port": int(os.environ["MASTER_PORT"])}


def run_node(parallel: ParallelConfig, model: str | None = None) -> int:
    """Start this node's ranks and wait for them; 0 when every one exited cleanly."""
    if parallel.node_rank == 0:
        raise ValueError("node 0 runs the server (`dsaserve serve ... --node-rank 0`); "
                         "give workers --node-rank 1 or more")
    ranks = parallel.node_ranks()
    processes = start_workers(ranks, parallel.master_addr, parallel.master_port, parallel.ranks_per_node, model,
                              world_size=parallel.world_size)
    logger.info("node %d: ranks %d-%d started", parallel.node_rank, ranks[0], ranks[-1])
    store = None
    reported: set[int] = set()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when the ranks stop
    while any(p.poll() is None for p in processes.values()) and not stop:
        for rank, proc in processes.items():
            if rank in reported or proc.poll() in (None, 0):
                continue
            reported.add(rank)
            try:
                store = store or pg.connect_store(parallel.master_addr, parallel.master_port, False,
                                                  parallel.collective_timeout)
                if not pg.reported_error(store, rank):  # it died without a word: say how
                    pg.report(store, "error", rank, f"its process {how_it_ended(proc.returncode)}")
            except Exception as e:  # node 0 is gone or unreachable: nobody to tell
                logger.error("rank %d %s; could not tell node 0: %s", rank, how_it_ended(proc.returncode), e)
        time.sleep(0.2)
    for proc in processes.values():  # stopped: this node's ranks go (the server then fails, naming them)
        if proc.poll() is None:
            proc.kill()
    codes = [proc.wait() for proc in processes.values()]
    return 0 if all(code == 0 for code in codes) else 1
