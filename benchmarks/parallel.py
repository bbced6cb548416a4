"""Tensor parallelism on one machine: what each rank holds, and what the distributed executor costs per step.

    python benchmarks/parallel.py [--out docs/parallel.json]

On the checkpoint benchmarks/model_core.py builds (GLM-5.2 per-head geometry, 214M parameters, bf16):

1. Per-rank bytes, measured on loaded shards: each rank's share is loaded by the loader's own path (its
   slices of the safetensors files) and its parameters are counted; KV bytes per token per rank come from
   the cache tensors an engine allocates. For TP=1, TP=2, TP=2 with expert parallelism and TP=2 × DCP=2,
   next to what `dsaserve doctor --tensor-parallel-size 2` predicts. The RSS of every rank's process in a
   running TP=2 engine is printed too.
2. Step time at batch 1 and 16 (decode, 128-token prompts) for TP=1 in one process and TP=2 (the driver
   plus one worker process), and the executor's own cost: the broadcast of each step's SchedulerOutput.
   On a 2-core machine TP=1 runs 2 threads and each TP=2 rank 1, so the ratio is about the split, not
   about more hardware.
3. gloo's latency for the all-reduce a decode step makes per layer ([rows, 1024]), against an all-gather
   followed by a local sum (what Communicator.all_reduce does for small CPU tensors), between two
   processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from model_core import checkpoint_dir  # noqa: E402

from dsaserve.config import ModelConfig  # noqa: E402
from dsaserve.distributed.communicator import Communicator  # noqa: E402
from dsaserve.distributed.parallel_config import ParallelConfig  # noqa: E402
from dsaserve.distributed.parallel_context import ParallelContext  # noqa: E402
from dsaserve.engine.llm_engine import LLMEngine  # noqa: E402
from dsaserve.engine.workers.kv_cache import KVCacheLayout  # noqa: E402
from dsaserve.engine_args import EngineArgs  # noqa: E402
from dsaserve.model import load_model  # noqa: E402
from dsaserve.model.checkpoint_layout import checkpoint_shapes  # noqa: E402
from dsaserve.parallel_plan import rank_shares  # noqa: E402
from dsaserve.sampling_params import SamplingParams  # noqa: E402

LAYOUTS = {"TP=1": (1, False, 1), "TP=2": (2, False, 1), "TP=2 EP": (2, True, 1), "TP=2 DCP=2": (2, False, 2)}
MiB = 2**20


def shard_bytes(path: str) -> dict:
    cfg = ModelConfig.from_pretrained(path)
    layout = KVCacheLayout.of(cfg, torch.bfloat16)
    out = {}
    for name, (tp, ep, dcp) in LAYOUTS.items():
        predicted = rank_shares(cfg, ParallelConfig(tp, ep, dcp),
                                {n: (s, 2) for n, s in checkpoint_shapes(cfg).items()}, resident_item=2)
        ranks = []
        for rank in range(tp):
            parallel = ParallelContext(Communicator(None, tuple(range(tp)), rank), expert_parallel=ep)
            model = load_model(cfg, path, torch.bfloat16, torch.device("cpu"), progress=False, parallel=parallel)
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            ranks.append({"weights_MiB": held / MiB, "doctor_MiB": predicted[rank].resident / MiB,
                          "kv_bytes_per_token": layout.bytes_per_token / dcp})
            del model
        out[name] = ranks
    return out


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def decode_steps(engine: LLMEngine, batch: int, steps: int = 24) -> tuple[float, float]:
    """(median ms per decode step, ms of SchedulerOutput broadcast per step) with `batch` running requests."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(10, 16000, (128,), generator=g).tolist(), params)
    while any(r.in_prompt for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times, sent = [], engine.executor.broadcast_seconds
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    broadcast = (engine.executor.broadcast_seconds - sent) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3, broadcast * 1e3


def step_times(path: str) -> dict:
    out = {}
    for name, tp in (("TP=2 driver + 1 worker", 2), ("TP=1 in-process", 1)):  # TP=2 first: its RSS is its own
        engine = LLMEngine(EngineArgs(model=path, tensor_parallel_size=tp, kv_cache_memory="256MiB",
                                      max_model_len=4096, progress=False))
        try:
            if tp > 1:
                pids = [os.getpid()] + [p.pid for p in engine.executor.processes.values()]
                out["rss_MiB_per_rank_TP=2"] = [rss_mib(pid) for pid in pids]
            decode_steps(engine, 1, steps=4)  # warm-up
            out[name] = {f"batch {b}": dict(zip(("step_ms", "broadcast_ms"), decode_steps(engine, b))) for b in (1, 16)}
        finally:
            engine.shutdown()
    return out


def _collectives(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def per_call(fn, n):
        for _ in range(5):
            fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    result = {}
    for rows in (1, 16, 256, 2048):
        x = torch.ones(rows, 1024, dtype=torch.bfloat16)
        flat = torch.empty(2 * rows, 1024, dtype=torch.bfloat16)
        n = 200 if rows <= 16 else 30
        result[f"{rows} rows"] = {
            "all_reduce_us": per_call(lambda: dist.all_reduce(x), n),
            "all_gather_and_sum_us": per_call(lambda: (dist.all_gather_into_tensor(flat, x),
                                                       flat.view(2, rows, -1).sum(0)), n)}
    dist.destroy_process_group()
    if rank == 0:
        queue.put(result)


def collective_latency() -> dict:
    import torch.multiprocessing as mp

    from dsaserve.engine.workers.executor import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port("127.0.0.1")
    ranks = [ctx.Process(target=_collectives, args=(r, port, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    result = queue.get()
    for p in ranks:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = checkpoint_dir()
    result = {**step_times(path), "shards": shard_bytes(path), "collectives_bf16_x1024": collective_latency()}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
