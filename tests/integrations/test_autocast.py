"""torch.autocast: flashmod follows SDPA's rule (attention and matmul_softmax run in the autocast
dtype, whatever mix of dtypes comes in), eager, through the operator, and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashmod


def autocast_dtypes(device):
    return [torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16]


def sdpa_math(q, k, v, mask=None):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)


CALLS = {
    "attention": lambda q, k, v, m: flashmod.attention(q, k, v, m),
    "op": lambda q, k, v, m: torch.ops.flashmod.attention(q, k, v, m, None, False, False)[0],
    "compiled": torch.compile(lambda q, k, v, m: flashmod.attention(q, k, v, m), fullgraph=True, dynamic=False),
    "module": lambda q, k, v, m: flashmod.FlashAttention(layout="bhsd")(q, k, v, m),
}


@pytest.mark.parametrize("call", CALLS, ids=list(CALLS))
def test_autocast_output_dtype_and_values_like_sdpa(device, call):
    for dtype in autocast_dtypes(device):
        q = torch.randn(2, 4, 17, 40, device=device)
        k = torch.randn(2, 2, 23, 40, device=device, dtype=dtype)  # mixed: k already low precision
        v = torch.randn(2, 2, 23, 40, device=device, dtype=torch.float16 if dtype == torch.bfloat16 else dtype)
        mask = torch.randn(17, 23, device=device)
        with torch.autocast(device, dtype=dtype):
            out = CALLS[call](q, k, v, mask)
            ref = sdpa_math(q, k, v, mask)
        assert ref.dtype == dtype and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)


def test_autocast_gradients_reach_fp32_leaves(device):
    for dtype in autocast_dtypes(device):
        q, k, v = (torch.randn(1, 2, 9, 16, device=device, requires_grad=True) for _ in range(3))
        with torch.autocast(device, dtype=dtype):
            out = flashmod.attention(q, k, v, is_causal=True)
        out.float().pow(2).sum().backward()
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        with torch.autocast(device, dtype=dtype):
            ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        ref.float().pow(2).sum().backward()
        for ours, theirs in ((q, qr), (k, kr), (v, vr)):
            assert ours.grad.dtype == torch.float32
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=5e-2, atol=5e-2)


def test_autocast_leaves_fp64_alone():
    q, k, v = (torch.randn(1, 1, 5, 8, dtype=torch.float64) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flashmod.attention(q, k, v).dtype == torch.float64
        assert F.scaled_dot_product_attention(q, k, v).dtype == torch.float64


def test_autocast_off_keeps_dtypes_and_mixed_dtypes_still_raise(device):
    q = torch.randn(1, 1, 5, 8, device=device)
    k = torch.randn(1, 1, 5, 8, device=device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k must have q's dtype torch.float32, got torch.bfloat16"):
        flashmod.attention(q, k, k)
    assert flashmod.attention(q, q, q).dtype == torch.float32


def test_autocast_matmul_softmax(device):
    for dtype in autocast_dtypes(device):
        a = torch.randn(2, 4, 7, 16, device=device)
        b = torch.randn(2, 2, 9, 16, device=device, dtype=dtype)
        with torch.autocast(device, dtype=dtype):
            p = flashmod.matmul_softmax(a, b, None, True)
            p_op = torch.ops.flashmod.matmul_softmax(a, b, None, True)
        assert p.dtype == dtype and p_op.dtype == dtype
        ref = torch.softmax((a @ b.float().repeat_interleave(2, 1).transpose(-1, -2)) / 4, -1)
        ref = ref.masked_fill(~torch.ones(7, 9, dtype=torch.bool, device=device).tril(), 0)
        ref = ref / ref.sum(-1, keepdim=True)
        torch.testing.assert_close(p.float(), ref, rtol=3e-2, atol=3e-2)
