#!/usr/bin/env bash
# Nsight Compute on one forward call of each contender (flashmod, SDPA CUDNN, SDPA FLASH) at one
# shape: every kernel the call launches, with its launch configuration (grid, block, registers,
# shared memory, CTAs per SM), duration, SM and DRAM throughput and tensor-pipe activity. What it
# answers: how a faster contender is built (tiles per CTA, CTAs per SM), not only that it is faster.
# One profiled call per contender after two warm-up calls; clocks as found. Needs a built tree.
# Usage: SHAPE="16 32 1024 64" CAUSAL=True bash tools/ncu_contenders.sh   (B H N D; output in $OUT)
#   WHO: the contenders to profile (default "flashmod CUDNN FLASH")
#   EXTRA_METRICS: more ncu metrics, comma-separated (e.g. lts__t_sector_hit_rate.pct,dram__bytes_read.sum)
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
read -r B H N D <<<"${SHAPE:-16 32 1024 64}"
causal=${CAUSAL:-False}
pipes=$(ncu --query-metrics --chip gh100 2>/dev/null | grep -oE "^sm__pipe_tensor_op_(gmma|hmma)_cycles_active\b" | sort -u)
metrics="gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread"
metrics="$metrics,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers"
metrics="$metrics,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics="$metrics,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed"
for m in $pipes; do metrics="$metrics,$m.avg.pct_of_peak_sustained_active"; done
[[ -n ${EXTRA_METRICS:-} ]] && metrics="$metrics,$EXTRA_METRICS"
rep="$OUT/ncu-contenders-$B-$H-$N-$D-$causal.txt"
for who in ${WHO:-flashmod CUDNN FLASH}; do
  echo "== $who B $B H $H N $N D $D causal $causal" | tee -a "$rep"
  timeout 150 ncu --clock-control none --nvtx --nvtx-include "timed/" --metrics "$metrics" python -c "
import torch, flashmod
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
q, k, v = (torch.randn($B, $H, $N, $D, device='cuda', dtype=torch.bfloat16) for _ in range(3))
def call():
    if '$who' == 'flashmod':
        return flashmod.attention_op(q, k, v, is_causal=$causal)
    with sdpa_kernel(getattr(SDPBackend, 'CUDNN_ATTENTION' if '$who' == 'CUDNN' else 'FLASH_ATTENTION')):
        return F.scaled_dot_product_attention(q, k, v, is_causal=$causal)
for _ in range(2):
    call()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push('timed')
call()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
" 2>&1 | grep -vE "^==PROF==|^$" | sed -E 's/\(CUtensorMap.*//; s/^ +//' | grep -vE "^-+ " | tee -a "$rep"
done
