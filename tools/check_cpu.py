"""Quick correctness sweep of the CPU kernel against the fp64 reference (not the test suite).

The rule: flashmod's max error vs fp64 is at most 2x that of plain attention computed in the
input's dtype (plus a small absolute slack). FLASHMOD_CPU_ISA=avx2|baseline checks the narrower
kernels on an AVX-512 machine.

    PYTHONPATH=. python tools/check_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import random

import torch

from flashmod.ops import attention_op
from flashmod.reference import attention_reference

SLACK = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def check(
    dtype,
    b,
    hq,
    hkv,
    nq,
    nk,
    d,
    *,
    causal=False,
    bottom_right=True,
    wl=-1,
    wr=-1,
    softcap=0.0,
    mask=None,
    layout="bhsd",
    seed=0,
) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(seed)

    def make(h, n):
        if layout == "bshd":  # transposed views: row stride H * D
            return torch.randn(b, n, h, d, generator=gen).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=gen).to(dtype)

    q, k, v = make(hq, nq), make(hkv, nk), make(hkv, nk)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(b, 1, nq, nk, generator=gen) > 0.3
        attn_mask[:, :, 0] = False  # one fully masked row
    elif mask == "add":
        attn_mask = (torch.randn(1, hq, nq, nk, generator=gen)).to(dtype)
    elif mask == "addf32":
        attn_mask = torch.randn(nq, nk, generator=gen)
    kw = dict(
        attn_mask=attn_mask,
        is_causal=causal,
        bottom_right=bottom_right,
        window_left=wl,
        window_right=wr,
        softcap=softcap,
    )
    out, lse = attention_op(q, k, v, **kw)
    ref, ref_lse = attention_reference(q, k, v, compute_dtype=torch.float64, **kw)
    low = torch.float64 if dtype == torch.float64 else dtype
    plain, _ = attention_reference(q, k, v, compute_dtype=low, **kw)
    if torch.isnan(out).any() or torch.isnan(lse).any():
        return False, "NaN"
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    plain_err = (plain.double() - ref).nan_to_num(0.0).abs().max().item() if out.numel() else 0.0
    fin = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse), fin) and (
        not fin.any() or (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3
    )
    ok = err <= 2 * plain_err + SLACK[dtype] and lse_ok
    return ok, f"err {err:.3g} plain {plain_err:.3g} lse_ok {lse_ok}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller grid of shapes")
    args = ap.parse_args()
    rng = random.Random(0)
    cases = []
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    for dtype, d, (nq, nk) in itertools.product(
        dtypes, [1, 40, 59, 64, 111, 128], [(1, 1), (17, 113), (113, 17), (203, 203), (1, 1023)]
    ):
        cases.append(dict(dtype=dtype, b=2, hq=4, hkv=2, nq=nq, nk=nk, d=d))
    features = [
        dict(causal=True),
        dict(causal=True, bottom_right=False),
        dict(wl=37, wr=5),
        dict(wl=0, wr=0),
        dict(wl=100),
        dict(softcap=5.0),
        dict(mask="bool"),
        dict(mask="add"),
        dict(mask="addf32"),
        dict(layout="bshd"),
        dict(causal=True, mask="bool", softcap=3.0),
        dict(wl=20, wr=70, bottom_right=False, layout="bshd"),
    ]
    for dtype, feat in itertools.product(dtypes, features):
        nq, nk = rng.choice([(17, 113), (203, 203), (113, 17), (1, 257), (300, 300), (64, 64)])
        d = rng.choice([40, 59, 64, 111, 128])
        if feat.get("mask") == "addf32" and dtype not in (torch.float16, torch.bfloat16):
            continue
        cases.append(dict(dtype=dtype, b=1, hq=6, hkv=3, nq=nq, nk=nk, d=d, **feat))
    cases.append(dict(dtype=torch.float32, b=1, hq=2, hkv=2, nq=1023, nk=1023, d=512, causal=True))
    cases.append(dict(dtype=torch.bfloat16, b=1, hq=2, hkv=1, nq=1023, nk=1023, d=96))
    if args.quick:
        cases = cases[::4]
    bad = 0
    for i, c in enumerate(cases):
        ok, msg = check(**c, seed=i)
        if not ok:
            bad += 1
            print("FAIL", c, msg, flush=True)
    print(f"{len(cases) - bad}/{len(cases)} cases passed")


if __name__ == "__main__":
    main()
