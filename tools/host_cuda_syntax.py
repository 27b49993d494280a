"""Compiles the CUDA host units (the torch-facing .cpp files under csrc/*/cuda/) for syntax and types on a
machine without a CUDA build of torch: g++ -fsyntax-only against this torch's headers and nvcc's, with
empty stand-ins for the CUDA library headers a CPU wheel lacks (cuSPARSE, cuBLAS, cuSOLVER and the
CMake-generated c10/cuda macro header). The kernel units are torch-free and go through
tools/ptxas_report.py; this covers the dispatch and glue that only the GPU machine's build compiled
(session 57: the widened head-dim dispatch was checked this way before any device time).
Usage: python tools/host_cuda_syntax.py [file.cpp ...] [--jobs 2]  (default: every csrc/*/cuda/*.cpp)"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import shutil
import subprocess
import tempfile

import torch.utils.cpp_extension as cpp_extension

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Only the handle and status types torch's CUDA context headers name; nothing here is called.
STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


def cuda_include() -> pathlib.Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("nvcc not on PATH (e.g. export PATH=/usr/local/cuda/bin:$PATH)")
    return pathlib.Path(nvcc).resolve().parent.parent / "include"


def check(unit: pathlib.Path, flags: list[str]) -> tuple[pathlib.Path, int, str]:
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DFLASHMOD_BUILT_SM90A", *flags, str(unit)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    errors = "\n".join(line for line in done.stderr.splitlines() if "error" in line)
    return unit, done.returncode, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("units", nargs="*", type=pathlib.Path)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    units = [u.resolve() for u in args.units] or sorted(ROOT.glob("csrc/*/cuda/*.cpp"))
    with tempfile.TemporaryDirectory() as stubs:
        for name, text in STUBS.items():
            path = pathlib.Path(stubs, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        flags = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{stubs}", f"-I{cuda_include()}"]
        failed = 0
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for unit, rc, errors in pool.map(lambda u: check(u, flags), units):
                print(f"{'ok  ' if rc == 0 else 'FAIL'} {unit.relative_to(ROOT)}")
                if rc != 0:
                    failed += 1
                    print(errors or "(no error line; rerun the g++ command by hand)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
