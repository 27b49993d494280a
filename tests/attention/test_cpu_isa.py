"""The CPU kernel is compiled once per instruction set and chosen at run time; the machine running
the tests normally exercises only the widest. FLASHMOD_CPU_ISA forces a narrower one, read once per
process, so each variant runs a slice of the forward grid in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SLICE = (
    "cpu and (nonfinite or mask_layouts or (forward_matches and "
    "(plain or causal_bottom_right_mqa or bool_mask_empty_rows or softcap_causal or additive_mask)))"
)


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


# What each forced ISA needs beyond the baseline (the C++ side also checks; forcing one the CPU lacks is an error).
ISA_FLAGS = {
    "amx": {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx2": {"avx2", "fma", "f16c"},
    "baseline": set(),
}


def run_pytest_under_isa(isa: str, repo_root, *args: str) -> None:
    """Runs pytest on args in a fresh interpreter with FLASHMOD_CPU_ISA=isa (the kernel is chosen once
    per process, so a forced ISA needs a process of its own) and asserts that it passed."""
    if not ISA_FLAGS[isa] <= cpu_flags():
        pytest.skip(f"this CPU lacks {isa}")
    env = dict(os.environ, FLASHMOD_CPU_ISA=isa)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_forced_instruction_set_matches_reference(isa, repo_root):
    forward_tests = [str(Path(__file__).with_name(name)) for name in ("test_attention.py", "test_nonfinite.py")]
    run_pytest_under_isa(isa, repo_root, *forward_tests, "-k", SLICE)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_forced_instruction_set_backward_matches_reference(isa, repo_root):
    """The fused backward's elementwise rows are compiled per ISA and follow FLASHMOD_CPU_ISA, and so
    does its choice of products: under a forced ISA bf16 takes rows widened to fp32, where an AMX CPU's
    default takes MKL's bf16 GEMM (test_bf16_strided_gqa among them)."""
    run_pytest_under_isa(isa, repo_root, str(Path(__file__).with_name("test_attention_backward.py")))


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_forced_instruction_set_paged_decode_matches_contiguous(isa, repo_root):
    """The decode engine reads a paged cache's rows in place at every ISA's vector width (head dims
    it takes and ones it leaves to the gathering path differ between them)."""
    serve_tests = Path(__file__).with_name("test_serve.py")
    run_pytest_under_isa(isa, repo_root, str(serve_tests), "-k", "paged_decode_equals_contiguous_cpu")


SOFTMAX_SLICE = (
    "cpu and (softmax_rows or every_dim or neg_inf_rows or matmul_softmax_shapes or matmul_softmax_masks"
    " or matmul_softmax_fp16_raw_logits)"
)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_forced_instruction_set_softmax_matches_reference(isa, repo_root):
    """The softmax row kernels follow FLASHMOD_CPU_ISA too (each is built at its ISA's own vector width)."""
    softmax_tests = Path(__file__).parent.parent / "softmax" / "test_softmax.py"
    run_pytest_under_isa(isa, repo_root, str(softmax_tests), "-k", SOFTMAX_SLICE)


def attention_error(env: dict[str, str], nq: int, repo_root) -> str:
    """What a fresh interpreter prints of the error that attention on (1, 2, nq, 40) inputs raises
    under env (knobs are read in the process that calls); fails if the call raises none."""
    script = (
        "import torch, flashmod\n"
        f"q = torch.randn(1, 2, {nq}, 40)\n"
        "try:\n"
        "    torch.ops.flashmod.attention(q, q, q)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=repo_root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("value", ["avx1024", "AVX2", "sse", "amx", "avx512"])
def test_unknown_or_missing_instruction_set_is_an_error_listing_the_allowed_ones(value, repo_root):
    if value in ISA_FLAGS and ISA_FLAGS[value] <= cpu_flags():
        pytest.skip(f"this CPU has {value}, so forcing it is no error")
    out = attention_error(dict(os.environ, FLASHMOD_CPU_ISA=value), 17, repo_root)
    assert f"FLASHMOD_CPU_ISA='{value}'" in out
    assert "allowed: amx, avx512, avx2, baseline" in out
    reason = "is not supported by this CPU" if value in ISA_FLAGS else "is not a known ISA"
    assert reason in out


@pytest.mark.parametrize("value", ["2", "yes", "on"])
def test_malformed_flag_is_an_error_naming_the_knob(value, repo_root):
    env = dict(os.environ, FLASHMOD_CPU_DECODE=value)
    env.pop("FLASHMOD_CPU_ISA", None)
    out = attention_error(env, 3, repo_root)
    assert f"FLASHMOD_CPU_DECODE must be 0 or 1, got '{value}'" in out
