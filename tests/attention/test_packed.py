"""flash-attn's packed front doors: flash_attn_qkvpacked_func / flash_attn_kvpacked_func on
(B, S, 3|2, H, D) and their varlen forms on (total, 3|2, H, D). Each is checked against the fp64
reference by the accuracy rule (outputs 2x, gradients 3x), so a wrong slot of the stack (k read as v,
heads taken from the wrong dimension) fails; the packed gradient must arrive as one stacked tensor."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference

# Odd sizes, GQA where the layout allows, causal (bottom-right), a window and a soft cap.
OPTIONS = {
    "plain": {},
    "causal_softcap": {"causal": True, "softcap": 7.0},
    "window": {"window_size": (9, 3)},
}


def reference_bshd(q, k, v, opts, compute_dtype):
    """The reference in flash-attn's (B, S, H, D) layout: out (B, S, H, D)."""
    wl, wr = opts.get("window_size", (-1, -1))
    out, _ = attention_reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=opts.get("causal", False), bottom_right=True, window_left=wl, window_right=wr,
        softcap=opts.get("softcap", 0.0), compute_dtype=compute_dtype,
    )  # fmt: skip
    return out.transpose(1, 2)


def check_against_reference(ours, grads, leaves_of, opts, dtype):
    """ours and grads from a packed call; leaves_of(compute_dtype) gives the same q, k, v as fresh
    leaves in that dtype, with the grad_out used, so that the reference's gradients can be compared."""
    results = {}
    for compute in (torch.float64, dtype):
        q, k, v, grad_out = leaves_of(compute)
        out = reference_bshd(q, k, v, opts, compute)
        results[compute] = (out, torch.autograd.grad(out, (q, k, v), grad_out))
    (truth, truth_grads), (plain, plain_grads) = results[torch.float64], results[dtype]
    assert_within_rule(ours, truth, plain, 2, dtype, "out")
    for name, g, t, p in zip(("dq", "dk", "dv"), grads, truth_grads, plain_grads):
        assert_within_rule(g, t, p, 3, dtype, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_qkvpacked(device, dtype, case):
    opts = OPTIONS[case]
    qkv = torch.randn(2, 113, 3, 4, 59, device=device, dtype=dtype, requires_grad=True)
    out = flashmod.flash_attn_qkvpacked_func(qkv, **opts)
    assert out.shape == (2, 113, 4, 59)
    grad_out = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, grad_out)
    assert dqkv.shape == qkv.shape

    def leaves_of(compute):
        return (*(t.detach().to(compute).requires_grad_() for t in qkv.unbind(2)), grad_out.to(compute))

    check_against_reference(out, dqkv.unbind(2), leaves_of, opts, dtype)


@pytest.mark.parametrize("case", list(OPTIONS))
def test_kvpacked_gqa(device, case):
    opts, dtype = OPTIONS[case], torch.bfloat16
    q = torch.randn(2, 17, 6, 40, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(2, 203, 2, 2, 40, device=device, dtype=dtype, requires_grad=True)
    out, lse = flashmod.flash_attn_kvpacked_func(q, kv, return_lse=True, **opts)
    assert out.shape == q.shape and lse.shape == (2, 6, 17)
    grad_out = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad_out)

    def leaves_of(compute):
        k, v = kv.unbind(2)
        return (*(t.detach().to(compute).requires_grad_() for t in (q, k, v)), grad_out.to(compute))

    check_against_reference(out, (dq, *dkv.unbind(2)), leaves_of, opts, dtype)


def cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def check_sequence(out, grads, inputs, grad_out, rows_q, rows_k, opts, dtype):
    """One sequence of a varlen call: its rows of out and of the gradients against the reference
    on that sequence alone."""
    q, k, v = (t[r].detach()[None] for t, r in zip(inputs, (rows_q, rows_k, rows_k)))

    def leaves_of(compute):
        return (*(t.to(compute).requires_grad_() for t in (q, k, v)), grad_out[rows_q][None].to(compute))

    ours_grads = tuple(g[r][None] for g, r in zip(grads, (rows_q, rows_k, rows_k)))
    check_against_reference(out[rows_q][None], ours_grads, leaves_of, opts, dtype)


