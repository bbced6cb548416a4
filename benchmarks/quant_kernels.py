"""The packed-weight kernels alone: GB/s of weights read by one [8192, 4096] product, per form and row count.

    python benchmarks/quant_kernels.py [--warm] [--native-kernels auto|avx512] [--cpu-isa avx2|...] [--fp32]

Against torch's bf16 F.linear on the same weight and this machine's copy bandwidth (bytes copied per
second, 1 GiB buffers). The weight is 64 MiB in bf16 (32, 16 MiB packed in 8, 4 bits); each measurement
cycles through copies of it, 256 MiB in all, so that every product reads its weight from memory as decode
does, not from a 32 MiB L3 that still holds it from the previous call.
int4 runs on the path this CPU takes for bf16 activations (printed); `--native-kernels avx512` measures the bf16
one where the VNNI path is the default, and puts fp8 on its shift decode where VBMI lookups are.
`--cpu-isa avx2` measures the AVX2 bodies (on an AVX-512 CPU too); `--fp32` multiplies fp32 activations (the
compute dtype of bf16 checkpoints on CPUs without bf16 instructions) instead of bf16 ones.
`--warm`: each kernel's own pace instead (one thread, a 2-4 MiB weight kept in cache, 1-8 rows), where the
decoding of the weights, not memory, sets the speed.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Callable

import torch

from dsaserve.native import torch_ops
from dsaserve.quantization import formats
from dsaserve.quantization.fp8_blocks import fp8_row_scales, quantize_fp8

N, K = 8192, 4096
COLD_BYTES = 256 << 20  # weight copies cycled through per measurement


def cold(tensors: tuple, size: int) -> Callable[[], tuple]:
    """The next of enough copies of `tensors` (`size` bytes) that cycling through them reads from memory."""
    copies = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(-(-COLD_BYTES // size) - 1)]
    turn = itertools.cycle(copies)
    return lambda: next(turn)


def per_call(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def packed_weight(kind: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, tuple]:
    """(packed weight, scales, their bytes, quant_linear's trailing arguments) of fp32 w in `kind`."""
    n, k = w.shape
    if kind == "bf16":
        q, scale = w.bfloat16(), torch.ones(n, 1)
    elif kind == "fp8":
        q8, scale_inv = quantize_fp8(w)
        q, scale = q8.view(torch.uint8), fp8_row_scales(scale_inv, (0, n), (0, k), (n, k), (128, 128))
    else:
        q, scale = formats.quantize_int8(w) if kind == "int8" else formats.quantize_int4(w)
    packed, scales = formats.pack(kind, q, scale)
    size = packed.numel() * packed.element_size() + scales.numel() * 4
    return packed, scales, size, (formats.KINDS[kind], formats.group_of(kind, k), 0, n, k)


ACT_DTYPE = torch.float32 if "--fp32" in sys.argv[1:] else torch.bfloat16


def option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def warm() -> None:
    """The kernels' own pace, memory aside: one thread, a [2048, 1024] weight that stays in cache, best of many."""
    torch.set_num_threads(1)
    print(f"one thread, [2048, 1024] weights in cache; fp8 decoded by {torch.ops.dsaserve.fp8_bf16_path()}, "
          f"int8 and int4 by {torch.ops.dsaserve.int8_bf16_path()}, {torch.ops.dsaserve.int4_bf16_path()}")
    w = torch.randn(2048, 1024)
    for kind in ("bf16", "fp8", "int8", "int4"):
        packed, scales, size, args = packed_weight(kind, w)
        line = []
        for m in (1, 2, 4, 8):
            x = torch.randn(m, 1024).to(ACT_DTYPE)
            t = min(per_call(lambda: torch.ops.dsaserve.quant_linear(x, packed, scales, *args), 200) for _ in range(5))
            line.append(f"{m} rows {size / t / 1e9:5.1f} GB/s")
        print(f"{kind:>4} kernel: " + ", ".join(line))


def main() -> None:
    torch_ops.configure(option("--native-kernels", "auto"), option("--cpu-isa", "auto"))
    if not torch_ops.runs("packed_products"):
        raise SystemExit(f"the kernels do not run here ({torch_ops.cpu_kernels()})")
    print(f"bodies: {torch_ops.cpu_kernels()}; activations {ACT_DTYPE}")
    if "--warm" in sys.argv[1:]:
        warm()
        return
    a = torch.ones(1 << 30, dtype=torch.uint8)
    b = torch.empty_like(a)
    copy = a.numel() / min(per_call(lambda: b.copy_(a), 3) for _ in range(2))
    print(f"copy bandwidth {copy / 1e9:.1f} GB/s, {torch.get_num_threads()} threads; int4 by bf16 activations: "
          f"{torch.ops.dsaserve.int4_bf16_path()}")
    w = torch.randn(N, K)
    wb = w.bfloat16()
    next_wb = cold((wb,), N * K * 2)
    for m in (1, 4, 16):
        x = torch.randn(m, K).to(ACT_DTYPE)
        t = per_call(lambda: torch.nn.functional.linear(x.bfloat16(), *next_wb()))
        print(f"torch bf16 F.linear, {m:2d} rows: {N * K * 2 / t / 1e9:5.1f} GB/s ({t * 1e3:.2f} ms)")
    for kind in ("bf16", "fp8", "int8", "int4"):
        packed, scales, size, args = packed_weight(kind, w)
        next_weight = cold((packed, scales), size)
        for m in (1, 4, 16):
            x = torch.randn(m, K).to(ACT_DTYPE)
            t = per_call(lambda: torch.ops.dsaserve.quant_linear(x, *next_weight(), *args))
            print(f"{kind:>4} kernel, {m:2d} rows: {size / t / 1e9:5.1f} GB/s ({t * 1e3:.2f} ms, "
                  f"{size / t / copy:.0%} of copy)")


if __name__ == "__main__":
    main()
