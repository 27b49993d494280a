"""flashmod::attention_backward (the fused kernels) against fp64 autograd through the reference."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_within_rule, max_abs_err

import flashmod
from flashmod.reference import attention_reference

LOW_PRECISION = (torch.float16, torch.bfloat16)
# fp32/fp64: max error relative to the largest gradient. fp64 holds to rounding although the
# forward saves an fp32 lse: the CPU backward recomputes the lse in fp64 where the two agree.
TIGHT = {torch.float32: 2e-5, torch.float64: 1e-12}


def make_inputs(device, dtype, b, hq, hkv, nq, nk, d):
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, device=device, dtype=dtype)
    return q, k, v


def reference_grads(q, k, v, grad_out, grad_lse, dtype, **options):
    """(dq, dk, dv) by autograd through attention_reference computed in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, compute_dtype=dtype, **options)
    loss = (out * grad_out.to(dtype)).sum()
    if grad_lse is not None:
        loss = loss + (torch.where(torch.isneginf(lse), 0, lse) * grad_lse.to(dtype)).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)


def op_args(attn_mask=None, **options):
    """The options of flashmod::attention (and its backward) after q, k, v, from keyword options."""
    args = (attn_mask, options.get("scale"), options.get("is_causal", False), options.get("bottom_right", True))
    return args + (options.get("window_left", -1), options.get("window_right", -1), options.get("softcap", 0.0))


def fused_grads(q, k, v, grad_out, grad_lse, **options):
    args = op_args(**options)
    out, lse = torch.ops.flashmod.attention(q, k, v, *args)
    return torch.ops.flashmod.attention_backward(grad_out, grad_lse, q, k, v, out, lse, *args)[:3]


def draw_upstream(q, use_grad_out=True, use_grad_lse=True):
    """Fresh (grad_out, grad_lse) for q's call: zeros / None where not used."""
    b, hq, nq, _ = q.shape
    grad_out = torch.randn_like(q) if use_grad_out else torch.zeros_like(q)
    return grad_out, torch.randn(b, hq, nq, device=q.device) if use_grad_lse else None


