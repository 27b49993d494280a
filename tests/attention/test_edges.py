"""SDPA's answers at the edges and clear errors everywhere else: zero heads, NestedTensors, argument
types, dropout and window values, enable_gqa, the caller's own layout and names in messages, tensor
scales, and flash-attn's rule for a window side reaching over every key."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashmod
from flashmod.reference import attention_reference


def qkv(device, b=2, hq=4, hkv=2, nq=9, nk=11, d=16, dtype=torch.float32):
    return (
        torch.randn(b, hq, nq, d, device=device, dtype=dtype),
        torch.randn(b, hkv, nk, d, device=device, dtype=dtype),
        torch.randn(b, hkv, nk, d, device=device, dtype=dtype),
    )


# --- item: H = 0 and NestedTensor -------------------------------------------------------------


@pytest.mark.parametrize("hkv", [0, 2])
def test_zero_query_heads_give_an_empty_result_like_sdpa(device, hkv):
    q = torch.randn(2, 0, 5, 8, device=device)
    k = torch.randn(2, hkv, 7, 8, device=device, requires_grad=True)
    v = torch.randn(2, hkv, 7, 8, device=device, requires_grad=True)
    out, lse = flashmod.attention(q, k, v, return_lse=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out.shape == sdpa.shape == (2, 0, 5, 8) and lse.shape == (2, 0, 5)
    out.sum().backward()
    assert (k.grad == 0).all() and (v.grad == 0).all()
    compiled = torch.compile(lambda q, k, v: flashmod.attention(q, k, v), fullgraph=True)
    assert compiled(q, k.detach(), v.detach()).shape == (2, 0, 5, 8)
    assert flashmod.matmul_softmax(q, k.detach()).shape == (2, 0, 5, 7)


def test_query_heads_without_key_heads_still_raise():
    q = torch.randn(2, 2, 5, 8)
    k = torch.randn(2, 0, 7, 8)
    with pytest.raises(
        RuntimeError, match="q's heads must be a multiple of k's heads .* got q heads 2 and k/v heads 0"
    ):
        flashmod.attention(q, k, k)


def test_jagged_nested_tensor_is_a_clear_error():
    nt = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 5, 8)], layout=torch.jagged)
    dense = torch.randn(2, 2, 4, 8)
    for call in (
        lambda: flashmod.attention(nt, nt, nt),
        lambda: flashmod.attention(dense, nt, nt),
        lambda: flashmod.flash_attn_func(nt, nt, nt),
        lambda: flashmod.FlashAttention()(nt, nt, nt),
        lambda: flashmod.attention_op(nt, nt, nt),
    ):
        with pytest.raises(NotImplementedError, match="NestedTensor.*use padded tensors with a mask"):
            call()


# --- item: validation and messages -------------------------------------------------------------


@pytest.mark.parametrize("p", [-0.1, float("nan"), 1.5, "0.1"])
def test_bad_dropout_raises(p):
    q, k, v = qkv("cpu")
    with pytest.raises(ValueError, match=r"flashmod.attention: dropout_p must be a probability in \[0, 1\]"):
        flashmod.attention(q, k, v, dropout_p=p)
    with pytest.raises(ValueError, match=r"flashmod.flash_attn_func: dropout_p must be a probability in \[0, 1\]"):
        flashmod.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=p)
    with pytest.raises(ValueError, match=r"FlashAttention: dropout must be a probability in \[0, 1\]"):
        flashmod.FlashAttention(dropout=p)


@pytest.mark.parametrize("window", [5, None, (1.7, 0.2), (1, 2, 3), (True, 0), "ab"])
def test_window_size_must_be_a_pair_of_ints(window):
    q, k, v = qkv("cpu")
    message = r"window_size must be a pair of ints \(left, right\), -1 = unbounded, got "
    with pytest.raises(TypeError, match="flashmod.attention: " + message):
        flashmod.attention(q, k, v, window_size=window)
    with pytest.raises(TypeError, match="flashmod.flash_attn_func: " + message):
        flashmod.flash_attn_func(q, k, v, window_size=window)
    with pytest.raises(TypeError, match="FlashAttention: " + message):
        flashmod.FlashAttention(window_size=window)


def test_window_size_accepts_numpy_and_lists():
    q, k, v = qkv("cpu")
    ref = flashmod.attention(q, k, v, window_size=(3, 1))
    torch.testing.assert_close(flashmod.attention(q, k, v, window_size=[np.int64(3), 1]), ref, rtol=0, atol=0)


def test_enable_gqa_false_requires_equal_heads_like_sdpa():
    q, k, v = qkv("cpu")
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=False)
    with pytest.raises(RuntimeError, match="with enable_gqa=False, key and value must have query's number of heads 4"):
        flashmod.attention(q, k, v, enable_gqa=False)
    torch.testing.assert_close(
        flashmod.attention(q, k, v, enable_gqa=True), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    )
    q2 = q[:, :2]
    torch.testing.assert_close(flashmod.attention(q2, k, v, enable_gqa=False), F.scaled_dot_product_attention(q2, k, v))


def test_bshd_errors_speak_the_callers_layout():
    q = torch.randn(5, 4, 8)
    k = v = torch.randn(1, 6, 2, 8)
    bshd = r"must be a 4-D tensor \(batch, seqlen, heads, head_dim\), got a 3-D tensor of shape \[5, 4, 8\]"
    with pytest.raises(RuntimeError, match="flashmod.flash_attn_func: q " + bshd):
        flashmod.flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="FlashAttention: q " + bshd):
        flashmod.FlashAttention(layout="bshd")(q, k, v)
    q = torch.randn(1, 7, 3, 8)  # 3 query heads over 2 kv heads
    shapes = r"got q \[1, 7, 3, 8\], k \[1, 6, 2, 8\], v \[1, 6, 2, 8\] \(batch, seqlen, heads, head_dim\)"
    with pytest.raises(RuntimeError, match=r"q's heads \(dim 2\) must be a multiple .*" + shapes):
        flashmod.flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match=r"v must have k's seqlen \(dim 1\)"):
        flashmod.FlashAttention()(torch.randn(1, 7, 2, 8), k, torch.randn(1, 5, 2, 8))


def test_key_padding_mask_errors_name_key_padding_mask():
    q = torch.randn(2, 7, 4, 8)
    k = v = torch.randn(2, 6, 2, 8)
    with pytest.raises(
        ValueError, match=r"FlashAttention: key_padding_mask must be a bool \(batch, seqlen_k\) = \[2, 6\]"
    ):
        flashmod.FlashAttention()(q, k, v, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool"):
        flashmod.FlashAttention()(q, k, v, key_padding_mask=torch.ones(2, 6))
    mha = flashmod.FlashMultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16)
    with pytest.raises(ValueError, match=r"FlashMultiheadAttention: key_padding_mask must be \(batch, S\) with S = 6"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("bad", [None, "numpy", [1.0, 2.0]])
def test_non_tensor_arguments_are_type_errors(bad):
    q, k, v = qkv("cpu")
    value = k.numpy() if bad == "numpy" else bad
    shown = "numpy.ndarray" if bad == "numpy" else type(bad).__qualname__
    with pytest.raises(TypeError, match=f"flashmod.attention: key must be a torch.Tensor, got .*{shown}"):
        flashmod.attention(q, value, v)
    with pytest.raises(TypeError, match=f"flashmod.attention: k must be a torch.Tensor, got .*{shown}"):
        flashmod.attention_op(q, value, v)
    with pytest.raises(TypeError, match=f"flashmod.flash_attn_func: k must be a torch.Tensor, got .*{shown}"):
        flashmod.flash_attn_func(q, value, v)
    with pytest.raises(TypeError, match=f"FlashAttention: v must be a torch.Tensor, got .*{shown}"):
        flashmod.FlashAttention()(q, k, value)
    with pytest.raises(TypeError, match=f"flashmod.matmul_softmax: b must be a torch.Tensor, got .*{shown}"):
        flashmod.matmul_softmax(q, value)
    if bad is not None:
        with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor or None"):
            flashmod.attention(q, k, v, attn_mask=value)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_attn_deterministic_needs_torch_deterministic_mode_on_cuda(monkeypatch, dtype):
    """deterministic=True promises a bitwise reproducible backward: on CUDA flashmod gives one under
    torch.use_deterministic_algorithms(True) (on in this suite's fixture) or FLASHMOD_BWD_FUSED_DQ=0;
    without either a call that will be differentiated raises (the Hopper backward and the fp32 one
    may add dQ up by atomics), a call that will not runs."""
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=dtype) for _ in range(3))
    grads = [t.clone().requires_grad_() for t in (q, k, v)]
    flashmod.flash_attn_func(*grads, causal=True, deterministic=True).sum().backward()
    torch.use_deterministic_algorithms(False)
    with pytest.raises(RuntimeError, match=r"deterministic=True needs torch.use_deterministic_algorithms\(True\)"):
        flashmod.flash_attn_func(*grads, causal=True, deterministic=True)
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "0")
    upstream = torch.randn_like(q)
    runs = []
    for _ in range(2):
        for t in grads:
            t.grad = None
        flashmod.flash_attn_func(*grads, causal=True, deterministic=True).backward(upstream)
        runs.append([t.grad.clone() for t in grads])
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    monkeypatch.delenv("FLASHMOD_BWD_FUSED_DQ")
    out = flashmod.flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert torch.equal(out, flashmod.flash_attn_func(q, k, v, causal=True))


def test_flash_attn_keywords_of_ported_code(device):
    """Code ported from flash-attn passes its keywords: return_attn_probs gives (out, lse, None) as
    flash-attn does without dropout, deterministic=True changes nothing where the backward is
    bitwise reproducible anyway (CPU; CUDA under the fixture's deterministic algorithms),
    return_softmax_lse is the KV-cache call's name for return_lse; alibi_slopes, which has no kernel
    here, and return_attn_probs with dropout (flash-attn's dropout pattern) raise, never ignored, also
    when passed positionally where flashmod's return_lse stands."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, n, h, 32, device=device, dtype=dtype) for n, h in ((9, 4), (11, 2), (11, 2)))
    out, lse = flashmod.flash_attn_func(q, k, v, causal=True, return_lse=True)
    got = flashmod.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, deterministic=True)
    assert len(got) == 3 and got[2] is None
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    slopes = torch.ones(4, device=device)
    with pytest.raises(NotImplementedError, match="flash_attn_func: alibi_slopes is not supported"):
        flashmod.flash_attn_func(q, k, v, alibi_slopes=slopes)
    with pytest.raises(TypeError, match="flash_attn_func: deterministic must be a bool, got str"):
        flashmod.flash_attn_func(q, k, v, deterministic="yes")
    with pytest.raises(NotImplementedError, match="return_attn_probs with dropout_p > 0"):
        flashmod.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    # flash-attn's 9th positional argument is alibi_slopes, flashmod's return_lse: a one-head slope
    # tensor there would otherwise read as True (the lse returned, the slopes dropped).
    hint = "return_lse must be a bool, got Tensor .flash-attn passes alibi_slopes in this place"
    with pytest.raises(TypeError, match=f"flash_attn_func: {hint}"):
        flashmod.flash_attn_func(q, k, v, 0.0, None, True, (-1, -1), 0.0, torch.ones(1, device=device))

    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    qv, kv_, vv = (t.reshape(-1, t.shape[2], t.shape[3])[:9] for t in (q, k, v))
    out, lse = flashmod.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 5, 5, causal=True, return_lse=True)
    got = flashmod.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 5, 5, causal=True, return_attn_probs=True)
    assert got[2] is None and torch.equal(got[0], out) and torch.equal(got[1], lse)
    with pytest.raises(NotImplementedError, match="flash_attn_varlen_func: alibi_slopes is not supported"):
        flashmod.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 5, 5, alibi_slopes=slopes)
    with pytest.raises(TypeError, match=f"flash_attn_varlen_func: {hint}"):
        flashmod.flash_attn_varlen_func(qv, kv_, vv, cu, cu, 5, 5, 0.0, None, True, (-1, -1), 0.0, slopes[:1])

    with torch.no_grad():
        kc, vc = k.clone(), v.clone()
        want = flashmod.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=7, return_lse=True)
        got = flashmod.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=7, return_softmax_lse=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: alibi_slopes is not supported"):
            flashmod.flash_attn_with_kvcache(q[:, :1], kc, vc, alibi_slopes=slopes)


