"""flash-attn's rule for low precision: our error against a high-precision reference is at most
``factor`` times the error of plain PyTorch attention computed in the inputs' own precision."""

from __future__ import annotations

import torch
from torch import Tensor

# Slack, relative to the largest reference value (at least 1), for cases where the plain error is
# (nearly) zero, e.g. single-key rows, or where both errors are a few ulps of large gradients
# (a GQA group's summed dk/dv): then summation order alone decides the ratio.
SLACK = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def max_abs_err(x: Tensor, ref: Tensor) -> float:
    x, ref = x.double(), ref.double()
    both_neg_inf = torch.isneginf(x) & torch.isneginf(ref)
    return (x - ref).abs().masked_fill(both_neg_inf, 0).max().item() if x.numel() else 0.0


def assert_within_rule(
    ours: Tensor, truth: Tensor, plain: Tensor, factor: float, dtype: torch.dtype, what: str
) -> None:
    assert ours.shape == truth.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(truth.shape)}"
    assert not torch.isnan(ours).any(), f"{what}: NaN in our result (unwritten or invalid elements)"
    ours_err, plain_err = max_abs_err(ours, truth), max_abs_err(plain, truth)
    scale = max(1.0, truth.double().abs().max().item()) if truth.numel() else 1.0
    bound = factor * plain_err + SLACK[dtype] * scale
    assert ours_err <= bound, f"{what}: error {ours_err:.3e} > {factor}x plain {plain_err:.3e} + slack"
