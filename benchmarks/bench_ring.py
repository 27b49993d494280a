"""Ring (context-parallel) attention: per-rank throughput and the share of communication hidden
behind compute, across processes on one machine.

    python benchmarks/bench_ring.py                        # 2 ranks; NCCL with a GPU per rank, else gloo
    python benchmarks/bench_ring.py --world-size 4 --seqlens 4096,8192 --backend gloo

For each sequence length N (the whole job's), every rank holds N / world_size tokens (zigzag slices
for causal) and the forward of ``flashmod.distributed.ring_attention`` is timed against its two
parts measured alone: the attention calls and merges of the ring's steps with no exchange ("compute"), and the
K/V exchanges with no attention ("comm"). hidden = (compute + comm - ring) / comm, clamped to
[0, 1]: 1 means the exchanges cost nothing on top of the compute. TFLOP/s per rank counts each
rank's share of 4 * B * H * N * N * D (half for causal). Medians of ``--reps`` runs after warm-up.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashmod.distributed import _Ring, ring_attention, shard_sequence
from flashmod.merge_ops import merge_attention
from flashmod.ops import attention_op


def _median_seconds(fn, device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # Every rank reports the slowest rank's time: the job finishes when the last rank does.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(n: int, rank: int, world_size: int, args: argparse.Namespace, device: torch.device, dtype) -> None:
    full = [torch.randn(args.batch, args.heads, n, args.head_dim, dtype=dtype, device=device) for _ in range(3)]
    q, k, v = (shard_sequence(t, 2, rank, world_size, args.causal).contiguous() for t in full)
    ring = _Ring(None, q.shape[2], device, args.causal)

    def compute_only():
        # The ring's attention calls and merges on the local K/V, without the exchanges.
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), device=device)
        for step in range(world_size):
            plan = ring.step_plan(step)
            if plan is not None:
                rows, keys, causal = plan
                o, l_part = attention_op(q[:, :, rows], k[:, :, keys], v[:, :, keys], None, None, causal, False)
                out[:, :, rows], lse[:, :, rows] = merge_attention([out[:, :, rows], o], [lse[:, :, rows], l_part])

    def comm_only():
        kv = [k, v]
        for step in range(world_size - 1):
            requests, kv = ring.exchange(kv, ring.source(step + 1))
            for request in requests:
                request.wait()

    t_ring = _median_seconds(lambda: ring_attention(q, k, v, causal=args.causal), device, args.reps)
    t_compute = _median_seconds(compute_only, device, args.reps)
    t_comm = _median_seconds(comm_only, device, args.reps)
    hidden = min(1.0, max(0.0, (t_compute + t_comm - t_ring) / t_comm)) if t_comm > 0 else 1.0
    flops = 4 * args.batch * args.heads * n * n * args.head_dim * (0.5 if args.causal else 1.0) / world_size
    if rank == 0:
        print(f"{n:>8} {t_ring * 1e3:>9.2f} {t_compute * 1e3:>11.2f} {t_comm * 1e3:>9.2f} "
              f"{hidden:>7.2f} {flops / t_ring / 1e12:>13.2f}")  # fmt: skip


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, rank=rank, world_size=world_size)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    try:
        if rank == 0:
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            print(f"ring attention, {world_size} ranks over {args.backend} ({where}), {args.dtype}, "
                  f"B {args.batch}, H {args.heads}, D {args.head_dim}, causal {args.causal}")  # fmt: skip
            print(f"{'N':>8} {'ring ms':>9} {'compute ms':>11} {'comm ms':>9} {'hidden':>7} {'TFLOP/s/rank':>13}")
        for n in (int(x) for x in args.seqlens.split(",")):
            measure(n, rank, world_size, args, device, dtype)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count()
    parser.add_argument("--world-size", type=int, default=2, help="processes forming the ring")
    parser.add_argument(
        "--backend",
        default=None,
        choices=["gloo", "nccl"],
        help="default: nccl when there is a GPU per rank, else gloo",
    )
    parser.add_argument("--seqlens", default=None, help="whole-job sequence lengths, comma-separated")
    parser.add_argument(
        "--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default: bf16 (CUDA), fp32 (CPU)"
    )
    parser.add_argument("--batch", type=int, default=1, help="batch size")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: 16 CUDA, 4 CPU)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim")
    parser.add_argument("--causal", type=int, default=1, help="1: causal (zigzag slices), 0: full attention")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (gloo)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per measurement (the median is reported)")
    args = parser.parse_args()
    args.causal = bool(args.causal)
    if args.backend is None:
        args.backend = "nccl" if gpus >= args.world_size else "gloo"
    on_gpu = args.backend == "nccl"
    args.seqlens = args.seqlens or ("32768,65536,131072,262144" if on_gpu else "2048,4096")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    args.heads = args.heads or (16 if on_gpu else 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
