"""Decode split-KV sweep (a tuning aid): flashmod at forced split counts vs SDPA FLASH, one process.

    python tools/decode_splits.py [--batches 1,2,4,8,16] [--sizes 1024,...] [--splits 1,2,4,...] [--warm]

Shapes: bf16, Hq = 32, Hkv = 8, D = 128, Nq = 1, B and Nk swept. FLASHMOD_DECODE_SPLITS=n forces
n splits (heur: the heuristic in csrc/attention/cuda/decode_heuristics.h choose_splits, whose
choice the last column names). Every call starts from a cold L2, as in bench_serve.py's kvcache
group (harness.median_times, isolate), unless --warm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness import median_times, with_env  # noqa: E402

from flashmod.ops import attention_op  # noqa: E402

SPLITS = [0, 1, 2, 3, 4, 6, 8, 16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warm", action="store_true", help="no L2 flush before each call")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS[1:])), help="forced split counts to time")
    args = ap.parse_args()
    splits = [0] + [int(s) for s in args.splits.split(",")]
    print(
        f"device: {torch.cuda.get_device_name()}; bf16 h32/8 d128 nq1; TFLOP/s = 4*B*Hq*Nq*Nk*D / t; "
        f"{'warm' if args.warm else 'cold'} L2"
    )
    head = " ".join(f"{'s' + str(s) if s else 'heur':>7}" for s in splits)
    print(f"{'B':>3} {'nk':>6} {'FLASH':>7} {head}   best (x heur)   heur = s?")
    for b in map(int, args.batches.split(",")):
        for nk in map(int, args.sizes.split(",")):
            q = torch.randn(b, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, 8, nk, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, 8, nk, 128, device="cuda", dtype=torch.bfloat16)
            flops = 4 * b * 32 * nk * 128

            def flash(q=q, k=k, v=v):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            fns = {"FLASH": flash}
            for s in splits:
                fns[s] = with_env(f"FLASHMOD_DECODE_SPLITS={s}", lambda q=q, k=k, v=v: attention_op(q, k, v))
            seconds = median_times(fns, "cuda", warmup=5, reps=args.reps, isolate=not args.warm)
            forced = {s: seconds[s] for s in splits if s}
            best = min(forced, key=forced.get)
            same = [s for s in forced if abs(forced[s] - seconds[0]) / seconds[0] < 0.01]
            print(
                f"{b:>3} {nk:>6} "
                + " ".join(f"{flops / t / 1e12:7.2f}" for t in seconds.values())
                + f"   s{best} ({seconds[0] / forced[best]:.3f})   {same}"
            )


if __name__ == "__main__":
    main()
