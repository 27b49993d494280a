"""Ring (context-parallel) attention: time to result against one device, the share of communication
hidden behind compute, and the result against one device's, across processes on one machine.

    python benchmarks/bench_ring.py                        # 2 ranks; NCCL with a GPU per rank, else gloo
    python benchmarks/bench_ring.py --world-size 4 --seqlens 4096,8192 --backend gloo

For each sequence length N (the whole job's), every rank holds N / world_size tokens (zigzag slices
for causal). Measured, forward alone and forward + backward:
- ring: ``flashmod.distributed.ring_attention`` across the ranks (the median over runs of the
  slowest rank's time);
- compute: the same ring, through the same autograd function, with every exchange replaced by what
  it would receive, cut beforehand from the whole problem (every step's attention on the same data,
  merges and gradient sums, no communication);
- comm: the ring's exchanges alone (forward: K/V; backward, the other way round: K/V and the dK/dV
  sums, in k's dtype after their first step, fp32 after the others);
- one device: ``flashmod.attention`` over the whole sequence on rank 0's device, the others idle.
hidden = (compute + comm - ring) / comm, clamped to [0, 1]: 1 means the exchanges cost nothing on
top of the compute. speedup = one device / ring. The ring's output (and gradients) are gathered and
compared with the one-device run: the largest difference, against the largest value. TFLOP/s per
rank counts each rank's share of 4 * B * H * N * N * D (half for causal; x 3.5 with the backward).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashmod
from flashmod.distributed import _arrived, _Ring, _RingAttention, ring_attention, shard_sequence, unshard_sequence


class _NoExchangeRing(_Ring):
    """The ring's plan without its communication. Each exchange hands over at once what it would
    have received: the K/V slices, cut from the whole problem that every rank of the benchmark holds
    (so the kernels see the ring's data and shapes; an earlier version reused the rank's own slices,
    and the forward kernel ran 6.5 % slower on them), and for fp32 gradient sums a buffer kept per
    rank. The sums' values are wrong; only the time counts."""

    kv_by_rank: list[list[torch.Tensor]]  # set by no_exchange_ring()
    sums_by_rank: dict[int, list[torch.Tensor]]

    def exchange(self, send, recv_like_rank, backward=False):
        kv = self.kv_by_rank[recv_like_rank]
        if all(t.dtype == kv[0].dtype for t in send):  # K/V, or the sums' first hop in k's dtype
            return [], kv[: len(send)]
        if recv_like_rank not in self.sums_by_rank:
            self.sums_by_rank[recv_like_rank] = [torch.zeros_like(t, dtype=send[0].dtype) for t in kv]
        return [], self.sums_by_rank[recv_like_rank][: len(send)]


def no_exchange_ring(k_full: torch.Tensor, v_full: torch.Tensor, world_size: int, causal: bool):
    """A ring type for ``_RingAttention.apply`` that times the compute alone (:class:`_NoExchangeRing`),
    given the whole sequence's K/V (B, H, N, D)."""
    kv_by_rank = [
        [shard_sequence(t, 2, r, world_size, causal).contiguous() for t in (k_full, v_full)] for r in range(world_size)
    ]

    sums_by_rank = {}

    def make(*args):
        ring = _NoExchangeRing(*args)
        ring.kv_by_rank, ring.sums_by_rank = kv_by_rank, sums_by_rank
        return ring

    return make


