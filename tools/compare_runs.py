"""Two runs of benchmarks/bench_attention.py side by side, shape by shape: flashmod's TFLOP/s in each,
their ratio, and flashmod / a reference backend in each. Runs on different machines or days differ
by clocks; the ratio to a backend measured in the same process is what compares across them.
Usage: python tools/compare_runs.py before.json after.json [--backend CUDNN] [--contender flashmod]"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from harness import geomean  # noqa: E402


def load(path: str, contender: str, backend: str) -> dict[str, tuple[float, float | None]]:
    """label -> (contender TFLOP/s, contender / backend or None) for the rows the contender ran."""
    rows = {}
    for row in json.load(open(path))["rows"]:
        res = row["results"]
        ours = res.get(contender, {}).get("tflops")
        ref = res.get(backend, {}).get("tflops")
        if ours:
            rows[row["label"]] = (ours, ours / ref if ref else None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--backend", default="CUDNN", help="the same-process reference (default: %(default)s)")
    ap.add_argument("--contender", default="flashmod", help="the contender to compare (default: %(default)s)")
    args = ap.parse_args()
    a = load(args.before, args.contender, args.backend)
    b = load(args.after, args.contender, args.backend)
    both = [k for k in b if k in a]
    print(f"{'shape':62s} {'before':>8s} {'after':>8s} {'ratio':>6s}   x {args.backend} before -> after")
    for k in both:
        (ta, ra), (tb, rb) = a[k], b[k]
        rel = f"{ra:5.2f} -> {rb:5.2f}" if ra and rb else "-"
        print(f"{k:62s} {ta:8.1f} {tb:8.1f} {tb / ta:6.3f}   {rel}")
    paired = [k for k in both if a[k][1] and b[k][1]]
    if paired:
        geo = [geomean([d[k][1] for k in paired]) for d in (a, b)]
        print(f"geomean x {args.backend} over {len(paired)} shapes: {geo[0]:.3f} -> {geo[1]:.3f}")


if __name__ == "__main__":
    main()
