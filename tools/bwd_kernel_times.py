"""Where the CUDA backward's time goes: device time per kernel (torch.profiler) of one training
step through flashmod.attention, for a few paper shapes. Prints a table per shape; the kernel names
say which family ran (sm80 / sm90) and which kernel (row statistics, dK/dV, dQ, forward).

    python tools/bwd_kernel_times.py [--dims 64,128] [--n 1024,4096] [--dtype bf16|fp16|fp32]
                                     [--portable] [--sdpa cudnn,efficient]

--sdpa adds SDPA backends on the same inputs, kernel by kernel, below each flashmod table
(CUDNN and FLASH take no fp32; EFFICIENT and MATH do).
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.nn.functional as F
from kernel_profile import kernel_us
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashmod

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SDPA_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
}


def short(name: str) -> str:
    m = re.search(r"(attention_\w+?kernel)", name)
    return m.group(1) if m else name[:60]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128", help="head dims, comma-separated")
    ap.add_argument("--n", default="1024,4096", help="sequence lengths (B * N = 16k, H * D = 2048)")
    ap.add_argument("--portable", action="store_true", help="FLASHMOD_DISABLE_SM90=1 (mma.sync kernels)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype")
    ap.add_argument("--sdpa", default="", help="SDPA backends to profile too, comma-separated (cudnn, efficient, ...)")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    backends = [b for b in args.sdpa.split(",") if b]
    if args.portable:
        os.environ["FLASHMOD_DISABLE_SM90"] = "1"
    print(torch.cuda.get_device_name(), "portable" if args.portable else "default kernels")
    for d in map(int, args.dims.split(",")):
        for n in map(int, args.n.split(",")):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                grad = torch.randn_like(q)

                def train_step(q=q, k=k, v=v, grad=grad, causal=causal):
                    out = flashmod.attention(q, k, v, is_causal=causal)
                    torch.autograd.grad(out, (q, k, v), grad)

                def sdpa_step(backend, q=q, k=k, v=v, grad=grad, causal=causal):
                    with sdpa_kernel(SDPA_BACKENDS[backend]):
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    torch.autograd.grad(out, (q, k, v), grad)

                steps = [("flashmod", train_step)]
                steps += [(f"SDPA {b.upper()}", lambda b=b: sdpa_step(b)) for b in backends]
                for who, step in steps:
                    totals = kernel_us(step, 10, key=short, warmup=3)
                    total = sum(totals.values())
                    shape = f"b{b} h{h} n{n} d{d}{' causal' if causal else ''}"
                    print(f"{shape} {who}: {total / 1e3:.3f} ms per step")
                    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
                        print(f"    {us / 1e3:8.3f} ms  {100 * us / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
