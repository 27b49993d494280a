"""CPU decode timing: flashmod vs F.scaled_dot_product_attention, interleaved, median of 60.

PYTHONPATH=. python benchmarks/decode_cpu_check.py   (FLASHMOD_CPU_DECODE=0: the old path)
"""

import statistics
import time

import torch
import torch.nn.functional as F

from flashmod.ops import attention_op

torch.set_num_threads(2)
torch.manual_seed(0)


def bench(fns, runs=60):
    for fn in fns:
        fn()
    ts = [[] for _ in fns]
    for _ in range(runs):
        for fn, t in zip(fns, ts):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


CASES = [
    (1, 1, 1, 1, 4096, 128),
    (1, 8, 8, 1, 4096, 128),
    (1, 32, 8, 1, 4096, 128),
    (4, 8, 8, 1, 1024, 64),
    (1, 1, 1, 1, 32768, 128),
    (1, 16, 16, 4, 8192, 64),
    (1, 32, 4, 1, 16384, 128),
]
for dt in (torch.float32, torch.bfloat16):
    for B, H, Hk, Nq, Nk, D in CASES:
        q = torch.randn(B, H, Nq, D, dtype=dt)
        k = torch.randn(B, Hk, Nk, D, dtype=dt)
        v = torch.randn(B, Hk, Nk, D, dtype=dt)
        gqa = H != Hk
        tt, tf = bench(
            [
                lambda q=q, k=k, v=v, g=gqa: F.scaled_dot_product_attention(q, k, v, enable_gqa=g),
                lambda q=q, k=k, v=v: attention_op(q, k, v),
            ]
        )
        print(
            f"{str(dt)[6:]:8s} B{B} H{H}/{Hk} Nq{Nq} Nk{Nk} D{D}: "
            f"torch {tt * 1e6:8.1f}us flashmod {tf * 1e6:8.1f}us ratio {tt / tf:.2f}",
            flush=True,
        )
