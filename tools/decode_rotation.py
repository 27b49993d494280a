"""Decode-step time with cold data but warm code: flash_attn_with_kvcache (and SDPA FLASH on the
same caches) rotating over enough distinct caches that each call's K/V has left L2, without the
L2 flush bench_serve.py runs between calls (which also evicts the kernels' machine code).
B = 8, 32/8 heads, D = 128, bf16, one new token. Prints microseconds per call (median of events)
and the fraction of a same-run copy rate.

    python tools/decode_rotation.py [--sizes 1024,4096] [--variant label:KNOB=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashmod


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the GPU is busy while the host queues the call: device time only
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def one_size(s: int, variants: dict[str, dict[str, str]], copy_rate: float) -> None:
    """Times every contender on caches of s tokens and prints one line."""
    dev, dt, b, hq, hkv, d = "cuda", torch.bfloat16, 8, 32, 8, 128
    cache_bytes = 2 * b * s * hkv * d * 2
    n = max(3, (150 << 20) // cache_bytes + 1)  # > 3x the L2 between two uses of one cache
    caches = [[torch.randn(b, s, hkv, d, device=dev, dtype=dt) for _ in range(2)] for _ in range(n)]
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    kn, vn = (torch.randn(b, 1, hkv, d, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((b,), s - 1, dtype=torch.int32, device=dev)
    turn = [0]

    def rotate(call):
        def step():
            kc, vc = caches[turn[0] % n]
            turn[0] += 1
            call(kc, vc)

        return step

    results = {}
    for label, knobs in variants.items():
        os.environ.update(knobs)
        step = rotate(lambda kc, vc: flashmod.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens))
        for _ in range(2 * n):
            step()
        results[label] = timed(step, 10 * n)
        for k in knobs:
            os.environ.pop(k)
    qb = q.transpose(1, 2)
    for label, backend in (("SDPA FLASH", SDPBackend.FLASH_ATTENTION), ("SDPA CUDNN", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            call = rotate(
                lambda kc, vc: F.scaled_dot_product_attention(
                    qb, kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True
                )
            )
            try:
                for _ in range(2 * n):
                    call()
                results[label] = timed(call, 10 * n)
            except RuntimeError as e:
                print(f"  {label}: {str(e)[:60]}")
    line = ", ".join(f"{k} {v:.1f} us ({cache_bytes / (v * 1e-6) / copy_rate:.2f})" for k, v in results.items())
    print(f"cache {s}: {line}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--variant", action="append", default=[], help="label:KNOB=value[,KNOB=value]")
    args = parser.parse_args()
    dev = "cuda"
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_us = timed(lambda: big[: 1 << 29].copy_(big[1 << 29 :]), 20)
    copy_rate = 2 * (1 << 29) / (copy_us * 1e-6)
    print(torch.cuda.get_device_name(), f"copy rate {copy_rate / 1e12:.2f} TB/s")
    variants = {"flashmod": {}}
    for v in args.variant:
        label, knobs = v.split(":", 1)
        variants[label] = dict(kv.split("=") for kv in knobs.split(","))
    for s in (int(x) for x in args.sizes.split(",")):
        one_size(s, variants, copy_rate)


if __name__ == "__main__":
    main()