def check_grads(q, k, v, use_grad_out=True, use_grad_lse=True, upstream=None, **options):
    """Fused gradients against fp64 autograd by the 3x rule; ``upstream`` = (grad_out, grad_lse) to
    use instead of fresh draws (tools/fuzz_backward.py keeps them to explain a failure)."""
    dtype = q.dtype
    grad_out, grad_lse = upstream if upstream is not None else draw_upstream(q, use_grad_out, use_grad_lse)
    ours = fused_grads(q, k, v, grad_out, grad_lse, **options)
    truth = reference_grads(q, k, v, grad_out, grad_lse, torch.float64, **options)
    if dtype in LOW_PRECISION:
        plain = reference_grads(q, k, v, grad_out, grad_lse, dtype, **options)
    for name, x, t, ref in zip(("dq", "dk", "dv"), ours, truth, (q, k, v)):
        assert x.shape == ref.shape and x.dtype == ref.dtype, name
        assert not torch.isnan(x).any(), f"{name}: NaN"
        if dtype in LOW_PRECISION:
            assert_within_rule(x, t, plain[("dq", "dk", "dv").index(name)], 3.0, dtype, name)
        else:
            scale = max(1.0, t.abs().max().item()) if t.numel() else 1.0
            err = max_abs_err(x, t)
            assert err <= TIGHT[dtype] * scale, f"{name}: error {err:.3e} (scale {scale:.3e})"
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("nq", "nk", "d"), [(1, 1, 40), (17, 203, 59), (113, 17, 64), (203, 113, 111), (203, 203, 128)]
)
def test_sizes(device, dtype, nq, nk, d):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("fp64 is CPU only")
    check_grads(*make_inputs(device, dtype, 1, 2, 2, nq, nk, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize(("nq", "nk"), [(113, 203), (203, 113), (200, 200)])
def test_causal(device, dtype, bottom_right, nq, nk):
    check_grads(*make_inputs(device, dtype, 1, 2, 1, nq, nk, 64), is_causal=True, bottom_right=bottom_right)


@pytest.mark.parametrize(("window_left", "window_right"), [(0, 0), (7, 3), (40, -1), (-1, 129)])
def test_window(device, window_left, window_right):
    q, k, v = make_inputs(device, torch.float32, 1, 2, 2, 203, 260, 40)
    check_grads(q, k, v, window_left=window_left, window_right=window_right, bottom_right=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap(device, dtype):
    q, k, v = make_inputs(device, dtype, 1, 2, 2, 113, 150, 64)
    check_grads(q * 3, k * 3, v, softcap=5.0, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(113, 150), (1, 2, 1, 150), (2, 1, 113, 1)])
def test_masks(device, dtype, shape):
    q, k, v = make_inputs(device, dtype, 2, 2, 2, 113, 150, 64)
    bool_mask = torch.rand(shape, device=device) > 0.3
    check_grads(q, k, v, attn_mask=bool_mask)
    additive = torch.randn(shape, device=device, dtype=dtype)
    check_grads(q, k, v, attn_mask=additive)


# 16-bit additive masks through every range of their encoding (the CPU backward widens them by bit
# operations of its own): subnormals, signed zeros, values on both sides of the hiding threshold
# (-32768 hides, the next representable value above it does not), finfo.min, -inf, and large
# finite values, at random places beside ordinary ones.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_mask_values(device, dtype):
    q, k, v = make_inputs(device, dtype, 2, 2, 2, 70, 150, 64)
    info = torch.finfo(dtype)
    above = torch.nextafter(torch.tensor(-32768.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
    specials = [info.smallest_normal / 4, -info.smallest_normal / 4, 0.0, -0.0, -32768.0, above]
    specials += [info.min, -math.inf, 40.0, -3.5, 1e-3]
    mask = torch.randn(2, 1, 70, 150, device=device, dtype=dtype)
    pick = torch.randint(0, len(specials), mask.shape, device=device)
    chosen = torch.tensor(specials, dtype=dtype, device=device)[pick]
    mask = torch.where(torch.rand(mask.shape, device=device) < 0.3, chosen, mask)
    check_grads(q, k, v, attn_mask=mask)


def test_additive_fp32_mask_for_bf16(device):
    q, k, v = make_inputs(device, torch.bfloat16, 1, 2, 2, 70, 90, 64)
    check_grads(q, k, v, attn_mask=torch.randn(70, 90, device=device))


@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (8, 1)])
def test_gqa_mqa(device, hq, hkv):
    check_grads(*make_inputs(device, torch.float32, 2, hq, hkv, 113, 150, 64), is_causal=True)


@pytest.mark.parametrize(("use_grad_out", "use_grad_lse"), [(True, False), (False, True), (True, True)])
def test_grad_out_and_grad_lse(device, use_grad_out, use_grad_lse):
    q, k, v = make_inputs(device, torch.float32, 1, 2, 2, 113, 130, 64)
    check_grads(q, k, v, use_grad_out=use_grad_out, use_grad_lse=use_grad_lse)


def test_fully_masked_rows_give_zero_gradients(device):
    q, k, v = make_inputs(device, torch.float32, 1, 2, 2, 70, 90, 64)
    mask = torch.rand(70, 90, device=device) > 0.5
    mask[5] = False
    mask[40:] = False
    dq, _, _ = check_grads(q, k, v, attn_mask=mask)
    assert torch.all(dq[:, :, 5] == 0) and torch.all(dq[:, :, 40:] == 0)


@pytest.mark.parametrize(
    "opts",
    [{"is_causal": True}, {"softcap": 5.0}, {"window_left": 40, "window_right": 3}, {"scale": 0.3}],
    ids=["causal", "softcap", "window", "scale"],
)
def test_bf16_strided_gqa(device, opts):
    """bf16 on the paths bf16 alone takes: on CPUs with AMX the products run on the tensors as they
    are (MKL's bf16 GEMM reading (B, S, H, D) rows and a row-strided slice in place; P and dS rounded
    to bf16), elsewhere on rows widened once per task. GQA 6/2, odd lengths and head dim, one row
    whose every key is masked, a one-query call; within the rule like every other dtype."""
    q = torch.randn(2, 203, 6, 59, device=device, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 333, 2, 59, device=device, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 2, 333, 80, device=device, dtype=torch.bfloat16)[..., 3:62]
    dq, dk, _ = check_grads(q, k, v, **opts)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    mask = torch.rand(203, 333, device=device) > 0.3
    mask[17] = False
    dq, _, _ = check_grads(q, k, v, attn_mask=mask, **opts)
    assert torch.all(dq[:, :, 17] == 0)
    check_grads(q[:, :, :1], k, v, **opts)


@pytest.mark.parametrize("products", ["1", "0"], ids=["brgemm", "blas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "opts",
    [{}, {"is_causal": True}, {"softcap": 5.0, "window_left": 40, "window_right": 3}, {"scale": 0.3}],
    ids=["plain", "causal", "softcap_window", "scale"],
)
def test_cpu_fp32_products_both_ways(monkeypatch, products, dtype, opts):
    """The CPU backward's fp32 products (fp32 tensors, fp16/bf16 rows widened) on oneDNN's kernel
    over transposed operands (FLASHMOD_CPU_BWD_BRGEMM=1, the default on AMD CPUs with AVX-512) and on
    the BLAS's sgemm (=0, elsewhere): (B, S, H, D) views, a row-strided V slice, GQA 6/2, odd
    lengths and head dim, several key and query blocks with partial last ones, a masked row, one
    query; each within the rule, and the same bits at 1 thread and at torch's count."""
    monkeypatch.setenv("FLASHMOD_CPU_BWD_BRGEMM", products)
    q = torch.randn(2, 203, 6, 59, dtype=dtype).transpose(1, 2)
    k = torch.randn(2, 333, 2, 59, dtype=dtype).transpose(1, 2)
    v = torch.randn(2, 2, 333, 80, dtype=dtype)[..., 3:62]
    dq, dk, dv = check_grads(q, k, v, **opts)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    mask = torch.rand(203, 333) > 0.3
    mask[17] = False
    dq, _, _ = check_grads(q, k, v, attn_mask=mask, **opts)
    assert torch.all(dq[:, :, 17] == 0)
    check_grads(q[:, :, :1], k, v, **opts)
    grad_out, grad_lse = torch.randn_like(q), torch.randn(2, 6, 203)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fused_grads(q, k, v, grad_out, grad_lse, **opts)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(single, fused_grads(q, k, v, grad_out, grad_lse, **opts)):
        assert torch.equal(a, b)


def test_strided_inputs(device):
    """(B, S, H, D) buffers viewed as (B, H, S, D), and a row-strided slice of a wider head_dim."""
    q = torch.randn(2, 113, 4, 64, device=device).transpose(1, 2)
    k = torch.randn(2, 150, 2, 64, device=device).transpose(1, 2)
    v = torch.randn(2, 2, 150, 80, device=device)[..., 8:72]
    dq, dk, dv = check_grads(q, k, v, is_causal=True)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()


@pytest.mark.parametrize(("nq", "nk"), [(0, 5), (5, 0), (0, 0)])
def test_empty(device, nq, nk):
    q, k, v = make_inputs(device, torch.float32, 1, 2, 2, nq, nk, 16)
    dq, dk, dv = check_grads(q, k, v)
    assert not dq.any() and not dk.any() and not dv.any()


def test_gradcheck(device):
    if device == "cuda":
        pytest.skip("fp64 is CPU only")
    q, k, v = (t.requires_grad_() for t in make_inputs(device, torch.float64, 1, 2, 1, 5, 7, 8))
    mask = torch.randn(5, 7, device=device, dtype=torch.float64)

    def out_only(q, k, v):
        return flashmod.ops.attention_op(q, k, v, attn_mask=mask, is_causal=True, softcap=2.0)[0]

    # out only: lse is an fp32 output, too coarse for finite differences.
    assert torch.autograd.gradcheck(out_only, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic(device, dtype):
    q, k, v = make_inputs(device, dtype, 2, 8, 2, 203, 260, 64)
    grad_out, grad_lse = torch.randn_like(q), torch.randn(2, 8, 203, device=device)
    first = fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)
    second = fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 150), (1, 2, 1, 300)], ids=["tasks", "one_task"])
