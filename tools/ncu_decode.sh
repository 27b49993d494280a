#!/usr/bin/env bash
# Nsight Compute on one decode step of flash_attn_with_kvcache (B = 8, 32/8 heads, D = 128, bf16,
# one new token; caches of $SIZES tokens): duration, DRAM throughput and the warp issue rate of the
# decode kernel, under the FLASHMOD_* knobs of the environment. ncu flushes the caches before the profiled launch, as bench_serve.py's
# cold-L2 timing does. Needs a built tree (gpu_check.sh). Usage: SIZES="1024 4096" bash tools/ncu_decode.sh
set -uo pipefail
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for s in ${SIZES:-1024 4096}; do
  for _ in 1; do
    echo "== cache $s" | tee -a "$OUT/ncu-decode.txt"
    timeout 180 ncu --clock-control none --kernel-name regex:attention_ \
      --launch-skip 2 --launch-count 1 --section SpeedOfLight --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis python -c "
import torch, flashmod
b, hq, hkv, d, s = 8, 32, 8, 128, $s
kc, vc = (torch.randn(b, s, hkv, d, device='cuda', dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(b, 1, hq, d, device='cuda', dtype=torch.bfloat16)
kn, vn = (torch.randn(b, 1, hkv, d, device='cuda', dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((b,), s - 1, dtype=torch.int32, device='cuda')
for _ in range(3):
    flashmod.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens)
torch.cuda.synchronize()
" 2>&1 | grep -E "attention_|Duration|DRAM Throughput|Memory Throughput|Grid Size|Registers|Stall|Warp Cycles Per|Active Warps|L2 Hit|Mem Busy|Max Bandwidth|==ERR|==WARN" |
      sed -E 's/\(flashmod::AttentionParams.*//' | tee -a "$OUT/ncu-decode.txt"
  done
done
