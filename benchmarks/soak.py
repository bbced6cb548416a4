"""Soak: minutes of mixed, partly hostile load on `dsaserve serve`, with the server's RSS sampled.

    python benchmarks/soak.py [--minutes 10] [--clients 8] [--model PATH]

Each client loops: a chat or completion request with random sampling parameters (temperature, top_p,
top_k, min_p, seed, n, penalties, logprobs, stop strings, max_tokens), streamed or not; 20% of the
streamed ones disconnect mid-stream; 10% of all requests are deliberately invalid and must get a 4xx.
Afterwards the script waits for the server to go idle and checks that no request runs and no KV block
is held. It reports the status counts, anything unexpected, and the RSS slope after a warm-up
(least squares over the samples after the first quarter of the run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_process import ServerProcess  # noqa: E402

WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this".split()
INVALID = [  # each must be a 4xx
    {"seed": 2**70}, {"temperature": -1}, {"n": 0}, {"top_p": 0}, {"max_tokens": 10**9},
    {"logit_bias": {"999999999": 1}}, {"structured_outputs": {"regex": "(?<=a)b"}},
    {"chat_template_kwargs": {"messages": []}}, {"stop_token_ids": [-5]}, {"model": "not-this-one"},
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def random_request(rng: random.Random) -> tuple[str, dict, bool]:
    """(path, body, expect_4xx)."""
    chat = rng.random() < 0.5
    body = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.3, 0.7, 1.0, 1.5]),
            "top_p": rng.choice([1.0, 0.9, 0.5]), "top_k": rng.choice([-1, 0, 5, 50, 2**40]),
            "min_p": rng.choice([0.0, 0.05]), "n": rng.choice([1, 1, 1, 2, 3]),
            "presence_penalty": rng.choice([0, 0.5]), "frequency_penalty": rng.choice([0, 0.3]),
            "repetition_penalty": rng.choice([1.0, 1.1]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**63)
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text(rng, rng.randint(1, 60))}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    else:
        path = "/v1/completions"
        body["prompt"] = text(rng, rng.randint(1, 60))
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
    invalid = rng.random() < 0.1
    if invalid:
        body.update(rng.choice([bad for bad in INVALID if chat or "chat_template_kwargs" not in bad]))
    return path, body, invalid


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.unexpected: list[str] = []

    def add(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
            if problem and len(self.unexpected) < 20:
                self.unexpected.append(problem)


def one(client: httpx.Client, url: str, rng: random.Random, tally: Tally) -> None:
    path, body, invalid = random_request(rng)
    body.setdefault("model", "soak")
    if body["stream"]:
        drop_after = rng.randint(1, 5) if rng.random() < 0.2 else None
        with client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                response.read()
                return check(tally, response.status_code, response.text, invalid, body)
            chunks = 0
            for line in response.iter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    tally.add("in-band error", f"stream error for {body}: {line[:300]}")
                chunks += line.startswith("data: ")
                if drop_after is not None and chunks >= drop_after:
                    return tally.add("disconnected")  # closing the stream here drops the connection
        return check(tally, 200, "", invalid, body)
    response = client.post(url + path, json=body)
    check(tally, response.status_code, response.text, invalid, body)


def check(tally: Tally, status: int, text_: str, invalid: bool, body: dict) -> None:
    if invalid:
        ok = 400 <= status < 500 and "error" in text_
    else:
        ok = status == 200
    tally.add(str(status), None if ok else f"{status} for {json.dumps(body)[:300]}: {text_[:300]}")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    t = [s[0] / 60 for s in samples]
    r = [s[1] for s in samples]
    mt, mr = statistics.mean(t), statistics.mean(r)
    return sum((a - mt) * (b - mr) for a, b in zip(t, r)) / sum((a - mt) ** 2 for a in t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    args = parser.parse_args()
    if args.model is None:
        from dsaserve.demo import demo_model_dir

        args.model = demo_model_dir()
    server = ServerProcess(args.model, "--served-model-name", "soak", "--max-model-len", "1024",
                           "--block-size", "64", "--dtype", "auto").wait_ready()
    tally, stop = Tally(), time.monotonic() + args.minutes * 60
    samples: list[tuple[float, float]] = []
    start = time.monotonic()

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as client:
            while time.monotonic() < stop:
                try:
                    one(client, server.url, rng, tally)
                except httpx.HTTPError as e:
                    tally.add("transport error", f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            samples.append((time.monotonic() - start, rss_mib(server.proc.pid)))
            time.sleep(5)
        for t in threads:
            t.join()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = server.metrics()
            idle = (m["dsaserve:num_requests_running"], m["dsaserve:num_requests_waiting"],
                    m["dsaserve:kv_cache_usage_perc"]) == (0, 0, 0)
            if idle:
                break
            time.sleep(0.5)
        samples.append((time.monotonic() - start, rss_mib(server.proc.pid)))
    finally:
        server.stop()
    after_warmup = [s for s in samples if s[0] >= args.minutes * 60 / 4]
    print(f"{args.minutes:g} minutes, {args.clients} clients, model {args.model}")
    print("responses:", dict(sorted(tally.counts.items())))
    print(f"idle afterwards (no request running or waiting, no KV block held): {idle}")
    print(f"server RSS MiB: start {samples[0][1]:.0f}, after warm-up {after_warmup[0][1]:.0f}, "
          f"end {samples[-1][1]:.0f}, max {max(s[1] for s in samples):.0f}; "
          f"slope after warm-up {slope_mib_per_min(after_warmup):+.2f} MiB/min")
    print("unexpected:", tally.unexpected or "none")
    sys.exit(0 if idle and not tally.unexpected else 1)


if __name__ == "__main__":
    main()
