"""KDA's delta rule alone: the native kda_delta against the chunked torch form it replaced, on the same random
inputs (one request's rows, every head's state carried in), the two taking turns.

    python benchmarks/kda_delta.py [--tokens 1024] [--heads 64] [--head-dim 128] [--rounds 3]

Gates in KDA's lower-bounded range (-5 to 0), q and k L2-normalised as the layer prepares them. Prints seconds per
call for each round.
"""

from __future__ import annotations

import argparse
import time

import torch

from dsaserve.attention import delta_rule
from dsaserve.native import torch_ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not torch_ops.load():
        raise SystemExit(f"the native operators are unavailable: {torch_ops.unavailable()}")
    g = torch.Generator().manual_seed(0)
    shape = (args.tokens, args.heads, args.head_dim)
    q, k = delta_rule.prepare(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    v, gate = torch.randn(shape, generator=g), -5 * torch.rand(shape, generator=g)
    beta = torch.rand(args.tokens, args.heads, generator=g)
    start = torch.randn(args.heads, args.head_dim, args.head_dim, generator=g)
    paths = {"native kda_delta": lambda s: torch.ops.dsaserve.kda_delta(q, k, v, gate, beta, s),
             "torch, chunked": lambda s: delta_rule.chunked(q, k, v, gate, beta, s)}
    print(f"{args.tokens} tokens × {args.heads} heads of {args.head_dim} × {args.head_dim}, "
          f"{torch.get_num_threads()} threads, cpu_kernels {torch_ops.cpu_kernels()}")
    with torch.no_grad():
        for r in range(args.rounds):
            for name, run in paths.items():
                state = start.clone()
                t0 = time.perf_counter()
                run(state)
                print(f"round {r + 1}  {name:>18}: {time.perf_counter() - t0:.3f} s", flush=True)


if __name__ == "__main__":
    main()
