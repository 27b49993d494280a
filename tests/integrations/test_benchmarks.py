"""The benchmark scripts run to the end on the CPU in their smoke modes, in a fresh interpreter each,
and every contender they time passed its check against flashmod first (a contender whose result
differs is dropped with a message, so a missing one fails here). The numbers are not asserted:
speed lives in the benchmarks' own output, not in tests."""

from __future__ import annotations

import json
import math

import pytest


def assert_timed(rows: list[dict], contenders: set[str]) -> None:
    """Every row timed each of ``contenders`` (so each passed its check), with a finite time."""
    assert rows, "no rows written"
    for row in rows:
        missing = contenders - set(row["results"])
        assert not missing, f"{row['label']}: {sorted(missing)} not timed (their check failed or they did not run)"
        for name in contenders:
            got = row["results"][name]
            assert got["status"] == "ok" and math.isfinite(got["ms"]) and got["ms"] > 0, (row["label"], name, got)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd", "masks"])
def test_bench_cpu_smoke(mode, run_repo_script, tmp_path):
    args = ["--smoke", "--out-dir", str(tmp_path), "--tag", "smoke"]
    args += ["--masks"] if mode == "masks" else ["--mode", mode]
    run_repo_script("benchmarks/bench_cpu.py", *args)
    assert_timed(json.loads((tmp_path / "smoke.json").read_text())["rows"], {"flashmod", "SDPA"})


def test_bench_serve_smoke(run_repo_script, tmp_path):
    run_repo_script(
        "benchmarks/bench_serve.py",
        "--smoke",
        "--device",
        "cpu",
        "--pages",
        "16",
        "--page-orders",
        "random,in-order,grouped",
        "--head-major",
        "--without-append",
        "--read-ceiling",
        "--out-dir",
        str(tmp_path),
    )
    assert_timed(json.loads((tmp_path / "serve_varlen.json").read_text())["rows"], {"flashmod"})
    kvcache = {
        "flashmod",
        "no append",
        "no append, no lengths",
        "paged 16",
        "paged 16 in-order",
        "paged 16 grouped",
        "flashmod head-major",
        "paged 16 head-major",
        "flashmod.attention",
        "read (torch sum)",
    }
    assert_timed(json.loads((tmp_path / "serve_kvcache.json").read_text())["rows"], kvcache)
