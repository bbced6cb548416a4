"""`dsaserve bench longctx`: decode ms/token and prefill time-to-first-token against context length,
for the dense, sparse and page attention backends, as a table, JSON and (with matplotlib) a PNG plot.
The backends' engines are all loaded at once (each with its own KV cache), each runs an untimed
decode first and an untimed prefill before the prefill points, and they take turns at every point;
decode points report the median step.

Decode points fill the KV cache (latents and indexer keys) with synthetic values instead of running a
prefill, so 64K contexts are measurable on a CPU; the output says so. Prefill points run a real
chunked prefill of random tokens and also report the peak C-heap growth during it (the KV cache is
allocated beforehand, so this is the prefill's scratch memory).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import statistics
import threading
import time

import torch

from dsaserve.attention.linear_state import LinearStateCache
from dsaserve.attention.pooled_keys import PooledKeyCache
from dsaserve.bench.common import write_json
from dsaserve.engine_args import EngineArgs
from dsaserve.sampling_params import SamplingParams


class HeapSampler:
    """Peak of glibc's in-use heap bytes, sampled on a side thread. mallinfo2 walks the allocator's
    free lists under its lock, and its cost grows during a prefill; sampling too often slows the prefill
    being measured, so the pause between samples is 50× the last call, at least 1 ms."""

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                  "fsmblks", "uordblks", "fordblks", "keepcost")]

    def __init__(self):
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = self._Info

    def used(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def __enter__(self):
        self.base = self.peak = self.used()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            start = time.perf_counter()
            self.peak = max(self.peak, self.used())
            time.sleep(max(0.001, 50 * (time.perf_counter() - start)))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.used())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def fill_synthetic_prefix(kv_cache, block_table: list[int], length: int, g: torch.Generator) -> None:
    """Write synthetic latents and indexer keys into the first `length` positions of these blocks (and, for a hybrid
    model, pool keys and small random KDA states in every state slot)."""
    block_size = kv_cache.block_size
    device = kv_cache.device
    blocks = torch.tensor(block_table[: -(-length // block_size)], device=device)
    for latent in kv_cache.latent:  # normalized latent (RMS ~1) and a rotated rope key
        if isinstance(latent, LinearStateCache):
            latent.recurrent.copy_(0.1 * torch.randn(latent.recurrent.shape, generator=g))
            latent.conv.copy_(torch.randn(latent.conv.shape, generator=g))
            continue
        latent[blocks] = torch.randn(latent[blocks].shape, generator=g).to(latent.dtype).to(device)
    positions = torch.arange(length, device=device)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    for keys in kv_cache.indexer.values():
        if isinstance(keys, PooledKeyCache):
            keys.tokens.view(-1, keys.tokens.shape[-1])[slots] = torch.randn(
                length, keys.tokens.shape[-1], generator=g).to(keys.tokens.dtype).to(device)
            pools = slots[keys.kpool - 1 :: keys.kpool] // keys.kpool  # complete pools only
            keys.pools.view(-1, keys.dim)[pools] = torch.randn(len(pools), keys.dim, generator=g).to(
                keys.pools.dtype).to(device)
            continue
        keys.write(slots, torch.randn(length, keys.dim, generator=g).to(device))


def synthetic_decode_ms(engine, context: int, steps: int, seed: int = 0) -> float:
    """Median ms per decode step of one request whose first `context` tokens are already (synthetically) cached."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, engine.config.vocab_size, (context,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    request = engine.make_request("synthetic", ids, params)
    engine.add_prefilled_request(request, context - 1,
                                 lambda cache, table, n: fill_synthetic_prefix(cache, table, n, g))
    engine.step()  # computes the last prompt token: the first decode-shaped step
    step_ms = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1000)
    engine.abort_request("synthetic")
    return statistics.median(step_ms)  # a step slowed by another process on the machine does not count


