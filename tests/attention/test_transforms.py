"""Every torch transform over flashmod's ops: torch.func.grad / jacrev / vjp / vmap / jvp / jacfwd,
torch.autograd.forward_ad and double backward, against the same transform of the reference math.

The op runs its fused kernels; the reference (flashmod.reference, plain torch) is the oracle. CPU runs
in fp64 (differences are rounding only); CUDA has no fp64 attention, so it runs fp32 with fp32
tolerances.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

import flashmod
from flashmod.reference import attention_reference

VMAP_SIZE = 5

# (id, op keyword arguments, mask kind)
CASES = [
    ("plain", {}, None),
    ("causal_softcap", {"is_causal": True, "softcap": 2.5}, None),
    ("window_bool_mask", {"window_left": 3, "window_right": 2}, "bool"),
    ("additive_mask", {"bottom_right": False, "is_causal": True}, "float"),
]


def dtype_for(device: str) -> torch.dtype:
    return torch.float64 if device == "cpu" else torch.float32


def tols(device: str) -> dict:
    return {"rtol": 1e-9, "atol": 1e-10} if device == "cpu" else {"rtol": 2e-4, "atol": 2e-5}


def make_problem(device, mask_kind, b=2, hq=4, hkv=2, nq=7, nk=9, d=5):
    dtype = dtype_for(device)
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(nq, nk, device=device) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(b, 1, nq, nk, device=device, dtype=dtype)
    return q, k, v, mask


def ours(q, k, v, mask, kw):
    return flashmod.attention_op(q, k, v, mask, **kw)


def direct(q, k, v, mask, kw):
    """The operator itself, positional (no wrapper)."""
    opts = {"scale": None, "is_causal": False, "bottom_right": True, "window_left": -1, "window_right": -1}
    opts.update(kw)
    return torch.ops.flashmod.attention(
        q, k, v, mask, opts["scale"], opts["is_causal"], opts["bottom_right"], opts["window_left"],
        opts["window_right"], opts.get("softcap", 0.0),
    )  # fmt: skip


def reference(q, k, v, mask, kw):
    out, lse = attention_reference(q, k, v, mask, **kw)
    return out.to(q.dtype), lse.float()


def loss_of(fn, k, v, mask, kw, w_out, w_lse):
    """A scalar of q through both outputs (lse's -inf rows count 0)."""

    def loss(q):
        out, lse = fn(q, k, v, mask, kw)
        return (out * w_out).sum() + (torch.where(torch.isinf(lse), 0, lse) * w_lse).sum().to(out.dtype)

    return loss


@pytest.mark.parametrize("call", [ours, direct], ids=["attention_op", "torch.ops"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_func_grad_jacrev_vjp(device, case, call):
    _, kw, mask_kind = case
    q, k, v, mask = make_problem(device, mask_kind)
    w_out, w_lse = torch.randn_like(q), torch.randn(q.shape[:3], device=device)
    g = grad(loss_of(call, k, v, mask, kw, w_out, w_lse))(q)
    g_ref = grad(loss_of(reference, k, v, mask, kw, w_out, w_lse))(q)
    torch.testing.assert_close(g, g_ref, **tols(device))

    small = make_problem(device, mask_kind, b=1, hq=2, hkv=1, nq=3, nk=4, d=3)
    jac = jacrev(lambda k_: call(small[0], k_, small[2], small[3], kw)[0])(small[1])
    jac_ref = jacrev(lambda k_: reference(small[0], k_, small[2], small[3], kw)[0])(small[1])
    torch.testing.assert_close(jac, jac_ref, **tols(device))

    (out, lse), vjp_fn = vjp(lambda q_, k_, v_: call(q_, k_, v_, mask, kw), q, k, v)
    (out_ref, _), vjp_ref = vjp(lambda q_, k_, v_: reference(q_, k_, v_, mask, kw), q, k, v)
    torch.testing.assert_close(out, out_ref, **tols(device))
    for a, b in zip(vjp_fn((w_out, w_lse)), vjp_ref((w_out, w_lse))):
        torch.testing.assert_close(a, b, **tols(device))


def count_kernel_calls(fn, name="flashmod::attention"):
    """``fn()`` and how many calls of operator ``name`` the profiler saw. It records the call at
    every transform level: under vmap a batching rule makes that 2 or 3 (one per level, then the
    one folded call), a per-sample loop at least 1 + the vmapped size (VMAP_SIZE = 5)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(e.count for e in prof.key_averages() if e.key == name)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_vmap_is_one_batched_call(device, case):
    """vmap over extra dims (q, k, v and the mask each batched or not) runs the kernel once."""
    _, kw, mask_kind = case
    q, k, v, mask = make_problem(device, mask_kind)
    n = VMAP_SIZE
    qs = torch.randn(n, *q.shape, device=device, dtype=q.dtype)
    vs = torch.randn(*v.shape, n, device=device, dtype=v.dtype)  # vmapped along its last dim
    masks = None if mask is None else torch.stack([mask] * n).clone()
    if mask_kind == "float":
        masks = torch.randn(n, *mask.shape, device=device, dtype=mask.dtype)
    in_dims = (0, None, -1, None if masks is None else 0)
    fn = vmap(lambda q_, k_, v_, m_: flashmod.attention_op(q_, k_, v_, m_, **kw), in_dims=in_dims)
    (out, lse), calls = count_kernel_calls(lambda: fn(qs, k, vs, masks if masks is not None else mask))
    assert calls <= 3, f"vmap ran the operator {calls} times: a per-sample fallback, not a batching rule"
    for i in range(n):
        m_i = None if masks is None else masks[i]
        out_i, lse_i = reference(qs[i], k, vs[..., i], m_i, kw)
        torch.testing.assert_close(out[i], out_i, **tols(device))
        torch.testing.assert_close(lse[i], lse_i, **tols(device))


def test_vmap_of_grad_is_per_sample_gradients(device):
    q, k, v, mask = make_problem(device, "float")
    qs = torch.randn(VMAP_SIZE, *q.shape, device=device, dtype=q.dtype)
    w = torch.randn_like(q)

    def loss(fn):
        return lambda q_: (fn(q_, k, v, mask, {"is_causal": True, "bottom_right": False})[0] * w).sum()

    (g, calls) = count_kernel_calls(lambda: vmap(grad(loss(ours)))(qs), "flashmod::attention_backward")
    assert calls <= 3
    for i in range(VMAP_SIZE):
        torch.testing.assert_close(g[i], grad(loss(reference))(qs[i]), **tols(device))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_mode(device, case):
    """torch.func.jvp and torch.autograd.forward_ad give the true tangent (never zero or None)."""
    _, kw, mask_kind = case
    q, k, v, mask = make_problem(device, mask_kind)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    (out, lse), (out_t, lse_t) = jvp(lambda *x: ours(*x, mask, kw), (q, k, v), tangents)
    _, (out_t_ref, lse_t_ref) = jvp(lambda *x: reference(*x, mask, kw), (q, k, v), tangents)
    assert out_t.abs().max() > 0
    torch.testing.assert_close(out_t, out_t_ref, **tols(device))
    torch.testing.assert_close(lse_t, lse_t_ref.nan_to_num(), **tols(device))

    for call in (ours, direct):
        with forward_ad.dual_level():
            dual = tuple(forward_ad.make_dual(t, dt) for t, dt in zip((q, k, v), tangents))
            out_d, lse_d = call(*dual, mask, kw)
            tangent = forward_ad.unpack_dual(out_d).tangent
            assert tangent is not None, "forward_ad lost the tangent"
            torch.testing.assert_close(tangent, out_t_ref, **tols(device))
            torch.testing.assert_close(forward_ad.unpack_dual(lse_d).tangent, lse_t_ref.nan_to_num(), **tols(device))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_double_backward(device, case):
    """autograd.grad(create_graph=True) twice, torch.func.grad of grad, and the Hessian by
    forward-over-reverse, all through the fused backward."""
    _, kw, mask_kind = case
    q, k, v, mask = make_problem(device, mask_kind, b=1, hq=2, hkv=1, nq=4, nk=5, d=3)
    w = torch.randn_like(q)

    def first(fn, q_, k_, v_):
        out, _ = fn(q_, k_, v_, mask, kw)
        return (out * w).sum()

    results = []
    for fn in (ours, reference):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        gq, gk, gv = torch.autograd.grad(first(fn, qg, kg, vg), (qg, kg, vg), create_graph=True)
        results.append(torch.autograd.grad((gq.pow(2).sum() + (gk * gv).sum()), (qg, kg, vg)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tols(device))

    gg = grad(lambda q_: grad(lambda x: first(ours, x, k, v))(q_).pow(2).sum())(q)
    gg_ref = grad(lambda q_: grad(lambda x: first(reference, x, k, v))(q_).pow(2).sum())(q)
    torch.testing.assert_close(gg, gg_ref, **tols(device))

    hess = jacfwd(jacrev(lambda x: first(ours, x, k, v)))(q)
    hess_ref = jacfwd(jacrev(lambda x: first(reference, x, k, v)))(q)
    torch.testing.assert_close(hess, hess_ref, **tols(device))


def test_attention_backward_op_is_differentiable(device):
    """The backward operator itself has a derivative (w.r.t. grad_out, q, k, v)."""
    q, k, v, _ = make_problem(device, None, b=1, hq=2, hkv=2, nq=3, nk=4, d=3)
    out, lse = flashmod.attention_op(q, k, v)
    do = torch.randn_like(out)

    def via_op(q_, do_):
        return torch.ops.flashmod.attention_backward(do_, None, q_, k, v, out, lse)[0]

    def via_reference(q_, do_):
        out_r, _ = attention_reference(q_, k, v)
        return torch.autograd.grad(out_r, q_, do_, create_graph=True)[0]

    jac = jacrev(via_op, argnums=(0, 1))(q, do)
    qr = q.clone().requires_grad_()
    dor = do.clone().requires_grad_()
    jac_ref = torch.autograd.functional.jacobian(via_reference, (qr, dor))
    for a, b in zip(jac, jac_ref):
        torch.testing.assert_close(a, b, **tols(device))


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_transforms(device, dim):
    dtype = dtype_for(device)
    x = torch.randn(3, 4, 6, device=device, dtype=dtype)
    x[0, 1, :] = float("-inf")  # an all -inf row: zeros, zero derivatives
    t = torch.randn_like(x)

    def ref(x_, dim):
        y = torch.softmax(x_, dim)
        return torch.where(torch.isinf(x_).all(dim, keepdim=True), 0, y)

    _, y_t = jvp(lambda x_: flashmod.softmax(x_, dim), (x,), (t,))
    _, y_t_ref = jvp(lambda x_: ref(x_, dim), (x,), (t,))
    torch.testing.assert_close(y_t, y_t_ref.nan_to_num(), **tols(device))
    w = torch.randn_like(x)
    g = grad(lambda x_: (flashmod.softmax(x_, dim) * w).sum())(x)
    g_ref = grad(lambda x_: (ref(x_, dim) * w).sum())(x)
    torch.testing.assert_close(g, g_ref.nan_to_num(), **tols(device))
    batched = vmap(lambda x_: torch.ops.flashmod.softmax(x_, dim), 1)
    y, calls = count_kernel_calls(lambda: batched(x), "flashmod::softmax")
    assert calls <= 3
    torch.testing.assert_close(y, ref(x, dim + 1 if dim >= 0 else dim).movedim(1, 0), **tols(device))
    with forward_ad.dual_level():
        y = flashmod.softmax(forward_ad.make_dual(x, t), -1)
        assert forward_ad.unpack_dual(y).tangent is not None
    xg = x[1:].clone().requires_grad_()
    (g1,) = torch.autograd.grad(flashmod.softmax(xg, -1).pow(3).sum(), xg, create_graph=True)
    (g2,) = torch.autograd.grad(g1.pow(2).sum(), xg)
    xr = x[1:].clone().requires_grad_()
    (r1,) = torch.autograd.grad(torch.softmax(xr, -1).pow(3).sum(), xr, create_graph=True)
    (r2,) = torch.autograd.grad(r1.pow(2).sum(), xr)
    torch.testing.assert_close(g2, r2, **tols(device))


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_matmul_softmax_transforms(device, mask_kind):
    dtype = dtype_for(device)
    a = torch.randn(2, 4, 5, 3, device=device, dtype=dtype)
    b = torch.randn(2, 2, 6, 3, device=device, dtype=dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(5, 6, device=device) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(5, 6, device=device, dtype=dtype)

    def ref(a_, b_):
        _, _, p = attention_reference(a_, b_, b_, mask, bottom_right=False, is_causal=True, return_probs=True)
        return p.to(a_.dtype)

    def fm(a_, b_):
        return flashmod.matmul_softmax(a_, b_, None, True, mask)

    ta, tb = torch.randn_like(a), torch.randn_like(b)
    torch.testing.assert_close(jvp(fm, (a, b), (ta, tb))[1], jvp(ref, (a, b), (ta, tb))[1], **tols(device))
    w = torch.randn(2, 4, 5, 6, device=device, dtype=dtype)
    for argnums in (0, 1):
        g = grad(lambda a_, b_: (fm(a_, b_) * w).sum(), argnums)(a, b)
        g_ref = grad(lambda a_, b_: (ref(a_, b_) * w).sum(), argnums)(a, b)
        torch.testing.assert_close(g, g_ref, **tols(device))
    a_s = torch.randn(VMAP_SIZE, *a.shape, device=device, dtype=dtype)
    p, calls = count_kernel_calls(lambda: vmap(fm, (0, None))(a_s, b), "flashmod::matmul_softmax")
    assert calls <= 3
    for i in range(VMAP_SIZE):
        torch.testing.assert_close(p[i], ref(a_s[i], b), **tols(device))
    a1, b1, w1 = a[:1, :2], b[:1, :1], w[:1, :2]
    hess = jacfwd(jacrev(lambda a_: (flashmod.matmul_softmax(a_, b1, None, True, mask) * w1).sum()))(a1)
    hess_ref = jacfwd(jacrev(lambda a_: (ref(a_, b1) * w1).sum()))(a1)
    torch.testing.assert_close(hess, hess_ref, **tols(device))
