"""Loading GLM-5.2-sized layers: time, read speed and anonymous memory per resident form.

    python benchmarks/load_memory.py [--experts 16] [--forms fp8,int8,int4,bf16] [--dir DIR] [--decode-steps 8]

Builds once (streaming, shard by shard) a 4-layer checkpoint with GLM-5.2's real dimensions: hidden 6144, 64 heads,
vocabulary 154,880, three dense layers (intermediate 12,288), then one MoE layer with `--experts` routed experts of
2,048 (GLM-5.2 has 256; 96 makes the 8.2 GiB checkpoint of the issue), FP8 with 128 × 128 block scales for every
projection, bf16 embeddings and head, 2 GB shards. Then, per form, a child process loads it with `LLM` while this
process samples the child's anonymous memory (RssAnon) every 0.1 s, and runs a few decode steps. Load time is given
twice: the whole `LLM(...)` (engine start-up included) and the loader's own (reading and converting the files, from
its closing log line):

    fp8   the checkpoint's FP8 kept as shipped (the native kernels' form)
    int8  --quantization int8
    int4  --quantization int4
    bf16  dequantized to bf16 Parameters (--cpu-isa none: no native body, as on a CPU without AVX2; torch's products)

Before each load (and before timing `cat` of the files) the files are dropped from the page cache with
posix_fadvise(DONTNEED), so reads come from the disk; the table says whether that worked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time

REFERENCE = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "glm-5.2-config.json")
SHARD_BYTES = 2 * 10**9
FORMS = {"fp8": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
         "bf16": {"cpu_isa": "none"}}


def bench_config(experts: int) -> dict:
    with open(REFERENCE) as f:
        raw = json.load(f)
    raw.update(num_hidden_layers=4, n_routed_experts=experts, num_nextn_predict_layers=0, index_topk_pattern=None,
               indexer_types=raw["indexer_types"][:4], mlp_layer_types=["dense"] * 3 + ["sparse"])
    if raw.get("n_group", 1) > 1:
        raw.update(n_group=1, topk_group=1)
    return raw


def build(path: str, experts: int) -> None:
    """Write the checkpoint tensor by tensor, never holding more than a shard (plus one tensor in fp32)."""
    import torch
    from safetensors.torch import save_file

    from dsaserve.config import ModelConfig
    from dsaserve.demo.checkpoint_builder import is_fp8_quantizable, quantize_fp8
    from dsaserve.demo.tokenizer import build_tokenizer, save_tokenizer
    from dsaserve.model.checkpoint_layout import checkpoint_shapes

    raw = bench_config(experts)
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    cfg = ModelConfig.from_dict(raw)
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map, sizes, count = {}, 0, 0

    def flush() -> None:
        nonlocal shard, count
        if shard:
            count += 1
            name = f"model-{count:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({n: name for n in shard})
            shard = {}

    for name, shape in checkpoint_shapes(cfg).items():
        if "norm" in name:
            tensors = {name: torch.ones(shape, dtype=torch.bfloat16)}
        elif name.endswith(("e_score_correction_bias", "mlp.gate.weight")):
            tensors = {name: torch.randn(shape, generator=gen) * 0.02}
        else:
            w = torch.randn(shape, generator=gen) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.02)
            if is_fp8_quantizable(name):
                q, scale = quantize_fp8(w)
                tensors = {name: q, name + "_scale_inv": scale}
            else:
                tensors = {name: w.to(torch.bfloat16)}
            del w
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if sizes + size > SHARD_BYTES:
            flush()
            sizes = 0
        shard.update(tensors)
        sizes += size
    flush()
    files = sorted(set(weight_map.values()))
    for i, old in enumerate(files):  # the published naming: model-0000i-of-0000n.safetensors
        new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(os.path.join(path, old), os.path.join(path, new))
        weight_map = {n: (new if f == old else f) for n, f in weight_map.items()}
    total = sum(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    save_tokenizer(build_tokenizer(1024), path)


def files_of(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


def drop_from_cache(files: list[str]) -> bool:
    """Ask the kernel to drop the files' clean pages from the page cache; False where it refuses."""
    try:
        for name in files:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


def cat_speed(files: list[str]) -> float:
    """MB/s of reading the files once, sequentially, as `cat file > /dev/null` does."""
    start, total = time.perf_counter(), 0
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    return total / 1e6 / (time.perf_counter() - start)


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class LoaderClock(logging.Handler):
    """The seconds load_checkpoint reports for reading and converting the files (its closing log line): the load
    without the engine's start-up around it."""

    seconds = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("loaded %.2f GiB of checkpoint in %.1f s"):
            self.seconds = record.args[1]


