"""Long-row softmax (rows > 16k) on each long-row path, in one process (NOTES.md "softmax long rows
(v4)"): the cluster path (default) and the L2 two-pass path (FLASHMOD_SOFTMAX_LONG=l2) at 4 and
2 CTAs per SM (FLASHMOD_SOFTMAX_L2_BLOCKS). softmax.cu reads both variables per call, so one
process switches between them. Time is the median of --reps calls; fraction_of_copy = time of a
same-size device copy / time (the bar is 0.85). The paths are timed in alternating order, twice,
and the better median of the two rounds is kept.

Usage: python benchmarks/softmax_long_paths.py [--out FILE.json] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch
from bench_softmax import median_time

import flashmod

MODES = [("cluster", "4"), ("l2", "4"), ("l2", "2")]


def set_mode(mode: str, blocks: str) -> None:
    os.environ["FLASHMOD_SOFTMAX_LONG"] = mode
    os.environ["FLASHMOD_SOFTMAX_L2_BLOCKS"] = blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    assert torch.cuda.is_available()
    total, warmup = 1 << 27, 5
    rows_out = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'dtype':>9} {'shape':>14} {'mode':>10} {'ms':>8} {'GB/s':>7} {'of copy':>8} {'max |diff|':>10}")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (65536, 262144):
            x = torch.randn(total // n, n, device="cuda", dtype=dtype) * 4
            y = torch.empty_like(x)
            t_copy = median_time(partial(y.copy_, x), "cuda", warmup, args.reps)
            moved = 2 * x.numel() * x.element_size()
            set_mode("cluster", "4")
            ref = flashmod.softmax(x, -1).float()
            best = {}
            for order in (MODES, MODES[::-1]):
                for mode, blocks in order:
                    set_mode(mode, blocks)
                    t = median_time(partial(flashmod.softmax, x, -1), "cuda", warmup, args.reps)
                    best[(mode, blocks)] = min(best.get((mode, blocks), t), t)
            for mode, blocks in MODES:
                set_mode(mode, blocks)
                diff = (flashmod.softmax(x, -1).float() - ref).abs().max().item()
                t = best[(mode, blocks)]
                label = mode if mode == "cluster" else f"{mode}/{blocks}"
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": list(x.shape),
                    "mode": mode,
                    "l2_blocks_per_sm": int(blocks) if mode == "l2" else None,
                    "ms": t * 1e3,
                    "GBps": moved / t / 1e9,
                    "copy_GBps": moved / t_copy / 1e9,
                    "fraction_of_copy": t_copy / t,
                    "max_abs_diff_vs_cluster": diff,
                }
                rows_out.append(row)
                print(
                    f"{row['dtype']:>9} {str(tuple(x.shape)):>14} {label:>10} {row['ms']:8.3f} "
                    f"{row['GBps']:7.0f} {row['fraction_of_copy']:8.3f} {diff:10.2e}"
                )
            del x, y, ref
            torch.cuda.empty_cache()
    os.environ.pop("FLASHMOD_SOFTMAX_LONG")
    os.environ.pop("FLASHMOD_SOFTMAX_L2_BLOCKS")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f, indent=1
            )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
