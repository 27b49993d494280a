"""The contract for non-finite values, SDPA's math backend's: a NaN anywhere among a row's visible
scores (from q, k or an additive mask) or a +inf score (from +-inf in q/k or a +inf mask entry)
makes that row's output and lse NaN, forward and backward agreeing; NaN or inf behind a bool mask
or outside the window is not seen; a row with no visible key (all masked, by a bool mask or -inf
additive entries) is output 0, lse -inf, with zero gradients. Additive entries at or below
HIDING_MASK_VALUE (HF's finfo.min, -1e9) hide their key exactly as -inf does; entries above it
(BERT's -1e4) stay numbers.

Every kernel path runs: prefill and decode shapes, the split-KV decode, fp32/fp16/bf16 (and fp64
on CPU); test_cpu_isa.py repeats this file under each forced CPU instruction set.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import HIDING_MASK_VALUE, attention_reference

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


def hiding_values(mask_dtype):
    """The threshold itself, fp16's min, -1e9 and the mask dtype's own min (HF's masks)."""
    return [HIDING_MASK_VALUE, -65504.0, -1e9, torch.finfo(mask_dtype).min]


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_nonfinite_hiding_mask_values_act_as_minus_inf(device, shape):
    """A row of only hiding values is an all-masked row (output 0, lse -inf, zero gradients, where
    the exp2 form gave NaN on CUDA and the fp32 lse gave P = 1 per key in the backward); results
    and gradients equal those of the same mask with -inf in their place, bit for bit, and match the
    fp64 reference."""
    for dtype in dtypes_for(device):
        mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        for value in hiding_values(mask_dtype):
            q, k, v = make(device, dtype, shape[1])
            nq, nk = q.shape[2], k.shape[2]
            bias = torch.randn(q.shape[0], 1, nq, nk, device=device, dtype=mask_dtype)
            hidden = torch.rand(q.shape[0], 1, nq, nk, device=device) < 0.3
            hidden[:, :, 0] = True  # row 0 of every batch: every key hidden
            results = []
            for fill in (value, -math.inf):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                out, lse = flashmod.attention_op(*leaves, bias.masked_fill(hidden, fill))
                results.append((out, lse, *torch.autograd.grad(out.float().square().sum(), leaves)))
            for name, ours, with_inf in zip(("out", "lse", "dq", "dk", "dv"), *results):
                assert torch.equal(ours, with_inf), f"{dtype} {value}: {name} differs from -inf's"
            out, lse, dq = results[0][:3]
            assert (out[:, :, 0] == 0).all() and torch.isneginf(lse[:, :, 0]).all() and (dq[:, :, 0] == 0).all()
            assert not any(torch.isnan(t).any() for t in results[0])
            ref_out, ref_lse = reference(q, k, v, bias.masked_fill(hidden, value))
            assert_rows(out, lse, ref_out, ref_lse, dtype)


def test_nonfinite_values_above_the_threshold_stay_numbers(device):
    """BERT's -1e4 on every key of a row shifts its scores and changes nothing else (exact math:
    softmax(s - 1e4) = softmax(s)); in fp32 its lse keeps 2^-10 spacing, so gradients stay close."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = (t.requires_grad_() for t in make(device, dtype, (1, 2, 1, 17, 113, 40)))
    mask = torch.randn(17, 113, device=device, dtype=dtype)
    mask[3] -= 1e4
    mask[5] = HIDING_MASK_VALUE + 8 + mask[5].clamp(-4, 4)  # just above the threshold: still numbers
    out, lse = flashmod.attention_op(q, k, v, mask)
    shifted = mask.clone()
    shifted[3] += 1e4  # the same row without the shift: same output, lse 1e4 higher
    ref_out, ref_lse = reference(q, k, v, shifted)
    # Scores near -32768 carry the spacing of their dtype there (fp32 2^-8, fp64 2^-37), as in plain
    # attention in that dtype: the rule. The truth takes each row's constant shift out first (exact:
    # softmax is shift-invariant), so even in fp64 it does not share that rounding.
    unshifted = shifted.clone()
    unshifted[5] -= HIDING_MASK_VALUE + 8
    truth, _ = reference(q.detach(), k.detach(), v.detach(), unshifted)
    plain, _ = attention_reference(q.detach(), k.detach(), v.detach(), mask, compute_dtype=dtype)
    assert_within_rule(out.detach(), truth, plain, 2.0, dtype, "out")
    torch.testing.assert_close(out[:, :, 3].double(), ref_out[:, :, 3], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close((lse[:, :, 3] + 1e4).double(), ref_lse[:, :, 3], rtol=0, atol=2e-3)
    assert (out[:, :, 5].abs().sum(-1) > 0).all() and torch.isfinite(lse[:, :, 5]).all()
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(attention_reference(*leaves, shifted.double())[0].square().sum(), leaves)
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours.double(), ref, rtol=5e-3, atol=5e-3)


def test_nonfinite_backward_agrees_with_forward(monkeypatch, device):
    """A NaN row's gradients are NaN where the reference's autograd has NaN (dq of that row, dk/dv
    of the keys it sees), and every other gradient matches; on CUDA (fp32) both with the dQ kernel
    and with dQ added from the dK/dV kernel (FLASHMOD_BWD_FUSED_DQ=0 / 2; the CPU has one backward)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = make(device, dtype, (1, 2, 1, 9, 13, 8))
    q[0, 1, 4, 0] = float("nan")
    mask = torch.zeros(9, 13, device=device, dtype=dtype)
    mask[7, 11] = float("inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, mask, is_causal=True, bottom_right=False)
    assert torch.isnan(out[0, 1, 4]).all() and torch.isnan(lse[0, 1, 4])
    ref_grads = torch.autograd.grad(out.sum(), leaves)
    for fused_dq in ("0", "2") if device == "cuda" else ("0",):
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", fused_dq)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flashmod.attention_op(*leaves, mask, is_causal=True, bottom_right=False)
        assert torch.isnan(out[0, 1, 4]).all() and torch.isnan(lse[0, 1, 4])
        grads = torch.autograd.grad(out.sum(), leaves)
        for name, ours, ref in zip("qkv", grads, ref_grads):
            assert torch.equal(torch.isnan(ours), torch.isnan(ref)), f"d{name}: NaN pattern differs ({fused_dq})"
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
