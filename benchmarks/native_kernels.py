"""The native CPU kernels against the torch paths they replace, on the same random data.

    python benchmarks/native_kernels.py [--cpu-isa avx2]

- selected rows: 64 queries × 16 heads, each over its own 2,048 rows of 576 (bf16; fp32 too on the AVX2 body)
  picked from a 16K-row cache; torch gathers two queries' rows at a time and runs two bmm (the sparse backend's
  fallback), the kernel reads the rows in place.
- indexer scores: 64 queries × 32 heads × 128 against 2,048 keys; torch: mm, fp32 copy, relu and the
  weighted head sum as a bmm (the indexer's fallback); the kernel: the same sum in registers. On the AVX2 body also
  fp32 queries against fp32 keys read in place from a paged cache (an fp32 model's indexer there).
- indexer scores of int8 keys (`--indexer-cache-dtype int8`: AVX-512 VNNI, or the AVX2 body's signed byte products)
  against bf16 keys, both read in place from a paged key cache kept in their kernel's layout: a prefill tile
  (64 queries × 2,048 keys) and a decode query (1 × 32,768 keys); the two kernels take turns.
- top-k: 64 rows of 16K fp32 scores, k = 2,048, unsorted.
- AMX tiles (only on a CPU with AMX-BF16 and AMX-INT8): the tile bodies of the selected rows (GLM-5.2's 64 heads,
  a prefill tile of 64 queries and a decode query, 2,048 rows each) and of the indexer scores (a prefill tile and
  a decode query, bf16 and int8 keys read in place) against the AVX-512 bodies, taking turns.
Medians of repeated calls; it prints ms per call (µs per query for selected rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsaserve.attention.dense import attend_own_keys
from dsaserve.native import index_scores, selected_rows, torch_ops
from dsaserve.native.topk import topk_rows


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_selected_rows(g: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> None:
    n, heads, dim, value_dim, width, pool = 64, 16, 576, 512, 2048, 16384
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    rows = torch.randn(pool, dim, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(pool, generator=g)[:width] for _ in range(n)])
    out = torch.empty(n, heads, value_dim, dtype=dtype)
    wide = torch.empty(n, heads, dim, dtype=dtype)
    buffer = torch.empty(2 * width, dim, dtype=dtype)

    def torch_path():
        scaled = q * 0.1
        for a in range(0, n, 2):
            keys = torch.index_select(rows, 0, slots[a:a + 2].reshape(-1), out=buffer)
            attend_own_keys(scaled[a:a + 2], keys.view(2, width, dim), None, out=wide[a:a + 2])

    native = median_ms(lambda: selected_rows.attend_selected_rows(q, rows, slots, 0.1, out))
    print(f"selected rows ({str(dtype).removeprefix('torch.')})   native {native * 1e3 / n:7.0f} µs/query   "
          f"torch {median_ms(torch_path) * 1e3 / n:7.0f} µs/query")


def bench_index_scores(g: torch.Generator) -> None:
    t, heads, dim, keys = 64, 32, 128, 2048
    q = torch.randn(t, heads, dim, generator=g).bfloat16()
    weights = torch.randn(t, heads, generator=g) * 0.03
    key_rows = torch.randn(keys, dim, generator=g).bfloat16()
    packed = torch.empty(index_scores.packed_size(keys, dim), dtype=torch.int32)
    out = torch.empty(t, keys)
    low, per_head = torch.empty(t * heads, keys, dtype=torch.bfloat16), torch.empty(t * heads, keys)
    flat = q.reshape(t * heads, dim)

    def torch_path():
        per_head.copy_(torch.mm(flat, key_rows.T, out=low)).relu_()
        torch.bmm(weights[:, None, :], per_head.view(t, heads, keys), out=out.view(t, 1, keys))

    def native_path():
        index_scores.index_scores(q, weights, index_scores.pack_keys(key_rows, packed), keys, out)

    print(f"indexer scores  native {median_ms(native_path):7.2f} ms         torch {median_ms(torch_path):7.2f} ms")


def bench_index_scores_f32(g: torch.Generator) -> None:
    """fp32 queries against fp32 keys (an fp32 model on the AVX2 body): read in place from a paged cache against
    torch's path (keys gathered, mm, relu, bmm for the head sum)."""
    from dsaserve.attention.indexer_cache import IndexerKeyCache

    t, heads, dim, keys, block = 64, 32, 128, 2048, 64
    q = torch.randn(t, heads, dim, generator=g)
    weights = torch.randn(t, heads, generator=g) * 0.03
    cache = IndexerKeyCache(keys // block, block, dim, "model", torch.float32, torch.device("cpu"))
    cache.write(torch.arange(keys), torch.randn(keys, dim, generator=g))
    blocks = torch.randperm(keys // block, generator=g)
    out, per_head = torch.empty(t, keys), torch.empty(t * heads, keys)
    flat = q.reshape(t * heads, dim)

    def torch_path():
        key_rows = cache.read_blocks(blocks, torch.float32)
        torch.mm(flat, key_rows.T, out=per_head).relu_()
        torch.bmm(weights[:, None, :], per_head.view(t, heads, keys), out=out.view(t, 1, keys))

    native = median_ms(lambda: index_scores.index_scores_f32_blocks(q, weights, cache.data, blocks, keys, out))
    print(f"indexer scores, fp32 keys in place  native {native:7.2f} ms         torch {median_ms(torch_path):7.2f} ms")


def bench_index_scores_int8(g: torch.Generator) -> None:
    from dsaserve.attention.indexer_cache import IndexerKeyCache

    heads, dim, block_size = 32, 128, 64
    if not index_scores.fits_int8(heads, dim):
        print("indexer scores, int8 keys: no int8 body here")
        return
    for t, keys in ((64, 2048), (1, 32768)):
        blocks = keys // block_size
        caches = {kind: IndexerKeyCache(blocks, block_size, dim, kind, torch.bfloat16, torch.device("cpu"), packed=True)
                  for kind in ("model", "int8")}
        key_rows = torch.randn(keys, dim, generator=g).bfloat16()
        for cache in caches.values():
            cache.write(torch.arange(keys), key_rows)
        q = torch.randn(t, heads, dim, generator=g).bfloat16()
        weights = torch.rand(t, heads, generator=g)
        table = torch.randperm(blocks, generator=g)
        out = torch.empty(t, keys)
        paths = {
            "bf16": lambda: index_scores.index_scores_blocks(q, weights, caches["model"].groups, table, keys, out),
            "int8": lambda: index_scores.index_scores_int8_blocks(q, weights, caches["int8"].int8_groups,
                                                                  caches["int8"].scale, table, keys, out),
        }
        times = {name: [] for name in paths}
        for turn in range(10):  # taking turns, so that both see the same minutes of a noisy machine
            for name in (("bf16", "int8") if turn % 2 else ("int8", "bf16")):
                times[name].append(median_ms(paths[name], repeats=5))
        bf16, int8 = statistics.median(times["bf16"]), statistics.median(times["int8"])
        print(f"indexer scores  {t} x {keys} keys: bf16 keys {bf16:6.3f} ms, int8 keys {int8:6.3f} ms "
              f"({bf16 / int8:.2f}x)")


def bench_topk(g: torch.Generator) -> None:
    scores = torch.randn(64, 16384, generator=g)
    native = median_ms(lambda: topk_rows(scores, 2048))
    print(f"top-k           native {native:7.2f} ms         "
          f"torch {median_ms(lambda: scores.topk(2048, dim=1, sorted=False)):7.2f} ms")


def bench_amx_tiles(g: torch.Generator) -> None:
    from dsaserve.attention.indexer_cache import IndexerKeyCache
    from dsaserve.native import amx

    if not torch.ops.dsaserve.amx_available():
        print("AMX tiles: no AMX-BF16 and AMX-INT8 on this CPU (or Linux did not grant the tile registers)")
        return
    heads, dim, value_dim, width, pool = 64, 576, 512, 2048, 32768
    rows = torch.randn(pool, dim, generator=g).bfloat16()
    paths = {}
    for n in (64, 1):
        q = torch.randn(n, heads, dim, generator=g).bfloat16()
        slots = torch.stack([torch.randperm(pool, generator=g)[:width] for _ in range(n)])
        out = torch.empty(n, heads, value_dim, dtype=torch.bfloat16)
        paths[f"selected rows, {n} x {width} rows (us/query)"] = (
            n, lambda q=q, slots=slots, out=out: selected_rows.attend_selected_rows(q, rows, slots, 0.04, out))
    index_heads, index_dim, block_size = 32, 128, 64
    for t, keys in ((64, 2048), (1, 32768)):
        cache = IndexerKeyCache(keys // block_size, block_size, index_dim, "model", torch.bfloat16, torch.device("cpu"),
                                packed=True)
        cache.write(torch.arange(keys), torch.randn(keys, index_dim, generator=g).bfloat16())
        q = torch.randn(t, index_heads, index_dim, generator=g).bfloat16()
        weights, table, out = (torch.rand(t, index_heads, generator=g), torch.randperm(keys // block_size),
                               torch.empty(t, keys))
        paths[f"indexer scores, {t} x {keys} keys (ms)"] = (
            0, lambda q=q, weights=weights, cache=cache, table=table, keys=keys, out=out:
            index_scores.index_scores_blocks(q, weights, cache.groups, table, keys, out))
        int8 = IndexerKeyCache(keys // block_size, block_size, index_dim, "int8", torch.bfloat16, torch.device("cpu"),
                               packed=True)
        int8.write(torch.arange(keys), torch.randn(keys, index_dim, generator=g).bfloat16())
        paths[f"indexer scores, int8 keys, {t} x {keys} keys (ms)"] = (
            0, lambda q=q, weights=weights, cache=int8, table=table, keys=keys, out=out:
            index_scores.index_scores_int8_blocks(q, weights, cache.int8_groups, cache.scale, table, keys, out))
    previous = amx.set_mode("off")
    try:
        for name, (per, fn) in paths.items():
            times = {"avx512": [], "tiles": []}
            for turn in range(10):  # taking turns, so that both see the same minutes of a noisy machine
                for form in (("avx512", "tiles") if turn % 2 else ("tiles", "avx512")):
                    amx.set_mode("hardware" if form == "tiles" else "off")
                    times[form].append(median_ms(fn, repeats=3) * (1e3 / per if per else 1))
            avx512, tiles = statistics.median(times["avx512"]), statistics.median(times["tiles"])
            print(f"AMX tiles       {name}: AVX-512 {avx512:8.2f}, tiles {tiles:8.2f} ({avx512 / tiles:.2f}x)")
    finally:
        amx.set_mode(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-isa", default="auto", choices=torch_ops.CPU_ISAS,
                        help="the body family (avx2: the kernels that have an AVX2 body, the others left out)")
    args = parser.parse_args()
    torch_ops.configure("auto", args.cpu_isa)
    if not index_scores.fits(32, 128):
        raise SystemExit(f"no native index-scores kernel here under cpu_isa {args.cpu_isa!r} (the kernels need a C "
                         "compiler and AVX2 or AVX-512 BF16)")
    g = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {torch_ops.cpu_kernels()} bodies")
    if selected_rows.has_bf16_kernel():
        for dtype in (torch.bfloat16, torch.float32):
            if selected_rows.takes_dtype(dtype):
                bench_selected_rows(g, dtype)
    bench_index_scores(g)
    if index_scores.fits_f32(32, 128):
        bench_index_scores_f32(g)
    bench_index_scores_int8(g)
    bench_topk(g)
    if torch_ops.cpu_kernels() == "avx512_bf16":
        bench_amx_tiles(g)


if __name__ == "__main__":
    main()
