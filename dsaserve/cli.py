"""The `dsaserve` command line: serve, generate, bench, doctor, worker, build-demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dsaserve.bench import add_bench_args
from dsaserve.chat_format import BUILT_IN_ENCODINGS
from dsaserve.config import SUPPORTED_MODEL_TYPES
from dsaserve.engine_args import EngineArgs, parse_bytes
from dsaserve.native.torch_ops import CPU_ISAS
from dsaserve.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS


def json_list(text: str) -> list[str]:
    """A CLI value given as a JSON list of strings, as vLLM's CORS flags take it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}; give e.g. '[\"https://example.com\"]'") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON list of strings")
    return value


def size(text: str) -> int:
    """A CLI size in bytes: a number, or e.g. '64MiB', '1GB'."""
    try:
        return parse_bytes(text, field="size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_generate(args: argparse.Namespace) -> int:
    from dsaserve import LLM, SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Hello, my name is"]
    for out in llm.generate(prompts, params, use_tqdm=False):
        if len(prompts) > 1:
            print(f"--- prompt: {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from dsaserve.engine.workers.node import torchrun_overrides, torchrun_rank
    from dsaserve.server.launcher import serve
    from dsaserve.server.state import ServerConfig

    overrides = {}
    if (launched := torchrun_rank()) is not None:  # torchrun started every rank: rank 0 serves
        overrides = torchrun_overrides()
        if args.tensor_parallel_size not in (1, overrides["tensor_parallel_size"]):
            raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} but torchrun started "
                             f"{overrides['tensor_parallel_size']} ranks; they must agree")
        rank, local_rank = launched
        if rank != 0:
            from dsaserve.engine.workers.worker_process import run_worker

            return run_worker(rank, local_rank, overrides["master_addr"], overrides["master_port"], args.model,
                              world_size=overrides["tensor_parallel_size"])

    config = ServerConfig(
        model_name=args.served_model_name, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
        body_timeout=args.request_body_timeout,
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        idle_shutdown=args.idle_shutdown, allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        shutdown_timeout=args.shutdown_timeout, allowed_hosts=args.allowed_hosts,
        responses_store_max_bytes=args.responses_store_max_bytes, header_timeout=args.header_timeout,
        max_connections=args.max_connections,
    )
    return serve(EngineArgs.from_cli_args(args, **overrides), config, host=args.host, port=args.port,
                 chat_template=args.chat_template, tokenizer_mode=args.tokenizer_mode)


def cmd_worker(args: argparse.Namespace) -> int:
    from dsaserve.distributed.parallel_config import ParallelConfig
    from dsaserve.engine.workers.node import run_node

    parallel = ParallelConfig(args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
                              master_addr=args.master_addr, master_port=args.master_port)
    return run_node(parallel, args.model)


def cmd_doctor(args: argparse.Namespace) -> int:
    from dsaserve.distributed.parallel_config import ParallelConfig
    from dsaserve.doctor import report

    parallel = ParallelConfig(args.tensor_parallel_size, args.enable_expert_parallel, args.decode_context_parallel_size)
    text, ok = report(args.model, hf_overrides=args.hf_overrides, max_model_len=args.max_model_len, parallel=parallel,
                      device_memory=parse_bytes(args.device_memory, "device_memory"),
                      utilization=args.memory_utilization, cpu_isa=args.cpu_isa)
    print(text)
    return 0 if ok else 1


