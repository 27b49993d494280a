"""CPU forward benchmark: flashmod.attention vs torch's F.scaled_dot_product_attention (flash).

Both run in this process with the same thread count, interleaved shape by shape so that machine
noise hits both contenders alike. Each shape is validated against the fp64 reference first.

    PYTHONPATH=. python benchmarks/bench_cpu.py --tag v1 [--quick] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmod.ops import attention_op
from flashmod.reference import attention_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (B, H, N, D): the range, B=1, H 8-16, N 512-4096, D 64/128.
SHAPES = [(1, 16, 512, 64), (1, 16, 1024, 64), (1, 8, 2048, 128), (1, 8, 4096, 64), (1, 16, 1024, 128)]
QUICK_SHAPES = [(1, 16, 512, 64), (1, 8, 2048, 128)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_interleaved(fns: list, min_runs: int, budget_s: float) -> list[float]:
    """Median seconds per call of each fn, alternating them run by run after one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_runs or time.perf_counter() - start < budget_s:
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        if len(times[0]) >= 4 * min_runs:
            break
    return [statistics.median(t) for t in times]


def validate(q, k, v, causal: bool) -> float:
    """Max |flashmod - fp64 reference| relative to that of plain attention in q's dtype."""
    out, _ = attention_op(q, k, v, is_causal=causal, bottom_right=False)
    ref, _ = attention_reference(q, k, v, is_causal=causal, bottom_right=False, compute_dtype=torch.float64)
    plain, _ = attention_reference(q, k, v, is_causal=causal, bottom_right=False, compute_dtype=q.dtype)
    err = (out.double() - ref).abs().max().item()
    plain_err = (plain.double() - ref).abs().max().item()
    ratio = err / max(plain_err, 1e-7)
    assert ratio <= 2.0, f"flashmod error {err:.3g} is {ratio:.2f}x plain attention's {plain_err:.3g}"
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="dev")
    ap.add_argument("--quick", action="store_true", help="two shapes, shorter timing")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per shape")
    args = ap.parse_args()

    threads = torch.get_num_threads()
    print(
        f"CPU: {cpu_name()}  threads: {threads}  torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"
    )
    shapes = QUICK_SHAPES if args.quick else SHAPES
    min_runs = 3 if args.quick else 5
    rows = []
    print(
        f"{'dtype':5} {'causal':6} {'B':>2} {'H':>3} {'N':>5} {'D':>4} | {'flashmod GF/s':>13} "
        f"{'torch GF/s':>10} {'ratio':>6} | err/plain"
    )
    for name in args.dtypes:
        dtype = DTYPES[name]
        for causal in (False, True):
            for b, h, n, d in shapes:
                gen = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for _ in range(3))
                err_ratio = validate(q, k, v, causal)

                def ours(q=q, k=k, v=v, causal=causal):
                    attention_op(q, k, v, is_causal=causal, bottom_right=False)

                def theirs(q=q, k=k, v=v, causal=causal):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                t_ours, t_torch = time_interleaved([ours, theirs], min_runs, args.budget)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                row = dict(
                    dtype=name,
                    causal=causal,
                    B=b,
                    H=h,
                    N=n,
                    D=d,
                    flashmod_s=t_ours,
                    torch_s=t_torch,
                    flashmod_gflops=flops / t_ours / 1e9,
                    torch_gflops=flops / t_torch / 1e9,
                    ratio=t_torch / t_ours,
                    err_vs_plain=err_ratio,
                )
                rows.append(row)
                print(
                    f"{name:5} {str(causal):6} {b:>2} {h:>3} {n:>5} {d:>4} | "
                    f"{row['flashmod_gflops']:13.1f} {row['torch_gflops']:10.1f} {row['ratio']:6.2f} | "
                    f"{err_ratio:.2f}",
                    flush=True,
                )
    geomeans = {}
    for name in args.dtypes:
        ratios = [r["ratio"] for r in rows if r["dtype"] == name]
        geomeans[name] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"geomean ratio {name}: {geomeans[name]:.3f}")

    date = datetime.date.today().isoformat()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{date}-cpu-{args.tag}.json")
    with open(path, "w") as f:
        json.dump(
            dict(
                cpu=cpu_name(),
                threads=threads,
                torch=torch.__version__,
                tag=args.tag,
                rows=rows,
                geomean_ratio=geomeans,
            ),
            f,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
