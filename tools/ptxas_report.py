"""Registers, spills, wgmma serialization (ptxas's C75xx notes) and machine-code size of every kernel
in some CUDA units, compiled here with nvcc: no GPU needed. The kernel units are torch-free, so this
is the check to run before spending device time on a kernel change. A serialization note means ptxas
made every wgmma of that kernel wait for the previous one: the kernel still passes its tests but runs
at a fraction of its speed, and nothing else reports it. Seen: C7518, a wait inserted in a divergent
path (session 10: 0.60x); C7511, "insufficient register resources for the wgmma pipeline", e.g. a
narrower wgmma chosen at run time inside a pipeline stage (session 25: causal 0.62-0.81x); C7515,
ordinary instructions defining a wgmma's accumulators inside the stage. The size (SASS instructions,
from the cubin's .text section) matters where a kernel runs from a cold instruction cache: the
KV-cache decode kernel at 7160 instructions spent 24 % of its stall samples waiting for
instructions, 6.5 us a call, and at 4272 none (session 11).
Usage: python tools/ptxas_report.py [unit ...] [--arch 90a] [--jobs 2]
  unit: a .cu path or a name under csrc/attention/cuda/generated/ (default: the fwd_sm90_ws units)"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import struct
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
GENERATED = ROOT / "csrc/attention/cuda/generated"


def text_sizes(cubin: bytes) -> dict[str, int]:
    """SASS instructions per kernel: the size of each .text.<kernel> section (16 bytes each)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name table's file offset
    sizes = {}
    for h in headers:
        name = cubin[names + h[0] : cubin.index(b"\0", names + h[0])].decode()
        if name.startswith(".text."):
            sizes[name[len(".text.") :]] = h[5] // 16
    return sizes


def compile_unit(unit: pathlib.Path, arch: str) -> tuple[str, dict[str, int]]:
    """ptxas's -v report for one unit (flags as setup.py's, plus -Xptxas -v) and its kernels' sizes.
    Device code only (-cubin): an error of the host pass (e.g. a device-only function named outside
    its architecture guard) shows in the build, or in `nvcc -c` of the unit."""
    with tempfile.TemporaryDirectory() as tmp:
        # The defines torch's CUDAExtension adds to every nvcc call (no implicit half/bfloat16
        # conversions): without them a unit compiles here that the build then rejects.
        cmd = [
            "nvcc", "-std=c++17", "-O3", "--use_fast_math", "--expt-relaxed-constexpr",
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-cubin", str(unit),
            "-o", f"{tmp}/unit.cubin",
        ]  # fmt: skip
        if arch == "90a":
            cmd.insert(1, "-DFLASHMOD_BUILT_SM90A")
        cmd[1:1] = os.environ.get("FLASHMOD_NVCC_EXTRA", "").split()  # as setup.py takes it
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=unit.parent)
        if done.returncode != 0:
            return f"ERROR {unit.name}\n{done.stderr[-2000:]}", {}
        return done.stderr, text_sizes(pathlib.Path(f"{tmp}/unit.cubin").read_bytes())


def short_name(mangled: str) -> str:
    """The kernel's name and its template arguments' numbers, enough to tell variants apart."""
    rest = mangled[3:] if mangled.startswith("_ZN") else mangled
    last = ""
    while (m := re.match(r"(\d+)", rest)) is not None:  # the nested name's <length><name> parts
        n = int(m.group(1))
        last, rest = rest[m.end() : m.end() + n], rest[m.end() + n :]
    # Integer and bool arguments, and enums (KvAddressing) as their values.
    args = re.findall(r"L(?:[ib]|NS\d_\d+\w+?E)(\d+)E", rest)
    elem = "bf16" if "bfloat16" in rest else "fp16" if "half" in rest else ""
    return f"{last or mangled[:60]} {elem} <{','.join(args)}>"


def report(text: str) -> list[tuple[str, str, str, bool, str]]:
    """(kernel, registers, spill stores/loads, serialized, mangled name) per entry function in a -v
    report."""
    rows, name, serialized = [], None, set()
    for line in text.splitlines():
        if "wgmma.mma_async instructions are serialized" in line:
            m = re.search(r"function '(\w+)'", line)
            if m:
                serialized.add(m.group(1))
    entries = re.split(r"Compiling entry function '(\w+)'", text)
    for mangled, body in zip(entries[1::2], entries[2::2]):
        name = mangled
        regs = re.search(r"Used (\d+) registers", body)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        rows.append(
            (
                short_name(name),
                regs.group(1) if regs else "?",
                f"{spill.group(1)}/{spill.group(2)}" if spill else "?",
                name in serialized,
                name,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("units", nargs="*")
    ap.add_argument("--arch", default="90a", help="compute capability to compile for (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="units compiled at once (default: %(default)s)")
    args = ap.parse_args()
    names = args.units or [p.name for p in sorted(GENERATED.glob("fwd_sm90_ws_*.cu"))]
    units = [pathlib.Path(n) if pathlib.Path(n).exists() else GENERATED / pathlib.Path(n).with_suffix(".cu").name
             for n in names]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda u: compile_unit(u, args.arch), units))
    bad = 0
    for unit, (text, sizes) in zip(units, results):
        print(f"== {unit.name}")
        if text.startswith("ERROR"):
            print(text)
            bad += 1
            continue
        for kernel, regs, spill, serialized, mangled in report(text):
            flag = "  SERIALIZED WGMMA" if serialized else ""
            bad += serialized
            size = sizes.get(mangled, 0)
            print(f"  {kernel:60s} regs {regs:>3s}  spill st/ld {spill:>9s}  SASS {size:5d}{flag}")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
