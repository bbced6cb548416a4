"""The indexer's keys scored where the cache keeps them (packed) against gathered and repacked per chunk.

    python benchmarks/indexer_keys.py [--contexts 8192,16384] [--steps 40]

1. The kernel alone, one decode query (32 heads × 128, GLM-5.2's indexer) against a request's blocks of
   64 keys: `index_scores_blocks` on a packed cache against `read_blocks` + `pack_keys` + `index_scores`
   on a plain one. Cold: every call reads another request's blocks (140 MB of caches, past the L3).
2. Writing keys at scattered slots (a decode token, a 2,048-token prefill chunk) into either cache.
3. Decode steps on the benchmark model (benchmarks/model_core.py, bf16) with the cache synthetically
   filled to each context: sparse with packed keys, sparse with key rows, and dense, the three engines in
   one process taking turns step by step. Engines loaded into one process are not equal (the same engine
   built twice differed by up to 10% here, with no order that always won), so the engines are loaded in
   three orders, each of them first once, and all three are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))


def kernel_alone(rounds: int = 4) -> dict:
    from dsaserve.attention.indexer_cache import IndexerKeyCache
    from dsaserve.native import index_scores as ns

    blocks_total, block_size, dim, heads, per_request = 9000, 64, 128, 32, 128
    g = torch.Generator().manual_seed(0)
    packed = IndexerKeyCache(blocks_total, block_size, dim, "model", torch.bfloat16, torch.device("cpu"), packed=True)
    plain = IndexerKeyCache(blocks_total, block_size, dim, "model", torch.bfloat16, torch.device("cpu"))
    for cache in (packed, plain):
        cache.data.normal_(generator=g)
    keys = per_request * block_size
    requests = [torch.arange(i * per_request, (i + 1) * per_request) for i in range(blocks_total // per_request)]
    q, w = torch.randn(1, heads, dim, generator=g).bfloat16(), torch.rand(1, heads, generator=g)
    out, buffer = torch.empty(1, keys), torch.empty(ns.packed_size(keys, dim), dtype=torch.int32)
    ways = {
        "in place (packed cache)": lambda b: ns.index_scores_blocks(q, w, packed.groups, b, keys, out),
        "gathered + repacked": lambda b: ns.index_scores(q, w, ns.pack_keys(plain.read_blocks(b, torch.bfloat16),
                                                                            buffer), keys, out),
    }
    result = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            times = []
            for blocks in requests:
                start = time.perf_counter()
                way(blocks)
                times.append(time.perf_counter() - start)
            result[name].append(statistics.median(times) * 1e6)
    return {name: [round(t) for t in times] for name, times in result.items()}


def write_alone(repeats: int = 200) -> dict:
    """µs to write n keys (a decode token, a prefill chunk) at scattered slots: packed cache (one native call),
    packed cache by torch indexing (the operators off), plain cache (index_copy_)."""
    from dsaserve.attention.indexer_cache import IndexerKeyCache
    from dsaserve.native import torch_ops

    blocks, block_size, dim = 9000, 64, 128
    packed = IndexerKeyCache(blocks, block_size, dim, "model", torch.bfloat16, torch.device("cpu"), packed=True)
    plain = IndexerKeyCache(blocks, block_size, dim, "model", torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    result = {}
    for n in (1, 2048):
        slots = torch.randperm(blocks * block_size, generator=g)[:n]
        keys = torch.randn(n, dim, generator=g).bfloat16()
        ways = {"packed, one call": packed.write, "plain": plain.write}
        for name, write in ways.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                write(slots, keys)
                times.append(time.perf_counter() - start)
            result[f"{n} keys, {name}"] = round(statistics.median(times) * 1e6, 1)
        load = torch_ops.load
        torch_ops.load = lambda: False
        try:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                packed.write(slots, keys)
                times.append(time.perf_counter() - start)
            result[f"{n} keys, packed, torch indexing"] = round(statistics.median(times) * 1e6, 1)
        finally:
            torch_ops.load = load
    return result


def engine(backend: str, packed: bool, context: int):
    from model_core import checkpoint_dir

    import dsaserve.engine.workers.kv_cache as kv_cache
    from dsaserve.bench.longctx import fill_synthetic_prefix
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine_args import EngineArgs
    from dsaserve.sampling_params import SamplingParams

    real = kv_cache.packs_indexer_keys
    if not packed:
        kv_cache.packs_indexer_keys = lambda *args: False
    try:
        e = LLMEngine(EngineArgs(model=checkpoint_dir(), kv_cache_memory="600MiB", max_model_len=32768, progress=False,
                                 attention_backend=backend, enable_prefix_caching=False))
    finally:
        kv_cache.packs_indexer_keys = real
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, e.config.vocab_size, (context,), generator=g).tolist()
    request = e.make_request("synthetic", ids, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    e.add_prefilled_request(request, context - 1, lambda cache, table, n: fill_synthetic_prefix(cache, table, n, g))
    for _ in range(3):
        e.step()
    return e


def engines_taking_turns(context: int, order: list[str], steps: int) -> dict:
    kinds = {"sparse, packed keys": ("sparse", True), "sparse, key rows": ("sparse", False), "dense": ("dense", False)}
    engines = {name: engine(*kinds[name], context) for name in order}
    times = {name: [] for name in order}
    for step in range(steps):
        turn = order[step % len(order):] + order[: step % len(order)]
        for name in turn:
            start = time.perf_counter()
            engines[name].step()
            times[name].append((time.perf_counter() - start) * 1e3)
    for e in engines.values():
        e.shutdown()
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,16384")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print("kernel alone, one query, 8,192 keys, µs (median per round):", kernel_alone(), flush=True)
    print("writing keys, µs:", write_alone(), flush=True)
    names = ["sparse, packed keys", "sparse, key rows", "dense"]
    for context in (int(c) for c in args.contexts.split(",")):
        for first in range(len(names)):  # each engine loaded first once
            order = names[first:] + names[:first]
            result = engines_taking_turns(context, list(order), args.steps)
            print(f"context {context}, loaded in order {' → '.join(order)}: median ms/step {result}", flush=True)


if __name__ == "__main__":
    main()
