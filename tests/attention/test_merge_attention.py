"""flashmod.merge_attention: the exact merge of partial attention results over disjoint key sets."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within_rule

import flashmod
from flashmod.merge_ops import merge_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _splits(seqlen_k: int, parts: int) -> list[slice]:
    bounds = torch.linspace(0, seqlen_k, parts + 1).round().long().tolist()
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 3, 17, 40])
def test_merge_of_key_splits_equals_full_attention(device, dtype, parts):
    if dtype != torch.float32 and device == "cpu" and parts > 17:
        pytest.skip("covered by the fp32 case; keeps CI short")
    q = torch.randn(2, 3, 19, 59, device=device, dtype=dtype)
    k = torch.randn(2, 3, 203, 59, device=device, dtype=dtype)
    v = torch.randn(2, 3, 203, 59, device=device, dtype=dtype)
    outs, lses = [], []
    for keys in _splits(203, parts):
        o, lse = flashmod.attention_op(q, k[:, :, keys], v[:, :, keys])
        outs.append(o)
        lses.append(lse)
    out, lse = merge_attention(outs, lses)  # a fresh output: every element must be written
    assert not torch.isnan(out).any()
    want_out, want_lse = flashmod.attention_reference(*(t.double() for t in (q, k, v)))[:2]
    plain, _ = flashmod.attention_reference(q, k, v, compute_dtype=dtype)[:2]
    assert_within_rule(out, want_out, plain, 2.0, dtype, "merged out")
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-5, atol=1e-5)
    assert out.dtype == dtype and lse.dtype == torch.float32


def test_merge_under_torch_func_equals_full_attention(device):
    """Forward-mode AD (the op's autograd is reverse mode only: a tangent was dropped, a silent zero),
    torch.func.grad and vmap through a merge of key splits agree with attention over all keys."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = (torch.randn(1, 2, 17, 40, device=device, dtype=dtype) for _ in range(3))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))

    def merged(q, k, v):
        parts = [flashmod.attention_op(q, k[:, :, s], v[:, :, s]) for s in _splits(17, 3)]
        return merge_attention([o for o, _ in parts], [lse for _, lse in parts])[0]

    def full(q, k, v):
        return flashmod.attention_op(q, k, v)[0]

    def assert_close(got, want, problem=(q, k, v)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            return
        # The parts' lse is fp32 for fp64 inputs too (as flash-attn's): each is off by up to half
        # an fp32 ulp, so a merge weight exp(lse_s - lse) is off by up to |lse| 2^-23 relative, and
        # what it weighs by that times its magnitude. Past that, fp64 rounding.
        lse = flashmod.attention_op(*problem)[1].abs().max().item()
        atol = 1e-9 + 4 * 2.0**-24 * lse * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=atol)

    (out, tangent), (want, want_tangent) = (torch.func.jvp(f, (q, k, v), tangents) for f in (merged, full))
    assert_close(out, want)
    assert_close(tangent, want_tangent)
    grads = torch.func.grad(lambda *a: merged(*a).square().sum(), argnums=(0, 1, 2))(q, k, v)
    want_grads = torch.func.grad(lambda *a: full(*a).square().sum(), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want_grads):
        assert_close(g, w)
    stacked = [torch.stack([t, 2 * t, -t]) for t in (q, k, v)]  # three different problems
    batched = torch.func.vmap(merged)(*stacked)
    for i in range(3):
        problem = tuple(t[i] for t in stacked)
        assert_close(batched[i], full(*problem), problem)


def test_empty_partials_contribute_nothing_and_empty_rows_stay_empty(device):
    o1 = torch.randn(1, 2, 5, 8, device=device)
    l1 = torch.randn(1, 2, 5, device=device)
    l1[0, 0, 2] = float("-inf")  # partial 1 saw no key for this row
    o2 = torch.randn(1, 2, 5, 8, device=device)
    l2 = torch.randn(1, 2, 5, device=device)
    l2[0, 0, 2] = float("-inf")  # nor did partial 2: the row is empty
    l2[0, 1, 3] = float("-inf")  # only partial 1 contributes here
    out, lse = merge_attention([o1, o2], [l1, l2])
    assert (out[0, 0, 2] == 0).all() and lse[0, 0, 2] == float("-inf")
    torch.testing.assert_close(out[0, 1, 3], o1[0, 1, 3])
    torch.testing.assert_close(lse[0, 1, 3], l1[0, 1, 3])
    assert torch.isfinite(out).all()


def test_weights_sum_to_one_at_huge_lse(device):
    """Rows a huge finite additive mask hides (HF's finfo.min masks) have |lse| ~ 1e9 or more, where
    lse + log(sum) rounds to lse: the merge (and its gradients) must weigh each part relative to the
    largest lse, not to the rounded merged one, or the weights sum to 2 and the output doubles."""
    q = torch.randn(1, 2, 4, 16, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 30, 16, device=device) for _ in range(2))
    mask = torch.zeros(4, 30, device=device)
    mask[1] = -1e9  # row 1 sees every key at -1e9: the softmax is still uniform over them
    mask[2, :20] = -1e30  # the first part sees only these keys
    out_full, _ = flashmod.attention_op(q, k, v, mask)
    parts = [flashmod.attention_op(q, k[:, :, s], v[:, :, s], mask[:, s]) for s in _splits(30, 3)]
    out, _ = merge_attention([o for o, _ in parts], [lse for _, lse in parts])
    torch.testing.assert_close(out, out_full, rtol=1e-5, atol=1e-5)
    # The gradients where the scores are well conditioned in fp32 (a -1e9 shift leaves q k^T below
    # the scores' ulp, there and in the full op alike).
    rows = [0, 3]
    (g,) = torch.autograd.grad(out[:, :, rows].square().sum(), q)
    (g_full,) = torch.autograd.grad(out_full[:, :, rows].square().sum(), q)
    torch.testing.assert_close(g, g_full, rtol=1e-4, atol=1e-5)
    # Two equal parts at a huge lse: out = (o1 + o2) / 2, and the gradients are the formula's.
    for parts_lse in ([-1e30, -1e30], [1000.0, 1000.0]):
        o1, o2 = (torch.randn(1, 1, 1, 4, device=device, requires_grad=True) for _ in range(2))
        lses = [torch.full((1, 1, 1), x, device=device, requires_grad=True) for x in parts_lse]
        merged, _ = merge_attention([o1, o2], lses)
        torch.testing.assert_close(merged, (o1 + o2) / 2, rtol=1e-6, atol=1e-6)
        grad = torch.randn_like(merged)
        g1, g2, gl1, _ = torch.autograd.grad(merged, [o1, o2, *lses], grad)
        torch.testing.assert_close(g1, grad / 2)
        torch.testing.assert_close(g2, grad / 2)
        torch.testing.assert_close(gl1, ((grad * (o1 - merged)).sum(-1) / 2).detach())