@pytest.mark.parametrize("case", list(OPTIONS))
def test_varlen_packed_match_each_sequence(device, case):
    """Both varlen packed forms, each sequence against the reference on that sequence alone (odd and
    empty sequences; the kv form with GQA and its own key lengths)."""
    opts, dtype = OPTIONS[case], torch.bfloat16
    lq, lk = [17, 0, 113, 1], [30, 2, 113, 9]
    qkv = torch.randn(sum(lq), 3, 4, 40, device=device, dtype=dtype, requires_grad=True)
    q = torch.randn(sum(lq), 4, 40, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(sum(lk), 2, 2, 40, device=device, dtype=dtype, requires_grad=True)
    cq, ck = cu(lq, device), cu(lk, device)
    packed = flashmod.flash_attn_varlen_qkvpacked_func(qkv, cq, max(lq), **opts)
    crossed = flashmod.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, max(lq), max(lk), **opts)
    grad_out = torch.randn_like(packed)
    (dqkv,) = torch.autograd.grad(packed, qkv, grad_out)
    dq, dkv = torch.autograd.grad(crossed, (q, kv), grad_out)
    assert dqkv.shape == qkv.shape and dkv.shape == kv.shape
    for b in range(len(lq)):
        rq, rk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if rq.start == rq.stop:
            assert packed[rq].numel() == 0
            continue
        try:
            check_sequence(packed, dqkv.unbind(1), qkv.unbind(1), grad_out, rq, rq, opts, dtype)
            check_sequence(crossed, (dq, *dkv.unbind(1)), (q, *kv.unbind(1)), grad_out, rq, rk, opts, dtype)
        except AssertionError as err:
            raise AssertionError(f"sequence {b}: {err}") from None


QKV_DIMS = r"\(batch, seqlen, 3, heads, head_dim\)"
KV_DIMS = r"\(batch, seqlen_k, 2, heads_k, head_dim\)"
VARLEN_QKV_DIMS = r"\(total, 3, heads, head_dim\)"


def test_packed_shape_errors_name_the_argument():
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(
        RuntimeError, match=rf"qkvpacked_func: qkv must be a 5-D tensor {QKV_DIMS}, got shape \[1, 5, 2, 8\]"
    ):
        flashmod.flash_attn_qkvpacked_func(q)
    with pytest.raises(RuntimeError, match=r"qkv must be a 5-D tensor .*got shape \[1, 5, 2, 2, 8\]"):
        flashmod.flash_attn_qkvpacked_func(torch.randn(1, 5, 2, 2, 8))  # k and v only
    with pytest.raises(RuntimeError, match=rf"flash_attn_kvpacked_func: kv must be a 5-D tensor {KV_DIMS}"):
        flashmod.flash_attn_kvpacked_func(q, torch.randn(1, 5, 3, 2, 8))
    with pytest.raises(TypeError, match="flash_attn_kvpacked_func: kv must be a torch.Tensor, got builtins.NoneType"):
        flashmod.flash_attn_kvpacked_func(q, None)
    with pytest.raises(RuntimeError, match=rf"varlen_qkvpacked_func: qkv must be a 4-D tensor {VARLEN_QKV_DIMS}"):
        flashmod.flash_attn_varlen_qkvpacked_func(q, cu([5], "cpu"), 5)
    # The shared checks behind them name the public function too.
    with pytest.raises(RuntimeError, match="flash_attn_kvpacked_func: q's heads .* multiple of k's"):
        flashmod.flash_attn_kvpacked_func(torch.randn(1, 5, 3, 8), torch.randn(1, 5, 2, 2, 8))
    with pytest.raises(
        ValueError, match=r"flash_attn_varlen_kvpacked_func: dropout_p must be a probability in \[0, 1\]"
    ):
        flashmod.flash_attn_varlen_kvpacked_func(
            torch.randn(5, 2, 8), torch.randn(5, 2, 2, 8), cu([5], "cpu"), cu([5], "cpu"), 5, 5, dropout_p=1.5
        )


def test_qkvpacked_under_compile_fullgraph():
    qkv = torch.randn(2, 33, 3, 2, 16)
    compiled = torch.compile(flashmod.flash_attn_qkvpacked_func, fullgraph=True)
    assert torch.equal(compiled(qkv, causal=True), flashmod.flash_attn_qkvpacked_func(qkv, causal=True))
