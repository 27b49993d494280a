"""Device time per kernel of a callable, from torch.profiler: the loop that tools/decode_kernel_times.py,
tools/bwd_kernel_times.py and tools/bwd_sm90_tiles.py share (imported by them; not a script).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_us(
    fn: Callable[[], object],
    reps: int,
    key: Callable[[str], str | None] = lambda name: name,
    before: Callable[[], object] | None = None,
    warmup: int = 0,
) -> dict[str, float]:
    """Microseconds of device time per call of fn, summed over the kernels that key maps to the same
    label (kernels it maps to None, e.g. an L2 flush, are left out). fn runs warmup times first
    (synchronized, not profiled), then reps times under the profiler, each call after before() when
    given."""
    if warmup > 0:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            label = key(e.name)
            if label is not None:
                totals[label] = totals.get(label, 0.0) + e.device_time / reps
    return totals