def _medians(fns, device: torch.device, reps: int, timed_here: bool = True) -> list[tuple[float, list[float]]]:
    """Each of ``fns``'s time over ``reps`` runs after a warm-up, as (the job's, every rank's median).
    The job's time is the median over runs of the slowest rank's time in that run: a job's step
    ends when its last rank does. (The largest of the ranks' medians reads low when the slowest rank
    changes from run to run: at 2 ranks and 128k on 4 x H100, by 0 and 1.9 ms for the ring's
    training step in two runs, 0 for its compute alone.) The runs of ``fns`` are interleaved, so that a drift of
    the clocks moves each alike. A rank with ``timed_here`` False only keeps pace with the others'
    barriers."""
    if timed_here:
        for fn in fns:
            fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, fn_times in zip(fns, times):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if timed_here:
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            fn_times.append(time.perf_counter() - start)
    results = []
    for fn_times in times:
        mine = torch.tensor(fn_times, dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        by_rank = [t.tolist() for t in every]
        job = statistics.median(max(run) for run in zip(*by_rank))
        results.append((job, [statistics.median(rank_times) for rank_times in by_rank]))
    return results


def _gathered(local: torch.Tensor, lengths: list[int], causal: bool) -> torch.Tensor:
    """The whole sequence from every rank's slice along dim 2 (slices may differ by a token)."""
    longest = max(lengths)
    padded = torch.nn.functional.pad(local, (0, 0, 0, longest - local.shape[2])).contiguous()
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    return unshard_sequence([part[:, :, :length] for part, length in zip(parts, lengths)], 2, causal)


def _relative_difference(ours: torch.Tensor, single: torch.Tensor) -> float:
    return ((ours.float() - single.float()).abs().max() / single.float().abs().max()).item()


def measure(n: int, rank: int, world_size: int, args, device: torch.device, dtype) -> dict:
    b, h, d, causal = args.batch, args.heads, args.head_dim, args.causal
    gen = torch.Generator(device=device).manual_seed(n)  # every rank draws the same full problem
    full = [torch.randn(b, h, n, d, dtype=dtype, device=device, generator=gen) for _ in range(4)]
    q, k, v, grad = (shard_sequence(t, 2, rank, world_size, causal).contiguous() for t in full)
    ring = _Ring(None, q.shape[2], device, causal)
    local_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    window = (-1, -1)

    def ring_forward():
        return ring_attention(q, k, v, causal=causal)

    def ring_training_step():
        for t in local_leaves:
            t.grad = None
        ring_attention(*local_leaves, causal=causal).backward(grad)

    compute_ring = no_exchange_ring(full[1], full[2], world_size, causal)

    def compute_forward():
        return _RingAttention.apply(q, k, v, None, causal, None, 0.0, window, compute_ring)

    def compute_training_step():
        for t in local_leaves:
            t.grad = None
        out, _ = _RingAttention.apply(*local_leaves, None, causal, None, 0.0, window, compute_ring)
        out.backward(grad)

    def comm_kv():
        kv = [k, v]
        for step in range(world_size - 1):
            requests, kv = ring.exchange(kv, ring.source(step + 1))
            for request in requests:
                request.wait()

    def comm_training_step():
        comm_kv()  # the forward's; then the backward's, in its order (flashmod.distributed._ring_backward)
        last = world_size - 1
        kv_in_flight = ring.exchange([k, v], ring.source(last), backward=True) if last > 0 else None
        sums_in_flight = None
        for step in range(last, 0, -1):
            kv = _arrived(kv_in_flight)
            kv_in_flight = ring.exchange(kv, ring.source(step - 1), backward=True) if step > 1 else None
            if sums_in_flight is None:  # a dense step's one part, in k's dtype
                sums = [torch.zeros_like(t) for t in kv]
            else:
                sums = [t.float() for t in _arrived(sums_in_flight)]
            sums_in_flight = ring.exchange(sums, ring.source(step - 1), backward=True)
        if sums_in_flight is not None:
            _arrived(sums_in_flight)

    single_leaves = [t.clone().requires_grad_() for t in full[:3]] if rank == 0 else None

    def single_forward():
        return flashmod.attention(*full[:3], is_causal=causal)

    def single_training_step():
        for t in single_leaves:
            t.grad = None
        flashmod.attention(*single_leaves, is_causal=causal).backward(full[3])

    reps = args.reps
    row = {"n": n, "world_size": world_size}
    for phase, ring_fn, compute_fn, comm_fn, single_fn, work in (
        ("fwd", ring_forward, compute_forward, comm_kv, single_forward, 1.0),
        ("fwdbwd", ring_training_step, compute_training_step, comm_training_step, single_training_step, 3.5),
    ):
        (t_ring, ring_per_rank), (t_compute, compute_per_rank) = _medians([ring_fn, compute_fn], device, reps)
        ((t_comm, _),) = _medians([comm_fn], device, reps)
        ((t_single, _),) = _medians([single_fn], device, reps, timed_here=rank == 0)
        hidden = min(1.0, max(0.0, (t_compute + t_comm - t_ring) / t_comm)) if t_comm > 0 else 1.0
        flops = work * 4 * b * h * n * n * d * (0.5 if causal else 1.0) / world_size
        row[phase] = {
            "ring_ms": t_ring * 1e3,
            "compute_ms": t_compute * 1e3,
            "comm_ms": t_comm * 1e3,
            "one_device_ms": t_single * 1e3,
            "hidden": hidden,
            "speedup": t_single / t_ring,
            "tflops_per_rank": flops / t_ring / 1e12,
            "ring_ms_per_rank": [t * 1e3 for t in ring_per_rank],
            "compute_ms_per_rank": [t * 1e3 for t in compute_per_rank],
        }

    # The results against one device's, on the same inputs.
    ring_training_step()
    out, lse = ring_attention(q, k, v, causal=causal, return_lse=True)
    lengths = ring.local_lens
    gathered = {
        "out": _gathered(out, lengths, causal),
        "lse": _gathered(lse.unsqueeze(-1), lengths, causal).squeeze(-1),
        **{f"d{name}": _gathered(t.grad, lengths, causal) for name, t in zip("qkv", local_leaves)},
    }
    if rank == 0:
        single_training_step()
        single_out, single_lse = flashmod.attention(*full[:3], is_causal=causal, return_lse=True)
        single = {"out": single_out, "lse": single_lse}
        single.update({f"d{name}": t.grad for name, t in zip("qkv", single_leaves)})
        row["max_difference_vs_one_device"] = {
            name: _relative_difference(gathered[name], single[name]) for name in gathered
        }
    return row


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank}") if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    options = None
    if args.nccl_max_ctas:  # the SMs NCCL's kernels may take at once (its config.maxCTAs)
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = args.nccl_max_ctas
    dist.init_process_group(
        args.backend,
        rank=rank,
        world_size=world_size,
        device_id=device if args.backend == "nccl" else None,
        pg_options=options,
    )
    if args.round_robin_dense_steps:
        flashmod.distributed._BOUND_DENSE_STEPS = False
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    try:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        header = (
            f"ring attention, {world_size} ranks over {args.backend} ({where}), {args.dtype}, "
            f"B {args.batch}, H {args.heads}, D {args.head_dim}, causal {args.causal}"
            + (", dense steps round-robin" if args.round_robin_dense_steps else "")
            + (f", NCCL max_ctas {args.nccl_max_ctas}" if args.nccl_max_ctas else "")
        )
        rows = []
        if rank == 0:
            print(header)
            print(f"{'N':>8} {'phase':>7} {'ring ms':>9} {'compute':>9} {'comm':>8} {'hidden':>7} "
                  f"{'1 device':>9} {'speedup':>8} {'TFLOP/s/rank':>13}")  # fmt: skip
        for n in (int(x) for x in args.seqlens.split(",")):
            row = measure(n, rank, world_size, args, device, dtype)
            if rank == 0:
                for phase in ("fwd", "fwdbwd"):
                    r = row[phase]
                    print(f"{n:>8} {phase:>7} {r['ring_ms']:>9.2f} {r['compute_ms']:>9.2f} {r['comm_ms']:>8.2f} "
                          f"{r['hidden']:>7.2f} {r['one_device_ms']:>9.2f} {r['speedup']:>8.2f} "
                          f"{r['tflops_per_rank']:>13.1f}")  # fmt: skip
                diffs = ", ".join(f"{k} {v:.1e}" for k, v in row["max_difference_vs_one_device"].items())
                print(f"{'':>8} max |ring - one device| / max |one device|: {diffs}", flush=True)
                rows.append(row)
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "torch": torch.__version__, "rows": rows}, f, indent=1)
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
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument(
        "--round-robin-dense-steps",
        action="store_true",
        help="A/B aid: the ring's dense forward steps without the right bound that makes the Hopper "
        "kernel claim tiles dynamically (flashmod/distributed.py: _BOUND_DENSE_STEPS)",
    )
    parser.add_argument(
        "--nccl-max-ctas",
        type=int,
        default=0,
        help="create the process group with ProcessGroupNCCL.Options().config.max_ctas = this "
        "(fewer SMs for NCCL's kernels beside the attention; 0: NCCL's default)",
    )
    args = parser.parse_args()
    args.causal = bool(args.causal)
    if args.backend is None:
        args.backend = "nccl" if gpus >= args.world_size else "gloo"
    on_gpu = args.backend == "nccl"
    if args.nccl_max_ctas and not on_gpu:
        parser.error("--nccl-max-ctas needs the nccl backend")
    args.seqlens = args.seqlens or ("32768,65536,131072,262144" if on_gpu else "2048,4096")
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    args.heads = args.heads or (16 if on_gpu else 4)
    spawn_ranks(worker, args)


def spawn_ranks(fn, args: argparse.Namespace) -> None:
    """Runs ``fn(rank, world_size, port, args)`` in ``args.world_size`` fresh processes on one machine
    (``port``: a free one for the process group's rendezvous). tools/ring_timeline.py shares it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(fn, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