def cmd_build_demo(args: argparse.Namespace) -> int:
    if args.train and args.model_type != "glm_moe_dsa":
        raise ValueError(f"--train with --model-type {args.model_type}: the demo trainer trains the GLM demo model "
                         "only; drop --train for random weights in that layout")
    if args.train:
        from dsaserve.demo.train import TrainConfig, train

        defaults = TrainConfig()
        steps = args.steps or defaults.steps
        share = 1.0 if args.steps is None else steps / defaults.steps  # phases keep their shares of a shorter run
        train(args.path, TrainConfig(seed=args.seed, steps=steps, threads=args.threads, **{
            phase: round(getattr(defaults, phase) * share)
            for phase in ("dense_steps", "copy_steps", "chain_steps", "skills_steps")}))
        print(f"trained demo checkpoint written to {args.path}")
    elif args.random or args.model_type != "glm_moe_dsa":
        import torch

        from dsaserve.demo import random_demo_config
        from dsaserve.demo.checkpoint_builder import build_checkpoint

        build_checkpoint(args.path, seed=args.seed, dtype=getattr(torch, args.dtype), include_mtp=True,
                         **random_demo_config(args.model_type))
        print(f"random-weight {args.model_type} demo checkpoint written to {args.path}")
    else:
        import shutil

        from dsaserve.demo import demo_model_dir

        shutil.copytree(demo_model_dir(), args.path, dirs_exist_ok=True)
        print(f"demo checkpoint copied to {args.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsaserve", description="Serve GLM-5.x sparse-attention models.")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (the demo model when no MODEL is given)")
    EngineArgs.add_cli_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or DSASERVE_API_KEY)")
    srv.add_argument("--chat-template", default=None, help="jinja file overriding the checkpoint's chat template")
    srv.add_argument("--reasoning-parser", default="auto", choices=("auto", *REASONING_PARSERS),
                     help="auto: the model family's (glm45 for GLM, deepseek_v3 for DeepSeek-V3.2)")
    srv.add_argument("--tool-call-parser", default="auto", choices=("auto", *TOOL_CALL_PARSERS),
                     help="auto: the model family's (glm47 for GLM, deepseek_v32 for DeepSeek-V3.2's DSML)")
    srv.add_argument("--tokenizer-mode", default="auto", choices=("auto", *BUILT_IN_ENCODINGS),
                     help="deepseek_v32: encode chats with DeepSeek-V3.2's own encoding whatever template the "
                          "checkpoint ships (auto uses it when it ships none)")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 << 20)
    srv.add_argument("--request-body-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="a client that has not sent its whole request body by then gets 408")
    srv.add_argument("--allowed-origins", type=json_list, default=["*"],
                     help='CORS origins, a JSON list (default ["*"])')
    srv.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods, a JSON list")
    srv.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers, a JSON list")
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    srv.add_argument("--idle-shutdown", type=float, default=None, metavar="SECONDS",
                     help="exit cleanly after this long with nothing running, waiting or arriving")
    srv.add_argument("--shutdown-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="after SIGTERM, how long running requests may take to finish (new ones get 503); past "
                          "it they end with an error and the exit code is 3 (default 600)")
    srv.add_argument("--allowed-hosts", type=json_list, default=None,
                     help='Host header names answered, a JSON list (default: the loopback names when --host is '
                          'loopback, any otherwise; ["*"]: any)')
    srv.add_argument("--responses-store-max-bytes", type=size, default="64MiB", metavar="SIZE",
                     help="stored /v1/responses conversations (for previous_response_id), at most this much JSON "
                          "together, oldest dropped first (default 64MiB)")
    srv.add_argument("--header-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="close a connection that has not sent a request's headers within this long (default 30)")
    srv.add_argument("--max-connections", type=int, default=1000,
                     help="open connections at most; one past it is answered 503 and closed (default 1000)")
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate a completion offline")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)

    doc = sub.add_parser("doctor", help="check a checkpoint directory before loading it")
    doc.add_argument("model", help="checkpoint directory (config.json is enough)")
    doc.add_argument("--hf-overrides", default=None)
    doc.add_argument("--max-model-len", type=int, default=None)
    doc.add_argument("--tensor-parallel-size", type=int, default=1, help="print each rank's share for this many ranks")
    doc.add_argument("--decode-context-parallel-size", type=int, default=1)
    doc.add_argument("--enable-expert-parallel", action="store_true")
    doc.add_argument("--device-memory", default=None, help="memory per rank, e.g. 141GB: how much context fits")
    doc.add_argument("--memory-utilization", type=float, default=0.9,
                     help="fraction of --device-memory for the weights, the largest step's activations and the KV "
                          "cache (the engine's --gpu-memory-utilization)")
    doc.add_argument("--cpu-isa", default="auto", choices=CPU_ISAS,
                     help="the CPU kernels' body family to report on, as the engine option chooses it")
    doc.set_defaults(func=cmd_doctor)

    wrk = sub.add_parser("worker", help="run the ranks of one more node for a server started with --nnodes "
                                        "(the engine's other arguments come from node 0)")
    wrk.add_argument("model", nargs="?", default=None,
                     help="this node's copy of the checkpoint (default: node 0's path)")
    wrk.add_argument("--tensor-parallel-size", type=int, required=True)
    wrk.add_argument("--nnodes", type=int, required=True)
    wrk.add_argument("--node-rank", type=int, required=True)
    wrk.add_argument("--master-addr", required=True, help="node 0's address")
    wrk.add_argument("--master-port", type=int, required=True)
    wrk.set_defaults(func=cmd_worker)

    add_bench_args(sub)

    demo = sub.add_parser("build-demo", help="write the built-in demo checkpoint to a directory (a copy of the "
                                             "shipped one, random weights, or trained anew)")
    demo.add_argument("path")
    demo.add_argument("--seed", type=int, default=1234)
    demo.add_argument("--random", action="store_true", help="random weights (the earlier demo geometry)")
    demo.add_argument("--model-type", default="glm_moe_dsa", choices=SUPPORTED_MODEL_TYPES,
                      help="the checkpoint's family: deepseek_v32 writes random weights in DeepSeek-V3.2's layout "
                           "(every layer its own indexer, grouped routing, no chat template: its own encoding)")
    demo.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                      help="weight dtype (with --random)")
    demo.add_argument("--train", action="store_true",
                      help="train the demo model on its synthetic tasks (CPU, about 66 minutes on 2 cores) "
                           "instead of writing random weights")
    demo.add_argument("--steps", type=int, default=None, help="training steps (with --train)")
    demo.add_argument("--threads", type=int, default=2, help="torch threads for training (results depend on it)")
    demo.set_defaults(func=cmd_build_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from dsaserve.distributed.process_group import RankFailure
    from dsaserve.engine.workers.executor import ExecutorFailure

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RankFailure, ExecutorFailure) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
