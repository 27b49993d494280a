"""Gradients with respect to an additive attention mask (a learned bias, e.g. T5's relative position
bias): attention_backward's compute_grad_mask, its reduction over the mask's broadcast dimensions,
and a tiny T5 that trains with flashmod as it does with SDPA."""

from __future__ import annotations

import os

import pytest
import torch
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference

B, HQ, HKV, NQ, NK, D = 2, 4, 2, 7, 9, 5

# (id, mask shape broadcastable to (B, Hq, Nq, Nk))
MASK_SHAPES = [
    ("full", (B, HQ, NQ, NK)),
    ("per_head_bias", (1, HQ, NQ, NK)),
    ("two_d", (NQ, NK)),
    ("key_bias", (B, 1, 1, NK)),
    ("row_bias", (HQ, NQ, 1)),
]

# (id, op options)
OPTIONS = [
    ("plain", {}),
    ("causal_softcap", {"is_causal": True, "softcap": 2.0}),
    ("window_top_left", {"window_left": 2, "window_right": 1, "bottom_right": False}),
]


def make(device, dtype, mask_shape):
    q = torch.randn(B, HQ, NQ, D, device=device, dtype=dtype)
    k = torch.randn(B, HKV, NK, D, device=device, dtype=dtype)
    v = torch.randn(B, HKV, NK, D, device=device, dtype=dtype)
    mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    mask = torch.randn(mask_shape, device=device, dtype=mask_dtype)
    return q, k, v, mask


