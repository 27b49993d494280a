"""Where a decode step's device time goes: device time per kernel (torch.profiler) of
flash_attn_with_kvcache (contiguous and 16-token pages), flashmod.attention on the same cache and
SDPA FLASH, B = 8 (--batch), 32/8 heads, D = 128, bf16, each call after an L2 flush (as bench_serve.py times
them). Kernel sums next to bench_serve's event times tell kernel work from launch gaps.

    python tools/decode_kernel_times.py [--sizes 1024,4096] [--batch 8]
"""

from __future__ import annotations

import argparse
import re

import torch
import torch.nn.functional as F
from kernel_profile import kernel_us
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashmod


def short(name: str) -> str:
    m = re.search(r"(attention_\w+?kernel|kvcache_append_kernel|flash_fwd\w*|[Mm]emset\w*)", name)
    return m.group(1) if m else name[:50]


def profile_cache(s: int, flush: torch.Tensor, b: int) -> None:
    """Prints the kernel times per call of every contender at cache length s, batch b."""
    dev, dt, hq, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    kc, vc = (torch.randn(b, s, hkv, d, device=dev, dtype=dt) for _ in range(2))
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    kn, vn = (torch.randn(b, 1, hkv, d, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((b,), s - 1, dtype=torch.int32, device=dev)
    n = s // 16
    table = torch.randperm(b * n, device=dev).to(torch.int32).reshape(b, n)
    kp, vp = (torch.empty(b * n, 16, hkv, d, device=dev, dtype=dt) for _ in range(2))
    kp[table.long().flatten()] = kc.reshape(b * n, 16, hkv, d)
    vp[table.long().flatten()] = vc.reshape(b * n, 16, hkv, d)
    qb, kb, vb = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)

    cases = {
        "kvcache": lambda: flashmod.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens),
        "kvcache paged 16": lambda: flashmod.flash_attn_with_kvcache(
            q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table
        ),
        "flashmod.attention": lambda: flashmod.attention(qb, kb, vb),
        "SDPA FLASH": sdpa,
    }
    for label, fn in cases.items():
        # The flush's reduction kernels are left out of the sums.
        totals = kernel_us(
            fn, 20, key=lambda name: None if "reduce" in name.lower() else short(name), before=flush.sum, warmup=3
        )
        parts = ", ".join(f"{name} {us:.1f}" for name, us in sorted(totals.items(), key=lambda kv: -kv[1]))
        print(f"B {b} cache {s} {label}: {sum(totals.values()):.1f} us of kernels per call ({parts})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,4096", help="cache lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    flush = torch.ones(2 * torch.cuda.get_device_properties(0).L2_cache_size // 4, device="cuda")
    print(torch.cuda.get_device_name())
    for s in map(int, args.sizes.split(",")):
        profile_cache(s, flush, args.batch)


if __name__ == "__main__":
    main()
