"""CUDA benchmark: flashmod.attention against every PyTorch SDPA backend, in one process.

    python benchmarks/bench_attention.py                      # forward, every shape group
    python benchmarks/bench_attention.py --mode fwdbwd        # forward + backward (training)
    python benchmarks/bench_attention.py --quick              # a few shapes only

(The CPU benchmark is benchmarks/bench_cpu.py; ``./dev.sh bench`` picks the one for this machine.)

Shapes follow the FlashAttention papers: B * N = 16k tokens, H * D = 2048, N = 512 .. 16k (1k .. 16k
for fwdbwd), D = 64 / 128 / 256, causal and not; plus grouped-query prefill (32 query heads on 8
key/value heads), bool key-padding masks, fp32, and (forward only) decode shapes (Nq = 1 .. 16
against long KV caches); --kinds masks (not a default) adds the other mask tensors of MASK_KINDS:
transformers' causal + padding mask, bool and additive, and dense additive biases (a quarter -inf, and
all finite); --kinds headdims
(not a default) the paper's shapes at D = 32 / 96 / 160 / 192 / 224 in bf16, fp16 and fp32. Every contender
runs on the same inputs and is first checked against flashmod's result (outputs, and in fwdbwd the
gradients); then all are timed in the same interleaved rounds (benchmarks/harness.py: median after
warm-up, device time) and their peak memory measured. FLOPs: forward 4 * B * Hq * Nq * Nk * D,
halved for causal (and for causal mask tensors); forward + backward 3.5x that (the
backward's five matmuls, one of them the recomputed scores, against the forward's two). Prints a
table and writes <out-dir>/<tag>.json and <tag>.png.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from harness import (
    PEAK_MEMORY_METHOD,
    device_name,
    median_times,
    peak_extra_bytes,
    plot_tflops,
    print_table,
    with_env,
    write_json,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashmod.functional import attention_bhsd
from flashmod.ops import attention_op

SDPA_BACKENDS = {
    "FLASH": SDPBackend.FLASH_ATTENTION,
    "CUDNN": SDPBackend.CUDNN_ATTENTION,
    "EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
    "MATH": SDPBackend.MATH,
}
# MATH materializes (B, H, Nq, Nk) scores (several copies, more for the backward): past this many
# score elements it would take tens of GB or seconds per call, so the table says "skip".
MATH_MAX_SCORES = 2**29
BACKWARD_FLOPS_FACTOR = 3.5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_OUT_DIR = os.path.join("build", "bench")

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", dict], torch.Tensor]


# Mask tensors a shape can carry (make_inputs builds them; every contender gets the same one):
#   padding                  (B, 1, 1, Nk) bool key padding, each row keeping at least half its keys
#   causal-padding           (B, 1, Nq, Nk) bool: causal and key padding in one mask, what transformers'
#                            SDPA mask builder hands an attention function for a padded batch
#   causal-padding-additive  the same as an additive mask in q's dtype (0 / finfo.min, eager style)
#   random-additive          (B, 1, Nq, Nk) N(0, 1) biases in q's dtype, a quarter of them -inf
#   bias                     (B, 1, Nq, Nk) N(0, 1) biases in q's dtype, all finite: a relative-position
#                            bias as T5's or ALiBi's, which hides no key (mask_tiles.h's kTileShownAdded)
MASK_KINDS = ("padding", "causal-padding", "causal-padding-additive", "random-additive", "bias")


def shape(
    kind: str, dtype: str, b: int, hq: int, hkv: int, nq: int, nk: int, d: int, causal: bool, mask: bool,
    window: int = -1, softcap: float = 0.0, mask_kind: str = "padding",
):  # fmt: skip
    """One benchmark shape; ``window`` > 0: keys at most that far left of the (causal) diagonal;
    ``softcap`` > 0: scores soft-capped (no SDPA backend takes one: flashmod runs alone); ``mask``:
    a mask tensor of ``mask_kind`` (MASK_KINDS)."""
    assert mask_kind in MASK_KINDS, mask_kind
    return dict(
        kind=kind, dtype=dtype, b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, causal=causal, mask=mask,
        window=window, softcap=softcap, mask_kind=mask_kind,
    )  # fmt: skip


def cuda_shapes(mode: str, quick: bool) -> list[dict]:
    lengths = (1024, 4096) if quick else ((512,) if mode == "fwd" else ()) + (1024, 2048, 4096, 8192, 16384)
    shapes = []
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            if d == 256 and dtype == "fp16":
                continue
            for n in lengths:
                for causal in (False, True):
                    shapes.append(shape("paper", dtype, 16384 // n, 2048 // d, 2048 // d, n, n, d, causal, False))
    if mode == "fwd":  # decode is inference: no backward
        for nq in (1, 4, 16):
            for nk in (16384,) if quick else (4096, 16384, 65536):
                shapes.append(shape("decode", "bf16", 8, 32, 8, nq, nk, 128, False, False))
    for d in (64, 128, 256):  # fp32: flashmod's 3xTF32 kernels against SDPA's fp32-capable backends
        for n in (1024, 4096):
            for causal in (False, True):
                shapes.append(shape("fp32", "fp32", 4, 16, 16, n, n, d, causal, False))
    for d in (32, 96, 160, 192, 224):  # head dims between the paper's (not in the default kinds):
        for dtype in ("bf16", "fp16", "fp32"):  # Hopper: 192 at its own size, the rest with zero columns
            for n in (1024, 4096):
                for causal in (False, True):
                    shapes.append(shape("headdims", dtype, 16384 // n, 2048 // d, 2048 // d, n, n, d, causal, False))
    for n in (1024, 4096):  # grouped-query prefill (32 query heads on 8 key/value heads)
        for causal in (False, True):
            shapes.append(shape("gqa", "bf16", 16384 // n, 32, 8, n, n, 128, causal, False))
    for n in (1024, 4096):
        shapes.append(shape("padding", "bf16", 8, 16, 16, n, n, 128, False, True))
    for n in (1024, 4096):  # mask tensors (MASK_KINDS; "padding" above is the first): not in the default kinds
        for kind in MASK_KINDS[1:]:
            shapes.append(shape("masks", "bf16", 16384 // n, 16, 16, n, n, 128, False, True, mask_kind=kind))
        for d, h in ((64, 32), (256, 16)):  # the additive masks at the other head dims
            for kind in ("causal-padding-additive", "random-additive", "bias"):
                shapes.append(shape("masks", "bf16", 16384 // n, h, h, n, n, d, False, True, mask_kind=kind))
    for n in (4096, 16384):  # sliding window (Mistral-style 1k causal band): SDPA needs a band mask
        shapes.append(shape("window", "bf16", 16384 // n, 16, 16, n, n, 128, True, False, window=1024))
    for n in (1024, 4096):  # soft-capped scores (Gemma 2's 50.0)
        shapes.append(shape("softcap", "bf16", 16384 // n, 16, 16, n, n, 128, True, False, softcap=50.0))
    return shapes


def forward_flops(s: dict) -> float:
    if s.get("window", -1) >= 0:  # the visible pairs of a causal band w keys wide (square, top-left)
        n, w = s["nq"], s["window"]
        pairs = n * (w + 1) - w * (w + 1) // 2
        return 4.0 * s["b"] * s["hq"] * pairs * s["d"]
    f = 4.0 * s["b"] * s["hq"] * s["nq"] * s["nk"] * s["d"]
    causal_mask = s["mask"] and s.get("mask_kind", "padding").startswith("causal")
    return f / 2 if s["causal"] or causal_mask else f


def label(s: dict) -> str:
    base = f"{s['kind']:7s} {s['dtype']} b{s['b']} h{s['hq']}/{s['hkv']} nq{s['nq']} nk{s['nk']} d{s['d']}"
    extra = (f" window{s['window']}" if s.get("window", -1) >= 0 else "") + (
        f" softcap{s['softcap']:g}" if s.get("softcap", 0) > 0 else ""
    )
    mask_kind = s.get("mask_kind", "padding")
    mask = (" mask" if mask_kind == "padding" else f" mask:{mask_kind}") if s["mask"] else ""
    dropout = f" dropout{s['dropout']:g}" if s.get("dropout", 0) > 0 else ""
    return base + (" causal" if s["causal"] else "") + mask + extra + dropout


def make_inputs(s: dict, device: str, requires_grad: bool):
    dt = DTYPES[s["dtype"]]
    q = torch.randn(s["b"], s["hq"], s["nq"], s["d"], device=device, dtype=dt, requires_grad=requires_grad)
    k = torch.randn(s["b"], s["hkv"], s["nk"], s["d"], device=device, dtype=dt, requires_grad=requires_grad)
    v = torch.randn(s["b"], s["hkv"], s["nk"], s["d"], device=device, dtype=dt, requires_grad=requires_grad)
    mask = None
    if s["mask"]:  # MASK_KINDS
        kind = s.get("mask_kind", "padding")
        lengths = torch.randint(s["nk"] // 2, s["nk"] + 1, (s["b"],), device=device)
        mask = (torch.arange(s["nk"], device=device)[None] < lengths[:, None])[:, None, None, :]
        if kind.startswith("causal-padding"):
            causal = torch.ones(s["nq"], s["nk"], dtype=torch.bool, device=device).tril(s["nk"] - s["nq"])
            mask = mask & causal
        if kind == "causal-padding-additive":
            mask = torch.zeros(mask.shape, dtype=dt, device=device).masked_fill(~mask, torch.finfo(dt).min)
        if kind in ("random-additive", "bias"):
            mask = torch.randn(s["b"], 1, s["nq"], s["nk"], device=device, dtype=dt)
        if kind == "random-additive":
            mask = mask.masked_fill(torch.rand(mask.shape, device=device) < 0.25, -math.inf)
    return q, k, v, mask


def flashmod_attend(q, k, v, mask, s):
    if s.get("dropout", 0) > 0:  # flashmod.attention's path: the fused dropout op where it applies
        window = (s.get("window", -1), -1)
        return attention_bhsd(q, k, v, mask, s["dropout"], None, s["causal"], False, window, s.get("softcap", 0.0))[0]
    return attention_op(
        q, k, v, mask, is_causal=s["causal"], bottom_right=False, window_left=s.get("window", -1),
        softcap=s.get("softcap", 0.0),
    )[0]  # fmt: skip


def flashmod_dropout_reference(q, k, v, mask, s):
    """The dropout path before the fused kernels: the reference math (attention_dropout_reference)."""
    return torch.ops.flashmod.attention_dropout_reference(
        q, k, v, mask, None, s["causal"], False, s.get("window", -1), -1, s.get("softcap", 0.0), s["dropout"]
    )[0]


def add_dropout_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="dropout probability for every shape (flashmod.attention's path and SDPA's dropout_p)",
    )
    ap.add_argument(
        "--dropout-reference",
        action="store_true",
        help="with --dropout, also time the reference dropout path (attention_dropout_reference)",
    )


def apply_dropout_arguments(args: argparse.Namespace, shapes: list[dict], contenders: dict[str, Attend]) -> None:
    """--dropout on every shape; --dropout-reference adds the reference path as a contender."""
    for s in shapes:
        s["dropout"] = args.dropout
    if args.dropout > 0 and args.dropout_reference:
        contenders["flashmod-reference"] = flashmod_dropout_reference


def band_mask(s: dict, device) -> torch.Tensor:
    """The (Nq, Nk) bool mask of a causal window: what SDPA needs for what flashmod takes as options."""
    i = torch.arange(s["nq"], device=device)[:, None]
    j = torch.arange(s["nk"], device=device)[None, :]
    return (j <= i) & (i - j <= s["window"])


def sdpa_attend(backend: SDPBackend | None) -> Attend:
    """torch's SDPA forced onto ``backend`` (None: its own dispatch, e.g. on the CPU)."""

    bands: dict = {}

    def attend(q, k, v, mask, s):
        gqa = s["hq"] != s["hkv"]
        if s.get("softcap", 0) > 0:
            raise RuntimeError("SDPA has no soft cap")
        causal = s["causal"]
        if s.get("window", -1) >= 0:  # the band replaces is_causal; built once per shape, outside the timing
            key = (s["nq"], s["nk"], s["window"])
            if key not in bands:
                bands.clear()
                bands[key] = band_mask(s, q.device)
            mask, causal = bands[key], False
        p = s.get("dropout", 0.0)
        if backend is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, enable_gqa=gqa
            )
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, enable_gqa=gqa
            )

    return attend


