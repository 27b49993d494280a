#!/usr/bin/env bash
# Where a kernel's warps wait: Nsight Compute's warp-state sampling of one launch (after two
# warm-ups, clocks as found), summed per SASS instruction and per stall reason, for bf16 B x H x N x
# D shapes given as "B,H,N,D,causal" arguments. By default the warp-specialized Hopper forward;
# NCU_MODE=bwd profiles the backward's dK/dV kernel (a training step through flashmod.attention;
# the fused-dQ variant where the backward picks it; NCU_KERNEL=attention_bwd_dq_sm90 profiles the
# dQ kernel of the seven-matmul path instead). NCU_DTYPE=float32 (or float16) runs that dtype, and
# NCU_KERNEL picks the kernel in either mode (fp32: attention_bwd_tf32_dkdv, attention_fwd_fp32_tc).
# Usage: bash tools/ncu_stalls.sh 4,16,4096,128,0 8,32,4096,64,0   (tables in $OUT)
#        NCU_MODE=bwd bash tools/ncu_stalls.sh 4,16,4096,128,0
# Keeps two files per shape in $OUT (the device tool brings back at most 8): the per-instruction
# CSV and the summary with the warp-state section.
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
MODE=${NCU_MODE:-fwd}
if [ "$MODE" = bwd ]; then
  KERNEL=${NCU_KERNEL:-attention_bwd_dkdv_sm90}
  STEP="out = flashmod.attention(q, k, v, is_causal=causal); torch.autograd.grad(out, (q, k, v), g)"
  GRAD=True
else
  GRAD=False
  KERNEL=${NCU_KERNEL:-attention_fwd_sm90_ws}
  STEP="flashmod.attention_op(q, k, v, is_causal=causal)"
fi
for shape in "$@"; do
  IFS=, read -r b h n d causal <<<"$shape"
  rep="$OUT/stalls-$MODE${NCU_KERNEL:+-$NCU_KERNEL}${NCU_DTYPE:+-$NCU_DTYPE}-b${b}h${h}n${n}d${d}c${causal}"
  timeout 200 ncu --clock-control none --kernel-name regex:$KERNEL --launch-skip 2 \
    --launch-count 1 --section WarpStateStats --section SourceCounters --import-source no \
    -f -o "$rep" python -c "
import torch, flashmod
causal = bool($causal)
q, k, v = (torch.randn($b, $h, $n, $d, device='cuda', dtype=torch.${NCU_DTYPE:-bfloat16}, requires_grad=$GRAD) for _ in range(3))
g = torch.randn_like(q)
for _ in range(3):
    $STEP
torch.cuda.synchronize()
" >"$rep.log" 2>&1 || { tail -5 "$rep.log"; continue; }
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>"$rep.err"
  ncu -i "$rep.ncu-rep" --page details --section WarpStateStats >"$rep.txt" 2>&1
  echo "== $shape"
  grep -E "Stall|Warp Cycles|Active" "$rep.txt" | head -12
  python tools/ncu_stall_table.py "$rep.csv" | tee -a "$rep.txt"
  rm -f "$rep.ncu-rep" "$rep.err" "$rep.log"
done
