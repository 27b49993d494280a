"""Builds flashmod._C: the CPU kernels always, the CUDA kernels when torch has CUDA and nvcc is found.

Environment:
  FLASHMOD_CPU_ONLY=1          skip the CUDA kernels even where they could be built
  FLASHMOD_CUDA_ARCHS="80;90a"  compute capabilities to build for (default: 80 and 90a)
  MAX_JOBS                      parallel compile jobs (default: all cores)
  FLASHMOD_NVCC_EXTRA           extra nvcc flags (e.g. "-Xptxas -v")

Install with `pip install --no-build-isolation .` (an isolated build would download torch).
"""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda() -> bool:
    if os.environ.get("FLASHMOD_CPU_ONLY", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def cuda_archs() -> list[str]:
    archs = os.environ.get("FLASHMOD_CUDA_ARCHS", "80;90a").replace(",", ";").split(";")
    return [a.strip() for a in archs if a.strip()]


def cuda_gencode_flags() -> list[str]:
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in cuda_archs()]


# No -std flag: torch's cpp_extension adds the standard its own headers were built with (C++17
# for torch 2.11, C++20 for 2.13).
# No -march: the wheel must run on any x86-64. csrc/attention/cpu/kernel_<isa>.cpp select their
# instruction sets with `#pragma GCC target`, and attention_cpu.cpp picks one at run time.
# -fopenmp: at::parallel_for is inline in ATen's headers and runs serially unless _OPENMP is
# defined here. The libgomp.so.1 it links resolves to the one torch already loaded (same soname).
cxx_flags = ["-O3", "-fvisibility=hidden", "-fopenmp"]
link_flags = ["-fopenmp"]
ext_sources = sources("csrc/*.cpp") + sources("csrc/*/*.cpp") + sources("csrc/*/cpu/*.cpp")

if want_cuda():
    nvcc_flags = [
        "-O3",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        *cuda_gencode_flags(),
        # Extra nvcc flags, e.g. "-Xptxas -v" for the register report.
        *os.environ.get("FLASHMOD_NVCC_EXTRA", "").split(),
    ]
    cuda_defines = ["-DFLASHMOD_BUILT_SM90A"] if "90a" in cuda_archs() else []
    extension = CUDAExtension(
        "flashmod._C",
        ext_sources
        + sources("csrc/*/cuda/*.cpp")
        + sources("csrc/*/cuda/*.cu")
        + sources("csrc/*/cuda/generated/*.cu"),
        # FLASHMOD_BUILT_SM90A tells the host launcher that the Hopper (wgmma) kernels exist as
        # machine code; without sm_90a in the build, H100s run the portable kernel.
        extra_compile_args={"cxx": cxx_flags + cuda_defines, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
        py_limited_api=True,
    )
else:
    extension = CppExtension(
        "flashmod._C",
        ext_sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
        py_limited_api=True,
    )

setup(
    name="flashmod",
    version="0.1.0",
    description="FlashAttention for PyTorch: one attention op on CPU and CUDA",
    packages=find_packages(include=["flashmod", "flashmod.*"]),
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
