#!/usr/bin/env bash
# Tensor-pipe utilization of the Hopper forward kernels under Nsight Compute (issue #13's "before and
# after"): the FlashAttention-2-style wgmma kernel (FLASHMOD_SM90_WS=0) against the warp-specialized
# one, bf16, D = 128, B 4 x H 16 x N 4096, causal and not; one profiled launch each, after two
# warm-up launches. Clocks are left alone (--clock-control none). Needs a built tree (gpu_check.sh).
# Usage: bash tools/ncu_tensor_pipe.sh   (output also in $OUT/ncu-tensor-pipe.txt)
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# Metric names differ between Nsight versions: take the tensor-pipe ones this ncu knows.
pipes=$(ncu --query-metrics --chip gh100 2>/dev/null | grep -oE "^sm__pipe_tensor_op_(gmma|hmma)_cycles_active\b" | sort -u)
metrics="gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed"
for m in $pipes; do metrics="$metrics,$m.avg.pct_of_peak_sustained_active"; done
echo "metrics: $metrics" | tee "$OUT/ncu-tensor-pipe.txt"
for ws in 0 1; do
  for causal in False True; do
    echo "== FLASHMOD_SM90_WS=$ws causal=$causal" | tee -a "$OUT/ncu-tensor-pipe.txt"
    FLASHMOD_SM90_WS=$ws timeout 120 ncu --clock-control none --kernel-name regex:attention_fwd \
      --launch-skip 2 --launch-count 1 --metrics "$metrics" python -c "
import torch, flashmod
q, k, v = (torch.randn(4, 16, 4096, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))
for _ in range(3):
    flashmod.attention_op(q, k, v, is_causal=$causal)
torch.cuda.synchronize()
" 2>&1 | grep -E "attention_fwd|duration|throughput|pipe_tensor|==ERR|==WARN" | sed -E 's/\(CUtensorMap.*//' |
      tee -a "$OUT/ncu-tensor-pipe.txt"
  done
done