def test_float32_mask_with_float64_queries_as_sdpa():
    """SDPA takes a float32 additive mask with float64 queries (fp64 runs on the CPU); so does
    flashmod.attention (the mask widened exactly), while the op keeps its contract (float64 queries
    take float64 masks) and says so."""
    q, k, v = qkv("cpu", dtype=torch.float64)
    mask = torch.randn(q.shape[2], k.shape[2]).masked_fill(torch.rand(q.shape[2], k.shape[2]) < 0.3, float("-inf"))
    got = flashmod.attention(q, k, v, attn_mask=mask)
    assert torch.equal(got, flashmod.attention(q, k, v, attn_mask=mask.double()))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"attn_mask must be bool or q's dtype torch.float64, got torch.float32"):
        flashmod.attention_op(q, k, v, mask)


def test_tensor_scale_works_eager_and_compiled(device):
    q, k, v = qkv(device)
    scale = torch.tensor(0.3, device=device)
    ref = flashmod.attention(q, k, v, scale=0.3)
    torch.testing.assert_close(flashmod.attention(q, k, v, scale=scale), ref)
    compiled = torch.compile(lambda q, k, v, s: flashmod.attention(q, k, v, scale=s), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, scale), ref, rtol=1e-5, atol=1e-6)
    learned = torch.tensor(0.3, device=device, requires_grad=True)
    out = flashmod.attention(q, k, v, scale=learned)
    (g,) = torch.autograd.grad(out.pow(2).sum(), learned)
    s_ref = torch.tensor(0.3, device=device, dtype=torch.float64, requires_grad=True)
    out_ref, _ = attention_reference(q.double(), k.double(), v.double(), scale=s_ref)
    (g_ref,) = torch.autograd.grad(out_ref.pow(2).sum(), s_ref)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="scale must be a float or a 0-d float tensor"):
        flashmod.attention(q, k, v, scale=torch.ones(2))
    for bad in (float("nan"), float("inf")):
        for grad in (False, True):
            with pytest.raises(RuntimeError, match="scale must be finite"):
                flashmod.attention(q, k, v, scale=torch.tensor(bad, device=device, requires_grad=grad))


