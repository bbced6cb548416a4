"""Prefix-cache speed-up: 8 requests sharing a 2,048-token prefix, prefix caching on vs off.

    python benchmarks/prefix_cache.py

Same ~215M checkpoint as benchmarks/model_core.py. Each request is the shared 2,048-token prefix
plus 32 tokens of its own, and generates 16 tokens. One request with the prefix is served first (the
prefix a deployment's system prompt leaves in the cache); then the 8 arrive together and are timed:
time to the last first token (TTFT of the batch) and total time, with prefix caching on and off.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

PREFIX, OWN, OUTPUT, REQUESTS = 2048, 32, 16, 8


def measure(path: str, prefix_caching: bool) -> dict:
    import torch

    from dsaserve import LLM, SamplingParams

    llm = LLM(path, progress=False, max_model_len=4096, kv_cache_memory="512MiB", enable_prefix_caching=prefix_caching)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    prefix = torch.randint(100, vocab, (PREFIX,), generator=g).tolist()
    own = torch.randint(100, vocab, (REQUESTS + 1, OWN), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    llm.generate(prompt_token_ids=prefix + own[-1], sampling_params=params, use_tqdm=False)  # warms the cache
    start = time.perf_counter()
    for i in range(REQUESTS):
        engine.add_request(f"r{i}", prefix + own[i], params)
    first, started = None, set()
    hits = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            hits = max(hits, out.metrics["num_prefix_hit_tokens"])
            if any(c.token_ids for c in out.outputs):
                started.add(out.request_id)
        if first is None and len(started) == REQUESTS:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"prefix_caching": prefix_caching, "batch_ttft_s": (first or end) - start, "total_s": end - start,
            "hit_tokens_per_request": hits}


def main() -> None:
    import torch
    from model_core import checkpoint_dir

    torch.set_num_threads(os.cpu_count() or 1)
    path = checkpoint_dir()
    on, off = measure(path, True), measure(path, False)
    print(f"{REQUESTS} requests = shared {PREFIX}-token prefix + {OWN} own tokens, {OUTPUT} output tokens each")
    print(f"{'prefix caching':<16}{'hit tokens/req':>16}{'batch TTFT s':>14}{'total s':>10}")
    for r in (on, off):
        print(f"{'on' if r['prefix_caching'] else 'off':<16}{r['hit_tokens_per_request']:>16}"
              f"{r['batch_ttft_s']:>14.2f}{r['total_s']:>10.2f}")
    print(f"speed-up: TTFT {off['batch_ttft_s'] / on['batch_ttft_s']:.1f}×, "
          f"total {off['total_s'] / on['total_s']:.1f}×")


if __name__ == "__main__":
    main()