@pytest.mark.parametrize("opts", OPTIONS, ids=[o[0] for o in OPTIONS])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=[s[0] for s in MASK_SHAPES])
def test_mask_gradient_matches_reference(device, shape, opts):
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v, mask = make(device, dtype, shape[1])
    mask[..., 0] = float("-inf")  # a masked-out key: its gradient is 0, never NaN
    w_out, w_lse = torch.randn_like(q), torch.randn(B, HQ, NQ, device=device)
    grads = []
    for fn in (flashmod.attention_op, attention_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
        out, lse = fn(*leaves, **opts[1])
        loss = (out * w_out).sum() + (torch.where(torch.isinf(lse), 0, lse) * w_lse).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    tol = {"rtol": 1e-6, "atol": 1e-6} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    for name, ours, ref in zip("q k v mask".split(), *grads):
        assert ours.shape == ref.shape and ours.dtype == ref.dtype, name
        torch.testing.assert_close(ours, ref, **tol, msg=lambda m, n=name: f"grad of {n}: {m}")
    assert grads[0][3][..., 0].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mask_gradient_low_precision(device, dtype):
    """fp16/bf16 q with an fp32 mask: the mask's gradient comes back in the mask's dtype, within the
    usual error rule against fp64."""
    q, k, v, mask = make(device, dtype, (1, HQ, NQ, NK))
    grad_out = torch.randn_like(q)

    def mask_grad(fn, q_, k_, v_, m_, compute_dtype=None):
        m_ = m_.clone().requires_grad_()
        kw = {} if compute_dtype is None else {"compute_dtype": compute_dtype}
        out = fn(q_, k_, v_, m_, is_causal=True, **kw)[0]
        (g,) = torch.autograd.grad(out, m_, grad_out.to(out.dtype))
        return g

    ours = mask_grad(flashmod.attention_op, q, k, v, mask)
    assert ours.dtype == mask.dtype
    truth = mask_grad(attention_reference, q.double(), k.double(), v.double(), mask.double())
    plain = mask_grad(attention_reference, q, k, v, mask.to(dtype), compute_dtype=dtype)
    assert_within_rule(ours, truth, plain, 3, dtype, "mask grad")


def test_gradcheck_mask(device):
    if device != "cpu":
        pytest.skip("fp64 attention runs on CPU only")
    q, k, v, _ = make(device, torch.float64, (1,))
    mask = torch.randn(HQ, 1, NK, dtype=torch.float64, requires_grad=True)
    # The op returns the mask's gradient through an fp32 buffer (the kernel's interface): fp32 tolerances.
    assert torch.autograd.gradcheck(
        lambda m: flashmod.attention_op(q, k, v, m, softcap=3.0, is_causal=True)[0], (mask,), atol=1e-5, rtol=1e-4
    )


def test_compute_grad_mask_op_contract(device):
    q, k, v, mask = make(device, torch.float32, (NQ, NK))
    out, lse = torch.ops.flashmod.attention(q, k, v, mask)
    grad_out = torch.randn_like(out)
    base = (grad_out, None, q, k, v, out, lse)
    *_, empty = torch.ops.flashmod.attention_backward(*base, mask)
    assert empty.shape == (0,) and empty.dtype == torch.float32
    *_, full = torch.ops.flashmod.attention_backward(*base, mask, None, False, True, -1, -1, 0.0, True)
    assert full.shape == (B, HQ, NQ, NK) and full.dtype == torch.float32 and full.is_contiguous()
    for bad, what in ((None, "no attn_mask"), (mask > 0, "a bool attn_mask")):
        with pytest.raises(RuntimeError, match=f"compute_grad_mask needs an additive float attn_mask, got {what}"):
            torch.ops.flashmod.attention_backward(*base, bad, None, False, True, -1, -1, 0.0, True)
    args = (*base, mask, None, True, True, -1, -1, 0.0, True)
    torch.library.opcheck(torch.ops.flashmod.attention_backward.default, args)


def test_matmul_softmax_mask_gradient(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    a = torch.randn(B, HQ, NQ, D, device=device, dtype=dtype)
    b = torch.randn(B, HKV, NK, D, device=device, dtype=dtype)
    mask = torch.randn(HQ, 1, NK, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(B, HQ, NQ, NK, device=device, dtype=dtype)
    (g,) = torch.autograd.grad((flashmod.matmul_softmax(a, b, None, False, mask) * w).sum(), mask)
    _, _, p = attention_reference(a, b, b, mask, return_probs=True)
    (g_ref,) = torch.autograd.grad((p * w).sum(), mask)
    torch.testing.assert_close(g, g_ref)


def test_tiny_t5_trains_like_sdpa():
    """A tiny T5 (learned relative position bias, which reaches attention as an additive mask that
    requires grad) trains with flashmod along SDPA's loss curve, and its bias gets SDPA's gradient."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(torch.initial_seed() % 2**31)
    base = transformers.T5ForConditionalGeneration(config).double()
    inputs = torch.randint(1, 64, (3, 11))
    labels = torch.randint(1, 64, (3, 6))
    curves, bias_grads = {}, {}
    for impl in ("sdpa", flashmod.HF_ATTN_IMPLEMENTATION):
        model = transformers.T5ForConditionalGeneration(config).double()
        model.load_state_dict(base.state_dict())
        model.set_attn_implementation(impl)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(3):
            opt.zero_grad()
            loss = model(input_ids=inputs, labels=labels).loss
            loss.backward()
            if step == 0:
                bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
                bias_grads[impl] = bias.grad.clone()
            opt.step()
            losses.append(loss.item())
        curves[impl] = losses
    sdpa, ours = curves["sdpa"], curves[flashmod.HF_ATTN_IMPLEMENTATION]
    assert bias_grads["sdpa"].abs().max() > 0
    # The mask gradient is summed in an fp32 buffer (README): within 1e-6 of the gradient's scale, not of each
    # element (a fixed atol of 1e-9 failed by 1.5e-9 on one small element, FLASHMOD_TEST_SEED=1263616748).
    scale = bias_grads["sdpa"].abs().max().item()
    torch.testing.assert_close(
        bias_grads[flashmod.HF_ATTN_IMPLEMENTATION], bias_grads["sdpa"], rtol=1e-6, atol=1e-6 * scale
    )
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(sdpa), rtol=1e-6, atol=1e-9)
    assert ours[-1] < ours[0]


def test_mask_derivatives_under_torch_func(device):
    """The mask as a differentiable input of torch.func transforms: grad, jvp, vmap(grad) and a
    second derivative."""
    from torch.func import grad, jvp, vmap

    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v, mask = make(device, dtype, (HQ, NQ, NK))
    w = torch.randn_like(q)
    tol = {"rtol": 1e-7, "atol": 1e-7} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}

    def loss(fn, dt=dtype):
        qq, kk, vv, ww = (x.to(dt) for x in (q, k, v, w))
        return lambda m: (fn(qq, kk, vv, m, is_causal=True)[0] * ww).sum()

    def second_derivative(fn, dt=dtype):
        return grad(lambda m: grad(loss(fn, dt))(m).pow(2).sum())(mask.to(dt))

    torch.testing.assert_close(grad(loss(flashmod.attention_op))(mask), grad(loss(attention_reference))(mask), **tol)
    t = torch.randn_like(mask)
    ours = jvp(lambda m: flashmod.attention_op(q, k, v, m)[0], (mask,), (t,))[1]
    ref = jvp(lambda m: attention_reference(q, k, v, m)[0], (mask,), (t,))[1]
    torch.testing.assert_close(ours, ref, **tol)
    masks = torch.randn(3, *mask.shape, device=device, dtype=dtype)
    per_sample = vmap(grad(loss(flashmod.attention_op)))(masks)
    for i in range(3):
        torch.testing.assert_close(per_sample[i], grad(loss(attention_reference))(masks[i]), **tol)
    second = second_derivative(flashmod.attention_op)
    if device == "cpu":
        torch.testing.assert_close(second, second_derivative(attention_reference), rtol=1e-5, atol=1e-6)
        return

    # fp32 on the GPU: judged as every gradient is, against fp64 (within 3x plain fp32's error).
    # A fixed atol of 1e-6 against the fp32 reference failed once by rounding alone (1.4e-6 on an
    # element of 0.0145, seed 242315579).
    truth = second_derivative(attention_reference, torch.float64)
    plain = second_derivative(attention_reference, torch.float32)
    assert_within_rule(second, truth, plain, 3.0, torch.float32, "second derivative")