def test_tensor_scale_carries_its_forward_mode_tangent(device):
    """A 0-d tensor scale with a forward-mode tangent (dual tensors do not require grad, so it was
    read as a float and the tangent dropped) gets the reference's jvp."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v = qkv(device, dtype=dtype)
    scale = torch.tensor(0.3, device=device, dtype=dtype)

    def ours(s):
        return flashmod.attention(q, k, v, scale=s)

    def ref(s):
        return attention_reference(q.double(), k.double(), v.double(), scale=s.double())[0]

    _, tangent = torch.func.jvp(ours, (scale,), (torch.ones_like(scale),))
    _, want = torch.func.jvp(ref, (scale,), (torch.ones_like(scale),))
    assert want.abs().max() > 0.1
    torch.testing.assert_close(tangent.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [(-1, 3), (3, -1), (5, 7), (-1, 2)])
def test_flash_attn_func_window_side_over_all_keys_is_unbounded(device, window):
    """flash-attn's mha_fwd sets a window side >= seqlen_k to -1 (unbounded)."""
    q = torch.randn(2, 10, 4, 16, device=device)
    k = torch.randn(2, 3, 2, 16, device=device)
    v = torch.randn(2, 3, 2, 16, device=device)
    out = flashmod.flash_attn_func(q, k, v, window_size=window)
    left, right = (-1 if w >= 3 else w for w in window)
    ref, _ = attention_reference(
        *(t.transpose(1, 2) for t in (q, k, v)), window_left=left, window_right=right, bottom_right=True
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    if window == (-1, 3):
        assert (out[:, :4] != 0).any(dim=-1).all(), "the first queries see every key, as in flash-attn"


@pytest.mark.parametrize("d", [40, 64, 111, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_window_right_past_every_key_changes_nothing(device, d, dtype):
    """The op keeps a right bound at or past the last key (flash_attn_func maps it to -1): with
    top-left alignment it hides no key, so the result is the unbounded call's, bit for bit.
    ring_attention puts one on its dense steps to pick the Hopper forward's tile scheduler, and
    2^40 checks that no 32-bit arithmetic truncates it (sides of Nq + Nk keys and more are
    unbounded before any kernel sees them: the next test)."""
    gen = torch.Generator(device=device).manual_seed(d)
    q = torch.randn(2, 4, 333, d, device=device, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 517, d, device=device, generator=gen).to(dtype) for _ in range(2))
    out, lse = flashmod.ops.attention_op(q, k, v, bottom_right=False)
    for window_right in (517, 600, 2**40):
        bounded, bounded_lse = flashmod.ops.attention_op(q, k, v, bottom_right=False, window_right=window_right)
        torch.testing.assert_close(bounded, out, rtol=0, atol=0, msg=f"window_right={window_right}")
        torch.testing.assert_close(bounded_lse, lse, rtol=0, atol=0, msg=f"window_right={window_right}")


@pytest.mark.parametrize("bottom_right", [False, True])
def test_window_sides_past_every_key_are_unbounded_up_to_int64s_end(device, bottom_right):
    """A side of Nq + Nk keys or more reaches every key in either alignment: it is the unbounded
    call's answer bit for bit, also at int64's end (where row + offset + side would wrap and hide
    every key) and past it (Python ints the op's int64 arguments cannot take)."""
    q, k, v = qkv(device, nq=13, nk=5)
    for causal in (False, True):
        out, lse = torch.ops.flashmod.attention(q, k, v, None, None, causal, bottom_right)
        for side in (18, 2**62, sys.maxsize):
            for wl, wr in ((side, -1), (-1, side), (side, side)):
                got, got_lse = torch.ops.flashmod.attention(q, k, v, None, None, causal, bottom_right, wl, wr)
                torch.testing.assert_close(got, out, rtol=0, atol=0, msg=f"window ({wl}, {wr})")
                torch.testing.assert_close(got_lse, lse, rtol=0, atol=0, msg=f"window ({wl}, {wr})")
    out, lse = flashmod.attention(q, k, v, return_lse=True)
    for window in ((sys.maxsize, 2**70), (2**70, -1)):
        got, got_lse = flashmod.attention(q, k, v, window_size=window, return_lse=True)
        torch.testing.assert_close(got, out, rtol=0, atol=0)
        torch.testing.assert_close(got_lse, lse, rtol=0, atol=0)
        # The dropout path (the reference) too: its lse does not depend on what is dropped.
        _, dropped_lse = flashmod.attention(q, k, v, window_size=window, dropout_p=0.5, return_lse=True)
        torch.testing.assert_close(dropped_lse, lse, rtol=1e-5, atol=1e-5)


BAD_CALLS = {
    "int dtype": (
        lambda q, k, v: (q.int(), k.int(), v.int()),
        {},
        "q must be float32, float16, bfloat16 or float64, got torch.int32",
    ),
    "mixed dtypes": (lambda q, k, v: (q.half(), k, v), {}, "k must have q's dtype"),
    "rank": (lambda q, k, v: (q[0], k[0], v[0]), {}, "q must be a 4-D tensor"),
    "gqa ratio": (lambda q, k, v: (q[:, :3], k, v), {}, "multiple of"),
    "head dim": (lambda q, k, v: (q, k[..., :8], v[..., :8]), {}, "k and v must have q's head_dim"),
    "mask shape": (lambda q, k, v: (q, k, v), {"attn_mask": torch.ones(3, 3, dtype=torch.bool)}, "attn_mask"),
    "mask dtype": (
        lambda q, k, v: (q, k, v),
        {"attn_mask": torch.zeros(9, 11, dtype=torch.int64)},
        "attn_mask must be",
    ),
    "softcap": (lambda q, k, v: (q, k, v), {"softcap": -2.0}, "softcap must be a finite number >= 0"),
    "scale": (lambda q, k, v: (q, k, v), {"scale": float("nan")}, "scale must be finite"),
    "window": (lambda q, k, v: (q, k, v), {"window_size": (-5, -7)}, "window_left must be >= -1"),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_dropout_checks_its_inputs_as_the_op_does(bad, dropout_p):
    """With dropout the reference runs instead of the op: the same bad inputs raise the same errors."""
    make, kwargs, message = BAD_CALLS[bad]
    q, k, v = make(*qkv("cpu"))
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        flashmod.attention(q, k, v, dropout_p=dropout_p, **kwargs)


def test_flash_attention_module_in_bshd_takes_flash_attns_window_rule():
    """FlashAttention(layout="bshd") answers as flash_attn_func: a side over all keys is unbounded."""
    q = torch.randn(1, 12, 2, 16)
    k, v = torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    for window in ((-1, 5), (7, -1), (6, 9), (2, 1)):
        module = flashmod.FlashAttention(window_size=window)
        torch.testing.assert_close(
            module(q, k, v), flashmod.flash_attn_func(q, k, v, window_size=window), rtol=0, atol=0
        )
