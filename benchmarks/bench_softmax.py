"""Benchmark flashmod.softmax and flashmod.matmul_softmax against plain torch, in one process.

    python benchmarks/bench_softmax.py --device cpu
    python benchmarks/bench_softmax.py --device cuda

Times are medians over interleaved rounds after warm-up (benchmarks/harness.py). Prints a table and
writes build/bench/<date>-<device>-softmax.json (or --out). Columns:
  softmax:         torch.softmax(x, -1) vs flashmod.softmax(x, -1); on CUDA also the achieved
                   bandwidth (read + write) as a fraction of a same-size device copy (x -> y).
  matmul_softmax:  torch.softmax(scale * a @ b^T [masked], -1) vs flashmod.matmul_softmax, and the
                   peak memory each needs beyond its inputs (CUDA: max_memory_allocated; CPU: peak
                   resident set, with glibc told to return large blocks at free so RSS tracks them).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from functools import partial

import torch
from harness import device_name, median_times, peak_extra_bytes, track_rss_of_large_blocks, with_env, write_json

import flashmod


def bench_softmax(device: str, dtypes, total: int, warmup: int, reps: int, variants: list[str]) -> list[dict]:
    """torch, flashmod, (CUDA) a same-size copy, and flashmod under each NAME=value of `variants`,
    all timed in the same interleaved rounds."""
    rows_out = []
    for dtype in dtypes:
        for n in (1024, 4096, 16384, 65536, 262144):
            x = torch.randn(max(1, total // n), n, device=device, dtype=dtype)
            fns = {"torch": partial(torch.softmax, x, -1), "flashmod": partial(flashmod.softmax, x, -1)}
            if device == "cuda":
                y = torch.empty_like(x)
                fns["copy"] = partial(y.copy_, x)
            for setting in variants:
                fns[setting] = with_env(setting, partial(flashmod.softmax, x, -1))
            t = median_times(fns, device, warmup, reps)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "shape": list(x.shape),
                "torch_ms": t["torch"] * 1e3,
                "flashmod_ms": t["flashmod"] * 1e3,
                "speedup": t["torch"] / t["flashmod"],
            }
            if device == "cuda":
                moved = 2 * x.numel() * x.element_size()
                row["flashmod_GBps"] = moved / t["flashmod"] / 1e9
                row["copy_GBps"] = moved / t["copy"] / 1e9
                row["fraction_of_copy"] = t["copy"] / t["flashmod"]
            for setting in variants:
                row[f"{setting}:speedup"] = t["torch"] / t[setting]
                if device == "cuda":
                    row[f"{setting}:fraction_of_copy"] = t["copy"] / t[setting]
            rows_out.append(row)
    return rows_out


def plain_matmul_softmax(a, b, scale: float, keep) -> torch.Tensor:
    """What the fused op replaces: logits, scaled, optionally causally masked, then softmax."""
    s = scale * a @ b.transpose(-1, -2)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1)


def bench_matmul_softmax(device: str, dtypes, shapes, warmup: int, reps: int, variants: list[str]) -> list[dict]:
    """torch, flashmod, and flashmod under each NAME=value of `variants`, in the same rounds."""
    rows_out = []
    for dtype in dtypes:
        for (batch, heads, m, n, k), causal in shapes:
            a = torch.randn(batch, heads, m, k, device=device, dtype=dtype)
            b = torch.randn(batch, heads, n, k, device=device, dtype=dtype)
            scale = 1 / math.sqrt(k)
            keep = torch.ones(m, n, dtype=torch.bool, device=device).tril() if causal else None
            plain = partial(plain_matmul_softmax, a, b, scale, keep)
            ours = partial(flashmod.matmul_softmax, a, b, scale=scale, is_causal=causal)

            fns = {"torch": plain, "flashmod": ours}
            for setting in variants:
                fns[setting] = with_env(setting, ours)
            t = median_times(fns, device, warmup, reps)
            t_torch, t_ours = t["torch"], t["flashmod"]
            mem_torch = max(peak_extra_bytes(plain, device) for _ in range(2))
            mem_ours = max(peak_extra_bytes(ours, device) for _ in range(2))
            rows_out.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape_BHMNK": [batch, heads, m, n, k],
                    "causal": causal,
                    "torch_ms": t_torch * 1e3,
                    "flashmod_ms": t_ours * 1e3,
                    "speedup": t_torch / t_ours,
                    "output_MiB": batch * heads * m * n * a.element_size() / 2**20,
                    "torch_peak_MiB": mem_torch / 2**20,
                    "flashmod_peak_MiB": mem_ours / 2**20,
                    "memory_ratio": mem_ours / mem_torch if mem_torch else float("nan"),
                    **{f"{setting}:speedup": t_torch / t[setting] for setting in variants},
                }
            )
    return rows_out


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = list(rows[0].keys())
    cells = [[f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if present",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed runs per case (default: cpu 15, cuda 50)")
    parser.add_argument("--out", default=None, help="JSON path (default: build/bench/<date>-<device>-softmax.json)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=value[,NAME=value]: also time flashmod.softmax and matmul_softmax with these knobs, in the same"
        " rounds (repeatable)",
    )
    parser.add_argument("--softmax-only", action="store_true", help="skip matmul_softmax")
    args = parser.parse_args()
    device = args.device
    if device == "cuda":
        assert torch.cuda.is_available(), "--device cuda needs a CUDA build of torch and a GPU"
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
        total, warmup, reps = 1 << 27, 10, args.reps or 50  # 512 MiB of fp32: far beyond L2
        mm_shapes = [
            ((4, 16, 1024, 1024, 64), False),
            ((2, 16, 2048, 2048, 128), False),
            ((2, 16, 2048, 2048, 128), True),
            ((1, 32, 512, 4096, 64), False),
            ((8, 16, 512, 512, 128), False),  # short rows: the fallback's warp-per-row normalize
            ((4, 16, 1024, 1024, 256), False),
        ]
    else:
        track_rss_of_large_blocks()
        dtypes = [torch.float32, torch.bfloat16]
        total, warmup, reps = 1 << 22, 3, args.reps or 15
        mm_shapes = [
            ((1, 8, 512, 512, 64), False),
            ((1, 8, 1024, 1024, 64), False),
            ((1, 8, 1024, 1024, 64), True),
            ((1, 4, 256, 4096, 128), False),
        ]

    print(f"device: {device_name(device)}  torch {torch.__version__}")
    softmax_rows = bench_softmax(device, dtypes, total, warmup, reps, args.variant)
    print_table("softmax over the last dim (speedup = torch time / flashmod time)", softmax_rows)
    mm_rows = []
    if not args.softmax_only:
        mm_dtypes = dtypes if device == "cuda" else [torch.float32, torch.float16, torch.bfloat16]
        mm_rows = bench_matmul_softmax(device, mm_dtypes, mm_shapes, warmup, reps, args.variant)
        print_table("matmul_softmax vs torch.softmax(scale * a @ b^T, -1) (memory_ratio = ours / torch)", mm_rows)

    date = datetime.date.today().isoformat()
    path = args.out or os.path.join("build", "bench", f"{date}-{device}-softmax.json")
    write_json(
        path,
        {"device": device_name(device), "torch": torch.__version__, "softmax": softmax_rows, "matmul_softmax": mm_rows},
    )


if __name__ == "__main__":
    main()
