"""`dsaserve bench throughput` and `dsaserve bench latency`: offline measurements of the engine.

Prompts are random token ids (so any checkpoint works without a dataset); generation ignores eos so
every request produces exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

from dsaserve.bench.common import percentile, print_table, random_prompts, write_json
from dsaserve.engine_args import EngineArgs
from dsaserve.sampling_params import SamplingParams


def run_throughput(llm, num_prompts: int, input_len: int, output_len: int, seed: int) -> dict:
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
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts, tpots = [], []
    for it in tqdm(range(warmup + iters), desc="Latency", unit="iter"):
        prompts = random_prompts(batch_size, input_len, engine.config.vocab_size, seed + it)
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"lat-{it}-{i}", p, params)
        first, started = None, set()
        while engine.has_unfinished_requests():
            started.update(out.request_id for out in engine.step() if any(c.token_ids for c in out.outputs))
            if first is None and len(started) == len(prompts):
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


def add_offline_args(kinds: argparse._SubParsersAction) -> None:
    for kind in ("throughput", "latency"):
        p = kinds.add_parser(kind)
        EngineArgs.add_cli_args(p)
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
        p.add_argument("--output-json", default=None, help="also write the result to this file")
        if kind == "throughput":
            p.add_argument("--num-prompts", type=int, default=16)
        else:
            p.add_argument("--batch-size", type=int, default=1)
            p.add_argument("--num-iters", type=int, default=3)
            p.add_argument("--num-iters-warmup", type=int, default=1)


def cmd_offline(args: argparse.Namespace) -> int:
    from dsaserve.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    if args.bench_kind == "throughput":
        result = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.seed)
    else:
        result = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.num_iters,
                             args.num_iters_warmup, args.seed)
    result["dtype"] = str(llm.engine.dtype).removeprefix("torch.")
    result["attention_backend"] = llm.engine.model.backend.name
    result.update(spec_decode_result(llm.engine.stats().spec_decode))
    print_table(f"dsaserve bench {args.bench_kind}: {llm.engine.model_dir}", result)
    write_json(args.output_json, result)
    return 0


def spec_decode_result(spec) -> dict:
    """Acceptance of speculative decoding over the run (nothing without it)."""
    if not spec.num_speculative_tokens:
        return {}
    rate = [round(a / spec.num_drafts, 3) if spec.num_drafts else 0.0 for a in spec.accepted_per_pos]
    return {"spec_decode_mean_accepted_length": spec.mean_accepted_length,
            "spec_decode_acceptance_per_position": rate, "spec_decode_num_drafts": spec.num_drafts}
