"""Decode with weights in 16, 8 and 4 bits against the memory-bandwidth bound.

    python benchmarks/quantized_decode.py [--out docs/quantized_decode.json] [--cpu-isa avx2] [--dtype bfloat16]
        [--forms ...]

On the checkpoint benchmarks/model_core.py builds (GLM-5.2 per-head geometry, 214M parameters, bf16),
each weight form in its own process, the forms taking turns for three rounds (medians reported): bf16 through
torch's matmuls (the kernels off), bf16 packed for
the bandwidth kernel (the default on a CPU with AVX-512 BF16), and --quantization fp8, int8, int4; int8 and int4
twice where the CPU has AVX-512 VNNI: as served (activations rounded to int8 per row and 128-column group, integer
dot products) and `int8-bf16act`, `int4-bf16act` (native_kernels 'avx512': the products in bf16, exact in the
activations); fp8 twice where the CPU has AVX-512 VBMI: as served (its bytes decoded by table lookups) and
`fp8-shifts` (native_kernels 'avx512': by shifts and masks). `int8-nobody`: int8 weights with no native body at all
(native_kernels off: torch's row layout and its int8 matmul up to 16 rows, a slab of rows dequantized at a time
beyond). `--cpu-isa avx2` runs every form on
the AVX2 bodies (on an AVX-512 CPU too: what an AVX2-only server runs; dtype auto then computes in fp32, bf16
weights kept in bf16; torch-bf16 is then the fp32-widened weights through torch). Any form with `-eager` appended
(e.g. `bf16-eager`) runs with enforce_eager: every decode step through the modules, no decode plan; with `@` and a
cpu_isa appended (e.g. `int4@avx512,int4@avx2`) it runs under that body family, so families take turns too.
`--dtype` is every form's engine dtype (default auto; `bfloat16` on the AVX2 bodies: bf16 activations, int4's
products then by activations rounded to int8).
For each: batch-1 decode (median step, 128-token prompts), batch-16 output tokens/s, a 2,048-token
prefill, the weight bytes one decode token reads (every projection once, the shared expert, and 4 of
the 8 routed experts per MoE layer), and the resident bytes. The bound is those bytes ÷ this machine's
copy bandwidth (bytes copied per second, 1 GiB buffers, as many threads as the decode), measured before
every round; the bound takes the highest, so a round that met a busy memory bus does not lower the bar.
Each run also measures the copy right before and right after its batch-1 steps and reports its fraction of
that same-minute bound (`fraction_of_same_minute_bound`, medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

FORMS = ["torch-bf16", "bf16", "fp8", "fp8-shifts", "int8", "int8-bf16act", "int4", "int4-bf16act",
         "int8-nobody"]


def copy_bandwidth() -> float:
    a = torch.ones(1 << 30, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - start)
    return a.numel() / min(times)


def active_bytes(engine) -> tuple[int, int, int]:
    """(bytes one decode token reads, resident weight bytes, parameters) of the loaded model."""
    from dsaserve.quantization.packed import is_packed

    cfg = engine.config
    model = engine.model
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    read = resident = params = 0
    seen = set()
    for name, module in model.named_modules():
        tensors = []
        if is_packed(module):
            tensors.append((name, module.nbytes(), math.prod(module.shape)))  # stacked experts or heads included
        else:
            for pname, p in module.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    tensors.append((f"{name}.{pname}", p.numel() * p.element_size(), p.numel()))
        for full, size, count in tensors:
            resident += size
            params += count
            if "embed_tokens" in full:
                continue  # one row per token
            read += size * share if ".experts_" in full else size
    return int(read), resident, params


def measure(form: str, cpu_isa: str, dtype: str = "auto") -> dict:
    from model_core import checkpoint_dir
    from parallel import decode_steps

    import dsaserve.quantization.apply as apply
    from dsaserve.engine.llm_engine import LLMEngine
    from dsaserve.engine_args import EngineArgs
    from dsaserve.sampling_params import SamplingParams

    eager = form.endswith("-eager")  # any form with "-eager": through the modules, no decode plan
    form = form.removesuffix("-eager")
    if form == "torch-bf16":
        apply.kernels_here = lambda device: False
    # The AVX-512 bodies alone: int8 and int4 products in bf16, fp8 decoded by shifts and masks.
    native_kernels = "avx512" if form.endswith("-bf16act") or form == "fp8-shifts" else "auto"
    native_kernels = "off" if form.endswith("-nobody") else native_kernels
    quantization = {"fp8": "fp8", "fp8-shifts": "fp8", "int8": "int8", "int8-bf16act": "int8", "int4": "int4",
                    "int4-bf16act": "int4", "int8-nobody": "int8"}.get(form)
    engine = LLMEngine(EngineArgs(model=checkpoint_dir(), kv_cache_memory="512MiB", max_model_len=4096,
                                  progress=False, quantization=quantization, native_kernels=native_kernels,
                                  cpu_isa=cpu_isa, enforce_eager=eager, dtype=dtype))
    decode_steps(engine, 1, steps=4)  # warm-up
    copy_before = copy_bandwidth()
    step_1, _ = decode_steps(engine, 1, steps=32)
    copy_around = (copy_before + copy_bandwidth()) / 2  # the same minute as the batch-1 steps
    step_16, _ = decode_steps(engine, 16, steps=24)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill = []
    for i in range(2):  # different prompts: no prefix-cache hits
        prompt = torch.randint(10, 16000, (2048,), generator=torch.Generator().manual_seed(7 + i)).tolist()
        engine.add_request(f"prefill-{i}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefill.append(time.perf_counter() - start)
    read, resident, count = active_bytes(engine)
    return {"form": form + ("-eager" if eager else ""), "decode_ms_batch1": step_1, "tok_s_batch1": 1e3 / step_1,
            "copy_GBps_around_batch1": copy_around / 1e9,
            "fraction_of_same_minute_bound": 1e3 / step_1 * read / copy_around,
            "tok_s_batch16": 16e3 / step_16, "prefill_2048_s": min(prefill), "bytes_per_token": read,
            "resident_bytes": resident, "parameters": count, "bytes_per_parameter": resident / count,
            "threads": torch.get_num_threads(), "dtype": str(engine.dtype).removeprefix("torch."),
            "cpu_isa": cpu_isa}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forms", default=",".join(FORMS), help="which forms, comma-separated (default: all)")
    parser.add_argument("--cpu-isa", default="auto", help="the engine's cpu_isa for every form (e.g. avx2)")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype for every form (e.g. bfloat16)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one form in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.cpu_isa, args.dtype)))
        return
    from model_core import checkpoint_dir

    checkpoint_dir()  # build it once, before the measuring processes
    forms = args.forms.split(",")
    runs = {form: [] for form in forms}
    bandwidths = []
    for _ in range(args.rounds):  # the forms take turns, so a slow phase of a shared machine hits them all
        bandwidths.append(copy_bandwidth())
        for form in forms:
            name, _, isa = form.partition("@")  # "int4@avx512": that form under that cpu_isa
            out = subprocess.run([sys.executable, __file__, "--one", name, "--cpu-isa", isa or args.cpu_isa,
                                  "--dtype", args.dtype],
                                 capture_output=True, text=True, check=True)
            runs[form].append({**json.loads(out.stdout.strip().splitlines()[-1]), "form": form})
    bandwidth = max(bandwidths)
    rows = []
    for form in forms:
        row = {key: (statistics.median(r[key] for r in runs[form]) if isinstance(value, float) else value)
               for key, value in runs[form][0].items()}  # medians over the rounds
        row["tok_s_batch1_runs"] = [r["tok_s_batch1"] for r in runs[form]]
        row["bound_tok_s"] = bandwidth / row["bytes_per_token"]
        row["fraction_of_bound"] = row["tok_s_batch1"] / row["bound_tok_s"]
        row["fraction_of_same_minute_bound_runs"] = [r["fraction_of_same_minute_bound"] for r in runs[form]]
        rows.append(row)
        print(f"{form:>10}: batch 1 {row['tok_s_batch1']:6.1f} tok/s ({row['fraction_of_bound']:.0%} of "
              f"{row['bound_tok_s']:.1f}; {row['fraction_of_same_minute_bound']:.0%} of the copy measured around "
              f"its steps), batch 16 {row['tok_s_batch16']:6.1f} tok/s, prefill 2K "
              f"{row['prefill_2048_s']:.2f} s, {row['bytes_per_token'] / 2**20:.0f} MiB/token, "
              f"{row['bytes_per_parameter']:.3f} B/param", flush=True)
    flags = open("/proc/cpuinfo").read()
    result = {"cpu_isa": args.cpu_isa, "dtype": args.dtype, "copy_bandwidth_GBps": bandwidth / 1e9,
              "copy_bandwidth_rounds_GBps": [b / 1e9 for b in bandwidths], "rows": rows,
              "cpu": {f: f in flags for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")}}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
