"""The contract for non-finite values, SDPA's math backend's: a NaN anywhere among a row's visible
scores (from q, k or an additive mask) or a +inf score (from +-inf in q/k or a +inf mask entry)
makes that row's output and lse NaN, forward and backward agreeing; NaN or inf behind a bool mask
or outside the window is not seen; a row with no visible key (all masked, by a bool mask or -inf
additive entries) is output 0, lse -inf, with zero gradients.

Every kernel path runs: prefill and decode shapes, the split-KV decode, fp32/fp16/bf16 (and fp64
on CPU); test_cpu_isa.py repeats this file under each forced CPU instruction set.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import flashmod
from flashmod.reference import attention_reference

# (id, (B, Hq, Hkv, Nq, Nk, D)): prefill (several query blocks), decode (a few queries), long
# decode keys (split-KV on both devices), GQA.
SHAPES = [
    ("prefill", (1, 2, 2, 37, 70, 40)),
    ("decode", (2, 4, 2, 1, 45, 64)),
    ("decode_split", (1, 8, 2, 2, 3000, 64)),
    ("amx_shape", (1, 2, 1, 48, 64, 64)),
]


def dtypes_for(device):
    return [torch.float32, torch.bfloat16, torch.float16] + ([torch.float64] if device == "cpu" else [])


def make(device, dtype, shape):
    b, hq, hkv, nq, nk, d = shape
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    return q, k, v


def reference(q, k, v, mask=None, **kw):
    out, lse = attention_reference(q.double(), k.double(), v.double(), None if mask is None else mask, **kw)
    return out, lse


def assert_rows(out, lse, ref_out, ref_lse, dtype):
    """NaN exactly where the reference has NaN (per row, out and lse), values close elsewhere."""
    nan_rows = torch.isnan(ref_out).any(-1)
    assert torch.equal(torch.isnan(out).any(-1), nan_rows), "NaN rows differ from the reference"
    assert torch.isnan(out[nan_rows]).all(), "a NaN row must be NaN in every element"
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), "NaN lse rows differ from the reference"
    assert torch.equal(torch.isnan(lse), nan_rows), "lse must be NaN exactly on NaN rows"
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out[~nan_rows].double(), ref_out[~nan_rows], rtol=tol, atol=tol)
    lse_tol = max(tol, 2e-6)  # lse is fp32 for every dtype
    torch.testing.assert_close(lse[~nan_rows].double(), ref_lse[~nan_rows].double(), rtol=lse_tol, atol=lse_tol)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_nonfinite_nan_in_q_k_mask(device, shape):
    for dtype in dtypes_for(device):
        q, k, v = make(device, dtype, shape[1])
        nq, nk = q.shape[2], k.shape[2]
        q[0, 0, nq // 2, 3] = float("nan")  # one row of one head
        k[-1, -1, nk // 3, 0] = float("nan")  # one key: every row of its group that sees it
        mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        mask = torch.zeros(q.shape[0], q.shape[1], nq, nk, device=device, dtype=mask_dtype)
        mask[0, -1, 0, nk - 1] = float("nan")  # one (row, key) pair
        for kw in ({}, {"is_causal": True, "bottom_right": False}, {"window_left": 5, "window_right": 0}):
            out, lse = flashmod.attention_op(q, k, v, mask, **kw)
            ref_out, ref_lse = reference(q, k, v, mask, **kw)
            assert_rows(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_nonfinite_inf_in_q_k_mask(device, shape):
    for dtype in dtypes_for(device):
        q, k, v = make(device, dtype, shape[1])
        nq, nk = q.shape[2], k.shape[2]
        k[0, 0, nk // 2, 1] = float("inf")  # +inf or -inf scores (or NaN) depending on q's sign
        q[-1, -1, nq - 1, 2] = float("-inf")
        mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        mask = torch.zeros(q.shape[0], 1, nq, nk, device=device, dtype=mask_dtype)
        mask[0, 0, 0, 1] = float("inf")
        mask[-1, 0, nq // 2, 2:5] = float("-inf")  # masked keys: nothing else changes
        out, lse = flashmod.attention_op(q, k, v, mask)
        ref_out, ref_lse = reference(q, k, v, mask)
        assert_rows(out, lse, ref_out, ref_lse, dtype)
        if dtype == torch.float32 and device == "cpu":  # SDPA's math backend, the contract's source
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                sdpa = F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
            assert torch.equal(torch.isnan(out), torch.isnan(sdpa))


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_nonfinite_hidden_values_are_not_seen(device, shape):
    """NaN/inf where a bool mask, the causal rule or the window hides them change nothing."""
    for dtype in dtypes_for(device):
        q, k, v = make(device, dtype, shape[1])
        nq, nk = q.shape[2], k.shape[2]
        clean = flashmod.attention_op(q, k, v, is_causal=True)
        k2 = k.clone()
        k2[:, :, nk - 1] = float("nan")  # the last key: hidden from every row but the last (bottom-right)
        out, lse = flashmod.attention_op(q, k2, v, is_causal=True)
        ref_out, ref_lse = reference(q, k2, v, is_causal=True)
        assert_rows(out, lse, ref_out, ref_lse, dtype)
        if nq > 1:
            torch.testing.assert_close(out[:, :, : nq - 1], clean[0][:, :, : nq - 1], rtol=0, atol=0)
        bool_mask = torch.ones(nq, nk, dtype=torch.bool, device=device)
        bool_mask[:, 0] = False
        k3 = k.clone()
        k3[:, :, 0] = float("inf")
        out, lse = flashmod.attention_op(q, k3, v, bool_mask)
        ref_out, ref_lse = reference(q, k, v, bool_mask)
        assert not torch.isnan(out).any()
        assert_rows(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_nonfinite_all_masked_rows_stay_zero(device, shape):
    for dtype in dtypes_for(device):
        q, k, v = (t.requires_grad_() for t in make(device, dtype, shape[1]))
        nq, nk = q.shape[2], k.shape[2]
        mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        mask = torch.zeros(nq, nk, device=device, dtype=mask_dtype)
        mask[0] = float("-inf")  # row 0: every key -inf
        bool_mask = torch.ones(nq, nk, dtype=torch.bool, device=device)
        bool_mask[-1] = False
        for m, row in ((mask, 0), (bool_mask, nq - 1)):
            out, lse = flashmod.attention_op(q, k, v, m)
            assert (out[:, :, row] == 0).all() and torch.isneginf(lse[:, :, row]).all()
            dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
            assert (dq[:, :, row] == 0).all()
            assert not any(torch.isnan(g).any() for g in (dq, dk, dv))


def test_nonfinite_backward_agrees_with_forward(device):
    """A NaN row's gradients are NaN where the reference's autograd has NaN (dq of that row, dk/dv
    of the keys it sees), and every other gradient matches."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = make(device, dtype, (1, 2, 1, 9, 13, 8))
    q[0, 1, 4, 0] = float("nan")
    mask = torch.zeros(9, 13, device=device, dtype=dtype)
    mask[7, 11] = float("inf")
    grads = []
    for fn in (flashmod.attention_op, attention_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves, mask, is_causal=True, bottom_right=False)
        assert torch.isnan(out[0, 1, 4]).all() and torch.isnan(lse[0, 1, 4])
        grads.append(torch.autograd.grad(out.sum(), leaves))
    for name, ours, ref in zip("qkv", *grads):
        assert torch.equal(torch.isnan(ours), torch.isnan(ref)), f"d{name}: NaN pattern differs"
        assert torch.isnan(ours).any() and not torch.isnan(ours).all()
        fine = ~torch.isnan(ref)
        torch.testing.assert_close(ours[fine], ref[fine].to(ours.dtype), rtol=1e-5, atol=1e-6)


def test_nonfinite_reference_lse_is_nan_on_inf_rows():
    """The oracle's own contract: a +inf score gives lse NaN (not +inf), like the kernels."""
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    mask = torch.zeros(3, 5, dtype=torch.float64)
    mask[1, 2] = math.inf
    out, lse = attention_reference(q, k, k, mask)
    assert torch.isnan(lse[0, 0, 1]) and torch.isnan(out[0, 0, 1]).all()
    assert not torch.isnan(lse[0, 0, 0]) and not torch.isnan(lse[0, 0, 2])
