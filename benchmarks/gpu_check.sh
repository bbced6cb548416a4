#!/usr/bin/env bash
# The CUDA path's prepared check (benchmarks/gpu_check.py): bash benchmarks/gpu_check.sh OUT_DIR [--device cpu]
# Runs from a checkout without installing it (the GPU machine has torch, Triton and transformers, no network).
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [--device cuda|cpu] [--budget SECONDS]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$root/benchmarks/gpu_check.py" "$out" "$@"