def document_ids(tokenizer, length: int, seed: int) -> list[int]:
    """`length` tokens of the demo's synthetic documents (filler sentences with facts), the text its
    trained indexer learned to read; random token ids tell nothing about trained selections."""
    import random

    from dsaserve.demo.tasks import codes, distinct_keys, document

    rng = random.Random(seed)
    n_facts = min(90, max(1, length // 200))
    facts = dict(zip(distinct_keys(rng, n_facts), codes(rng, n_facts)))
    sentences = length // 8 + 8
    depths = {k: 0.7 * rng.random() for k in facts}  # the text runs ~1.25× long and is cut: keep facts early
    while len(ids := tokenizer.encode(document(rng, facts, sentences, depths), add_special_tokens=False)) < length:
        sentences *= 2  # a tokenizer with longer tokens than the demo's
    return ids[:length]


def prefill(engine, length: int, seed: int = 0, prompt_source: str = "random") -> tuple[float, int]:
    """Seconds to the first token of a `length`-token prompt, and the peak scratch bytes."""
    if prompt_source == "document":
        ids = document_ids(engine.tokenizer, length, seed + length)
    else:
        g = torch.Generator().manual_seed(seed + length)
        ids = torch.randint(100, engine.config.vocab_size, (length,), generator=g).tolist()
    engine.add_request("prefill", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    with HeapSampler() as heap:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        ttft = time.perf_counter() - start
    return ttft, heap.extra


def run(engine_args: EngineArgs, backends: list[str], decode_lens: list[int], prefill_lens: list[int],
        steps: int, prompt_source: str = "random") -> dict:
    from dsaserve.engine.llm_engine import LLMEngine

    results = {"decode_ms_per_token": {}, "prefill_ttft_s": {}, "prefill_peak_scratch_mib": {},
               "note": "median of the decode steps; decode points use synthetic cached latents and indexer keys "
                       "(no prefill)"}
    # Every backend's engine stays loaded and they take turns at each point, so a slow phase of a
    # shared machine lands on all of them instead of on whichever backend ran then.
    # On a GPU without --kv-cache-memory each engine measures what is left: the i-th of n takes (i + 1) / n of
    # gpu_memory_utilization in all (its own and the earlier engines'), so they share it evenly.
    share = engine_args.gpu_memory_utilization / len(backends)
    engines = {b: LLMEngine(dataclasses.replace(engine_args, attention_backend=b, progress=False,
                                                enable_prefix_caching=False, gpu_memory_utilization=share * (i + 1)))
               for i, b in enumerate(backends)}
    for backend, engine in engines.items():
        synthetic_decode_ms(engine, decode_lens[0] if decode_lens else 256, 2)  # warm-up
        results["decode_ms_per_token"][backend] = {}
        results["prefill_ttft_s"][backend], results["prefill_peak_scratch_mib"][backend] = {}, {}
    for n in decode_lens:
        for backend, engine in engines.items():
            results["decode_ms_per_token"][backend][n] = synthetic_decode_ms(engine, n, steps)
    # Untimed prefill per engine right before the prefill points: oneDNN builds its kernels per
    # matmul shape on first use, and the first prefill after the long-context decodes re-faults the
    # heap the allocator gave back; without it the first backend at the first point pays for that.
    for engine in engines.values():
        if prefill_lens:
            prefill(engine, min(prefill_lens), seed=1, prompt_source=prompt_source)
    for n in prefill_lens:
        for backend, engine in engines.items():
            ttft, extra = prefill(engine, n, prompt_source=prompt_source)
            results["prefill_ttft_s"][backend][n] = ttft
            results["prefill_peak_scratch_mib"][backend][n] = extra / 2**20
    return results


def print_results(results: dict) -> None:
    if any(results["decode_ms_per_token"].values()):  # (a section with no lengths asked for is left out)
        print(f"decode ms/token ({results['note']}):")
        for backend, points in results["decode_ms_per_token"].items():
            print(f"  {backend:<7}" + "".join(f"{n:>9}: {ms:8.1f}" for n, ms in points.items()))
    if not any(results["prefill_ttft_s"].values()):
        return
    print("prefill time to first token, s (peak scratch MiB):")
    for backend, points in results["prefill_ttft_s"].items():
        scratch = results["prefill_peak_scratch_mib"][backend]
        print(f"  {backend:<7}" + "".join(f"{n:>9}: {s:7.2f} ({scratch[n]:6.0f})" for n, s in points.items()))


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); pip install matplotlib") from e
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("decode_ms_per_token", "prefill_ttft_s")):
        for backend, points in results[key].items():
            ax.plot([int(n) for n in points], list(points.values()), marker="o", label=backend)
    axes[0].set(title="decode (synthetic cache)", xlabel="context tokens", ylabel="ms / token")
    axes[1].set(title="prefill", xlabel="prompt tokens", ylabel="time to first token, s")
    for ax, key in zip(axes, ("decode_ms_per_token", "prefill_ttft_s")):
        ticks = sorted({int(n) for points in results[key].values() for n in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{n / 1024:.0f}K" for n in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_longctx_args(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("longctx", help="decode and prefill cost against context length per attention backend")
    EngineArgs.add_cli_args(p, skip=("attention_backend", "enable_prefix_caching"))
    p.add_argument("--backends", default="dense,sparse,page")
    p.add_argument("--decode-lens", default="2048,8192,32768,65536")
    p.add_argument("--prefill-lens", default="2048,4096,8192")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--prompt-source", default="random", choices=["random", "document"],
                   help="prefill prompts: random token ids, or the demo's synthetic documents (the text the "
                        "trained demo model reads, so its indexer selects as it learned to)")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--output-json", default=None)


def cmd_longctx(args: argparse.Namespace) -> int:
    lens = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.model is None:
        from dsaserve.demo import demo_model_dir

        engine_args = dataclasses.replace(engine_args, model=demo_model_dir())
    results = run(engine_args, args.backends.split(","), lens(args.decode_lens), lens(args.prefill_lens),
                  args.decode_steps, args.prompt_source)
    print_results(results)
    write_json(args.output_json, results)
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 0