def test_same_at_any_thread_count(dtype, shape):
    """Bitwise the same on 1 thread and on torch's own count: more tasks than threads, and one task
    (run inline, where the BLAS could thread itself)."""
    b, hq, hkv, n = shape
    threads = torch.get_num_threads()
    q, k, v = make_inputs("cpu", dtype, b, hq, hkv, n, n, 64)
    grad_out, grad_lse = torch.randn_like(q), torch.randn(b, hq, n)
    try:
        torch.set_num_threads(1)
        single = fused_grads(q, k, v, grad_out, grad_lse)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(single, fused_grads(q, k, v, grad_out, grad_lse)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_opcheck(device, layout):
    def tensor(h, n):
        t = torch.randn(2, n, h, 16, device=device) if layout == "bshd" else torch.randn(2, h, n, 16, device=device)
        return t.transpose(1, 2) if layout == "bshd" else t

    q, k, v = tensor(4, 9), tensor(2, 11), tensor(2, 11)
    out, lse = torch.ops.flashmod.attention(q, k, v)
    grad_out = torch.randn_like(out)
    mask = torch.randn(9, 11, device=device) > 0
    for args in [
        (grad_out, None, q, k, v, out, lse),
        (grad_out, torch.randn_like(lse), q, k, v, out, lse, mask, 0.3, True, False, 3, -1, 2.0),
    ]:
        torch.library.opcheck(torch.ops.flashmod.attention_backward.default, args)


SHAPE = r"\(batch, q_heads, seqlen_q\)"
BAD_BACKWARD_INPUTS = [
    ("out_shape", "out", lambda a: a["out"][:, :, :5], r"out must have q's shape \[1, 2, 9, 16\], got \[1, 2, 5, 16\]"),
    ("out_dtype", "out", lambda a: a["out"].double(), r"out must have q's dtype torch.float32, got torch.float64"),
    ("lse_dtype", "lse", lambda a: a["lse"].double(), r"lse must be float32, got torch.float64"),
    (
        "lse_shape",
        "lse",
        lambda a: a["lse"][:, :1],
        r"lse must have shape " + SHAPE + r" = \[1, 2, 9\], got \[1, 1, 9\]",
    ),
    ("grad_out_shape", "grad_out", lambda a: a["grad_out"][..., :8], r"grad_out must have out's shape"),
    ("grad_out_dtype", "grad_out", lambda a: a["grad_out"].half(), r"grad_out must have out's dtype torch.float32"),
    ("grad_lse_dtype", "grad_lse", lambda a: a["lse"].long(), r"grad_lse must be a floating dtype, got torch.int64"),
    ("grad_lse_shape", "grad_lse", lambda a: a["lse"][..., :3], r"grad_lse must have shape " + SHAPE),
    ("k_dtype", "k", lambda a: a["k"].double(), r"k must have q's dtype torch.float32, got torch.float64"),
]


@pytest.mark.parametrize(
    ("case", "name", "corrupt", "message"), BAD_BACKWARD_INPUTS, ids=[c[0] for c in BAD_BACKWARD_INPUTS]
)
@pytest.mark.parametrize("meta", [False, True])
def test_bad_inputs(device, case, name, corrupt, message, meta):
    q, k, v = make_inputs(device, torch.float32, 1, 2, 2, 9, 11, 16)
    out, lse = torch.ops.flashmod.attention(q, k, v)
    args = {"grad_out": torch.randn_like(out), "grad_lse": None, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    args[name] = corrupt(args)
    if meta:
        args = {name: None if t is None else t.to("meta") for name, t in args.items()}
    with pytest.raises(RuntimeError, match="flashmod.attention_backward: " + message):
        torch.ops.flashmod.attention_backward(*args.values())


def test_autograd_uses_the_fused_kernel(device):
    """Training through flashmod.attention_op reaches attention_backward and matches it."""
    q, k, v = (t.requires_grad_() for t in make_inputs(device, torch.float32, 1, 4, 2, 50, 60, 64))
    out, lse = flashmod.ops.attention_op(q, k, v, is_causal=True)
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()
    expected = fused_grads(q.detach(), k.detach(), v.detach(), grad_out, None, is_causal=True)
    for leaf, e in zip((q, k, v), expected):
        assert torch.equal(leaf.grad, e)


def test_fp64_backward_of_a_key_share_under_the_merged_lse():
    """Ring attention's backward: each share of the keys runs with the merged lse of all of them, and
    the shares' gradients sum to the whole's. The fp64 CPU backward replaces a saved lse by its own
    recomputation only where the saved one is that value rounded to fp32; a relative bound once took
    a share holding all but 1e-3 of the mass for the whole row (dq 13 % off at lse ~1000)."""
    q = torch.ones(1, 1, 4, 1, dtype=torch.float64)
    k = torch.tensor([1000.0, 1000.0, 993.0, 993.0], dtype=torch.float64).view(1, 1, 4, 1)
    v = torch.randn(1, 1, 4, 1, dtype=torch.float64)
    out, lse = flashmod.attention_op(q, k, v, scale=1.0)
    grad_out = torch.randn_like(out)

    def backward(keys):
        share_k, share_v = k[:, :, keys], v[:, :, keys]
        return torch.ops.flashmod.attention_backward(grad_out, None, q, share_k, share_v, out, lse, None, 1.0)

    whole, first, second = backward(slice(0, 4)), backward(slice(0, 2)), backward(slice(2, 4))
    # The merged lse is fp32: the shares carry its rounding (~6e-8 x 1000), nothing like 13 %.
    torch.testing.assert_close(first[0] + second[0], whole[0], rtol=1e-4, atol=1e-4 * whole[0].abs().max().item())
    torch.testing.assert_close(torch.cat([first[2], second[2]], 2), whole[2], rtol=1e-4, atol=1e-9)
