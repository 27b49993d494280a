"""A value head dim other than the query/key head dim (SDPA accepts it; latent-attention models use
e.g. 192 for q/k and 128 for v): forward and gradients against the reference, in both layouts,
eager and compiled, on every device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference

PAIRS = [(40, 59), (59, 40), (192, 128), (16, 8)]


def dtypes_for(device):
    return [torch.float32, torch.bfloat16] + ([torch.float64] if device == "cpu" else [torch.float16])


@pytest.mark.parametrize("dims", PAIRS, ids=[f"qk{a}_v{b}" for a, b in PAIRS])
def test_value_head_dim_forward_and_grads(device, dims):
    d_qk, d_v = dims
    for dtype in dtypes_for(device):
        q = torch.randn(2, 4, 17, d_qk, device=device, dtype=dtype)
        k = torch.randn(2, 2, 23, d_qk, device=device, dtype=dtype)
        v = torch.randn(2, 2, 23, d_v, device=device, dtype=dtype)
        mask = torch.rand(17, 23, device=device) > 0.2
        grad_out = torch.randn(2, 4, 17, d_v, device=device, dtype=dtype)
        results = {}
        for name, fn, cast in (
            ("ours", flashmod.attention_op, lambda t: t),
            ("truth", attention_reference, lambda t: t.double()),
            ("plain", lambda *a, d=dtype, **kw: attention_reference(*a, **kw, compute_dtype=d), lambda t: t),
        ):
            leaves = [cast(t).detach().requires_grad_() for t in (q, k, v)]
            out, lse = fn(*leaves, mask, is_causal=True)
            grads = torch.autograd.grad(out, leaves, cast(grad_out).to(out.dtype))
            results[name] = (out, lse, *grads)
        assert results["ours"][0].shape == (2, 4, 17, d_v) and results["ours"][0].dtype == dtype
        for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
            ours, truth, plain = (results[n][i] for n in ("ours", "truth", "plain"))
            assert ours.shape == truth.shape, what
            rule_dtype = dtype
            if what == "lse" and dtype == torch.float64:  # lse is fp32 for every input dtype
                plain, rule_dtype = truth.float(), torch.float32
            assert_within_rule(ours, truth, plain, 2 if i < 2 else 3, rule_dtype, f"{what} {dtype}")


@pytest.mark.parametrize("dims", PAIRS, ids=[f"qk{a}_v{b}" for a, b in PAIRS])
def test_value_head_dim_like_sdpa_default_scale(device, dims):
    """The default scale is 1 / sqrt(Dqk), as SDPA's, not of the padded width."""
    d_qk, d_v = dims
    q = torch.randn(1, 2, 9, d_qk, device=device)
    k = torch.randn(1, 2, 11, d_qk, device=device)
    v = torch.randn(1, 2, 11, d_v, device=device)
    sdpa = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(flashmod.attention(q, k, v), sdpa, rtol=1e-4, atol=1e-5)


def test_value_head_dim_bshd_and_compiled(device):
    q = torch.randn(2, 13, 4, 24, device=device)
    k = torch.randn(2, 15, 2, 24, device=device)
    v = torch.randn(2, 15, 2, 40, device=device)
    out = flashmod.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 13, 4, 40)
    ref, _ = attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-4, atol=1e-5)
    module = flashmod.FlashAttention(causal=True)
    torch.testing.assert_close(module(q, k, v), out, rtol=0, atol=0)
    compiled = torch.compile(lambda q, k, v: flashmod.attention(q, k, v), fullgraph=True)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    torch.testing.assert_close(compiled(qt, kt, vt), flashmod.attention(qt, kt, vt), rtol=1e-5, atol=1e-6)


def test_value_head_dim_errors_still_name_the_mismatch():
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(RuntimeError, match="k and v must have q's head_dim 16, got k 8 and v 8"):
        flashmod.attention(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
