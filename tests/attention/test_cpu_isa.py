"""The CPU kernel is compiled once per instruction set and chosen at run time; the machine running
the tests normally exercises only the widest. FLASHMOD_CPU_ISA forces a narrower one, read once per
process, so each variant runs a slice of the forward grid in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SLICE = "cpu and forward_matches and (plain or causal_bottom_right_mqa or bool_mask_empty_rows or softcap_causal)"


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_forced_instruction_set_matches_reference(isa, repo_root):
    env = dict(os.environ, FLASHMOD_CPU_ISA=isa)
    forward_tests = Path(__file__).with_name("test_attention.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(forward_tests), "-k", SLICE],
        env=env,
        capture_output=True,
        text=True,
        cwd=repo_root,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
