"""One prefill chunk after a long cached prefix, per backend, with its attention, indexer and MoE time.

    python benchmarks/prefill_chunk.py CHECKPOINT [--prefix 12288] [--chunk 4096] [--backends sparse,dense]

The prefix is filled with synthetic latents and indexer keys (as `dsaserve bench longctx` does for
its decode points), so the chunk measured is the last one of a (prefix + chunk)-token prefill without
running the ones before it. --native-kernels off times the torch paths instead of the native kernels.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from dsaserve.attention.dense import DenseAttention
from dsaserve.attention.sparse import SparseAttention
from dsaserve.bench.longctx import fill_synthetic_prefix
from dsaserve.engine.llm_engine import LLMEngine
from dsaserve.engine_args import EngineArgs
from dsaserve.model.indexer import Indexer
from dsaserve.model.moe import MoE
from dsaserve.sampling_params import SamplingParams

sections: dict[str, float] = collections.defaultdict(float)


def timed(cls, method: str, label: str) -> None:
    inner = getattr(cls, method)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sections[label] += time.perf_counter() - start

    setattr(cls, method, wrapper)


def last_chunk(engine: LLMEngine, prefix: int, chunk: int, seed: int) -> float:
    """Seconds for the engine step that prefills tokens [prefix, prefix + chunk) of a random prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, engine.config.vocab_size, (prefix + chunk,), generator=g).tolist()
    request = engine.make_request("chunk", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.add_prefilled_request(request, prefix, lambda cache, table, n: fill_synthetic_prefix(cache, table, n, g))
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request("chunk")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--prefix", type=int, default=12288)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--backends", default="sparse,dense")
    parser.add_argument("--kv-cache-memory", default="900MiB")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--native-kernels", default="auto")
    args = parser.parse_args()
    for cls in (SparseAttention, DenseAttention):
        timed(cls, "forward", "attention")
    timed(Indexer, "forward", "indexer")
    timed(MoE, "forward", "moe")
    engines = {b: LLMEngine(EngineArgs(args.model, attention_backend=b, progress=False, enable_prefix_caching=False,
                                       max_model_len=args.prefix + args.chunk + 1, kv_cache_memory=args.kv_cache_memory,
                                       max_num_batched_tokens=args.chunk, native_kernels=args.native_kernels))
               for b in args.backends.split(",")}
    for repeat in range(args.repeats):
        for backend, engine in engines.items():
            sections.clear()
            total = last_chunk(engine, args.prefix, args.chunk, seed=repeat)
            parts = "  ".join(f"{name} {seconds:6.2f} s" for name, seconds in sections.items())
            print(f"{backend:<7} tokens {args.prefix}–{args.prefix + args.chunk}: {total:6.2f} s  ({parts}, "
                  f"rest {total - sum(sections.values()):5.2f} s)", flush=True)


if __name__ == "__main__":
    main()
