"""Attention through flashmod on the default device (CUDA if present, else CPU).

Prints the parity with PyTorch's own attention (against an fp64 reference, side by side with
torch's error) and the speed of both, in the same process.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import flashmod
from flashmod.reference import attention_reference


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    dtype = torch.bfloat16
    b, h, hkv, n, d = (4, 16, 4, 4096, 128) if device == "cuda" else (1, 8, 2, 1024, 64)
    print(f"flashmod {flashmod.__version__} on {name}: B={b} Hq={h} Hkv={hkv} N={n} D={d} {dtype}")

    q = torch.randn(b, h, n, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, n, d, device=device, dtype=dtype)
    for causal in (False, True):
        ours = flashmod.attention(q, k, v, is_causal=causal)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        rows = slice(0, 256)  # the fp64 reference on the first queries keeps this quick (and
        # top-left causal attention of a prefix of queries does not depend on the rest)
        truth = attention_reference(
            q[:, :, rows], k, v, is_causal=causal, bottom_right=False, compute_dtype=torch.float64
        )[0]
        err_ours = (ours[:, :, rows].double() - truth).abs().max().item()
        err_torch = (theirs[:, :, rows].double() - truth).abs().max().item()
        t_ours = median_seconds(lambda c=causal: flashmod.attention(q, k, v, is_causal=c), 10)
        t_torch = median_seconds(
            lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=True), 10
        )
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        unit, per = ("TFLOP/s", 1e12) if device == "cuda" else ("GFLOP/s", 1e9)
        print(
            f"causal={causal!s:5}  max|err| vs fp64: flashmod {err_ours:.2e}  torch {err_torch:.2e}   "
            f"flashmod {flops / t_ours / per:7.1f} {unit}  torch SDPA {flops / t_torch / per:7.1f} {unit}  "
            f"speed ratio {t_torch / t_ours:.2f}x"
        )


if __name__ == "__main__":
    main()
