"""Decode split-KV sweep (a tuning aid): flashmod at forced split counts vs SDPA FLASH, one process.

    python benchmarks/decode_splits.py

Shapes: bf16, B = 8, Hq = 32, Hkv = 8, D = 128, Nq = 1, Nk = 1k..64k. FLASHMOD_DECODE_SPLITS=n
forces n splits (0 = the heuristic in csrc/attention/cuda/entry_points.h choose_splits).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashmod.ops import attention_op  # noqa: E402


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}; bf16 b8 h32/8 d128 nq1; TFLOP/s = 4*B*Hq*Nq*Nk*D / t")
    splits = [0, 1, 2, 4, 8, 16, 32, 64]
    print(f"{'nk':>6} {'FLASH':>7} " + " ".join(f"{'s' + str(s) if s else 'heur':>7}" for s in splits))
    for nk in (1024, 2048, 4096, 8192, 16384, 65536):
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(8, 8, nk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(8, 8, nk, 128, device="cuda", dtype=torch.bfloat16)
        flops = 4 * 8 * 32 * nk * 128

        def flash(q=q, k=k, v=v):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        cells = [flops / triton.testing.do_bench(flash, warmup=25, rep=100, return_mode="median") / 1e9]
        for s in splits:
            os.environ["FLASHMOD_DECODE_SPLITS"] = str(s)
            fn = lambda q=q, k=k, v=v: attention_op(q, k, v)  # noqa: E731
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            cells.append(flops / ms / 1e9)
        os.environ.pop("FLASHMOD_DECODE_SPLITS", None)
        print(f"{nk:>6} " + " ".join(f"{c:7.2f}" for c in cells))


if __name__ == "__main__":
    main()
