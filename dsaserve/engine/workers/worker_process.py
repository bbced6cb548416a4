"""A worker rank's process: join the ranks, load this rank's share, then run the driver's steps until
it says to stop.

Started by the driver for the ranks of its own node, by `dsaserve worker` on other nodes, or by
torchrun. The engine arguments come from the driver (through the rendezvous store), so every rank
resolves the same config, dtype and cache; only the checkpoint directory may differ per node. A
failure is reported to the driver through the store before the process exits non-zero.

    python -m dsaserve.engine.workers.worker_process --rank R --local-rank L --master-addr A --master-port P
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import torch

from dsaserve.config import ModelConfig
from dsaserve.distributed import process_group as pg
from dsaserve.engine.workers.executor import config_fingerprint, threads_per_rank
from dsaserve.engine.workers.grammar_transport import GrammarRestorer
from dsaserve.engine.workers.worker import Worker

logger = logging.getLogger(__name__)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def watch_parent(parent_pid: int) -> None:
    """Exit when the process that started this one is gone (no orphan workers after a killed driver)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        logger.error("the driver (pid %d) is gone: exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="dsaserve-parent-watch", daemon=True).start()


def run_worker(rank: int, local_rank: int, master_addr: str, master_port: int, model: str | None = None,
               parent_pid: int | None = None, world_size: int | None = None) -> int:
    """Serve as rank `rank` until the driver shuts the ranks down; returns the exit code."""
    # Ctrl-C, and a SIGTERM sent to every process (systemd, torchrun), reach the driver too: it drains the
    # requests, then tells the workers to exit. A worker whose driver is gone exits by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent_pid:
        watch_parent(parent_pid)
    store = pg.connect_store(master_addr, master_port, False, pg.STORE_TIMEOUT)
    spec = pg.fetch(store, "spec")
    try:
        args = spec.args if model is None else dataclasses.replace(spec.args, model=model)
        if world_size is not None and world_size != args.parallel.world_size:
            raise ValueError(f"this rank was started for tensor_parallel_size={world_size}, the server runs "
                             f"{args.parallel.world_size}; give every node the same --tensor-parallel-size")
        cfg = ModelConfig.from_pretrained(args.model, hf_overrides=args.hf_overrides)
        if config_fingerprint(cfg) != spec.config_fingerprint:
            raise ValueError(f"the config.json in {args.model!r} differs from the driver's; give every node the "
                             "same checkpoint")
        device = torch.device("cpu") if spec.device_type == "cpu" else torch.device(spec.device_type, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads_per_rank(args.parallel.ranks_per_node))
        dtype = getattr(torch, spec.dtype)
    except Exception as e:
        pg.report(store, "hello", rank, describe(e))
        return 1
    pg.report(store, "hello", rank)
    parallel, control = pg.join(store, rank, args.parallel, device.type)
    try:
        worker = Worker(args, cfg, device, dtype, parallel, progress=False)
    except Exception as e:
        logger.exception("rank %d failed to load", rank)
        pg.report(store, "loaded", rank, describe(e))
        return 1
    pg.report(store, "loaded", rank)
    grammars = GrammarRestorer(args.model, cfg.vocab_size, cfg.eos_token_ids)
    while True:
        try:
            message = control.broadcast_object(None, src=0)
        except Exception as e:
            logger.error("rank %d lost the driver: %s", rank, describe(e))
            return 1
        try:
            if message[0] == "shutdown":
                break
            if message[0] == "init_cache":
                worker.init_cache(message[1], message[2], message[3])
                pg.report(store, "ready", rank)
            elif message[0] == "profile_memory":
                pg.publish(store, f"memory/{rank}", worker.profile_memory(message[1], message[2]))
                pg.report(store, "profiled", rank)
            elif message[0] == "step":
                worker.execute(grammars.restore(message[1]))
        except Exception as e:
            logger.exception("rank %d failed", rank)
            pg.report(store, "error", rank, (pg.LOST_PEER if pg.lost_peer(e) else "") + describe(e))
            return 1
    pg.leave()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsaserve.engine.workers.worker_process")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=None, help="what the launcher expects the world to be")
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--model", default=None, help="this node's copy of the checkpoint (default: the driver's path)")
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank {args.rank} %(name)s: %(message)s",
                        stream=sys.stderr)
    return run_worker(args.rank, args.local_rank, args.master_addr, args.master_port, args.model, args.parent_pid,
                      args.world_size)


if __name__ == "__main__":
    sys.exit(main())
