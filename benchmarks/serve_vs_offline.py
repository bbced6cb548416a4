"""Server overhead: `dsaserve bench serve` against `dsaserve serve` vs the same load through LLM.generate.

    python benchmarks/serve_vs_offline.py

Same ~215M checkpoint as benchmarks/model_core.py. 16 concurrent streams of 256 prompt + 128 output
tokens (greedy, eos ignored), the same token ids on both sides, prefix caching off on both so repeats
measure the same work. The offline runs go first, in this process; then the server runs alone in its
own process and is loaded over HTTP from this one (the load generator shares the machine's cores with
the server). Each side runs ROUNDS times and the best round is reported, to damp the machine's noise.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))

STREAMS, INPUT, OUTPUT, ROUNDS = 16, 256, 128, 2
ENGINE_ARGS = ["--max-model-len", "4096", "--kv-cache-memory", "256MiB", "--no-enable-prefix-caching"]


def offline_throughput(path: str) -> float:
    from dsaserve import LLM, SamplingParams
    from dsaserve.bench.serve import make_prompt

    rng = random.Random(0)
    prompts = [make_prompt(rng, INPUT, "ids") for _ in range(STREAMS)]
    llm = LLM(path, progress=False, max_model_len=4096, kv_cache_memory="256MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(ROUNDS):
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        best = max(best, STREAMS * OUTPUT / (time.perf_counter() - start))
    return best


def server_load(path: str, port: int = 8765) -> dict:
    from dsaserve.bench.serve import run_load

    proc = subprocess.Popen([sys.executable, "-m", "dsaserve", "serve", path, "--port", str(port),
                             "--served-model-name", "bench", *ENGINE_ARGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(run_load(url, "bench", 2, 16, 4, 2, None, None, "ids", 1))  # warm-up
        rounds = [asyncio.run(run_load(url, "bench", STREAMS, INPUT, OUTPUT, STREAMS, None, None, "ids", 0))
                  for _ in range(ROUNDS)]
        return max(rounds, key=lambda r: r["output_tokens_per_s"])
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    import torch
    from model_core import checkpoint_dir

    torch.set_num_threads(os.cpu_count() or 1)
    path = checkpoint_dir()
    offline = offline_throughput(path)
    served = server_load(path)
    print(f"{STREAMS} concurrent streams, {INPUT} prompt + {OUTPUT} output tokens, greedy")
    print(f"offline LLM.generate: {offline:.1f} output tok/s")
    print(f"dsaserve serve:       {served['output_tokens_per_s']:.1f} output tok/s "
          f"({served['completed']} completed, {served['errors']} errors)")
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        print(f"  {name}: p50 {served[name + '_p50']:.1f}  p90 {served[name + '_p90']:.1f}  "
              f"p99 {served[name + '_p99']:.1f}")
    print(f"server / offline throughput: {served['output_tokens_per_s'] / offline:.1%}")


if __name__ == "__main__":
    main()
