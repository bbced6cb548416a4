"""The CUDA path's one prepared check: parity, kernels, speed and memory, in sections that each run in a child
process with their own time limit, so one failure or hang still leaves the others' numbers.

    bash benchmarks/gpu_check.sh OUT_DIR [--device cuda|cpu] [--budget SECONDS]

Writes OUT_DIR/results.json (every section's numbers, or its error and the log's tail) and OUT_DIR/summary.md (the
table docs/benchmarks.md records). `--device cpu` runs the same sections at small sizes, the Triton kernels under
Triton's interpreter: what CI runs so the script does not rot (its numbers say nothing about GPUs).

Sections: env (versions, device); parity (a generated fp32 checkpoint, 32 greedy tokens and their logprobs on the
device, Triton kernels on and off, against the CPU path; also an FP8 one and a GLM-5.3-Flash one); kernels (Triton
against the torch path at GLM-5.2's shapes: sparse MLA decode over 2,048 selected rows, a prefill chunk per query and
by tile unions at 8 and 16 heads, indexer scores at 64K); syncs (host synchronisations inside a decode step, counted
by torch.cuda.set_sync_debug_mode); profile (a decode step's most expensive kernels); latency and throughput (the
`small` checkpoint, GLM-5.2 per-head geometry, batch 1, 16, 64; with CUDA graphs and with --enforce-eager; the
default run's KV cache sized by gpu_memory_utilization 0.5, its measured step peak beside doctor's estimate);
transformers (its `generate` on the same checkpoint and batch); longctx (sparse against dense decode at 8K, 32K,
64K).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
WORK = os.environ.get("DSASERVE_BENCH_DIR", "/tmp/dsaserve-gpu-check")
SECTIONS = ("env", "parity", "kernels", "syncs", "profile", "latency", "transformers", "longctx")
# Share of the whole budget each section may take at most (they sum to 1: what a section leaves carries over to the
# later ones). Kernels compiles a dozen Triton specializations on a fresh machine before it times them.
SHARES = {"env": 0.03, "parity": 0.17, "kernels": 0.17, "syncs": 0.07, "profile": 0.06, "latency": 0.22,
          "transformers": 0.08, "longctx": 0.20}


def engine_options(device: str) -> dict:
    """What every engine of a section takes: on a GPU the native CPU operators off (their first use on a machine
    compiles them, minutes of the GPU's time, for load-time helpers that have torch forms)."""
    return {"native_kernels": "off"} if device == "cuda" else {}


class Progress(dict):
    """A section's results, written to OUT/NAME.partial.json as each one is added: a section that runs out of time
    still reports what it measured."""

    path: str | None = None

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.save()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            with open(self.path, "w") as f:
                json.dump(self, f, indent=1, default=str)


PROGRESS = Progress()


def graph_log_lines() -> list[str]:
    """The engines' "CUDA graphs: …" log lines from here on (what was captured, or why not), gathered in a list."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("CUDA graphs"):
                lines.append(message[:400])

    logging.getLogger("dsaserve").addHandler(Keep())
    return lines


def sizes(device: str) -> dict:
    """What each section runs at: the issue's sizes on a GPU, small ones on a CPU."""
    if device == "cuda":
        return dict(batches=[1, 16, 64], input_len=128, output_len=128, contexts=[8192, 32768, 65536],
                    parity_prompts=(90, 41), parity_steps=32, rows_batch=64, rows_cache=65536, score_context=65536,
                    heads=64, index_heads=32)
    return dict(batches=[1, 4], input_len=32, output_len=8, contexts=[256, 512], parity_prompts=(24, 20),
                parity_steps=3, rows_batch=2, rows_cache=512, score_context=256, heads=4, index_heads=4)


def small_checkpoint(device: str) -> str:
    """The `small` checkpoint (benchmarks/model_core.py: GLM-5.2 per-head geometry, 215M, bf16) on a GPU; the
    tests' tiny generated checkpoint (fp32) on a CPU."""
    if device == "cuda":
        os.environ.setdefault("DSASERVE_BENCH_DIR", WORK)
        from model_core import checkpoint_dir

        return checkpoint_dir()
    return tiny_checkpoint()


TINY_KINDS = {"plain": {}, "fp8": dict(fp8=True, intermediate_size=384, moe_intermediate_size=96),
              "flash": dict(model_type="glm5_next")}


def tiny_checkpoint(kind: str = "plain") -> str:
    """The tests' tiny generated checkpoint (fp32); fp8: its projections in FP8 blocks, widths past one block; flash:
    GLM-5.3-Flash's (KDA layers, pooled keys, mHC streams)."""
    from dsaserve.demo.checkpoint_builder import build_checkpoint

    path = os.path.join(WORK, f"tiny-{kind}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_checkpoint(path, seed=0, **TINY_KINDS[kind])
    return path


def peak_memory(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    return {"peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def section_env(device: str) -> dict:
    import torch

    import dsaserve.triton_ops as triton_ops

    info = {"torch": torch.__version__, "device": device, "triton": triton_ops.triton_imports() or "imports"}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__  # (the baseline section needs its glm_moe_dsa)
    except ImportError as error:
        info["transformers"] = f"does not import: {error}"
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return info


def greedy(path: str, device: str, triton: str, prompts, steps: int, native: str | None = None,
           eager: bool = False) -> tuple[list, list]:
    from dsaserve import LLM, SamplingParams

    # (a cache of its own size: several engines run in this process one after another, and by default each would
    # take gpu_memory_utilization's share of the GPU)
    options = engine_options(device) | ({} if native is None else {"native_kernels": native})
    llm = LLM(path, dtype="float32", device=device, block_size=16, max_model_len=256, triton_kernels=triton,
              enforce_eager=eager, progress=False, kv_cache_memory="1GiB" if device == "cuda" else None, **options)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)
    outs = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
    tokens = [o.token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]
    return tokens, logprobs


def section_parity(device: str) -> dict:
    """Greedy tokens and logprobs of the device path (Triton kernels on, their decode steps replayed from CUDA graphs
    on a GPU; on without graphs, --enforce-eager, on a GPU; off) against the CPU path, fp32; of an FP8 checkpoint,
    kept in FP8 on the Triton path, against the CPU's dequantized one; and of a GLM-5.3-Flash checkpoint."""
    import torch

    prompts = [torch.randint(30, 600, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in sizes(device)["parity_prompts"]]  # past the tiny checkpoint's index_topk (16)
    result = PROGRESS
    result["graph_log"] = graph_log_lines()
    plain = ("on", "on_eager", "off") if device == "cuda" else ("on", "off")  # (no graphs on a CPU)
    flash = ("on", "on_eager") if device == "cuda" else ("on",)
    for kind, modes in (("plain", plain), ("fp8", ("on",)), ("flash", flash)):
        path = tiny_checkpoint(kind)
        # The CPU reference with torch's operators: the native ones would first compile (minutes of the GPU's time).
        steps = sizes(device)["parity_steps"]
        cpu_tokens, cpu_logprobs = greedy(path, "cpu", "off", prompts, steps, native="off")
        for mode in modes:
            tokens, logprobs = greedy(path, device, mode.removesuffix("_eager"), prompts, steps,
                                      eager=mode.endswith("_eager"))
            diff = max(abs(a - b) for x, y in zip(logprobs, cpu_logprobs) for a, b in zip(x, y))
            result[f"{'' if kind == 'plain' else kind + '_'}triton_{mode}"] = {"tokens_identical": tokens == cpu_tokens,
                                                                              "max_logprob_diff": diff}
    return result


def timed(fn, device: str, repeat: int) -> float:
    """Median ms of fn() (after one warm-up call)."""
    import statistics

    import torch

    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def section_kernels(device: str) -> dict:
    """Each Triton kernel against the torch path it replaces, same inputs: ms and the largest difference."""
    import torch

    from dsaserve.attention.dense import attend_latent
    from dsaserve.triton_ops.index_scores import index_scores
    from dsaserve.triton_ops.row_topk import BINS, row_topk
    from dsaserve.triton_ops.selected_rows import attend_selected_rows

    s = sizes(device)
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    n, heads, width = s["rows_batch"], s["heads"], min(2048, s["rows_cache"])
    rows = torch.randn(s["rows_cache"], 576, device=device, dtype=dtype, generator=g)
    query = torch.randn(n, heads, 576, device=device, dtype=dtype, generator=g)
    slots = torch.randint(0, s["rows_cache"], (n, width), device=device, generator=g)
    out = torch.empty(n, heads, 512, device=device, dtype=dtype)
    scale = 576 ** -0.5

    def torch_rows():
        return attend_latent(query, rows[slots], None, scale, 512)

    triton_ms = timed(lambda: attend_selected_rows(query, rows, slots, scale, out), device, 5)
    torch_ms = timed(torch_rows, device, 5)
    difference = float((out.float() - torch_rows().float()).abs().max())
    result = PROGRESS
    result["sparse_decode"] = {"queries": n, "heads": heads, "selected": width, "triton_ms": triton_ms,
                               "torch_ms": torch_ms, "max_diff": difference}
    result.update(sparse_prefill(device, g))
    context, iheads, bs = s["score_context"], s["index_heads"], 64
    blocks = context // bs
    for kind, key_dtype in (("bf16", dtype), ("fp8", torch.float8_e4m3fn)):
        keys = torch.randn(blocks, bs, 128, device=device, generator=g).to(key_dtype)
        key_scales = torch.rand(blocks, bs, device=device, generator=g) if kind == "fp8" else None
        q = torch.randn(n, iheads, 128, device=device, dtype=dtype, generator=g)
        w = torch.rand(n, iheads, device=device, generator=g)
        tables = torch.randperm(blocks, device=device, generator=g)[None, :]
        requests = torch.zeros(n, dtype=torch.int64, device=device)
        positions = torch.full((n,), context - 1, dtype=torch.int64, device=device)
        scores = torch.empty(n, context, device=device)

        def torch_scores():
            k = keys[tables[0]].reshape(-1, 128).float()
            if key_scales is not None:
                k = k * key_scales[tables[0]].reshape(-1, 1)
            per_head = torch.relu(torch.einsum("thd,sd->ths", q, k.to(dtype)).float())
            return (per_head * w[:, :, None]).sum(1)

        counts = torch.zeros(n, BINS, dtype=torch.int32, device=device)
        chosen = torch.empty(n, min(2048, context // 4), dtype=torch.int32, device=device)

        def scores_and_counts():  # (the counts start from zeros, as the engine's do)
            counts.zero_()
            index_scores(q, w, keys, key_scales, tables, requests, positions, scores, counts)

        t_ms = timed(scores_and_counts, device, 5)
        r_ms = timed(torch_scores, device, 5)
        top_ms = timed(lambda: scores.topk(chosen.shape[1], dim=1), device, 5)
        radix_ms = timed(lambda: row_topk(scores, chosen.shape[1], chosen, counts), device, 5)
        # One row (a batch-1 decode step's full layer): the radix top-k runs one program per row, torch spreads a row
        # over the GPU; whether a row needs splitting across programs is this pair.
        one_ms = timed(lambda: row_topk(scores[:1], chosen.shape[1], chosen[:1], counts[:1]), device, 5)
        one_top_ms = timed(lambda: scores[:1].topk(chosen.shape[1], dim=1), device, 5)
        max_rel_diff = float(((scores - torch_scores()).abs().max() / torch_scores().abs().max()))
        result[f"index_scores_{kind}"] = {
            "queries": n, "context": context, "heads": iheads, "triton_ms": t_ms, "torch_ms": r_ms, "topk_ms": top_ms,
            "radix_topk_ms": radix_ms, "radix_topk_ms_1_row": one_ms, "topk_ms_1_row": one_top_ms,
            "max_rel_diff": max_rel_diff,
            **radix_agreement(q, keys, key_scales, tables, requests, scores, counts, chosen, g)}
    weight_products(device, g, result)
    return result


def radix_agreement(q, keys, key_scales, tables, requests, scores, counts, chosen, g) -> dict:
    """The scoring kernel's first histogram and the radix top-k against torch where every case shows: signed weights
    (negative scores), queries at staggered positions (-inf futures, programs wholly in them, rows with fewer
    candidates than k). The chosen values are compared, not positions (a tie may pick either)."""
    import torch

    from dsaserve.triton_ops.index_scores import index_scores
    from dsaserve.triton_ops.row_topk import row_topk, top_byte_counts

    n, k, context = q.shape[0], chosen.shape[1], scores.shape[1]
    staggered = torch.linspace(k // 2, context - 1, n, device=q.device).long()
    signed = torch.randn(n, q.shape[1], device=q.device, generator=g)
    counts.zero_()
    index_scores(q, signed, keys, key_scales, tables, requests, staggered, scores, counts)
    row_topk(scores, k, chosen, counts)
    picked = torch.where(chosen >= 0, scores.gather(1, chosen.clamp(min=0).long()), float("-inf"))
    expected = scores.topk(k, dim=1).values
    return {"counts_match": bool(torch.equal(counts, top_byte_counts(scores))),
            "radix_same_values": bool(torch.equal(picked.sort(dim=1).values, expected.sort(dim=1).values))}


def sparse_prefill(device: str, g) -> dict:
    """Sparse MLA on a prefill chunk whose neighbouring queries select mostly the same rows (as the indexer's
    selections do), at 8 heads (a rank's share of GLM-5.2's 64 at TP=8) and at 16: the per-query kernel (a 16-head
    tile per query, half masked at 8 heads, each query's rows read for it) against tiles of neighbouring queries
    reading their union once (union_rows.py: 4 queries × 8 heads or 2 × 16 a program), with the unions' build (a
    sort per tile, once per full layer: shared layers reuse it) timed apart, and the largest difference between the
    two outputs. The bytes say how far from the bandwidth bound the per-query reads are."""
    import torch

    from dsaserve.attention import tile_unions
    from dsaserve.attention.metadata import BatchMetadata
    from dsaserve.triton_ops.selected_rows import attend_selected_rows
    from dsaserve.triton_ops.union_rows import attend_union_rows
    from dsaserve.triton_ops.union_tiles import tile_queries

    n, context, width = (2048, 8192, 2048) if device == "cuda" else (8, 256, 32)
    block = 64
    meta = BatchMetadata.build([[0] * n], [context - n], [list(range(context // block))], block, [], device=device)
    rows = torch.randn(context, 576, device=device, dtype=torch.bfloat16, generator=g)  # slot = position here
    shared = torch.rand(context, device=device, generator=g)  # what every query of the chunk mostly agrees on
    scores = shared + 0.05 * torch.rand(n, context, device=device, generator=g)
    slots = scores.topk(width, dim=1).indices
    topk = slots.to(torch.int32)
    result = {"distinct_rows": int(torch.unique(slots).numel()), "queries": n, "selected": width}
    scale = 576 ** -0.5
    for heads in (8, 16):
        query = torch.randn(n, heads, 576, device=device, dtype=torch.bfloat16, generator=g)
        out = torch.empty(n, heads, 512, device=device, dtype=torch.bfloat16)
        by_union = torch.empty_like(out)
        queries = tile_queries(heads)

        def build():
            meta.derived.clear()
            return tile_unions.tile_unions(meta, topk, queries)

        result[f"triton_ms_{heads}_heads"] = timed(lambda: attend_selected_rows(query, rows, slots, scale, out),
                                                   device, 5)
        result[f"union_build_ms_{heads}_heads"] = timed(build, device, 5)
        tiles = build()
        result[f"union_ms_{heads}_heads"] = timed(lambda: attend_union_rows(query, rows, tiles, scale, by_union),
                                                  device, 5)
        result[f"union_rows_per_tile_{heads}_heads"] = tiles.counts.float().mean().item()
        result[f"union_max_diff_{heads}_heads"] = (by_union.float() - out.float()).abs().max().item()
    result["gb_if_every_query_reads_its_rows"] = n * width * 576 * 2 / 1e9
    return {"sparse_prefill": result}


def weight_products(device: str, g, result: dict) -> None:
    """A quantized weight (a GLM-5.2 projection's shape: 6,144 → 12,288 on a GPU) by the Triton kernel in each stored
    form (FP8 as shipped, int8, int4: half and a quarter of bf16's bytes), against torch's bf16 matmul of the same
    weight dequantized, and FP8 prefill rows on the FP8 tensor cores (fp8_scaled_mm.py, where its check passes): ms
    per product at decode and prefill rows, and whether each form pays (its ms under bf16's); into `result`."""
    import torch

    from dsaserve.quantization import formats
    from dsaserve.triton_ops import fp8_scaled_mm
    from dsaserve.triton_ops.quantized_linear import quantized_matmul

    n, k = (12288, 6144) if device == "cuda" else (96, 160)
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    why_not = fp8_scaled_mm.unavailable(torch.device(device))
    result["fp8_tensor_cores"] = "used for 64+ bf16 rows" if why_not is None else f"not used: {why_not}"
    for kind in ("fp8", "int8", "int4"):
        if kind == "fp8":
            q, scale = formats.quantize_fp8_rows(weight)
            if n % 128 == 0 and k % 128 == 0:  # a checkpoint's form: one scale per 128 × 128 block (as FP8 ships)
                scale = scale.view(n // 128, 128, -1).amax(dim=1).repeat_interleave(128, dim=0)
                q = fp8_scaled_mm.fp8_bytes(weight, scale)
            values = q
        else:
            values, scale = formats.quantize(kind, weight)
            q = formats.pack_int4_rows(values) if kind == "int4" else values
        dense = formats.dequantize_reference(kind, values, scale).to(device=device, dtype=torch.bfloat16)
        q, scale = q.to(device), scale.to(device)
        blocks = fp8_scaled_mm.block_scales(scale) if kind == "fp8" else None
        for rows in ((1, 16, 2048) if device == "cuda" else (1, 4)):
            x = torch.randn(rows, k, device=device, generator=g).to(torch.bfloat16)
            got, expected = quantized_matmul(x, q, scale, kind).float(), (x @ dense.T).float()
            entry = {"n": n, "k": k, "triton_ms": timed(lambda: quantized_matmul(x, q, scale, kind), device, 10),
                     "torch_bf16_ms": timed(lambda: x @ dense.T, device, 10),
                     "max_rel_diff": float((got - expected).abs().max() / expected.abs().max())}
            if why_not is None and blocks is not None and rows >= fp8_scaled_mm.MIN_ROWS:
                scaled = fp8_scaled_mm.scaled_matmul(x, q, blocks).float()
                entry.update(scaled_mm_ms=timed(lambda: fp8_scaled_mm.scaled_matmul(x, q, blocks), device, 10),
                             scaled_mm_max_rel_diff=float((scaled - expected).abs().max() / expected.abs().max()))
            result[f"{kind}_linear_{rows}_rows"] = entry


def section_syncs(device: str) -> dict:
    """Host synchronisations in decode steps of 16 requests, counted by torch's sync debug mode."""
    import warnings

    import torch

    if device != "cuda":
        return {"skipped": "host synchronisation is a CUDA notion"}
    from dsaserve import LLM, SamplingParams
    from dsaserve.bench.common import random_prompts

    llm = LLM(small_checkpoint(device), device=device, max_model_len=1024, kv_cache_memory="2GiB", progress=False,
              **engine_options(device))
    engine = llm.engine
    for i, p in enumerate(random_prompts(16, 128, engine.config.vocab_size, 0)):
        engine.add_request(f"sync-{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the prefills
    engine.step()
    counts = []
    for _ in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            engine.step()
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
        where = sorted({f"{w.filename.split('dsaserve/')[-1]}:{w.lineno}" for w in caught})
    return {"syncs_per_decode_step": counts, "where": where[:30]}


def section_profile(device: str) -> dict:
    """Where a decode step of 16 requests spends its time: torch.profiler's operators and kernels by their own time,
    the most expensive first (device time on a GPU, CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from dsaserve import LLM, SamplingParams
    from dsaserve.bench.common import random_prompts

    llm = LLM(small_checkpoint(device), device=device, max_model_len=1024, progress=False,
              kv_cache_memory="2GiB" if device == "cuda" else "256MiB", **engine_options(device))
    engine = llm.engine
    for i, p in enumerate(random_prompts(16, sizes(device)["input_len"], engine.config.vocab_size, 0)):
        engine.add_request(f"profile-{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(3):  # the prefills, then a decode step to warm up
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.step()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    return {"decode_step_top": [{"name": e.key[:80], "ms": getattr(e, key, 0.0) / 1e3, "calls": e.count}
                                for e in events[:20]]}


def section_latency(device: str) -> dict:
    from dsaserve import LLM
    from dsaserve.bench.offline import run_latency, run_throughput

    s = sizes(device)
    result = PROGRESS
    result["graph_log"] = graph_log_lines()
    # With CUDA graphs (the default on a GPU; a CPU has none), then --enforce-eager on a GPU: the same runs.
    for eager in (False, True) if device == "cuda" else (False,):
        # On a GPU the default run sizes its cache from gpu_memory_utilization (the step's peak measured at start).
        memory = dict(gpu_memory_utilization=0.5) if device == "cuda" and not eager else dict(
            kv_cache_memory="4GiB" if device == "cuda" else "256MiB")
        llm = LLM(small_checkpoint(device), device=device, max_model_len=1024, progress=False, enforce_eager=eager,
                  max_num_seqs=max(s["batches"]), **memory, **engine_options(device))
        graphs = llm.engine.runner.graphs
        runs = {"graphs": "off" if graphs is None else f"{len(graphs.captured)} ({','.join(map(str, graphs.sizes))} × "
                f"{','.join(map(str, graphs.contexts))}), {(graphs.memory_bytes or 0) / 2**20:.0f} MiB"}
        if llm.engine.memory_profiles:
            measured = llm.engine.memory_profiles[0]
            runs["memory_plan"] = {"step_tokens": measured.step_tokens, "step_peak_gib": measured.step_peak / 2**30,
                                   "estimate_gib": llm.engine.activation_estimate / 2**30,
                                   "kv_cache_gib": llm.engine.kv_cache.nbytes() / 2**30}
        run_throughput(llm, 2, s["input_len"], 4, 1)  # untimed: Triton compiles what the captures did not use
        runs["latency_batch_1"] = run_latency(llm, 1, s["input_len"], s["output_len"], 3, 1, 0)
        for batch in s["batches"][1:]:
            runs[f"throughput_batch_{batch}"] = run_throughput(llm, batch, s["input_len"], s["output_len"], 0)
        result["eager" if eager else "default"] = runs
        llm.shutdown()
    result.update(peak_memory(device))
    return result


def section_transformers(device: str) -> dict:
    import torch
    import transformers

    from dsaserve.bench.common import random_prompts

    s = sizes(device)
    path = small_checkpoint(device)
    # Eager attention, as benchmarks/model_core.py runs it (its sdpa path failed in generate with a cache in 5.24).
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto", attn_implementation="eager")
    model = model.to(device).eval()
    batch = max(s["batches"])
    ids = torch.tensor(random_prompts(batch, s["input_len"], model.config.vocab_size, 0), device=device)
    kwargs = dict(max_new_tokens=s["output_len"], min_new_tokens=s["output_len"], do_sample=False)
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return {"batch": batch, "output_tokens_per_s": batch * s["output_len"] / elapsed, **peak_memory(device)}


def section_longctx(device: str) -> dict:
    from dsaserve.bench import longctx
    from dsaserve.engine_args import EngineArgs

    s = sizes(device)
    longest = max(s["contexts"])
    # Both backends eager: the dense one never replays graphs (its attention loops on the host), so with graphs the
    # ratio would hold the graphs' savings too. The small checkpoint's 65,536 positions stretched to hold the longest.
    args = EngineArgs(model=small_checkpoint(device), device=device, max_model_len=longest + 64,
                      hf_overrides={"max_position_embeddings": max(longest + 64, 4096)}, enforce_eager=True,
                      kv_cache_memory="8GiB" if device == "cuda" else "256MiB", max_num_seqs=2,
                      **engine_options(device))
    result = longctx.run(args, ["dense", "sparse"], s["contexts"], [], 8)
    ms = result["decode_ms_per_token"]
    result["sparse_over_dense"] = {n: ms["dense"][n] / ms["sparse"][n] for n in s["contexts"]}
    result.update(peak_memory(device))
    return result


def run_section(name: str, device: str, out: str) -> None:
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels run on CPU tensors so
    PROGRESS.path = os.path.join(out, f"{name}.partial.json")
    if device == "cuda":  # nor for the sections' own load-time helpers (see engine_options)
        from dsaserve.native import torch_ops

        torch_ops.configure("off")
    try:
        result = {"ok": True, **globals()[f"section_{name}"](device)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()[-3000:]}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def partial(out: str, name: str) -> dict:
    """What a section that ran out of time had measured (Progress), under "partial"."""
    try:
        with open(os.path.join(out, f"{name}.partial.json")) as f:
            return {"partial": json.load(f)}
    except (OSError, json.JSONDecodeError):
        return {}


def summary(results: dict, device: str) -> str:
    """The markdown table of the figures the issue's goals name."""
    def get(*keys, fmt="{:.2f}"):
        value = results
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                return "—"
            value = value[key]
        return fmt.format(value) if isinstance(value, float) else str(value)

    env = results.get("env", {})
    lines = [f"gpu_check on {env.get('gpu', device)} (torch {env.get('torch')}, triton {env.get('triton')}), "
             f"{time.strftime('%Y-%m-%d')}", "", "| check | result |", "|---|---|"]
    lines.append(f"| parity, Triton on: tokens identical / max Δlogprob | "
                 f"{get('parity', 'triton_on', 'tokens_identical')} / "
                 f"{get('parity', 'triton_on', 'max_logprob_diff', fmt='{:.2e}')} |")
    lines.append(f"| parity, Triton on, --enforce-eager: tokens identical / max Δlogprob | "
                 f"{get('parity', 'triton_on_eager', 'tokens_identical')} / "
                 f"{get('parity', 'triton_on_eager', 'max_logprob_diff', fmt='{:.2e}')} |")
    lines.append(f"| parity, Triton off: tokens identical / max Δlogprob | "
                 f"{get('parity', 'triton_off', 'tokens_identical')} / "
                 f"{get('parity', 'triton_off', 'max_logprob_diff', fmt='{:.2e}')} |")
    lines.append(f"| parity, FP8 checkpoint kept in FP8 (Triton): tokens identical / max Δlogprob | "
                 f"{get('parity', 'fp8_triton_on', 'tokens_identical')} / "
                 f"{get('parity', 'fp8_triton_on', 'max_logprob_diff', fmt='{:.2e}')} |")
    for mode, how in (("on", "Triton on"), ("on_eager", "Triton on, --enforce-eager")):
        lines.append(f"| parity, GLM-5.3-Flash checkpoint, {how}: tokens identical / max Δlogprob | "
                     f"{get('parity', f'flash_triton_{mode}', 'tokens_identical')} / "
                     f"{get('parity', f'flash_triton_{mode}', 'max_logprob_diff', fmt='{:.2e}')} |")
    for kernel in ("sparse_decode", "index_scores_bf16", "index_scores_fp8"):
        lines.append(f"| {kernel}: Triton ms / torch ms | {get('kernels', kernel, 'triton_ms', fmt='{:.3f}')} / "
                     f"{get('kernels', kernel, 'torch_ms', fmt='{:.3f}')} |")
    for kind in ("bf16", "fp8"):
        lines.append(f"| top-k of {get('kernels', f'index_scores_{kind}', 'queries')} rows × "
                     f"{get('kernels', f'index_scores_{kind}', 'context')} ({kind} keys): radix top-k ms (its "
                     "first histogram counted by the scoring kernel) / torch.topk ms (same values chosen; counts "
                     "match) | "
                     f"{get('kernels', f'index_scores_{kind}', 'radix_topk_ms', fmt='{:.3f}')} / "
                     f"{get('kernels', f'index_scores_{kind}', 'topk_ms', fmt='{:.3f}')} "
                     f"({get('kernels', f'index_scores_{kind}', 'radix_same_values')}; "
                     f"{get('kernels', f'index_scores_{kind}', 'counts_match')}) |")
        lines.append(f"| top-k of 1 row × {get('kernels', f'index_scores_{kind}', 'context')} ({kind} keys): radix "
                     "top-k ms / torch.topk ms | "
                     f"{get('kernels', f'index_scores_{kind}', 'radix_topk_ms_1_row', fmt='{:.3f}')} / "
                     f"{get('kernels', f'index_scores_{kind}', 'topk_ms_1_row', fmt='{:.3f}')} |")
    for heads in (8, 16):
        lines.append(f"| sparse prefill, {get('kernels', 'sparse_prefill', 'queries')} queries × "
                     f"{get('kernels', 'sparse_prefill', 'selected')} rows at {heads} heads: per-query ms / tile "
                     "unions ms + their build ms (rows per union; max difference) | "
                     f"{get('kernels', 'sparse_prefill', f'triton_ms_{heads}_heads', fmt='{:.3f}')} / "
                     f"{get('kernels', 'sparse_prefill', f'union_ms_{heads}_heads', fmt='{:.3f}')} + "
                     f"{get('kernels', 'sparse_prefill', f'union_build_ms_{heads}_heads', fmt='{:.3f}')} "
                     f"({get('kernels', 'sparse_prefill', f'union_rows_per_tile_{heads}_heads', fmt='{:.0f}')}; "
                     f"{get('kernels', 'sparse_prefill', f'union_max_diff_{heads}_heads', fmt='{:.1e}')}) |")
    for kernel in (k for k in results.get("kernels", {}) if "_linear_" in k):
        lines.append(f"| {kernel}: Triton {kernel.split('_')[0]} ms / torch bf16 ms / FP8 tensor cores ms | "
                     f"{get('kernels', kernel, 'triton_ms', fmt='{:.3f}')} / "
                     f"{get('kernels', kernel, 'torch_bf16_ms', fmt='{:.3f}')} / "
                     f"{get('kernels', kernel, 'scaled_mm_ms', fmt='{:.3f}')} |")
    lines.append(f"| FP8 tensor cores (torch's block-scaled matmul) | {get('kernels', 'fp8_tensor_cores')} |")
    lines.append(f"| host syncs per decode step | {get('syncs', 'syncs_per_decode_step')} |")
    top = results.get("profile", {}).get("decode_step_top", [])[:4]
    lines.append("| decode step (16 requests), most self time | "
                 + ("; ".join(f"{e['name']} {e['ms']:.2f} ms" for e in top) or "—") + " |")
    for run, words in (("default", "CUDA graphs"), ("eager", "--enforce-eager")):
        lines.append(f"| batch-1 decode ms/token (TPOT), {words} (captured: {get('latency', run, 'graphs')}) | "
                     f"{get('latency', run, 'latency_batch_1', 'tpot_ms_p50')} |")
        for batch in sizes(device)["batches"][1:]:
            lines.append(f"| throughput batch {batch}, output tok/s, {words} | "
                         f"{get('latency', run, f'throughput_batch_{batch}', 'output_tokens_per_s', fmt='{:.0f}')} |")
    graph_lines = results.get("latency", {}).get("graph_log") or ["—"]
    lines.append(f"| CUDA graphs, the latency section's log | {'; '.join(graph_lines)[:300]} |")
    lines.append(f"| memory plan (gpu_memory_utilization 0.5): largest step's peak GiB measured / doctor's estimate, "
                 f"KV cache GiB | {get('latency', 'default', 'memory_plan', 'step_peak_gib')} / "
                 f"{get('latency', 'default', 'memory_plan', 'estimate_gib')}, "
                 f"{get('latency', 'default', 'memory_plan', 'kv_cache_gib')} |")
    lines.append(f"| transformers generate batch {get('transformers', 'batch')}, output tok/s | "
                 f"{get('transformers', 'output_tokens_per_s', fmt='{:.0f}')} |")
    for n in sizes(device)["contexts"]:
        lines.append(f"| longctx {n}: dense / sparse ms per step, both eager (ratio) | "
                     f"{get('longctx', 'decode_ms_per_token', 'dense', str(n))} / "
                     f"{get('longctx', 'decode_ms_per_token', 'sparse', str(n))} "
                     f"({get('longctx', 'sparse_over_dense', str(n))}×) |")
    failed = [name for name, r in results.items() if not r.get("ok", False)]
    lines += ["", f"sections failed: {', '.join(failed) or 'none'} (errors in results.json)"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all sections together")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child process's one section
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.section:
        run_section(args.section, args.device, args.out)
        return 0
    deadline = time.monotonic() + args.budget
    results = {}
    for name in args.sections.split(","):
        left = deadline - time.monotonic()
        limit = max(5.0, min(left, SHARES[name] * args.budget + max(0.0, left - args.budget * sum(
            SHARES[s] for s in SECTIONS[SECTIONS.index(name):]))))
        log_path = os.path.join(args.out, f"{name}.log")
        start = time.monotonic()
        with open(log_path, "w") as log:
            try:
                subprocess.run([sys.executable, __file__, args.out, "--device", args.device, "--section", name],
                               stdout=log, stderr=subprocess.STDOUT, timeout=limit, check=False)
                with open(os.path.join(args.out, f"{name}.json")) as f:
                    results[name] = json.load(f)
            except subprocess.TimeoutExpired:
                results[name] = {"ok": False, "error": f"timed out after {limit:.0f} s", **partial(args.out, name)}
            except (OSError, json.JSONDecodeError) as error:
                results[name] = {"ok": False, "error": f"no result ({error}); the log's tail is below"}
        results[name]["seconds"] = time.monotonic() - start
        if not results[name]["ok"]:
            with open(log_path) as f:
                results[name]["log_tail"] = f.read()[-2000:]
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} in {results[name]['seconds']:.0f} s", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary(results, args.device))
    print(summary(results, args.device))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
