"""Forward-pass benchmark: flashmod.attention against PyTorch SDPA's backends.

    python benchmarks/bench_attention.py                  # CUDA: FLASH, CUDNN, EFFICIENT, MATH
    python benchmarks/bench_attention.py --device cpu     # flashmod CPU vs torch CPU SDPA
    python benchmarks/bench_attention.py --quick          # a few shapes only

Shapes follow the FlashAttention papers (B * N = 16k tokens, H * D = 2048, N = 512 .. 16k,
D = 64 / 128 / 256, causal and not), plus decode-like shapes (Nq = 1 .. 16 against long KV
caches, GQA), key-padding masks and fp32 inputs. Every backend runs in this process on the same inputs; each
result is validated against flashmod's before it is timed; times are medians of many runs after
warm-up (triton.testing.do_bench on CUDA). TFLOP/s = 4 * B * H * Nq * Nk * D / t, halved for
causal. Writes <out-dir>/<tag>.json and <tag>.png, and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashmod.ops import attention_op  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover

    def tqdm(x, **_):
        return x


from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

BACKENDS = {
    "FLASH": SDPBackend.FLASH_ATTENTION,
    "CUDNN": SDPBackend.CUDNN_ATTENTION,
    "EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
    "MATH": SDPBackend.MATH,
}
# MATH materializes (B, H, Nq, Nk) scores (several copies): past this many score elements it
# would take tens of GB or seconds per call, so it is skipped and the table says "skip".
MATH_MAX_SCORES = 2**29


def cuda_shapes(quick: bool):
    shapes = []
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            if d == 256 and dtype == "fp16":
                continue
            for n in (512, 1024, 2048, 4096, 8192, 16384):
                if quick and n not in (1024, 4096):
                    continue
                for causal in (False, True):
                    shapes.append(
                        dict(
                            kind="paper",
                            dtype=dtype,
                            b=16384 // n,
                            hq=2048 // d,
                            hkv=2048 // d,
                            nq=n,
                            nk=n,
                            d=d,
                            causal=causal,
                            mask=False,
                        )
                    )
    for nq in (1, 4, 16):
        for nk in (4096, 16384, 65536):
            if quick and nk != 16384:
                continue
            shapes.append(
                dict(kind="decode", dtype="bf16", b=8, hq=32, hkv=8, nq=nq, nk=nk, d=128, causal=False, mask=False)
            )
    for d in (64, 128):  # fp32: flashmod's 3xTF32 kernel against SDPA's fp32-capable backends
        for n in (1024, 4096):
            for causal in (False, True):
                shapes.append(
                    dict(kind="fp32", dtype="fp32", b=4, hq=16, hkv=16, nq=n, nk=n, d=d, causal=causal, mask=False)
                )
    for n in (1024, 4096):  # grouped-query prefill (32 query heads on 8 key/value heads)
        for causal in (False, True):
            shapes.append(
                dict(kind="gqa", dtype="bf16", b=16384 // n, hq=32, hkv=8, nq=n, nk=n, d=128, causal=causal, mask=False)
            )
    for n in (1024, 4096):
        shapes.append(
            dict(kind="padding", dtype="bf16", b=8, hq=16, hkv=16, nq=n, nk=n, d=128, causal=False, mask=True)
        )
    return shapes


def cpu_shapes(quick: bool):
    shapes = []
    for dtype in ("fp32", "bf16"):
        for n in (128, 512, 1024) if not quick else (512,):
            for causal in (False, True):
                shapes.append(
                    dict(kind="cpu", dtype=dtype, b=1, hq=8, hkv=8, nq=n, nk=n, d=64, causal=causal, mask=False)
                )
    return shapes


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def flops(s):
    f = 4.0 * s["b"] * s["hq"] * s["nq"] * s["nk"] * s["d"]
    return f / 2 if s["causal"] else f


def make_inputs(s, device):
    dt = DTYPES[s["dtype"]]
    q = torch.randn(s["b"], s["hq"], s["nq"], s["d"], device=device, dtype=dt)
    k = torch.randn(s["b"], s["hkv"], s["nk"], s["d"], device=device, dtype=dt)
    v = torch.randn(s["b"], s["hkv"], s["nk"], s["d"], device=device, dtype=dt)
    mask = None
    if s["mask"]:
        lengths = torch.randint(s["nk"] // 2, s["nk"] + 1, (s["b"],), device=device)
        mask = (torch.arange(s["nk"], device=device)[None] < lengths[:, None])[:, None, None, :]
    return q, k, v, mask


def fn_flashmod(s, q, k, v, mask):
    return lambda: attention_op(q, k, v, mask, is_causal=s["causal"], bottom_right=False)[0]


def fn_sdpa(s, q, k, v, mask, backend):
    gqa = s["hq"] != s["hkv"]

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=s["causal"], enable_gqa=gqa)

    return run


def time_cuda(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def time_cpu(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def label(s):
    base = f"{s['kind']:7s} {s['dtype']} b{s['b']} h{s['hq']}/{s['hkv']} nq{s['nq']} nk{s['nk']} d{s['d']}"
    return base + (" causal" if s["causal"] else "") + (" mask" if s["mask"] else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default=None, help="file name stem (default: <date>-<device>)")
    ap.add_argument("--backends", default="FLASH,CUDNN,EFFICIENT,MATH")
    ap.add_argument("--kinds", default="paper,decode,gqa,padding,fp32,cpu", help="shape groups to run")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--dims", default="", help="head dims to keep (default: all)")
    ap.add_argument("--min-n", type=int, default=0, help="skip paper shapes with N below this")
    ap.add_argument(
        "--portable",
        action="store_true",
        help="also time flashmod's portable mma.sync kernel (FLASHMOD_DISABLE_SM90=1) where the wgmma one runs",
    )
    args = ap.parse_args()

    device = args.device
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        shapes = cuda_shapes(args.quick)
        timer = time_cuda
        backends = [b for b in args.backends.split(",") if b]
        if args.portable:
            backends = ["flashmod-mma"] + backends
    else:
        name = f"CPU ({torch.get_num_threads()} threads)"
        shapes = cpu_shapes(args.quick)
        timer = time_cpu
        backends = ["SDPA_CPU"]
    dims = {int(x) for x in args.dims.split(",") if x}
    shapes = [
        s
        for s in shapes
        if s["kind"] in args.kinds.split(",")
        and s["dtype"] in args.dtypes.split(",")
        and (not dims or s["d"] in dims)
        and (s["kind"] != "paper" or s["nq"] >= args.min_n)
    ]
    tag = args.tag or f"{datetime.date.today().isoformat()}-{device}"
    print(f"device: {name}; torch {torch.__version__}; {len(shapes)} shapes; backends: flashmod, {', '.join(backends)}")

    rows = []
    for s in tqdm(shapes, desc="bench", file=sys.stderr):
        torch.manual_seed(0)
        q, k, v, mask = make_inputs(s, device)
        ref = fn_flashmod(s, q, k, v, mask)()
        row = dict(shape=s, label=label(s), flops=flops(s), results={})
        cands = {"flashmod": fn_flashmod(s, q, k, v, mask)}
        for bname in backends:
            if bname == "MATH" and s["b"] * s["hq"] * s["nq"] * s["nk"] > MATH_MAX_SCORES:
                row["results"][bname] = {"status": "skip (too large for MATH)"}
                continue
            if bname == "flashmod-mma":
                cands[bname] = fn_flashmod(s, q, k, v, mask)
            elif bname == "SDPA_CPU":
                gqa = s["hq"] != s["hkv"]
                cands[bname] = lambda q=q, k=k, v=v, m=mask, c=s["causal"], g=gqa: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, is_causal=c, enable_gqa=g
                )
            else:
                cands[bname] = fn_sdpa(s, q, k, v, mask, BACKENDS[bname])
        for bname, fn in cands.items():
            portable = bname == "flashmod-mma"
            if portable:
                os.environ["FLASHMOD_DISABLE_SM90"] = "1"
            try:
                out = fn()
                if bname != "flashmod":
                    err = (out.float() - ref.float()).abs().max().item()
                    tol = 1e-4 if s["dtype"] == "fp32" else 3e-2
                    if not err <= tol:
                        row["results"][bname] = {"status": f"mismatch {err:.2e}"}
                        continue
                del out
                ms = timer(fn)
                row["results"][bname] = {"status": "ok", "ms": ms, "tflops": row["flops"] / ms / 1e9}
            except Exception as e:  # unsupported shape/dtype/mask for that backend
                row["results"][bname] = {"status": "n/a: " + str(e).splitlines()[0][:80] if str(e) else "n/a"}
            finally:
                if portable:
                    del os.environ["FLASHMOD_DISABLE_SM90"]
        rows.append(row)
        del q, k, v, mask, ref, cands
        if device == "cuda":
            torch.cuda.empty_cache()

    # Table
    cols = ["flashmod"] + backends
    print()
    print(
        f"{'shape':60s} "
        + " ".join(f"{c:>10s}" for c in cols)
        + "   "
        + " ".join(f"{'fm/' + c:>12s}" for c in backends)
    )
    for row in rows:
        r = row["results"]
        cells = []
        for c in cols:
            x = r.get(c, {})
            cells.append(
                (f"{x['tflops']:10.1f}" if x.get("tflops", 0) >= 10 else f"{x.get('tflops', 0):10.4f}")
                if x.get("status") == "ok"
                else f"{x.get('status', '-')[:10]:>10s}"
            )
        ratios = []
        fm = r.get("flashmod", {})
        for c in backends:
            x = r.get(c, {})
            if fm.get("status") == "ok" and x.get("status") == "ok":
                ratios.append(f"{x['ms'] / fm['ms']:12.2f}")
            else:
                ratios.append(f"{'-':>12s}")
        print(f"{row['label']:60s} " + " ".join(cells) + "   " + " ".join(ratios))
    print("(TFLOP/s; fm/X = time of X / time of flashmod, > 1 means flashmod is faster)")

    os.makedirs(args.out_dir, exist_ok=True)
    meta = dict(
        device=name,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        backends=cols,
        rows=rows,
    )
    jpath = os.path.join(args.out_dir, f"{tag}.json")
    with open(jpath, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {jpath}")
    try:
        plot(rows, cols, name, os.path.join(args.out_dir, f"{tag}.png"))
    except Exception as e:  # matplotlib missing: the JSON and table still stand
        print(f"no plot: {e}")


def plot(rows, cols, name, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for row in rows:
        s = row["shape"]
        if s["kind"] not in ("paper", "cpu"):
            continue
        groups.setdefault((s["dtype"], s["d"], s["causal"]), []).append(row)
    if not groups:
        return
    n = len(groups)
    ncol = min(4, n)
    nrow = math.ceil(n / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.5 * ncol, 3.5 * nrow), squeeze=False)
    for ax, ((dtype, d, causal), grp) in zip(axes.flat, sorted(groups.items())):
        xs = [g["shape"]["nq"] for g in grp]
        for c in cols:
            ys = [g["results"].get(c, {}).get("tflops", float("nan")) for g in grp]
            ax.plot(xs, ys, marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} d={d}{' causal' if causal else ''}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"flashmod forward vs SDPA backends, {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