def child(path: str, form: str, steps: int) -> None:
    import torch

    from dsaserve import LLM, SamplingParams

    loader = LoaderClock()
    logging.getLogger("dsaserve.model.loader").addHandler(loader)
    logging.getLogger("dsaserve.model.loader").setLevel(logging.INFO)
    print("READY", flush=True)
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", max_model_len=256, kv_cache_memory="64MiB", progress=False,
              enable_prefix_caching=False, **FORMS[form])
    load_s = time.perf_counter() - start
    model = llm.engine.model
    resident = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    print("LOADED " + json.dumps({"load_s": load_s, "loader_s": loader.seconds, "resident": resident}), flush=True)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=[list(range(100, 132))], sampling_params=params, use_tqdm=False)
    print("DONE " + json.dumps({"decode_s": time.perf_counter() - start, "threads": torch.get_num_threads()}),
          flush=True)


def measure(path: str, form: str, steps: int) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--child", form, "--dir", path, "--decode-steps", str(steps)],
                            stdout=subprocess.PIPE, text=True)
    phase, peaks, result = ["start"], {"start": 0, "load": 0, "decode": 0}, {}

    def sample() -> None:
        while proc.poll() is None:
            try:
                peaks[phase[0]] = max(peaks[phase[0]], rss_anon(proc.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in proc.stdout:
        word, _, rest = line.strip().partition(" ")
        if word == "READY":
            phase[0] = "load"
            peaks["baseline"] = rss_anon(proc.pid)
        elif word == "LOADED":
            result.update(json.loads(rest))
            phase[0] = "decode"
        elif word == "DONE":
            result.update(json.loads(rest))
    proc.wait()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{form}: the child exited with {proc.returncode}")
    return {**result, **{f"peak_{k}": v for k, v in peaks.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--forms", default="fp8,int8,int4,bf16")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = args.dir or os.path.join(os.environ.get("DSASERVE_BENCH_DIR", "/tmp/dsaserve-bench"),
                                    f"glm52-dims-4layers-{args.experts}experts-fp8")
    if args.child:
        child(path, args.child, args.decode_steps)
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        start = time.perf_counter()
        build(path, args.experts)
        print(f"built {path} in {time.perf_counter() - start:.0f} s")
    files = files_of(path)
    size = sum(os.path.getsize(f) for f in files)
    cold = drop_from_cache(files)
    speed = cat_speed(files)
    print(f"checkpoint: {path}: {len(files)} files, {size / 2**30:.2f} GiB; reading it once: {speed:.0f} MB/s "
          f"({'page cache dropped first' if cold else 'warm page cache'})")
    gib = 2**30
    print(f"{'form':6}{'load s':>8}{'MB/s':>7}{'of read':>9}{'loader s':>10}{'MB/s':>7}{'of read':>9}"
          f"{'resident GiB':>14}{'peak load GiB':>15}{'peak / (res + 1)':>18}{'decode peak GiB':>17}{'decode s':>10}")
    results = {}
    for form in args.forms.split(","):
        drop_from_cache(files)
        r = measure(path, form, args.decode_steps)
        results[form] = r
        mbs = size / 1e6 / r["load_s"]
        load_peak = r["peak_load"] - r.get("peak_baseline", 0)
        loader_mbs = size / 1e6 / r["loader_s"]
        print(f"{form:6}{r['load_s']:>8.1f}{mbs:>7.0f}{mbs / speed:>9.0%}{r['loader_s']:>10.1f}{loader_mbs:>7.0f}"
              f"{loader_mbs / speed:>9.0%}{r['resident'] / gib:>14.2f}"
              f"{r['peak_load'] / gib:>15.2f}{r['peak_load'] / (r['resident'] + gib):>18.2f}"
              f"{r['peak_decode'] / gib:>17.2f}{r['decode_s']:>10.1f}   (before loading "
              f"{r.get('peak_baseline', 0) / gib:.2f} GiB, growth while loading {load_peak / gib:.2f} GiB)")
    drop_from_cache(files)
    after = cat_speed(files)
    print(f"reading it once again after the loads: {after:.0f} MB/s (the disk's speed varies: compare with both)")
    print(json.dumps({"checkpoint_bytes": size, "read_mb_s": [speed, after], "forms": results}))


if __name__ == "__main__":
    main()
