"""What every benchmark and timing tool shares: the machine's name, timing, peak memory, the
results table, the JSON file and the plot. Scripts in benchmarks/ import it as ``harness`` (their
folder is on ``sys.path`` when run as scripts); scripts in tools/ put benchmarks/ there first.

Timing rules, the same for every contender of a run:

* warm-up calls first, then timed rounds in which every contender runs once, in turn, so clock and
  thermal drift weigh on all alike; the order rotates from round to round, so every contender
  holds every place in the round equally often; the result is the median per contender. (The
  place matters: on an H100 the first call after the spin kernel below ran 3-4 % slower than the
  same call right after it at N = 512-1k, 1 % at 2k; benchmarks/results/design/
  cuda-hopper-forward.md, session 12. Until then the order was fixed, flashmod first.)
* CUDA: device time between events around each call, each round queued behind a ~1 ms spin kernel
  so the events time the kernels and not the host's launch overhead; with ``isolate`` every call
  also starts from an L2 cache holding none of its data (a read of twice the L2 size before it,
  outside the events), so no contender reads what the one before it left in L2 (contenders that
  share inputs, such as decode caches of a few tens of MB, otherwise do);
* CPU: wall time with ``time.perf_counter``.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's with the thread count torch uses."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def median_times(
    fns: dict[str, Callable[[], Any]], device: str, warmup: int, reps: int, isolate: bool = False
) -> dict[str, float]:
    """Median seconds per call of each fn, over ``reps`` interleaved rounds in a rotating order after
    ``warmup`` calls each (``isolate``: cold L2 before every call; see the module docstring)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)

    def round_order(rep: int) -> list[str]:
        return names[rep % len(names) :] + names[: rep % len(names)]

    if device == "cuda":
        flush = None
        if isolate:
            l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
            flush = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.float32, device="cuda").fill_(1.0)
        torch.cuda.synchronize()
        for rep in range(reps):
            # Spin (cycles; ~1 ms, more for long rounds) while the host queues the whole round.
            torch.cuda._sleep(2_000_000 + (500_000 * len(fns) if isolate else 0))
            events = []
            for name in round_order(rep):
                fn = fns[name]
                if flush is not None:
                    flush.sum()  # reads (clean lines: nothing to write back while fn runs)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events.append((name, start, end))
            torch.cuda.synchronize()
            for name, start, end in events:
                times[name].append(start.elapsed_time(end) / 1e3)
    else:
        for rep in range(reps):
            for name in round_order(rep):
                fn = fns[name]
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def host_seconds_per_call(fn: Callable[[], Any], device: str, calls: int = 5000) -> float:
    """The host's cost of one call: ``calls`` back to back, one synchronize at the end (on tiny
    tensors the device finishes each kernel long before the next launch)."""
    for _ in range(calls // 10):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def with_env(settings: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn run with the environment settings ``"NAME=value[,NAME=value...]"`` (knobs csrc reads per
    call), restored after each call so contenders timed in the same rounds do not see them."""
    pairs = [setting.split("=", 1) for setting in settings.split(",") if setting]

    def run():
        old = {name: os.environ.get(name) for name, _ in pairs}
        os.environ.update(dict(pairs))
        try:
            return fn()
        finally:
            for name, value in old.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value

    return run


def track_rss_of_large_blocks() -> None:
    """CPU peak memory through RSS: glibc then serves blocks over 64 KiB from mmap and unmaps them
    at free, so the resident set follows live tensors instead of the allocator's free lists."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


PEAK_MEMORY_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus what was allocated before",
    "cpu": "peak RSS (VmHWM, reset through /proc/self/clear_refs) minus RSS before; large blocks mmap-served",
}


def peak_extra_bytes(fn: Callable[[], Any], device: str) -> int:
    """Peak memory one call of fn allocates beyond what exists before it (its outputs included);
    :data:`PEAK_MEMORY_METHOD` says how. On CPU call :func:`track_rss_of_large_blocks` once first."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - before
    before = _proc_status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    out = fn()
    del out
    return _proc_status("VmHWM:") - before


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def _mib(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def print_table(rows: list[dict], contenders: list[str], baseline: str = "flashmod") -> None:
    """Rows as the attention benchmarks write them (``label``, ``results[contender]`` with ``status``,
    ``ms``, ``tflops``, ``peak_mib``): TFLOP/s per contender, then time of X / time of ``baseline``."""
    others = [c for c in contenders if c != baseline]
    width = max(len(r["label"]) for r in rows) if rows else 10
    print(
        f"{'shape':{width}s} "
        + " ".join(f"{c[:10]:>10s}" for c in contenders)
        + "   "
        + " ".join(f"{'fm/' + c[:9]:>12s}" for c in others)
        + "   peak MiB "
        + "/".join(c[:6] for c in contenders)
    )
    for row in rows:
        res = row["results"]
        cells = []
        for c in contenders:
            x = res.get(c, {})
            if x.get("status") == "ok":
                cells.append(f"{x['tflops']:10.1f}" if x["tflops"] >= 10 else f"{x['tflops']:10.4f}")
            else:
                cells.append(f"{x.get('status', '-')[:10]:>10s}")
        base = res.get(baseline, {})
        ratios = [
            f"{res[c]['ms'] / base['ms']:12.2f}"
            if base.get("status") == "ok" and res.get(c, {}).get("status") == "ok"
            else f"{'-':>12s}"
            for c in others
        ]
        peaks = "/".join(_mib(res[c]["peak_mib"]) if "peak_mib" in res.get(c, {}) else "-" for c in contenders)
        print(f"{row['label']:{width}s} " + " ".join(cells) + "   " + " ".join(ratios) + "   " + peaks)
    print(f"(TFLOP/s; fm/X = time of X / time of {baseline}, > 1 means {baseline} is faster)")
    for c in others:
        ratios = [
            r["results"][c]["ms"] / r["results"][baseline]["ms"]
            for r in rows
            if r["results"].get(c, {}).get("status") == "ok" and r["results"].get(baseline, {}).get("status") == "ok"
        ]
        if ratios:
            print(f"geomean fm/{c}: {geomean(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} shapes)")


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}")


def plot_tflops(rows: list[dict], contenders: list[str], title: str, path: str) -> None:
    """TFLOP/s against sequence length, one panel per (dtype, head dim, causal, kind) group of rows
    whose shape has ``nq == nk``. Without matplotlib it says so and returns: the table and the JSON
    stand on their own."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (./dev.sh bench installs it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        s = row["shape"]
        if s["nq"] == s["nk"]:
            groups.setdefault((s["kind"], s["dtype"], s["d"], s["causal"]), []).append(row)
    if not groups:
        print("no plot: no square (nq == nk) shapes")
        return
    n = len(groups)
    ncol = min(4, n)
    nrow = math.ceil(n / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.5 * ncol, 3.5 * nrow), squeeze=False)
    for ax, ((kind, dtype, d, causal), group) in zip(axes.flat, sorted(groups.items())):
        group = sorted(group, key=lambda r: r["shape"]["nq"])
        xs = [g["shape"]["nq"] for g in group]
        for c in contenders:
            ys = [g["results"].get(c, {}).get("tflops", float("nan")) for g in group]
            ax.plot(xs, ys, marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{kind} {dtype} d={d}{' causal' if causal else ''}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")
