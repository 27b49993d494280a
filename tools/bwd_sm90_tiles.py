"""Sweeps the tile variants of the Hopper backward (FLASHMOD_BWD_SM90_TILE, tools/gen_kernels.py's
BWD_SM90_TILES) in one process: per shape, one training step (forward + backward) of each tile and of
SDPA's FLASH backend, timed in interleaved rounds (median), then the dK/dV and dQ kernels' device
times per tile (torch.profiler), so the best dK/dV and the best dQ configuration can be told apart.

    python tools/bwd_sm90_tiles.py [--dims 64,128,256] [--n 1024,4096,16384] [--dtype bf16]

Shapes: B * N = 16k, H * D = 2048 (the FlashAttention papers'). TFLOP/s counts a step as 3.5x the
forward's 4 * B * H * N^2 * D (half of that causal). Prints one table per head dim: a row per
variant, a column per (N, causal) holding "ms  TFLOP/s  x FLASH", then the kernels' ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_profile import kernel_us
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashmod

KNOB = "FLASHMOD_BWD_SM90_TILE"


def built_tiles() -> dict[int, list[str]]:
    """Head dim -> tile names, default first, from the variant table."""
    path = Path(__file__).resolve().parent / "gen_kernels.py"
    spec = importlib.util.spec_from_file_location("gen_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    family = next(f for f in module.FAMILIES if f.name == "bwd_sm90")
    tiles: dict[int, list[str]] = {}
    for _, t, d in family.tile_entries():
        tiles.setdefault(d, []).insert(0 if t.default else len(tiles.get(d, [])), t.name)
    return tiles


def step_fn(variant: str, q, k, v, grad, causal: bool):
    """One training step of a variant: "FLASH" (SDPA) or a tile name (flashmod)."""
    if variant == "FLASH":

        def run():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)

        return run

    def run():
        os.environ[KNOB] = variant
        out = flashmod.attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), grad)

    return run


def time_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_ms(fn, reps: int) -> tuple[float, float]:
    """Device ms per step of the dK/dV kernel(s) and of the dQ kernel."""

    def family(name: str) -> str | None:
        if "attention_bwd_dkdv_sm90" in name:
            return "dkdv"
        return "dq" if "attention_bwd_dq_sm90" in name else None

    us = kernel_us(fn, reps, key=family)
    return us.get("dkdv", 0.0) / 1e3, us.get("dq", 0.0) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="64,128,256", help="head dims, comma-separated")
    ap.add_argument("--n", default="1024,4096,16384", help="sequence lengths")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--tiles", default="", help="only these tiles (comma-separated; default: all built)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the per-kernel profile")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    tiles = built_tiles()
    only = [t for t in args.tiles.split(",") if t]
    print(torch.cuda.get_device_name(), torch.__version__, args.dtype, "B*N = 16k, H*D = 2048")
    for d in map(int, args.dims.split(",")):
        names = [t for t in tiles.get(d, []) if not only or t in only]
        variants = ["FLASH", *names]
        cols, cells, kern = [], {v: [] for v in variants}, {t: [] for t in names}
        for n in map(int, args.n.split(",")):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                grad = torch.randn_like(q)
                flops = 3.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                reps = max(2, min(20, int(2e13 / flops)))
                fns = {var: step_fn(var, q, k, v, grad, causal) for var in variants}
                for fn in fns.values():
                    fn()
                torch.cuda.synchronize()
                times = {var: [] for var in variants}
                for _ in range(args.rounds):
                    for var, fn in fns.items():
                        times[var].append(time_ms(fn, reps))
                ms = {var: statistics.median(t) for var, t in times.items()}
                cols.append(f"N {n}{' causal' if causal else ''}")
                for var in variants:
                    x = ms["FLASH"] / ms[var]
                    cells[var].append(f"{ms[var]:7.3f} {flops / ms[var] / 1e9:4.0f} {x:4.2f}x")
                for t in names if not args.no_kernels else []:
                    a, c = kernel_ms(fns[t], reps)
                    kern[t].append(f"{a:7.3f} {c:7.3f}")
                del q, k, v, grad
        os.environ.pop(KNOB, None)
        width = max(len(c) for c in cells["FLASH"])
        print(f"\nD = {d}: step ms, TFLOP/s, x FLASH")
        print(f"{'':16}" + " | ".join(f"{c:>{width}}" for c in cols))
        for var in variants:
            print(f"{var:16}" + " | ".join(f"{c:>{width}}" for c in cells[var]))
        if not args.no_kernels:
            print(f"D = {d}: dK/dV ms, dQ ms (profiler)")
            for t in names:
                print(f"{t:16}" + " | ".join(f"{c:>{width}}" for c in kern[t]))


if __name__ == "__main__":
    main()
