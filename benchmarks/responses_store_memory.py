"""The server's resident memory while clients fill the /v1/responses store.

    python benchmarks/responses_store_memory.py [--tree .] [--model DIR] [--requests 100] [--field-mb 3.9]
                                                [--store-max-bytes 64MiB]

Starts `dsaserve serve` from --tree (a checkout: PYTHONPATH is set to it, so an older tree can be compared) and
reads its RSS from /proc before and after --requests responses whose function_call carries a --field-mb call_id
(never rendered, so the context limit does not see it) with its function_call_output: the second hostile probe's
finding. Prints the status counts and the RSS growth in MiB.

(Stored conversations of rendered text are bounded by the context and then by --responses-store-max-bytes; RSS
cannot show that bound below the few hundred MiB that the allocators keep after a few long prefills, so the store's
accounting is a unit test, tests/test_responses_api.py.)
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_process import free_port  # noqa: E402
from soak import rss_mib  # noqa: E402


def start(tree: str, model: str | None, store_max_bytes: str, port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "dsaserve", "serve", *([model] if model else []), "--port", str(port),
            *(["--responses-store-max-bytes", store_max_bytes] if store_max_bytes != "none" else [])]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    proc = subprocess.Popen(args, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
    raise TimeoutError("the server did not start")


def posted(url: str, pid: int, bodies) -> tuple[dict, float]:
    before, statuses = rss_mib(pid), collections.Counter()
    for body in bodies:
        statuses[httpx.post(url + "/v1/responses", json=body, timeout=300).status_code] += 1
    time.sleep(1)
    return dict(statuses), rss_mib(pid) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=".")
    ap.add_argument("--model", default=None, help="a checkpoint (default: the demo model)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--field-mb", type=float, default=3.9, help="(twice this must fit --max-request-body-bytes)")
    ap.add_argument("--store-max-bytes", default="64MiB", help="'none': do not pass the flag (a tree without it)")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(args.tree, args.model, args.store_max_bytes, port)
    try:
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        call_id = "c" * int(args.field_mb * (1 << 20))
        tool = {"type": "function", "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
        unrendered = ({"model": name, "max_output_tokens": 1, "tools": [tool], "input": [
            {"role": "user", "content": f"weather? {k}"},
            {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call_id, "output": "sunny"}]} for k in range(args.requests))
        statuses, grew = posted(url, proc.pid, unrendered)
        print(f"{args.requests} x {args.field_mb:g} MB call_id: statuses {statuses}, RSS grew {grew:.1f} MiB")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
