"""The examples run to the end on the CPU, in a fresh interpreter each: a renamed or moved public
name, or a changed signature, breaks them before any user sees it. (Their numbers are parity and
speed reports for people; the parity itself is asserted by the other tests.)"""

from __future__ import annotations

import importlib.util

import pytest

EXAMPLES = {
    "quickstart": ["quickstart.py"],
    "transformer_block": ["transformer_block.py", "--device", "cpu"],
    "compile": ["compile.py", "--device", "cpu", "--backend", "aot_eager"],
    "hf_generate": ["hf_generate.py", "--device", "cpu", "--prompt-len", "16", "--new-tokens", "4"],
    # Exits non-zero when the flashmod and sdpa loss curves part; 4 steps keep it to seconds.
    "hf_train": ["hf_train.py", "--device", "cpu", "--steps", "4", "--seq-len", "64", "--no-save"],
    # Exits non-zero when the ring-parallel loss or gradients differ from the single-process ones.
    "hf_ring_attention": ["hf_ring_attention.py", "--world-size", "2", "--seqlen", "67"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_runs(name, run_repo_script):
    if name.startswith("hf_") and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers")
    script, *args = EXAMPLES[name]
    result = run_repo_script(f"examples/{script}", *args)
    assert result.stdout.strip(), f"{script} printed nothing"
