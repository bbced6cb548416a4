"""What the small native operators (norms, rope, cache writes, top-k) cost in a decode step, by body family.

    python benchmarks/small_ops_share.py [--context 128,16384] [--cpu-isa avx2] [--dtype bfloat16] [--steps 32]
                                         [--checkpoint DIR]

For each context length: one request on the benchmark model (benchmarks/model_core.py) whose first `context` tokens
are cached synthetically (as `dsaserve bench longctx` does), decoded greedily with the sparse backend. The same
engine's steps alternate between the decode plan (the whole step one native call: the step as served) and the
modules (--enforce-eager's path, where torch's profiler sees every native operator by name). Printed per operator:
its time per step through the modules, and that time as a share of the planned step (the same kernels run in both;
the planned step has less around them, so this share is the larger one). Top-k runs inside the selection's call
(decode_selection), so it is timed alone too: torch.ops.dsaserve.topk_rows on one row of `context` scores, k =
index_topk, once per full layer and step.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))

SMALL_OPS = ("rms_norm", "add_rms_norm", "gated_rms_norm", "apply_rope", "write_latent_rows", "write_packed_keys",
             "write_int8_keys", "topk_rows")


def engine_with_context(args, context: int):
    from model_core import checkpoint_dir

    from dsaserve.bench.longctx import fill_synthetic_prefix
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine_args import EngineArgs
    from dsaserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=args.checkpoint or checkpoint_dir(), kv_cache_memory="900MiB",
                                  max_model_len=32768, progress=False, attention_backend="sparse",
                                  max_num_batched_tokens=4096, enable_prefix_caching=False, dtype=args.dtype,
                                  cpu_isa=args.cpu_isa))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (context,), generator=g).tolist()
    request = engine.make_request("synthetic", ids, SamplingParams(temperature=0, max_tokens=4 * args.steps + 40,
                                                                   ignore_eos=True))
    engine.add_prefilled_request(request, context - 1,
                                 lambda cache, table, n: fill_synthetic_prefix(cache, table, n, g))
    return engine


def decode_plan_of(engine):
    model = engine.model
    return model.model.prepared("decode plan", model._plan) if hasattr(model, "_plan") else None


def planned_and_eager_steps(engine, steps: int):
    """Median planned step (s) and the profiler's self time per native operator per eager step (s)."""
    plan = decode_plan_of(engine)
    for _ in range(8):
        engine.step()
    planned = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        planned.append(time.perf_counter() - start)
    plan.run = lambda *args: None  # the plan declines every step: the modules run it
    try:
        engine.step()  # warm the modules' path
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.step()
    finally:
        del plan.run
    per_op = collections.Counter()
    for event in prof.key_averages():
        if event.key.startswith("dsaserve::"):
            per_op[event.key.removeprefix("dsaserve::")] += event.self_cpu_time_total / 1e6 / steps
    return statistics.median(planned), per_op


def topk_alone(context: int, k: int, repeats: int = 200) -> float:
    scores = torch.randn(1, context)
    torch.ops.dsaserve.topk_rows(scores, k)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.ops.dsaserve.topk_rows(scores, k)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", default="128,16384", help="comma-separated cached context lengths")
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    from dsaserve.native import torch_ops

    for context in (int(n) for n in args.context.split(",")):
        engine = engine_with_context(args, context)
        if decode_plan_of(engine) is None:
            sys.exit("no decode plan on this engine (native kernels off?): nothing to compare against")
        planned, per_op = planned_and_eager_steps(engine, args.steps)
        cfg = engine.config
        print(f"context {context}, {torch_ops.summary()}, dtype {engine.dtype}: planned step {planned * 1e3:.2f} ms")
        small = 0.0
        for name, seconds in per_op.most_common():
            mark = "*" if name in SMALL_OPS else " "
            small += seconds if name in SMALL_OPS else 0.0
            print(f"  {mark} {name:<26} {seconds * 1e6:9.1f} µs/step  {seconds / planned:6.2%} of the planned step")
        line = f"  small operators (*) together: {small * 1e6:.1f} µs/step, {small / planned:.2%}"
        if context > cfg.index_topk:
            topk = topk_alone(context, cfg.index_topk) * len(cfg.full_layers)
            line += (f"; top-k inside the selections ({len(cfg.full_layers)} full layers × one row of {context}): "
                     f"{topk * 1e6:.1f} µs/step, {topk / planned:.2%}")
        print(line)
        engine.shutdown()


if __name__ == "__main__":
    main()
