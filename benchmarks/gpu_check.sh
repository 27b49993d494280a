#!/usr/bin/env bash
# One call on the GPU machine: build (all cores, sm_80 + sm_90a), the whole test suite, benchmarks.
# Usage: bash benchmarks/gpu_check.sh [tests|bench|all]   (logs go to $OUT, or ./gpu_logs)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
if ! MAX_JOBS=$(nproc) FLASHMOD_CUDA_ARCHS="80;90a" python setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
if [[ $what == tests || $what == all ]]; then
  timeout 420 python -m pytest tests -q -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  timeout 120 python benchmarks/bench_softmax.py --device cuda --out "$OUT/cuda-softmax.json" 2>&1 | tail -30
fi
