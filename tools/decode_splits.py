"""Decode split-KV sweep (a tuning aid): flashmod at forced split counts vs SDPA FLASH, one process.

    python tools/decode_splits.py

Shapes: bf16, B = 8, Hq = 32, Hkv = 8, D = 128, Nq = 1, Nk = 1k..64k. FLASHMOD_DECODE_SPLITS=n
forces n splits (0 = the heuristic in csrc/attention/cuda/decode_heuristics.h choose_splits).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness import median_times, with_env  # noqa: E402

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

        fns = {"FLASH": flash}
        for s in splits:
            fns[s] = with_env(f"FLASHMOD_DECODE_SPLITS={s}", lambda q=q, k=k, v=v: attention_op(q, k, v))
        seconds = median_times(fns, "cuda", warmup=10, reps=100)
        print(f"{nk:>6} " + " ".join(f"{flops / t / 1e12:7.2f}" for t in seconds.values()))


if __name__ == "__main__":
    main()
