#!/usr/bin/env bash
# One device call: build (all cores, sm_80 + sm_90a), the whole CUDA suite, the training and
# forward benchmarks, the serving benchmark and the CUDA training example; logs and JSON to $OUT.
#   bash tools/gpu_session.sh            (PYTHONPATH must reach the test wheels, see the device docs)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
if ! MAX_JOBS=$(nproc) FLASHMOD_CUDA_ARCHS="80;90a" python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  grep -B2 -A8 -m5 error "$OUT/build.log" | head -80
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout "${TEST_SECONDS:-420}" python3 -m pytest tests -q -n 12 -p no:cacheprovider -m "${TEST_M:-cuda}" --tb=line \
  >"$OUT/tests.log" 2>&1
grep -E "^E |FAILED|ERROR| passed| failed" "$OUT/tests.log" | tail -25
for mode in fwdbwd fwd; do
  timeout "${BENCH_SECONDS:-240}" python3 benchmarks/bench_attention.py --mode $mode --quick --kinds paper,gqa,padding \
    --dtypes bf16,fp16 --dims 64,128,256 --min-n 1024 --out-dir "$OUT" --tag "cuda-$mode" 2>/dev/null |
    grep -E "geomean" | tail -6
done
timeout 200 python3 benchmarks/bench_serve.py --reps 10 > "$OUT/bench-serve.log" 2>&1; grep -E "geomean|fraction|: flashmod" "$OUT/bench-serve.log" | tail -30
timeout 150 python3 examples/hf_train.py --device cuda > "$OUT/hf-train.log" 2>&1; tail -4 "$OUT/hf-train.log"
rm -f "$OUT"/*.png  # at most 8 files come back: the plots are redrawn from the JSON
