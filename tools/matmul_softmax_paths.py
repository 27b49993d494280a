"""CUDA matmul_softmax by path, in one process: plain torch, the op's default (the fused kernels or
the cuBLAS + in-place normalize fallback, by softmax_cuda.cpp's fused_preferred), the fallback forced
(FLASHMOD_MMSM_FUSED=0), the fused kernels forced where they run (=2), and the GEMM alone. The data
behind that rule (benchmarks/results/design/softmax.md, session 42).

    PYTHONPATH=$PWD python tools/matmul_softmax_paths.py [--reps 20]
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_softmax import plain_matmul_softmax  # noqa: E402
from harness import median_times, with_env  # noqa: E402

import flashmod  # noqa: E402

SHAPES = [  # (B, H, M, N, K)
    (4, 16, 1024, 1024, 64),
    (2, 16, 2048, 2048, 128),
    (1, 32, 512, 4096, 64),
    (2, 16, 2048, 2048, 96),
    (2, 16, 2048, 2048, 32),
    (8, 16, 512, 512, 128),
    (1, 16, 4096, 4096, 128),
    (2, 16, 2048, 2048, 256),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("x torch (time of torch / time of each); ms of the GEMM alone")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for batch, heads, m, n, k in SHAPES:
            for causal in (False, True):
                a = torch.randn(batch, heads, m, k, device="cuda", dtype=dtype)
                b = torch.randn(batch, heads, n, k, device="cuda", dtype=dtype)
                scale = 1 / math.sqrt(k)
                keep = torch.ones(m, n, dtype=torch.bool, device="cuda").tril() if causal else None
                op = partial(flashmod.matmul_softmax, a, b, scale=scale, is_causal=causal)
                fns = {
                    "torch": partial(plain_matmul_softmax, a, b, scale, keep),
                    "default": op,
                    "fallback": with_env("FLASHMOD_MMSM_FUSED=0", op),
                    "fused": with_env("FLASHMOD_MMSM_FUSED=2", op),
                    "gemm": partial(torch.matmul, a, b.transpose(-1, -2)),
                }
                t = median_times(fns, "cuda", 5, args.reps)
                ratios = "  ".join(f"{name} {t['torch'] / t[name]:5.2f}x" for name in ("default", "fallback", "fused"))
                print(
                    f"{str(dtype).removeprefix('torch.'):8} {batch},{heads},{m},{n},{k} causal={causal!s:5}  "
                    f"torch {t['torch'] * 1e3:7.3f} ms  {ratios}  gemm {t['gemm'] * 1e3:6.3f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
