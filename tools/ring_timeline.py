"""Where a ring training step's time goes on each GPU: the ring against its compute alone, kernel by kernel.

    python tools/ring_timeline.py [--world-size 2] [--seqlen 131072] [--steps 3] [--trace-dir DIR]

Every rank profiles ``--steps`` training steps (forward + backward, causal, zigzag slices) of
``ring_attention``, then of the same ring with each exchange replaced by what it would receive, cut
beforehand from the whole problem (bench_ring.py's compute), after warm-up steps of each, and
reports from the kernel timelines:
- wall time a step (host clock, synchronized), the kernels' span, the compute kernels' busy time
  (the union of their intervals) and idle time (the span outside it);
- each NCCL kernel's start, duration and how much of it ran beside compute kernels;
- compute gaps longer than --gap-us, with the kernels on either side (what the stream waited for);
- the compute kernels' time a step by name, ring against compute alone: which kernels slow down
  beside the exchanges, if any.
The question it answers (benchmarks/results/design/merge-and-ring.md): whether the ms a ring
training step loses to its compute alone are waiting (idle), slowed kernels, or host time
outside the kernels. --trace-dir keeps each rank's Chrome traces. Needs one GPU per rank (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_ring import no_exchange_ring, spawn_ranks  # noqa: E402

from flashmod.distributed import _RingAttention, ring_attention, shard_sequence  # noqa: E402


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


def summarize(trace_path: str, gap_us: float) -> tuple[list[str], dict[str, float]]:
    """The report's lines for one trace, and the kernels' total time in ms by name."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel" and "dur" in e
    )
    if not kernels:
        return ["no kernels in the trace (CPU run?)"], {}
    nccl = [k for k in kernels if "nccl" in k[2].lower()]
    compute = [k for k in kernels if "nccl" not in k[2].lower()]
    t0, t1 = kernels[0][0], max(k[1] for k in kernels)
    busy_ms, union = _union_ms([(s, e) for s, e, _ in compute])
    lines = [f"kernels span {(t1 - t0) / 1e3:.2f} ms, compute busy {busy_ms:.2f}, idle {(t1 - t0) / 1e3 - busy_ms:.2f}"]
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
    by_name: dict[str, float] = {}
    for s, e, name in compute:
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + (e - s) / 1e3
    return lines, by_name


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

        def ring_step():
            for t in leaves:
                t.grad = None
            ring_attention(*leaves, causal=True).backward(grad)

        compute_ring = no_exchange_ring(full[1], full[2], world_size, True)

        def compute_step():  # the same ring without its exchanges (bench_ring.py's compute)
            for t in leaves:
                t.grad = None
            _RingAttention.apply(*leaves, None, True, None, 0.0, (-1, -1), compute_ring)[0].backward(grad)

        trace_dir = args.trace_dir or tempfile.mkdtemp()
        kernel_ms = {}
        for mode, step in (("ring", ring_step), ("compute", compute_step)):
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
            path = os.path.join(trace_dir, f"{mode}-rank{rank}.json")
            prof.export_chrome_trace(path)
            lines, by_name = summarize(path, args.gap_us)
            kernel_ms[mode] = {name: ms / args.steps for name, ms in by_name.items()}
            header = f"rank {rank}, {mode}, {args.steps} steps: wall {wall_ms:.2f} ms a step; "
            _print_in_rank_order(rank, world_size, header + "\n".join(lines))
        names = sorted(set(kernel_ms["ring"]) | set(kernel_ms["compute"]), key=lambda n: -kernel_ms["ring"].get(n, 0))
        table = [f"rank {rank}, kernel time a step by name, ms: ring, compute, ring - compute"]
        for name in names[: args.top]:
            ring_ms, compute_ms = kernel_ms["ring"].get(name, 0.0), kernel_ms["compute"].get(name, 0.0)
            table.append(f"  {ring_ms:8.2f} {compute_ms:8.2f} {ring_ms - compute_ms:+7.2f}  {name}")
        total = [sum(kernel_ms[mode].values()) for mode in ("ring", "compute")]
        table.append(f"  {total[0]:8.2f} {total[1]:8.2f} {total[0] - total[1]:+7.2f}  (all compute kernels)")
        _print_in_rank_order(rank, world_size, "\n".join(table))
    finally:
        dist.destroy_process_group()


def _print_in_rank_order(rank: int, world_size: int, text: str) -> None:
    for r in range(world_size):
        if r == rank:
            print(text, flush=True)
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=131072, help="the whole job's sequence length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps of each (averaged)")
    parser.add_argument("--top", type=int, default=12, help="kernel names listed, by their time in the ring")
    parser.add_argument("--gap-us", type=float, default=200.0, help="report compute gaps longer than this")
    parser.add_argument("--trace-dir", default=None, help="keep each rank's Chrome trace here")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, this machine has {torch.cuda.device_count()}")
    spawn_ranks(worker, args)


if __name__ == "__main__":
    main()
