#!/usr/bin/env bash
# One call on the GPU machine: build (all cores, sm_80 + sm_90a), tests, benchmarks.
# Usage: bash tools/gpu_check.sh [tests|bench|softmax|serve|decode|all|session]   (logs go to $OUT, or ./gpu_logs)
#   session: the whole CUDA suite (failures by their first line), forward and forward+backward
#            benchmarks (the JSON holds the tables), serving, the CUDA training example; leaves at
#            most 8 files in $OUT (what the device tool brings back). session-a / session-b: its
#            two halves, one device call each
#   TEST_M      pytest -m expression (default: cuda, every test that runs on the GPU)
#   BENCH_ARGS  arguments of bench_attention.py (default: the speed-bar subset, all backends)
#   TEST_SECONDS / BENCH_SECONDS   time limits
#   ARCHS       compute capabilities to build (default "80;90a"; "90a" halves the build for
#               Hopper-only iterations)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
if ! MAX_JOBS=$(nproc) FLASHMOD_CUDA_ARCHS="${ARCHS:-80;90a}" python setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  grep -B2 -A6 -m5 "error" "$OUT/build.log" | head -60
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
# ptxas's C7518: a kernel whose wgmmas it serialized (correct, but a fraction of its speed).
serialized=$(grep -c C7518 "$OUT/build.log")
[[ $serialized -gt 0 ]] && echo "WARNING: ptxas serialized the wgmmas of $serialized kernels (C7518; tools/ptxas_report.py names them)"
# The Hopper kernel must be wgmma (HGMMA) in the machine code, not an mma.sync fallback.
for unit in fwd_sm90_bf16_hd128 bwd_sm90_bf16_hd128; do
  obj=$(find build -name "$unit.o" | head -1)
  [[ -n $obj ]] && echo "HGMMA in $unit: $(cuobjdump --dump-sass "$obj" 2>/dev/null | grep -c HGMMA)"
done
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# A bad input must raise, not crash the process (it once did on this image).
python -c "
import torch, flashmod
x = torch.randn(2, 1, 4, 8, device='cuda')
try:
    torch.ops.flashmod.attention(x, x[:1], x[:1])
except RuntimeError as e:
    print('bad input raises:', e)
"
if [[ $what == tests || $what == all ]]; then
  OMP_NUM_THREADS=2 timeout ${TEST_SECONDS:-240} python -m pytest tests -q -n 12 -p no:cacheprovider -x \
    -m "${TEST_M:-cuda}" 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_SECONDS:-200} python benchmarks/bench_attention.py --out-dir "$OUT" --tag cuda-attention \
    ${BENCH_ARGS:---kinds paper,gqa,padding --dtypes bf16,fp16 --dims 64,128 --min-n 1024 --portable} 2>/dev/null |
    tee "$OUT/attention-bench.log" | tail -45
fi
if [[ $what == serve ]]; then  # not in "all": the serving benchmark takes minutes
  timeout ${SERVE_SECONDS:-400} python benchmarks/bench_serve.py --out-dir "$OUT" 2>&1 |
    tee "$OUT/serve-bench.log" | tail -40
fi
# The decode kernel alone: its tests (compute-sanitizer included) and the kvcache benchmark with
# decode knobs side by side (DECODE_VARIANTS: "label:KNOB=value;...").
if [[ $what == decode ]]; then
  OMP_NUM_THREADS=2 timeout ${TEST_SECONDS:-300} python -m pytest tests/attention/test_serve.py \
    tests/attention/test_cuda.py -q -n 12 -p no:cacheprovider -m cuda --tb=short \
    -k "decode or kvcache or sanitizer" 2>&1 | tee "$OUT/tests.log" | tail -25
  variants=()
  IFS=';' read -ra specs <<<"${DECODE_VARIANTS:-1 split:FLASHMOD_DECODE_SPLITS=1}"
  for spec in "${specs[@]}"; do variants+=(--variant "$spec"); done
  timeout ${SERVE_SECONDS:-240} python benchmarks/bench_serve.py --group kvcache --reps 10 \
    --out-dir "$OUT" "${variants[@]}" 2>&1 | tee "$OUT/serve-bench.log" | grep -E "fraction|flashmod|FLASH|CUDNN|copy" | tail -40
fi
if [[ $what == softmax || $what == all ]]; then
  timeout ${SOFTMAX_SECONDS:-75} python benchmarks/bench_softmax.py --device cuda --out "$OUT/cuda-softmax.json" 2>&1 |
    tee "$OUT/softmax-bench.log" | tail -30
fi
# The session run, in two halves that each fit one device call (10 minutes): session-a the whole
# suite and the forward benchmark (every kind, N 1k-16k); session-b forward+backward, serving and
# the CUDA training example. The second call finds the first one's build when the machine is
# still warm (ninja rebuilds nothing). session runs both.
if [[ $what == session || $what == session-a ]]; then
  timeout "${TEST_SECONDS:-420}" python -m pytest tests -q -n 12 -p no:cacheprovider -m "${TEST_M:-cuda}" --tb=line \
    >"$OUT/tests.log" 2>&1
  grep -E "^E |FAILED|ERROR| passed| failed" "$OUT/tests.log" | tail -25
  timeout "${BENCH_SECONDS:-240}" python benchmarks/bench_attention.py --mode fwd --reps 30 \
    --kinds paper,gqa,padding,window,softcap --dtypes bf16,fp16 --dims 64,128,256 --min-n 1024 \
    --out-dir "$OUT" --tag "cuda-fwd" 2>/dev/null | grep -E "^(paper|gqa|padding|window|softcap)|geomean"
fi
if [[ $what == session || $what == session-b ]]; then
  timeout "${BENCH_SECONDS:-240}" python benchmarks/bench_attention.py --mode fwdbwd --quick \
    --kinds paper,gqa,padding --dtypes bf16,fp16 --dims 64,128,256 --min-n 1024 --out-dir "$OUT" \
    --tag "cuda-fwdbwd" 2>/dev/null | grep geomean
  timeout 200 python benchmarks/bench_serve.py --reps 10 --out-dir "$OUT" >"$OUT/bench-serve.log" 2>&1
  timeout 120 python benchmarks/bench_serve.py --group varlen --varlen-backward --reps 10 --out-dir "$OUT" \
    >>"$OUT/bench-serve.log" 2>&1
  grep -E "geomean|fraction|: flashmod" "$OUT/bench-serve.log" | tail -30
  timeout 150 python examples/hf_train.py --device cuda >"$OUT/hf-train.log" 2>&1
  tail -4 "$OUT/hf-train.log"
fi
if [[ $what == session* ]]; then
  rm -f "$OUT"/*.png  # at most 8 files come back: the plots are redrawn from the JSON
fi
