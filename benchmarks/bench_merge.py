"""merge_attention's bandwidth: flashmod.merge_attention against a device copy of the same bytes and
against the same merge in plain torch (logsumexp + weighted sum), in one process.

    python benchmarks/bench_merge.py                 # CUDA if present, else CPU
    python benchmarks/bench_merge.py --parts 2,4,8

Bytes counted: every partial read once (outputs and lses), the result and its lse written once. The
copy moves the same number of bytes (read + write) with ``Tensor.copy_``; the bar is >= 85 % of its
rate for large merges.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import flashmod  # noqa: E402


def torch_merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    stacked = torch.stack(lses)
    lse = torch.logsumexp(stacked, 0)
    weights = torch.exp(stacked - lse).nan_to_num(0.0)
    out = sum(w[..., None] * o.float() for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--parts", default="2,4,8", help="numbers of partials to merge, comma-separated")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="dtype of the partials")
    parser.add_argument("--reps", type=int, default=30, help="timed rounds (the median is reported)")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = args.device
    # One rank's share of a long-context job: (B, H, N, D) = (1, 32, 32k, 128) on CUDA; smaller on CPU.
    shape = (1, 32, 32768, 128) if dev == "cuda" else (1, 8, 4096, 128)
    print(f"merge_attention on {harness.device_name(dev)}, partials {list(shape)} {args.dtype}")
    print(f"{'parts':>5} {'GB moved':>9} {'merge GB/s':>11} {'copy GB/s':>10} {'of copy':>8} {'torch GB/s':>11}")
    for parts in (int(p) for p in args.parts.split(",")):
        outs = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(parts)]
        lses = [torch.randn(shape[:-1], device=dev) for _ in range(parts)]
        want = torch_merge(outs, lses)
        got = flashmod.merge_attention(outs, lses)
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        moved = (parts + 1) * (outs[0].numel() * outs[0].element_size() + lses[0].numel() * 4)
        src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        times = harness.median_times(
            {
                "merge": lambda outs=outs, lses=lses: flashmod.merge_attention(outs, lses),
                "copy": lambda dst=dst, src=src: dst.copy_(src),
                "torch": lambda outs=outs, lses=lses: torch_merge(outs, lses),
            },
            dev,
            warmup=3,
            reps=args.reps,
        )
        rate = {name: moved / t / 1e9 for name, t in times.items()}
        print(
            f"{parts:>5} {moved / 1e9:>9.2f} {rate['merge']:>11.0f} {rate['copy']:>10.0f} "
            f"{rate['merge'] / rate['copy']:>8.2f} {rate['torch']:>11.0f}"
        )


if __name__ == "__main__":
    main()
