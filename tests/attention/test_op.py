"""The operator's contract: bad inputs, gradcheck, opcheck, torch.compile, and backward memory."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashmod
from flashmod.reference import attention_reference


def qkv(device, dtype=torch.float32, b=2, hq=4, hkv=2, nq=9, nk=11, d=16, requires_grad=False):
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


# (id, function of a valid (q, k, v) returning the op's args/kwargs with one thing wrong, message)
BAD_INPUTS = [
    ("q_rank", lambda q, k, v: ((q[0], k, v), {}), r"q must be a 4-D tensor .* got a 3-D tensor of shape \[4, 9, 16\]"),
    ("k_rank", lambda q, k, v: ((q, k[None], v), {}), r"k must be a 4-D tensor .* got a 5-D tensor"),
    (
        "int_dtype",
        lambda q, k, v: ((q.long(), k.long(), v.long()), {}),
        r"q must be float32, float16, bfloat16 or float64, got torch.int64",
    ),
    ("k_dtype", lambda q, k, v: ((q, k.double(), v), {}), r"k must have q's dtype torch.float32, got torch.float64"),
    ("v_dtype", lambda q, k, v: ((q, k, v.half()), {}), r"v must have q's dtype torch.float32, got torch.float16"),
    ("k_device", lambda q, k, v: ((q, k.to("meta"), v), {}), r"k must be on q's device .*, got meta"),
    ("batch", lambda q, k, v: ((q, k[:1], v[:1]), {}), r"k and v must have q's batch size 2, got k 1 and v 1"),
    ("head_dim", lambda q, k, v: ((q, k[..., :8], v), {}), r"k and v must have q's head_dim 16, got k 8 and v 16"),
    ("v_heads", lambda q, k, v: ((q, k, v[:, :1]), {}), r"v must have k's number of heads 2, got 1"),
    ("v_seqlen", lambda q, k, v: ((q, k, v[:, :, :5]), {}), r"v must have k's sequence length 11, got 5"),
    (
        "gqa_ratio",
        lambda q, k, v: ((q[:, :3], k, v), {}),
        r"q's heads must be a multiple of k's heads \(GQA/MQA\), got q heads 3 and k/v heads 2",
    ),
    (
        "mask_shape",
        lambda q, k, v: ((q, k, v, torch.ones(9, 10, dtype=torch.bool, device=q.device)), {}),
        r"attn_mask must be broadcastable to \(batch, q_heads, seqlen_q, seqlen_k\) = \[2, 4, 9, 11\], "
        r"got shape \[9, 10\]",
    ),
    (
        "mask_rank",
        lambda q, k, v: ((q, k, v, torch.ones(1, 2, 4, 9, 11, dtype=torch.bool, device=q.device)), {}),
        r"attn_mask must be broadcastable .* got shape \[1, 2, 4, 9, 11\]",
    ),
    (
        "mask_dtype",
        lambda q, k, v: ((q, k, v, torch.ones(9, 11, dtype=torch.int32, device=q.device)), {}),
        r"attn_mask must be bool or q's dtype torch.float32, got torch.int32",
    ),
    (
        "window_left",
        lambda q, k, v: ((q, k, v), {"window_left": -2}),
        r"window_left must be >= -1 \(-1 = unbounded\), got -2",
    ),
    (
        "window_right",
        lambda q, k, v: ((q, k, v), {"window_right": -5}),
        r"window_right must be >= -1 \(-1 = unbounded\), got -5",
    ),
    (
        "scale",
        lambda q, k, v: ((q, k, v), {"scale": float("nan")}),
        r"scale must be finite, got nan",
    ),
    (
        "softcap",
        lambda q, k, v: ((q, k, v), {"softcap": -1.0}),
        r"softcap must be a finite number >= 0 \(0 = off\), got -1",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_clear_error(device, case):
    _, corrupt, message = case
    q, k, v = qkv(device)
    out, lse = flashmod.attention_op(q, k, v)  # positive control: the valid call works
    assert out.shape == q.shape and torch.isfinite(out).all()
    args, kwargs = corrupt(q, k, v)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.flashmod.attention(*args, **kwargs)


@pytest.mark.parametrize("case", BAD_INPUTS[:3] + BAD_INPUTS[10:12], ids=lambda c: c[0])
def test_bad_input_raises_under_compile(case):
    """register_fake mirrors the C++ checks, so the same message comes while tracing."""
    _, corrupt, message = case
    q, k, v = qkv("cpu")
    args, kwargs = corrupt(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a, **kw: torch.ops.flashmod.attention(*a, **kw), fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(*args, **kwargs)


GRADCHECK_CASES = {
    "plain": ({}, None),
    "gqa_causal_top_left": ({"is_causal": True, "bottom_right": False}, None),
    "mqa_causal_bottom_right": ({"is_causal": True}, None),
    "window_softcap_scale": ({"window_left": 3, "window_right": 2, "softcap": 2.0, "scale": 0.7}, None),
    "bool_mask": ({}, "bool"),
    "float_mask": ({"is_causal": True, "bottom_right": False}, "float"),
}


@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck_fp64(name):
    opts, mask_kind = GRADCHECK_CASES[name]
    hkv = 1 if name.startswith("mqa") else 2
    q, k, v = qkv("cpu", torch.float64, b=2, hq=4, hkv=hkv, nq=6, nk=7, d=5, requires_grad=True)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 6, 7) > 0.3
        mask[..., 0] = True  # gradcheck needs finite outputs: keep one key per row
    elif mask_kind == "float":
        mask = torch.randn(1, 4, 6, 7, dtype=torch.float64)
    # Only `out`: lse is fp32 even for fp64 inputs, too coarse for finite differences
    # (test_lse_gradient checks its gradient against the fp64 reference instead).
    assert torch.autograd.gradcheck(
        lambda q, k, v: torch.ops.flashmod.attention(q, k, v, mask, **opts)[0], (q, k, v), eps=1e-6, atol=1e-5
    )


def opcheck_samples(device):
    samples = []
    for requires_grad in (False, True):
        q, k, v = qkv(device, requires_grad=requires_grad)
        bool_mask = torch.rand(2, 1, 9, 11, device=device) > 0.3
        float_mask = torch.randn(9, 11, device=device)
        samples += [
            ((q, k, v), {}),
            ((q, k, v), {"is_causal": True, "bottom_right": False}),
            ((q, k, v, bool_mask), {"is_causal": True}),
            ((q, k, v, float_mask), {"softcap": 3.0, "scale": 0.5}),
            ((q, k, v), {"window_left": 2, "window_right": 1}),
        ]
    return samples


def test_opcheck(device):
    for args, kwargs in opcheck_samples(device):
        torch.library.opcheck(torch.ops.flashmod.attention.default, args, kwargs)


def test_attn_mask_alone_requiring_grad_gets_its_gradient():
    # The eager fast path that skips the autograd layer when no input needs a gradient must count
    # the mask as an input.
    q, k, v = qkv("cpu")
    mask = torch.randn(9, 11, requires_grad=True)
    out, _ = flashmod.attention_op(q, k, v, mask)
    (grad,) = torch.autograd.grad(out.sum() + out.pow(2).sum(), mask)
    assert grad.shape == mask.shape and grad.abs().max() > 0


def test_no_grad_fast_path_matches_autograd_path(device):
    """Without inputs that need a gradient the wrappers skip the autograd layer (ops.no_grad_needed):
    same values, no graph; with one, the graph is there."""
    q, k, v = qkv(device)
    plain_out, plain_lse = flashmod.attention_op(q, k, v, is_causal=True)
    assert plain_out.grad_fn is None and not plain_out.requires_grad
    qg = q.clone().requires_grad_()
    out, lse = flashmod.attention_op(qg, k, v, is_causal=True)
    assert out.grad_fn is not None
    torch.testing.assert_close(out.detach(), plain_out, rtol=0, atol=0)
    torch.testing.assert_close(lse.detach(), plain_lse, rtol=0, atol=0)
    with torch.no_grad():
        assert flashmod.attention_op(qg, k, v)[0].grad_fn is None
    x = torch.randn(5, 33, device=device)
    y = flashmod.softmax(x, -1)
    assert y.grad_fn is None
    yg = flashmod.softmax(x.clone().requires_grad_(), -1)
    assert yg.grad_fn is not None
    torch.testing.assert_close(yg.detach(), y, rtol=0, atol=0)


@pytest.mark.parametrize("opts", [(False, 0.0), (True, 3.0)], ids=["plain", "causal_softcap"])
def test_eager_autograd_matches_registered_autograd(device, opts):
    """attention_op's direct AttentionFunction.apply and the op's own Autograd kernel
    (a direct torch.ops call) give the same outputs and gradients, through out and lse both."""
    is_causal, softcap = opts
    q, k, v = qkv(device, requires_grad=True)
    mask = torch.rand(9, 11, device=device) > 0.3
    args = (mask, None, is_causal, True, -1, -1, softcap)
    w_out = torch.randn(q.shape, device=device)
    w_lse = torch.randn(q.shape[:-1], device=device)
    results = []
    for call in (flashmod.attention_op, torch.ops.flashmod.attention):
        q.grad = k.grad = v.grad = None
        out, lse = call(q, k, v, *args)
        assert out.grad_fn is not None
        ((out * w_out).sum() + (lse.nan_to_num(neginf=0.0) * w_lse).sum()).backward()
        results.append((out.detach(), lse.detach(), q.grad, k.grad, v.grad))
    for ours, registered in zip(*results):
        torch.testing.assert_close(ours, registered, rtol=0, atol=0)


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


def test_backward_never_holds_an_n_by_n_tensor():
    n, d = 8192, 16
    q, k, v = qkv("cpu", b=1, hq=1, hkv=1, nq=n, nk=n, d=d, requires_grad=True)
    out, _ = flashmod.attention_op(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    with LargestAllocation() as mode:
        out.backward(grad)
    assert mode.largest < n * n // 2, f"backward allocated a tensor of {mode.largest} elements"
    # Spot-check a few rows of dq against the reference on a slice of keys it depends on.
    rows = torch.tensor([0, 1, 4095, 8191])
    q_rows = q.detach()[:, :, rows].double().requires_grad_()
    mask = torch.arange(n)[None, :] <= rows[:, None]
    ref_out, _ = attention_reference(q_rows, k.detach().double(), v.detach().double(), mask)
    (dq_ref,) = torch.autograd.grad(ref_out, q_rows, grad[:, :, rows].double())
    torch.testing.assert_close(q.grad[:, :, rows].double(), dq_ref, rtol=1e-4, atol=1e-5)


def test_forward_never_holds_an_n_by_n_tensor():
    n = 4096
    q, k, v = qkv("cpu", b=1, hq=2, hkv=1, nq=n, nk=n, d=32)
    mask = torch.ones(n, 1, dtype=torch.bool).expand(n, n)  # broadcast by strides, never copied
    with LargestAllocation() as mode:
        flashmod.attention_op(q, k, v, mask)
    assert mode.largest <= q.numel(), f"forward allocated a tensor of {mode.largest} elements"
    assert math.isfinite(mode.largest)