def step(attend: Attend, mode: str, q, k, v, mask, s, grad_out):
    """One timed call: the forward, or forward + backward returning the gradients."""
    if mode == "fwd":
        return lambda: (attend(q, k, v, mask, s),)
    return lambda: torch.autograd.grad(attend(q, k, v, mask, s), (q, k, v), grad_out)


def mismatch(ours: tuple, theirs: tuple, dtype: str) -> str | None:
    """None if every tensor of ``theirs`` matches flashmod's within the precision, else why not."""
    tol = 1e-4 if dtype == "fp32" else 3e-2
    for name, a, b in zip(("out",) if len(ours) == 1 else ("dq", "dk", "dv"), ours, theirs):
        scale = max(1.0, a.float().abs().max().item())
        err = (b.float() - a.float()).abs().max().item() / scale
        if not err <= tol:
            return f"mismatch {name} {err:.1e}"
    return None


def run(
    shapes: list[dict],
    contenders: dict[str, Attend],
    device: str,
    mode: str,
    warmup: int,
    reps: int,
    skip: Callable[[str, dict], str | None] = lambda name, s: None,
    progress: bool = True,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Checks, times and measures every contender on every shape; rows for :func:`harness.print_table`.
    ``skip(name, shape)`` gives a reason to leave a contender out of a shape, or None; ``env[name]``
    holds knob settings ("NAME=value,...") a contender's whole step runs under (forward and backward)."""
    rows = []
    for i, s in enumerate(shapes):
        if progress:
            print(f"[{i + 1}/{len(shapes)}] {label(s)}", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        q, k, v, mask = make_inputs(s, device, requires_grad=mode == "fwdbwd")
        grad_out = torch.randn_like(q) if mode == "fwdbwd" else None
        flops = forward_flops(s) * (BACKWARD_FLOPS_FACTOR if mode == "fwdbwd" else 1.0)
        row = dict(shape=s, label=label(s), mode=mode, flops=flops, results={})
        fns = {name: step(attend, mode, q, k, v, mask, s, grad_out) for name, attend in contenders.items()}
        fns = {name: with_env(env[name], fn) if env and name in env else fn for name, fn in fns.items()}
        reference = fns["flashmod"]()
        runnable = {}
        for name, fn in fns.items():
            reason = skip(name, s)
            # Dropout: every contender draws its own keys, so outputs differ by design (the fused
            # kernels' correctness is tests/attention/test_dropout.py); each still runs once here.
            if reason is None and name != "flashmod" and s.get("dropout", 0) > 0:
                try:
                    fn()
                except RuntimeError as e:
                    reason = "n/a: " + (str(e).splitlines() or [""])[0][:80]
            elif reason is None and name != "flashmod":
                try:
                    reason = mismatch(reference, fn(), s["dtype"])
                except RuntimeError as e:  # this backend does not take the shape, dtype or mask
                    reason = "n/a: " + (str(e).splitlines() or [""])[0][:80]
            if reason is None:
                runnable[name] = fn
            else:
                row["results"][name] = {"status": reason}
        del reference
        times = median_times(runnable, device, warmup, reps)
        for name, fn in runnable.items():
            peak = peak_extra_bytes(fn, device)
            row["results"][name] = {
                "status": "ok",
                "ms": times[name] * 1e3,
                "tflops": flops / times[name] / 1e12,
                "peak_mib": peak / 2**20,
            }
        rows.append(row)
        del q, k, v, mask, grad_out, fns, runnable
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], contenders: list[str], device: str, mode: str, out_dir: str, tag: str, meta: dict):
    """The table, the JSON and the plot of one run."""
    print()
    print_table(rows, contenders)
    print(f"peak memory: {PEAK_MEMORY_METHOD[device]}")
    write_json(
        os.path.join(out_dir, f"{tag}.json"),
        dict(meta, mode=mode, contenders=contenders, peak_memory=PEAK_MEMORY_METHOD[device], rows=rows),
    )
    what = "forward" if mode == "fwd" else "forward + backward"
    plot_tflops(rows, contenders, f"flashmod {what}, {meta['device']}", os.path.join(out_dir, f"{tag}.png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd", help="forward only, or forward + backward")
    ap.add_argument("--quick", action="store_true", help="two sequence lengths per group, fewer decode shapes")
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the JSON and the plot go (default: %(default)s)")
    ap.add_argument("--tag", default=None, help="file name stem (default: <date>-cuda-<mode>)")
    ap.add_argument("--backends", default=",".join(SDPA_BACKENDS), help="SDPA backends to compare, comma-separated")
    ap.add_argument(
        "--kinds", default="paper,decode,gqa,padding,fp32,window,softcap", help="shape groups to run, comma-separated"
    )
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="dtypes to run, comma-separated")
    ap.add_argument("--dims", default="", help="head dims to keep, comma-separated (default: all)")
    ap.add_argument("--min-n", type=int, default=0, help="skip paper shapes with N below this")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls per contender before timing")
    ap.add_argument("--reps", type=int, default=50, help="timed rounds (the median is reported)")
    ap.add_argument(
        "--portable",
        action="store_true",
        help="also time flashmod's portable mma.sync kernels (FLASHMOD_DISABLE_SM90=1, forward and backward)",
    )
    ap.add_argument(
        "--ws-one-tile",
        action="store_true",
        help="also time the warp-specialized sm_90 forward on one CTA per tile (FLASHMOD_SM90_WS_PERSISTENT=0)",
    )
    ap.add_argument(
        "--fa2-sm90",
        action="store_true",
        help="also time the sm_90 forward without warp specialization (FLASHMOD_SM90_WS=0)",
    )
    add_dropout_arguments(ap)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:NAME=value[,NAME=value]",
        help="also time flashmod under these knob settings, as contender flashmod-LABEL (repeatable; "
        "e.g. bwd-base:FLASHMOD_BWD_SM90_TILE=base)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU; the CPU benchmark is benchmarks/bench_cpu.py")

    dims = {int(x) for x in args.dims.split(",") if x}
    shapes = [
        s
        for s in cuda_shapes(args.mode, args.quick)
        if s["kind"] in args.kinds.split(",")
        and s["dtype"] in args.dtypes.split(",")
        and (not dims or s["d"] in dims)
        and (s["kind"] != "paper" or s["nq"] >= args.min_n)
    ]
    contenders: dict[str, Attend] = {"flashmod": flashmod_attend}
    apply_dropout_arguments(args, shapes, contenders)
    if args.portable:
        contenders["flashmod-mma"] = flashmod_attend
    if args.fa2_sm90:
        contenders["flashmod-fa2"] = flashmod_attend
    if args.ws_one_tile:
        contenders["flashmod-1tile"] = flashmod_attend
    variants = dict(v.split(":", 1) for v in args.variant)
    for label in variants:
        contenders[f"flashmod-{label}"] = flashmod_attend
    for name in filter(None, args.backends.split(",")):
        contenders[name] = sdpa_attend(SDPA_BACKENDS[name])

    def skip(name: str, s: dict) -> str | None:
        if name in ("MATH", "flashmod-reference") and s["b"] * s["hq"] * s["nq"] * s["nk"] > MATH_MAX_SCORES:
            return "skip (too large: materialized scores)"
        return None

    name = device_name("cuda")
    print(
        f"device: {name}; torch {torch.__version__}; mode {args.mode}; {len(shapes)} shapes; "
        f"contenders: {', '.join(contenders)}"
    )
    env = {
        "flashmod-mma": "FLASHMOD_DISABLE_SM90=1",
        "flashmod-fa2": "FLASHMOD_SM90_WS=0",
        "flashmod-1tile": "FLASHMOD_SM90_WS_PERSISTENT=0",
        **{f"flashmod-{label}": settings for label, settings in variants.items()},
    }
    rows = run(shapes, contenders, "cuda", args.mode, args.warmup, args.reps, skip, env=env)
    tag = args.tag or f"{datetime.date.today().isoformat()}-cuda-{args.mode}"
    report(rows, list(contenders), "cuda", args.mode, args.out_dir, tag, dict(device=name, torch=torch.__version__))


if __name__ == "__main__":
    main()
