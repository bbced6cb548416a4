"""dsaserve against llama.cpp on the same checkpoint, thread count and machine: batch-1 decode per weight form and
a 2,048-token prefill.

    python benchmarks/llama_cpp_side_by_side.py --llama-cpp DIR [--cpu-isa avx2] [--dtype bfloat16] [--rounds 3]
        [--out F]

DIR is a llama.cpp source tree (for instance the one vendored in the llama-cpp-python sdist: `pip download
--no-deps --no-binary :all: llama-cpp-python`, unpacked, vendor/llama.cpp) with llama-bench and llama-quantize built
under DIR/build/bin. For an AVX2-only build (what an AVX2 server runs, also on an AVX-512 machine):

    cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \\
        -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DLLAMA_CURL=OFF
    cmake --build build --target llama-bench llama-quantize

The checkpoint is benchmarks/model_core.py's (GLM-5.2 per-head geometry, 214M parameters, bf16), converted by
llama.cpp's convert_hf_to_gguf.py (its demo tokenizer's pre-tokenizer is named GLM's, "glm4", which llama.cpp does
not recognise by hash; the weights convert as they are) and quantized to Q8_0 and Q4_0 by llama-quantize.
Pairs at equal bytes per weight: bf16 / BF16, int8 / Q8_0, int4 / Q4_0 (fp8 has no llama.cpp form: dsaserve's
alone). llama.cpp: `llama-bench -t T -p 0 -n 64 -d 128` (64 tokens after 128 of context) and `-p 2048 -n 0`;
dsaserve: benchmarks/quantized_decode.py's measurement of one form (median step at batch 1 after a 128-token
prompt, batch 16, a 2,048-token prefill) with the same cpu_isa and the engine dtype `--dtype` (default auto: fp32
on a CPU without bf16 instructions; bfloat16 rounds activations to int8 for int4 weights, as Q4_0's products do).
The tools take turns for `--rounds` rounds; medians and each round are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

PAIRS = [("bf16", "BF16"), ("int8", "Q8_0"), ("int4", "Q4_0"), ("fp8", None)]
# Runs llama.cpp's converter with the pre-tokenizer named (argv: the converter's own arguments).
CONVERT = """
import runpy, sys
sys.path[:0] = ["gguf-py", "."]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf_files(llama_cpp: str, checkpoint: str, out_dir: str) -> dict[str, str]:
    """The checkpoint as BF16, Q8_0 and Q4_0 GGUF files (made once)."""
    os.makedirs(out_dir, exist_ok=True)
    files = {t: os.path.join(out_dir, f"model-{t}.gguf") for t in ("BF16", "Q8_0", "Q4_0")}
    if not os.path.exists(files["BF16"]):
        subprocess.run([sys.executable, "-c", CONVERT, checkpoint, "--outtype", "bf16", "--outfile", files["BF16"]],
                       cwd=llama_cpp, check=True, capture_output=True)
    for t in ("Q8_0", "Q4_0"):
        if not os.path.exists(files[t]):
            subprocess.run([os.path.join(llama_cpp, "build", "bin", "llama-quantize"), files["BF16"], files[t], t],
                           check=True, capture_output=True)
    return files


def llama_bench(llama_cpp: str, model: str, threads: int, args: list[str]) -> float:
    """Tokens per second of one llama-bench test."""
    out = subprocess.run([os.path.join(llama_cpp, "build", "bin", "llama-bench"), "-m", model, "-t", str(threads),
                          "-r", "1", "-o", "json", *args], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def dsaserve_form(form: str, cpu_isa: str, dtype: str) -> dict:
    script = os.path.join(os.path.dirname(__file__), "quantized_decode.py")
    out = subprocess.run([sys.executable, script, "--one", form, "--cpu-isa", cpu_isa, "--dtype", dtype], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp source tree with build/bin/llama-bench")
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--dtype", default="auto", help="dsaserve's engine dtype (e.g. bfloat16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf-dir", default="/tmp/dsaserve-bench/gguf")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from model_core import checkpoint_dir

    threads = torch.get_num_threads()
    files = gguf_files(os.path.abspath(args.llama_cpp), checkpoint_dir(), args.gguf_dir)
    runs: dict[str, list] = {}
    for _ in range(args.rounds):
        for form, gguf in PAIRS:
            ours = dsaserve_form(form, args.cpu_isa, args.dtype)
            runs.setdefault(f"dsaserve {form} decode", []).append(ours["tok_s_batch1"])
            runs.setdefault(f"dsaserve {form} batch16", []).append(ours["tok_s_batch16"])
            runs.setdefault(f"dsaserve {form} prefill", []).append(2048 / ours["prefill_2048_s"])
            if gguf:
                runs.setdefault(f"llama.cpp {gguf} decode", []).append(
                    llama_bench(args.llama_cpp, files[gguf], threads, ["-p", "0", "-n", "64", "-d", "128"]))
        runs.setdefault("llama.cpp BF16 prefill", []).append(
            llama_bench(args.llama_cpp, files["BF16"], threads, ["-p", "2048", "-n", "0"]))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    for name, values in runs.items():
        print(f"{name:>26}: {medians[name]:7.1f} tok/s ({', '.join(f'{v:.1f}' for v in values)})")
    for form, gguf in PAIRS:
        if gguf:
            print(f"{form} / {gguf} batch-1 decode: "
                  f"{medians[f'dsaserve {form} decode'] / medians[f'llama.cpp {gguf} decode']:.2f}×")
    prefill = medians["dsaserve bf16 prefill"] / medians["llama.cpp BF16 prefill"]
    print(f"bf16 prefill 2K / llama.cpp BF16: {prefill:.2f}×")
    result = {"cpu_isa": args.cpu_isa, "dtype": args.dtype, "threads": threads, "runs": runs, "medians": medians}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
