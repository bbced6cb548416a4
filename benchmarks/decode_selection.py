"""What a sparse decode step spends on its selections, past index_topk.

    python benchmarks/decode_selection.py [--context 8192] [--batch 1] [--steps 300] [--checkpoint DIR]
                                          [--indexer-cache-dtype auto|model|int8] [--enforce-eager] [--cpu-isa avx2]
                                          [--quantization fp8]

`batch` requests (1 by default) on the benchmark model (benchmarks/model_core.py) whose first `context` tokens are
cached synthetically each (as `dsaserve bench longctx` does for its decode points), decoded greedily with the sparse
backend. Where a full layer's selection runs in Python between the step's native calls, this reports the median
time of one full layer's selection (the indexer's queries, scoring, top-k: Indexer.select) and the time per step
spent turning the selections into cache slots (the backend's decode_slots, once per selection); where the step's one
native call selects, it says so (--enforce-eager runs every step through the modules, so the selections are
timed, and their share of the step reported); and the median step.
Run it in two trees taking turns to compare them (PYTHONPATH=TREE).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from dsaserve.attention.indexer_cache import INDEXER_CACHE_DTYPES

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--indexer-cache-dtype", default="auto", choices=INDEXER_CACHE_DTYPES)
    parser.add_argument("--enforce-eager", action="store_true", help="no decode plan: the modules one by one")
    parser.add_argument("--cpu-isa", default="auto", help="the native kernels' body family (avx2: what such CPUs run)")
    parser.add_argument("--quantization", default=None, help="the weights' form (fp8: as DeepSeek-V3.2 ships)")
    args = parser.parse_args()
    from model_core import checkpoint_dir

    from dsaserve.attention.sparse import SparseAttention
    from dsaserve.bench.longctx import fill_synthetic_prefix
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine_args import EngineArgs
    from dsaserve.model.indexer import Indexer
    from dsaserve.sampling_params import SamplingParams

    cache_mib = 900 * -(-args.batch * (args.context + args.steps + 40) // 32768)  # 900 MiB hold 32K tokens
    engine = LLMEngine(EngineArgs(model=args.checkpoint or checkpoint_dir(), kv_cache_memory=f"{cache_mib}MiB",
                                  max_model_len=32768, progress=False, attention_backend="sparse",
                                  max_num_batched_tokens=4096, enable_prefix_caching=False,
                                  indexer_cache_dtype=args.indexer_cache_dtype, enforce_eager=args.enforce_eager,
                                  cpu_isa=args.cpu_isa, quantization=args.quantization))
    g = torch.Generator().manual_seed(0)
    for r in range(args.batch):
        ids = torch.randint(10, 1000, (args.context,), generator=g).tolist()
        request = engine.make_request(f"synthetic-{r}", ids, SamplingParams(temperature=0, max_tokens=args.steps + 40,
                                                                            ignore_eos=True))
        engine.add_prefilled_request(request, args.context - 1,
                                     lambda cache, table, n: fill_synthetic_prefix(cache, table, n, g))
    times: dict[str, list[float]] = {}

    def timed(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def call(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                times.setdefault(key, []).append((time.perf_counter() - start) * 1e6)

        setattr(owner, name, call)

    timed(Indexer, "select", "select")
    timed(Indexer, "forward", "select")  # through the modules (--enforce-eager): keys, their write and the selection
    timed(SparseAttention, "decode_slots", "slots")
    timed(engine, "step", "step")
    for _ in range(20):
        engine.step()
    times.clear()
    for _ in range(args.steps):
        engine.step()
    steps = len(times["step"])
    line = f"context {args.context}, batch {args.batch}, indexer keys {args.indexer_cache_dtype}: "
    if "select" in times:  # selections made in Python between the step's native calls
        per_layer, per_step_selections = statistics.median(times["select"]), len(times["select"]) / steps
        share = per_layer * per_step_selections / statistics.median(times["step"])
        line += (f"one full layer's selection, median {per_layer:.0f} µs ({per_step_selections:.0f} a step: "
                 f"{share:.0%} of the step); ")
        if "slots" in times:
            per_step = len(times["slots"]) // steps
            slots = [sum(times["slots"][i:i + per_step]) for i in range(0, per_step * steps, per_step)]
            line += f"slots from the selections {statistics.median(slots):.0f} µs a step; "
    else:
        line += "selections made inside the step's native call; "
    print(line + f"step {statistics.median(times['step']) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
