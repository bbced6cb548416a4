"""Executors: where the model step runs. The engine hands each SchedulerOutput to one and gets rank 0's
ModelRunnerOutput back.

`InProcessExecutor` (one device, the default) calls its worker directly. `DistributedExecutor` runs
one Worker per rank: rank 0's in this process (the driver), the others in worker processes it starts
on this node (engine/workers/worker_process.py) or that `dsaserve worker` starts on other nodes. Each step the
driver broadcasts the SchedulerOutput to every rank, then all ranks run it together. Any failure of a
rank, in a phase or a step, ends the executor: the error names the rank and the cause.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from dsaserve.config import ModelConfig
from dsaserve.distributed import process_group as pg
from dsaserve.engine.scheduling.cache_plan import StateCounts
from dsaserve.engine.scheduling.scheduler_output import SchedulerOutput
from dsaserve.engine.workers.grammar_transport import grammars_serialized
from dsaserve.engine.workers.memory_profile import DeviceMemory
from dsaserve.engine.workers.runner_output import ModelRunnerOutput
from dsaserve.engine.workers.worker import Worker
from dsaserve.engine_args import EngineArgs

logger = logging.getLogger(__name__)


class ExecutorFailure(RuntimeError):
    """The executor cannot run steps any more (a rank failed or died); the engine must stop."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What the driver tells every worker before it loads: the engine's arguments, as resolved here."""

    args: EngineArgs
    dtype: str  # e.g. "bfloat16": resolved once, so every rank computes in the same dtype
    device_type: str
    config_fingerprint: str


