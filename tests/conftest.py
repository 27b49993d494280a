"""Shared fixtures: the device list, fresh random seeds, and NaN-poisoned allocations."""

from __future__ import annotations

import random

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A new seed every run (inputs are never the same twice); printed so a failure can be replayed."""
    seed = random.SystemRandom().randrange(2**31)
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
