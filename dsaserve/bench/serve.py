"""`dsaserve bench serve --base-url URL`: a streaming load generator for any OpenAI-compatible server.

Sends /v1/completions requests with random token-id prompts (or random-word text prompts with
`--prompt-format text`, for servers that take no token ids), `ignore_eos` and a fixed `max_tokens`,
either with a fixed number in flight (`--max-concurrency`) or arriving as a Poisson process
(`--request-rate`). Reports throughput, TTFT, TPOT and inter-token latency percentiles, and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from dsaserve.bench.common import percentile, print_table, write_json

if TYPE_CHECKING:  # imported where a load runs: the offline benches (and a GPU machine without it) do not need it
    import httpx

WORDS = ("the of and to in is that for it as with was on be by at this are from or have an they which one "
         "you were all we when there can been has more if no would what their about out up into them time").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, payload: dict, headers: dict) -> RequestResult:
    import httpx

    start = time.perf_counter()
    first = last = None
    itls, tokens = [], 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a chunk per step that produced tokens (its text may be held back)
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itls.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    return RequestResult(True, ttft=(first or end) - start, latency=end - start, output_tokens=tokens, itls=itls)


def make_prompt(rng: random.Random, length: int, fmt: str):
    if fmt == "ids":
        return [rng.randrange(50, 500) for _ in range(length)]  # inside any real vocabulary
    return " ".join(rng.choice(WORDS) for _ in range(length))


async def run_load(base_url: str, model: str, num_prompts: int, input_len: int, output_len: int,
                   max_concurrency: int | None, request_rate: float | None, api_key: str | None,
                   prompt_format: str, seed: int) -> dict:
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    payloads = [{"model": model, "prompt": make_prompt(rng, input_len, prompt_format), "max_tokens": output_len,
                 "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                for _ in range(num_prompts)]
    limit = asyncio.Semaphore(max_concurrency or num_prompts)
    bar = tqdm(total=num_prompts, desc="Requests", unit="req")

    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def issue(payload, delay):
            await asyncio.sleep(delay)
            async with limit:
                result = await one_request(client, url, payload, headers)
            bar.update(1)
            return result

        delays, t = [], 0.0
        for _ in payloads:
            delays.append(t)
            if request_rate:
                t += rng.expovariate(request_rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(issue(p, d) for p, d in zip(payloads, delays)))
        duration = time.perf_counter() - start
    bar.close()
    good = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    itls = [x for r in good for x in r.itls]
    out_tokens = sum(r.output_tokens for r in good)
    summary = {
        "num_prompts": num_prompts, "completed": len(good), "errors": len(results) - len(good),
        "duration_s": duration, "request_throughput": len(good) / duration,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + len(good) * input_len) / duration,
    }
    for name, values in (("ttft_ms", [r.ttft for r in good]), ("tpot_ms", tpots), ("itl_ms", itls)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}"] = percentile(values, q) * 1000 if values else 0.0
    if len(good) < len(results):
        summary["first_error"] = next(r.error for r in results if not r.ok)
    return summary


def add_serve_bench_args(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("serve", help="load an OpenAI-compatible server over HTTP")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests/s, Poisson arrivals (default: all at once)")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = args.model
    if model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    result = asyncio.run(run_load(args.base_url, model, args.num_prompts, args.input_len, args.output_len,
                                  args.max_concurrency, args.request_rate, args.api_key, args.prompt_format, args.seed))
    print_table(f"dsaserve bench serve: {args.base_url} ({model})", result)
    write_json(args.output_json, result)
    return 0 if result["errors"] == 0 else 1
