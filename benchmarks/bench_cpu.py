"""CPU benchmark: flashmod.attention against torch's F.scaled_dot_product_attention, in one process.

    ./dev.sh bench                                  # on a machine without CUDA: this, forward
    PYTHONPATH=. python benchmarks/bench_cpu.py --mode fwdbwd
    PYTHONPATH=. python benchmarks/bench_cpu.py --smoke --mode fwdbwd   # tiny shapes: does it run
    PYTHONPATH=. python benchmarks/bench_cpu.py --masks                 # every kind of mask tensor

Both contenders use the same threads (printed; set OMP_NUM_THREADS or --threads) and run in the same
interleaved rounds, so machine noise hits both alike; torch's SDPA picks its own CPU kernel (its
flash kernel wherever it applies). The output names the CPU and the flashmod kernel its instruction
set selects (csrc/attention/cpu/attention_cpu.cpp, pick_kernel). Shapes: B = 1, H = 8-16,
N = 512-4096, D = 64/128 (and 256 outside --quick), causal and not, fp32 and bf16; fwdbwd adds
grouped-query (32/8 heads) and bool key-padding cases. --masks runs the mask group instead: each kind
of mask tensor (bench_attention.MASK_KINDS: key padding, transformers' causal + padding mask as bool
and additive, dense additive biases with and without -inf entries) on B = 2, H = 8, N = 1024, D = 64
and B = 1, H = 16, N = 1024, D = 128 (causal masks count half the FLOPs). Checks, timing, FLOPs
(fwdbwd = 3.5x forward) and the table, JSON and plot are bench_attention.py's; peak memory is the RSS
high-water mark of one call (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform

import torch
from bench_attention import (
    DEFAULT_OUT_DIR,
    MASK_KINDS,
    add_dropout_arguments,
    apply_dropout_arguments,
    flashmod_attend,
    report,
    run,
    sdpa_attend,
    shape,
)
from harness import cpu_name, track_rss_of_large_blocks

import flashmod  # noqa: F401  (loads the operators)

# (B, H, N, D)
SHAPES = [
    (1, 16, 512, 64), (1, 16, 1024, 64), (1, 8, 2048, 128), (1, 8, 4096, 64), (1, 16, 1024, 128), (1, 8, 1024, 256),
]  # fmt: skip
QUICK_SHAPES = [(1, 16, 512, 64), (1, 8, 2048, 128)]
SMOKE_SHAPES = [(1, 2, 64, 32)]
# Environment variables that make a wider CPU run an instruction-set class's code (recorded as set).
FORCING_KNOBS = ("FLASHMOD_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


# --masks: (B, H, N, D) of the mask group, every MASK_KINDS entry on each.
MASK_SHAPES = [(2, 8, 1024, 64), (1, 16, 1024, 128)]


def mask_shapes(dtypes: list[str], smoke: bool) -> list[dict]:
    """Attention behind each kind of mask tensor (bench_attention.MASK_KINDS), not causal by option."""
    base = SMOKE_SHAPES if smoke else MASK_SHAPES
    return [
        shape("mask", dtype, b, h, h, n, n, d, False, True, mask_kind=kind)
        for dtype in dtypes
        for b, h, n, d in base
        for kind in MASK_KINDS
    ]


def cpu_shapes(mode: str, dtypes: list[str], quick: bool, smoke: bool) -> list[dict]:
    base = SMOKE_SHAPES if smoke else QUICK_SHAPES if quick else SHAPES
    n_extra = 64 if smoke else 1024
    shapes = []
    for dtype in dtypes:
        for causal in (False, True):
            shapes += [shape("cpu", dtype, b, h, h, n, n, d, causal, False) for b, h, n, d in base]
        if mode == "fwdbwd" or smoke:
            shapes.append(shape("gqa", dtype, 1, 32 if not smoke else 4, 8 if not smoke else 2, n_extra, n_extra,
                                128 if not smoke else 32, True, False))  # fmt: skip
            shapes.append(shape("padding", dtype, 2, 8 if not smoke else 2, 8 if not smoke else 2, n_extra, n_extra,
                                64 if not smoke else 32, False, True))  # fmt: skip
    return shapes


def _amx_granted() -> bool:
    """Whether Linux lets this process use the AMX tile state (what the C++ side asks once too)."""
    try:
        arch_prctl, req_xcomp_perm, xfeature_tiledata = 158, 0x1023, 18
        return ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xfeature_tiledata) == 0
    except (OSError, AttributeError):
        return False


def flashmod_cpu_kernel() -> str:
    """The kernel pick_kernel (csrc/attention/cpu/attention_cpu.cpp) selects on this CPU, derived from
    the same CPU flags and FLASHMOD_CPU_ISA (the extension does not report it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "baseline"
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    forced = os.environ.get("FLASHMOD_CPU_ISA", "")
    if avx512 and forced in ("", "amx") and {"amx_tile", "amx_bf16"} <= flags and _amx_granted():
        return "amx (bf16: forward on AMX tiles, backward products on MKL's bf16 GEMM; other dtypes on AVX-512)"
    if avx512 and forced in ("", "avx512"):
        return "avx512"
    if avx2 and forced in ("", "avx512", "avx2"):
        return "avx2"
    return "baseline"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd", help="forward only, or forward + backward")
    ap.add_argument("--quick", action="store_true", help="two shapes per dtype and causality")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few runs: checks that the benchmark runs")
    ap.add_argument("--dtypes", default="fp32,bf16", help="dtypes to run, comma-separated (fp32, bf16, fp16)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per contender (default: 2, smoke 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds, the median is reported (default: 7, smoke 3)")
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the JSON and the plot go (default: %(default)s)")
    ap.add_argument("--tag", default=None, help="file name stem (default: <date>-cpu-<mode>)")
    ap.add_argument("--masks", action="store_true", help="the mask group instead: every mask tensor kind")
    add_dropout_arguments(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    reps = args.reps if args.reps is not None else (3 if args.smoke else 7)

    track_rss_of_large_blocks()
    dtypes = args.dtypes.split(",")
    shapes = mask_shapes(dtypes, args.smoke) if args.masks else cpu_shapes(args.mode, dtypes, args.quick, args.smoke)
    contenders = {"flashmod": flashmod_attend, "SDPA": sdpa_attend(None)}
    apply_dropout_arguments(args, shapes, contenders)
    meta = dict(
        device=f"{cpu_name()} ({torch.get_num_threads()} threads)",
        cpu=cpu_name(),
        threads=torch.get_num_threads(),
        flashmod_kernel=flashmod_cpu_kernel(),
        torch=torch.__version__,
        torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
        env={k: os.environ[k] for k in FORCING_KNOBS if k in os.environ},
    )
    print(
        f"CPU: {meta['cpu']}; threads: {meta['threads']}; flashmod kernel: {meta['flashmod_kernel']}; "
        f"torch {meta['torch']} ({meta['torch_cpu_capability']}); mode {args.mode}; {len(shapes)} shapes"
    )
    rows = run(shapes, contenders, "cpu", args.mode, warmup, reps)
    group = "-masks" if args.masks else ""
    dropout = f"-dropout{args.dropout:g}" if args.dropout > 0 else ""
    tag = args.tag or (
        f"{datetime.date.today().isoformat()}-cpu-{args.mode}{group}{dropout}{'-smoke' if args.smoke else ''}"
    )
    report(rows, list(contenders), "cpu", args.mode, args.out_dir, tag, meta)


if __name__ == "__main__":
    main()
