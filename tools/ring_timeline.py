"""Where a ring training step's time goes on each GPU: the NCCL kernels against the compute kernels.

    python tools/ring_timeline.py [--world-size 2] [--seqlen 131072] [--trace-dir DIR]

Every rank runs warm-up steps of ``ring_attention`` forward + backward (causal, zigzag slices),
then one step under torch.profiler, and reports from its kernel timeline (milliseconds):
- step: first kernel start to last kernel end;
- compute busy: the union of the non-NCCL kernels' intervals; idle: the step's time outside it;
- nccl: each NCCL kernel's start, duration and how much of it overlapped compute kernels;
- the compute gaps longer than --gap-us, with the kernels on either side (what the stream waited for).
The question it answers (benchmarks/results/design/merge-and-ring.md, session 15): which part of
the 6-9 ms a training step exposes is waiting (compute idle while a transfer runs) and which is
compute slowed beside NCCL (busy time above the compute-only run's). --trace-dir keeps each rank's
Chrome trace. Needs one GPU per rank (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_ring import spawn_ranks  # noqa: E402

from flashmod.distributed import ring_attention, shard_sequence  # noqa: E402


def _union_ms(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total length of the union of (start, end) intervals in microseconds, as ms, and the union."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return sum(e - s for s, e in merged) / 1e3, merged


def _overlap_us(start: float, end: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in union)


def summarize(trace_path: str, gap_us: float) -> list[str]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel" and "dur" in e
    )
    if not kernels:
        return ["no kernels in the trace (CPU run?)"]
    nccl = [k for k in kernels if "nccl" in k[2].lower()]
    compute = [k for k in kernels if "nccl" not in k[2].lower()]
    t0, t1 = kernels[0][0], max(k[1] for k in kernels)
    busy_ms, union = _union_ms([(s, e) for s, e, _ in compute])
    lines = [f"step {(t1 - t0) / 1e3:.2f} ms, compute busy {busy_ms:.2f}, idle {(t1 - t0) / 1e3 - busy_ms:.2f}"]
    for s, e, name in nccl:
        lines.append(
            f"  nccl at {(s - t0) / 1e3:8.2f} ms, {(e - s) / 1e3:6.2f} ms long, "
            f"{_overlap_us(s, e, union) / 1e3:6.2f} beside compute: {name[:60]}"
        )
    by_end = sorted(compute, key=lambda k: k[1])
    for before, after in zip(by_end, by_end[1:]):
        gap = after[0] - before[1]
        if gap > gap_us:
            lines.append(
                f"  compute gap {gap / 1e3:.2f} ms at {(before[1] - t0) / 1e3:.2f}: {before[2][:40]} -> {after[2][:40]}"
            )
    return lines


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (1, args.heads, args.seqlen, args.head_dim)
        full = [torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen) for _ in range(4)]
        q, k, v, grad = (shard_sequence(t, 2, rank, world_size, True).contiguous() for t in full)
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            for t in leaves:
                t.grad = None
            ring_attention(*leaves, causal=True).backward(grad)

        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        trace_dir = args.trace_dir or tempfile.mkdtemp()
        path = os.path.join(trace_dir, f"ring-rank{rank}.json")
        prof.export_chrome_trace(path)
        lines = summarize(path, args.gap_us)
        for r in range(world_size):  # one rank's report at a time
            if r == rank:
                print(f"rank {rank}: " + "\n".join(lines), flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=131072, help="the whole job's sequence length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gap-us", type=float, default=200.0, help="report compute gaps longer than this")
    parser.add_argument("--trace-dir", default=None, help="keep each rank's Chrome trace here")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, this machine has {torch.cuda.device_count()}")
    spawn_ranks(worker, args)


if __name__ == "__main__":
    main()
