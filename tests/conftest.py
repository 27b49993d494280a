"""Shared by every test: the ``device`` parametrization, the ``cuda`` marker, the repository root and
a runner of its scripts, fresh random seeds and NaN-poisoned allocations."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    """Every test taking ``device`` runs once per available device; its CUDA case carries the
    ``cuda`` marker, so ``-m cuda`` selects exactly what runs on the GPU."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device", [pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else []) for d in DEVICES]
        )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout's root: the working directory of tests that start a fresh interpreter."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def run_repo_script(repo_root: Path):
    """Runs a script of the checkout (a path under it, then its arguments) in a fresh interpreter on
    the CPU (CUDA hidden, the hub offline), and fails with the end of its output unless it exits 0."""

    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(repo_root), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
        result = subprocess.run(
            [sys.executable, str(repo_root / script), *args],
            capture_output=True,
            text=True,
            cwd=repo_root,
            env=env,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        return result

    return run


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A new seed every run (inputs are never the same twice); printed so a failure can be replayed
    with FLASHMOD_TEST_SEED=<seed>."""
    replay = os.environ.get("FLASHMOD_TEST_SEED")
    seed = int(replay) if replay else random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    print(f"seed={seed}")
    yield seed


@pytest.fixture(autouse=True)
def poisoned_allocations():
    """Fill every torch.empty with NaN: an output element the kernel forgot to write shows up."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = was_fill
    torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