def test_nan_lse_propagates(device):
    o = torch.randn(1, 1, 3, 8, device=device)
    l1 = torch.randn(1, 1, 3, device=device)
    l1[0, 0, 1] = float("nan")
    out, lse = merge_attention([o, o.clone()], [l1, torch.randn(1, 1, 3, device=device)])
    assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(lse[0, 0, 1])
    assert torch.isfinite(out[0, 0, 0]).all() and torch.isfinite(out[0, 0, 2]).all()


def test_gradients_match_autograd_of_the_formula():
    outs = [torch.randn(2, 3, 7, 5, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(2, 3, 7).requires_grad_() for _ in range(3)]  # lse is always fp32
    with torch.no_grad():
        lses[1][0, 0, 0] = float("-inf")  # a partial without visible keys for one row
    out, lse = merge_attention(outs, lses)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (grad_out, grad_lse))

    # The formula in fp64, differentiated by autograd.
    ref_outs = [o.detach().clone().requires_grad_() for o in outs]
    ref_lses = torch.stack([x.detach().double() for x in lses]).requires_grad_()
    total = torch.logsumexp(ref_lses, 0)
    weights = torch.exp(ref_lses - total)
    ref_out = sum(w[..., None] * o for w, o in zip(weights, ref_outs))
    torch.autograd.backward((ref_out, total), (grad_out, grad_lse.double()))
    for mine, ref in zip(outs, ref_outs):
        torch.testing.assert_close(mine.grad, ref.grad)
    torch.testing.assert_close(torch.stack([x.grad.double() for x in lses]), ref_lses.grad, rtol=1e-5, atol=1e-6)
    assert lses[1].grad[0, 0, 0] == 0


def test_bad_inputs_raise_clear_errors():
    o = torch.randn(1, 2, 3, 4)
    lse = torch.randn(1, 2, 3)
    with pytest.raises(RuntimeError, match="outs must hold at least one"):
        merge_attention([], [])
    with pytest.raises(RuntimeError, match="same length, got 2 outs and 1 lses"):
        merge_attention([o, o], [lse])
    with pytest.raises(RuntimeError, match=r"lses\[1\] must be float32, got torch.float64"):
        merge_attention([o, o], [lse, lse.double()])
    with pytest.raises(RuntimeError, match=r"outs\[1\] must have outs\[0\]'s shape \[1, 2, 3, 4\], got \[1, 2, 3, 5\]"):
        merge_attention([o, torch.randn(1, 2, 3, 5)], [lse, lse])
    with pytest.raises(RuntimeError, match=r"lses\[0\] must have outs\[0\]'s shape without head_dim"):
        merge_attention([o], [torch.randn(1, 2, 4)])


def test_compiles_fullgraph():
    outs = [torch.randn(1, 2, 9, 16) for _ in range(3)]
    lses = [torch.randn(1, 2, 9) for _ in range(3)]
    compiled = torch.compile(merge_attention, fullgraph=True)
    got = compiled(outs, lses)
    want = merge_attention(outs, lses)
    torch.testing.assert_close(got[0], want[0])
    torch.library.opcheck(torch.ops.flashmod.merge_attention.default, (outs, lses))
