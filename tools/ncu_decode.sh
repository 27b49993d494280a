#!/usr/bin/env bash
# Nsight Compute on one decode step, the KV-cache kernel (flash_attn_with_kvcache) and the dense one
# (flashmod.attention) on the same cache (B = 8, 32/8 heads, D = 128, bf16, one new token), under
# the FLASHMOD_* knobs of the environment: duration, DRAM bytes, instructions and the stall
# sampling per SASS instruction (tools/ncu_stall_table.py), caches flushed before the profiled
# launch as bench_serve.py's cold-L2 timing does. Needs a built tree (gpu_check.sh). Keeps one text
# file per (mode, size) in $OUT. Modes: dense, kvcache (contiguous cache), paged16 (16-token pages
# in random order, as bench_serve.py draws them), paged16order (the same pages in sequence order:
# the contiguous cache's addresses through the paged code path), kvnoappend (the contiguous cache
# read over the same length without the append: what the fused append costs).
# Usage: SIZES="1024 4096" MODES="dense kvcache paged16 paged16order" BATCH=8 bash tools/ncu_decode.sh
#   EXTRA_METRICS: more --metrics, comma-separated, printed with the others
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for s in ${SIZES:-1024 4096}; do
for mode in ${MODES:-dense kvcache}; do
  rep="$OUT/dec-$mode-$s"
  timeout 150 ncu --clock-control none --kernel-name regex:attention_fwd_kernel --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,sm__cycles_active.avg,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum${EXTRA_METRICS:+,$EXTRA_METRICS} \
    --import-source no -f -o "$rep" python -c "
import torch, flashmod
b, hq, hkv, d, s = ${BATCH:-8}, 32, 8, 128, $s
kc, vc = (torch.randn(b, s, hkv, d, device='cuda', dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(b, 1, hq, d, device='cuda', dtype=torch.bfloat16)
kn, vn = (torch.randn(b, 1, hkv, d, device='cuda', dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((b,), s - 1, dtype=torch.int32, device='cuda')
table = None
if '$mode'.startswith('paged16'):
    n = s // 16
    order = torch.arange(b * n, device='cuda') if '$mode' == 'paged16order' else torch.randperm(b * n, device='cuda')
    table = order.view(b, n).int()
    kp, vp = (torch.empty(b * n, 16, hkv, d, device='cuda', dtype=torch.bfloat16) for _ in range(2))
    kp[table.long()] = kc.view(b, n, 16, hkv, d)
    vp[table.long()] = vc.view(b, n, 16, hkv, d)
    kc, vc = kp, vp
for _ in range(3):
    if '$mode' == 'dense':
        flashmod.attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))
    elif '$mode' == 'kvnoappend':
        flashmod.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens + 1)
    else:
        flashmod.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table)
torch.cuda.synchronize()
" >"$rep.log" 2>&1 || { tail -5 "$rep.log"; continue; }
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>"$rep.err"
  ncu -i "$rep.ncu-rep" --page details >"$rep.txt" 2>&1
  echo "== $mode $s"
  grep -E "Duration|DRAM Through|Registers Per|Grid Size|dram__bytes|smsp__inst_executed|sm__cycles_active|local_op|Warp Cycles Per Issued|Stack|Elapsed Cycles${EXTRA_METRICS:+|${EXTRA_METRICS//,/|}}" "$rep.txt" | head -24
  python tools/ncu_stall_table.py "$rep.csv" 22 >> "$rep.txt"
  python tools/ncu_stall_table.py "$rep.csv" 22 | head -40
  rm -f "$rep.ncu-rep" "$rep.err" "$rep.log" "$rep.csv"
done
done
