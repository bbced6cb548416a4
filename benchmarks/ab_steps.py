"""Two builds' decode steps taking turns a few steps at a time, each in its own live process.

    python benchmarks/ab_steps.py --a /tmp/before --b . [--quantization int4] [--batch 1] [--checkpoint DIR]
                                  [--turns 60]

This machine's speed moves by 1.5x between minutes, so two builds timed one after the other (or one process
after another) differ by more than most changes do. Here both builds are loaded at once, each in a process of
its own (PYTHONPATH set to its tree), decoding --batch requests of the same 128-token prompt (a request
replaced by a new one as it ends); they take turns of --steps steps
(the other process waits), --turns times, so both meet the same minutes. Reports each build's median step over
all its turns and how many turns each won (the same turn index, compared step medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, statistics, sys, time
try:
    from dsaserve.engine.llm_engine import LLMEngine
except ImportError:  # a build from before engine/ was split by concern
    from dsaserve.engine.engine import LLMEngine
from dsaserve.engine_args import EngineArgs
from dsaserve.sampling_params import SamplingParams
checkpoint, quantization = sys.argv[1], (None if sys.argv[2] == "none" else sys.argv[2])
batch = int(sys.argv[3])
engine = LLMEngine(EngineArgs(model=checkpoint, kv_cache_memory="512MiB", max_model_len=4096, progress=False,
                              quantization=quantization))
prompt = list(range(10, 138))
def request(i):
    engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(5):
        engine.step()
count = 0
for count in range(batch):
    request(count)
print("ready", flush=True)
for line in sys.stdin:
    steps, times = int(line), []
    for _ in range(steps):
        while len(engine.scheduler.requests) < batch:  # (400 tokens: the context stays short)
            count += 1
            request(count)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(json.dumps(times), flush=True)
"""


def start(tree: str, checkpoint: str, quantization: str, batch: int, settings: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), **dict(s.split("=", 1) for s in settings))
    worker = subprocess.Popen([sys.executable, "-c", WORKER, checkpoint, quantization, str(batch)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert worker.stdout.readline().strip() == "ready"
    return worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True, help="a source tree (its dsaserve/ is imported)")
    parser.add_argument("--b", required=True)
    parser.add_argument("--a-env", nargs="*", default=[], help="NAME=VALUE settings for a's process")
    parser.add_argument("--b-env", nargs="*", default=[], help="NAME=VALUE settings for b's process")
    parser.add_argument("--quantization", default="int4", help="int4, int8, fp8 or none")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--checkpoint", default=None, help="default: benchmarks/model_core.py's model")
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if args.checkpoint is None:
        sys.path.insert(0, os.path.dirname(__file__))
        from model_core import checkpoint_dir
        args.checkpoint = str(checkpoint_dir())
    workers = {name: start(tree, args.checkpoint, args.quantization, args.batch, settings)
               for name, tree, settings in (("a", args.a, args.a_env), ("b", args.b, args.b_env))}
    medians = {name: [] for name in workers}
    for turn in range(args.turns):
        for name in (("a", "b") if turn % 2 == 0 else ("b", "a")):
            workers[name].stdin.write(f"{args.steps}\n")
            workers[name].stdin.flush()
            medians[name].append(statistics.median(json.loads(workers[name].stdout.readline())) * 1e3)
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    wins = sum(a < b for a, b in zip(medians["a"], medians["b"]))
    for name, tree in (("a", args.a), ("b", args.b)):
        print(f"{name} ({tree}): median step {statistics.median(medians[name]):.3f} ms over {args.turns} turns of "
              f"{args.steps} steps")
    print(f"a faster in {wins} of {args.turns} turns, b in {args.turns - wins}")


if __name__ == "__main__":
    main()
