"""CPU decode timing: flashmod vs F.scaled_dot_product_attention on decode shapes (Nq <= 4, long KV,
GQA), 2 threads, interleaved rounds, median of 60 (benchmarks/harness.py).

    PYTHONPATH=. python tools/decode_cpu_check.py   (FLASHMOD_CPU_DECODE=0: the prefill kernel)
    PYTHONPATH=. python tools/decode_cpu_check.py --dtype bfloat16 --case 1,8,8,1,4096,128 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import median_times  # noqa: E402

from flashmod.ops import attention_op  # noqa: E402

# (B, Hq, Hkv, Nq, Nk, D)
CASES = [
    (1, 1, 1, 1, 4096, 128),
    (1, 8, 8, 1, 4096, 128),
    (1, 32, 8, 1, 4096, 128),
    (4, 8, 8, 1, 1024, 64),
    (1, 1, 1, 1, 32768, 128),
    (1, 16, 16, 4, 8192, 64),
    (1, 32, 4, 1, 16384, 128),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], action="append", help="default: both")
    ap.add_argument("--case", action="append", help="B,Hq,Hkv,Nq,Nk,D (repeatable; default: the built-in list)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    dtypes = [getattr(torch, n) for n in args.dtype] if args.dtype else [torch.float32, torch.bfloat16]
    cases = [tuple(int(x) for x in c.split(",")) for c in args.case] if args.case else CASES
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for dt in dtypes:
        for b, hq, hkv, nq, nk, d in cases:
            q = torch.randn(b, hq, nq, d, dtype=dt)
            k = torch.randn(b, hkv, nk, d, dtype=dt)
            v = torch.randn(b, hkv, nk, d, dtype=dt)
            t = median_times(
                {
                    "torch": lambda q=q, k=k, v=v, g=hq != hkv: F.scaled_dot_product_attention(q, k, v, enable_gqa=g),
                    "flashmod": lambda q=q, k=k, v=v: attention_op(q, k, v),
                },
                "cpu",
                warmup=1,
                reps=args.reps,
            )
            print(
                f"{str(dt)[6:]:8s} B{b} H{hq}/{hkv} Nq{nq} Nk{nk} D{d}: torch {t['torch'] * 1e6:8.1f}us "
                f"flashmod {t['flashmod'] * 1e6:8.1f}us ratio {t['torch'] / t['flashmod']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
