"""`dsaserve bench throughput` and `dsaserve bench latency`: offline measurements of the engine
(`dsaserve bench serve` loads a server over HTTP: see bench_serve.py).

Prompts are random token ids (so any checkpoint works without a dataset); generation ignores eos so
every request produces exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm import tqdm


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 2)
    return torch.randint(low, vocab, (num, length), generator=g).tolist()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run_throughput(llm, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
    from dsaserve import SamplingParams

    prompts = random_prompts(num_prompts, input_len, llm.engine.config.vocab_size, seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "elapsed_s": elapsed,
        "requests_per_s": num_prompts / elapsed, "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + num_prompts * input_len) / elapsed,
    }


def run_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int, warmup: int, seed: int) -> dict:
    """TTFT: from submission to the step that produced the first token. TPOT: mean time per later token."""
    from dsaserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts, tpots = [], []
    for it in tqdm(range(warmup + iters), desc="Latency", unit="iter"):
        prompts = random_prompts(batch_size, input_len, engine.config.vocab_size, seed + it)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"lat-{it}-{i}", p, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None and all(len(s.output_token_ids) > 0 for g in engine.groups.values() for s in g):
                first = time.perf_counter()
        end = time.perf_counter()
        first = first or end
        if it >= warmup:
            ttfts.append(first - start)
            tpots.append((end - first) / max(output_len - 1, 1))
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iters": iters,
        "ttft_ms_mean": statistics.mean(ttfts) * 1e3, "ttft_ms_p50": percentile(ttfts, 50) * 1e3,
        "ttft_ms_p90": percentile(ttfts, 90) * 1e3,
        "tpot_ms_mean": statistics.mean(tpots) * 1e3, "tpot_ms_p50": percentile(tpots, 50) * 1e3,
        "tpot_ms_p90": percentile(tpots, 90) * 1e3,
    }


def print_table(title: str, result: dict) -> None:
    print(title)
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}")


def add_bench_args(sub: argparse._SubParsersAction, add_engine_args) -> None:
    from dsaserve.bench_longctx import add_longctx_args
    from dsaserve.bench_serve import add_serve_bench_args

    bench = sub.add_parser("bench", help="measure throughput, latency or long context offline, or load a server")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    add_serve_bench_args(kinds)
    add_longctx_args(kinds, add_engine_args)
    for kind in ("throughput", "latency"):
        p = kinds.add_parser(kind)
        add_engine_args(p)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--output-json", default=None, help="also write the result to this file")
        if kind == "throughput":
            p.add_argument("--num-prompts", type=int, default=16)
        else:
            p.add_argument("--batch-size", type=int, default=1)
            p.add_argument("--num-iters", type=int, default=3)
            p.add_argument("--num-iters-warmup", type=int, default=1)


def cmd_bench(args: argparse.Namespace, make_engine_kwargs) -> int:
    from dsaserve import LLM

    if args.bench_kind == "serve":
        from dsaserve.bench_serve import cmd_bench_serve

        return cmd_bench_serve(args)
    engine_kwargs = make_engine_kwargs(args)
    if args.bench_kind == "longctx":
        from dsaserve.bench_longctx import cmd_longctx

        return cmd_longctx(args, engine_kwargs)
    llm = LLM(args.model, **engine_kwargs)
    if args.bench_kind == "throughput":
        result = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
    else:
        result = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                             args.num_iters_warmup, args.seed)
    result["dtype"] = str(llm.engine.dtype).removeprefix("torch.")
    result["attention_backend"] = llm.engine.model.backend.name
    print_table(f"dsaserve bench {args.bench_kind}: {llm.engine.model_dir}", result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
