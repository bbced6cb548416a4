"""`dsaserve bench {throughput,latency,serve,longctx}`: offline engine runs, a server load, long context."""

from __future__ import annotations

import argparse

from dsaserve.bench.longctx import add_longctx_args, cmd_longctx
from dsaserve.bench.offline import add_offline_args, cmd_offline
from dsaserve.bench.serve import add_serve_bench_args, cmd_bench_serve


def add_bench_args(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure throughput, latency or long context offline, or load a server")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    add_serve_bench_args(kinds)
    add_longctx_args(kinds)
    add_offline_args(kinds)
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_kind == "serve":
        return cmd_bench_serve(args)
    if args.bench_kind == "longctx":
        return cmd_longctx(args)
    return cmd_offline(args)