def config_fingerprint(cfg: ModelConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


class InProcessExecutor:
    failure: str | None = None
    broadcast_seconds = 0.0

    def __init__(self, worker: Worker):
        self.driver = worker

    def profile_memory(self, tokens: int, logits_rows: int) -> list[DeviceMemory]:
        return [self.driver.profile_memory(tokens, logits_rows)]

    def init_cache(self, num_blocks: int, states: StateCounts, max_model_len: int) -> None:
        self.driver.init_cache(num_blocks, states, max_model_len)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute(scheduler_output)

    def add_failure_listener(self, listener) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_executor(args: EngineArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    if not args.parallel.distributed:
        if device.type == "cuda" and device.index is not None:  # Triton launches and graph streams on the current one
            torch.cuda.set_device(device)
        return InProcessExecutor(Worker(args, cfg, device, dtype, progress=args.progress))
    return DistributedExecutor(args, cfg, device, dtype)


def threads_per_rank(ranks_on_node: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks_on_node)


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def worker_command(rank: int, local_rank: int, addr: str, port: int, world_size: int, model: str | None = None
                   ) -> list[str]:
    command = [sys.executable, "-m", "dsaserve.engine.workers.worker_process", "--rank", str(rank), "--local-rank",
               str(local_rank), "--world-size", str(world_size), "--master-addr", addr, "--master-port", str(port),
               "--parent-pid", str(os.getpid())]
    return command + (["--model", model] if model else [])


def start_workers(ranks, addr: str, port: int, ranks_on_node: int, model: str | None = None,
                  world_size: int | None = None) -> dict[int, subprocess.Popen]:
    """Start one worker process per rank on this node (local rank = index on the node)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank(ranks_on_node)))
    first = min(ranks, default=0) // ranks_on_node * ranks_on_node
    world_size = world_size or ranks_on_node
    return {rank: subprocess.Popen(worker_command(rank, rank - first, addr, port, world_size, model), env=env)
            for rank in ranks}


def how_it_ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def exit_cause(rank: int, proc: subprocess.Popen) -> str | None:
    code = proc.poll()
    return None if code is None else f"rank {rank} (pid {proc.pid}) {how_it_ended(code)}"


class DistributedExecutor:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.parallel_config = parallel = args.parallel
        self.world = parallel.world_size
        self.failure: str | None = None
        self.broadcast_seconds = 0.0  # time spent sending SchedulerOutputs to the workers
        self.processes: dict[int, subprocess.Popen] = {}
        self._listeners = []
        self._stopping = False
        self.control = None
        atexit.register(self.shutdown)  # a program that forgets to shut down leaves no workers behind
        self._threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(parallel.ranks_per_node))
        if device.type == "cuda":
            device = torch.device("cuda", 0)  # local rank 0
            torch.cuda.set_device(device)
        self.dist_timeout = parallel.dist_timeout
        port = parallel.master_port or free_port(parallel.master_addr)
        self.store = pg.connect_store(parallel.master_addr, port, True, parallel.collective_timeout)
        try:
            pg.publish(self.store, "spec", WorkerSpec(args, str(dtype).removeprefix("torch."), device.type,
                                                      config_fingerprint(cfg)))
            if not pg.under_torchrun():
                self.processes = start_workers(parallel.node_ranks(0)[1:], parallel.master_addr, port,
                                               parallel.ranks_per_node, world_size=self.world)
            threading.Thread(target=self._monitor, name="dsaserve-rank-monitor", daemon=True).start()
            others = range(1, self.world)
            # Every rank must turn up within the collective timeout; loading then takes as long as it takes.
            pg.wait_for_ranks(self.store, "hello", others, self._dead_rank, parallel.dist_timeout)
            parallel_context, self.control = pg.join(self.store, 0, parallel, device.type)
            self.driver = Worker(args, cfg, device, dtype, parallel_context, progress=args.progress)
            pg.wait_for_ranks(self.store, "loaded", others, self._dead_rank)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d ranks ready: tensor parallel %d%s%s", self.world, parallel.tensor_parallel_size,
                    ", expert parallel" if parallel.enable_expert_parallel else "",
                    f", decode context parallel {parallel.decode_context_parallel_size}"
                    if parallel.decode_context_parallel_size > 1 else "")

    def add_failure_listener(self, listener) -> None:
        """listener(cause) is called (on another thread) when a rank is found dead or failed."""
        self._listeners.append(listener)

    def profile_memory(self, tokens: int, logits_rows: int) -> list[DeviceMemory]:
        """Every rank's device memory after the largest step, run by all ranks together (its layers exchange
        partial results); rank order."""
        self._send(("profile_memory", tokens, logits_rows))
        own = self.driver.profile_memory(tokens, logits_rows)
        others = range(1, self.world)
        pg.wait_for_ranks(self.store, "profiled", others, self._dead_rank)
        return [own] + [pg.fetch(self.store, f"memory/{rank}") for rank in others]

    def init_cache(self, num_blocks: int, states: StateCounts, max_model_len: int) -> None:
        self._send(("init_cache", num_blocks, states, max_model_len))
        self.driver.init_cache(num_blocks, states, max_model_len)
        pg.wait_for_ranks(self.store, "ready", range(1, self.world), self._dead_rank)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.failure:
            raise ExecutorFailure(self.failure)
        try:
            start = time.perf_counter()
            self._send(("step", grammars_serialized(scheduler_output)))
            self.broadcast_seconds += time.perf_counter() - start
            return self.driver.execute(scheduler_output)
        except Exception as e:
            self._fail(self._explain(e))
            raise ExecutorFailure(self.failure) from e

    def _send(self, message) -> None:
        self.control.broadcast_object(message, src=0)

    def _explain(self, error: Exception) -> str:
        """The cause of a failed step: a rank that reported an error or died, else the driver's own error."""
        deadline = time.monotonic() + 3.0  # a failing rank reports, then exits, before its sockets close
        while True:
            cause = self.failure or self._find_cause()
            if cause or time.monotonic() > deadline:
                return cause or self._own_cause(error)
            time.sleep(0.05)

    def _own_cause(self, error: Exception) -> str:
        if "Timed out" in str(error):  # gloo's words: every rank is alive, one stopped answering
            others = "rank 1" if self.world == 2 else f"ranks 1-{self.world - 1}"
            return (f"a collective timed out after {self.dist_timeout:g}s (--dist-timeout) waiting for {others}: "
                    f"one is hung or far slower than rank 0 ({error})")
        return f"rank 0 failed in a step: {type(error).__name__}: {error}"

    def _find_cause(self) -> str | None:
        """Why the ranks cannot go on, if they cannot: first a rank's own error, then a rank killed or exited
        (on this node), then a rank that only lost a peer (the consequence of another's failure)."""
        errors = {rank: pg.reported_error(self.store, rank) for rank in range(1, self.world)}
        for rank, error in errors.items():
            if error and not error.startswith(pg.LOST_PEER):
                return f"rank {rank} failed: {error}"
        ended = [(rank, proc.returncode, exit_cause(rank, proc)) for rank, proc in self.processes.items()
                 if proc.poll() is not None]
        for rank, code, cause in sorted(ended, key=lambda e: e[1] >= 0):  # killed by a signal first
            if not errors.get(rank):
                return cause
        for rank, error in errors.items():
            if error:
                return f"rank {rank} failed: {error}"
        return ended[0][2] if ended else None

    def _dead_rank(self) -> str | None:
        """While the ranks start: a local rank that has already ended, with its report if it made one."""
        if any(proc.poll() is not None for proc in self.processes.values()):
            return self._find_cause()
        return None

    def _monitor(self) -> None:
        """Watch local worker processes, and other nodes' reports, while the driver runs or waits."""
        polls = 0
        while not self._stopping and not self.failure:
            try:
                ended = any(proc.poll() is not None for proc in self.processes.values())
                cause = self._find_cause() if ended or polls % 10 == 0 else None
            except Exception:  # the store is gone: shutting down
                return
            if cause:
                time.sleep(0.2)  # let the failing rank's own report arrive
                self._fail(self._find_cause() or cause)
                return
            polls += 1
            time.sleep(0.1)

    def _fail(self, cause: str) -> None:
        if self.failure or self._stopping:
            return
        self.failure = cause
        logger.error("distributed executor failed: %s", cause)
        for listener in self._listeners:
            listener(cause)

    def shutdown(self) -> None:
        """Tell the workers to exit (they finish and leave the groups), wait for them, then leave."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self.control is not None and not self.failure:
            try:
                self._send(("shutdown",))
            except Exception:
                logger.warning("could not reach every worker to shut it down")
        for rank, proc in self.processes.items():
            try:
                proc.wait(timeout=10 if not self.failure else 2)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) did not exit: killing it", rank, proc.pid)
                proc.kill()
                proc.wait()
        try:
            pg.leave()  # also after a failure, so this process can start ranks again
        except Exception:
            logger.warning("leaving the process groups failed", exc_info=True)
        torch.set_num_threads(self._threads)
