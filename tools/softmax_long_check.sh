#!/usr/bin/env bash
# The GPU check for long softmax rows (benchmarks/results/design/softmax.md): build, the CUDA softmax tests
# (every launch path by name), the path each benchmark shape takes, then the softmax benchmark with
# the register-cached cluster path (FLASHMOD_SOFTMAX_STREAM=0) timed in the same rounds.
# Usage: bash tools/softmax_long_check.sh   (logs go to $OUT, or ./gpu_logs)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if ! MAX_JOBS=$(nproc) FLASHMOD_CUDA_ARCHS="80;90a" FLASHMOD_NVCC_EXTRA="-Xptxas -v" \
  python setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
grep -A2 "softmax_stream_kernel" "$OUT/build.log" | grep -E "registers|spill" | head -12
timeout 300 python -m pytest tests/softmax -q -p no:cacheprovider -m cuda 2>&1 | tee "$OUT/tests.log" | tail -15
FLASHMOD_SOFTMAX_TRACE=1 python -c "
import torch, flashmod
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for n in (1024, 4096, 16384, 65536, 262144):
        flashmod.softmax(torch.randn((1 << 27) // n, n, device='cuda', dtype=dtype), -1)
torch.cuda.synchronize()
" 2>&1 | tee "$OUT/paths.log"
timeout ${SOFTMAX_SECONDS:-180} python benchmarks/bench_softmax.py --device cuda --softmax-only \
  --variant FLASHMOD_SOFTMAX_STREAM=0 ${SOFTMAX_ARGS:-} --out "$OUT/cuda-softmax.json" 2>&1 |
  tee "$OUT/softmax-bench.log" | sed -n 1,20p
