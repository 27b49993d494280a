"""Dropout in the variable-length op (flash_attn_varlen_func(dropout_p=...)). The definition: sequence
b's query i keeps key j as batch row b of a dense attention_dropout call would (rows and keys counted
from the sequence's first), so reference.dropout_keep_mask over (batch, heads, max_seqlen_q,
max_seqlen_k), cut to each sequence, gives the mask the fp64 reference drops with. Outputs and
gradients of every sequence are held to the accuracy rule against it."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference, dropout_keep_mask

VARIANTS = {
    "plain": {},
    "causal": {"is_causal": True},
    "window": {"window_left": 7, "window_right": 2},
    "softcap_causal": {"is_causal": True, "softcap": 5.0},
}
# (query lengths, key lengths) per sequence: odd sizes, an empty sequence, a single token, Nq != Nk.
LENGTHS = ([5, 0, 40, 1, 113], [17, 3, 0, 64, 203])


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _case(device, dtype, hq, hkv, d, requires_grad=False):
    lq, lk = LENGTHS

    def rows(n, h):
        return torch.randn(sum(n), h, d, dtype=dtype, device=device, requires_grad=requires_grad)

    return rows(lq, hq), rows(lk, hkv), rows(lk, hkv), _cu(lq, device), _cu(lk, device)


def _options(variant):
    o = VARIANTS[variant]
    return (None, o.get("is_causal", False), o.get("window_left", -1), o.get("window_right", -1), o.get("softcap", 0.0))


def _sequence_reference(q, k, v, keep, options, dropout_p, dtype):
    """One sequence (N, H, D) through the reference with its keep mask: (out (N, H, D), lse (H, N))."""
    scale, is_causal, wl, wr, softcap = options
    out, lse = attention_reference(
        *(t.transpose(0, 1)[None].to(dtype) for t in (q, k, v)), None, scale, is_causal, True, wl, wr, softcap,
        dropout_p=dropout_p, compute_dtype=dtype, dropout_mask=keep,
    )  # fmt: skip
    return out[0].transpose(0, 1), lse[0]


def _sequences(cq, ck):
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]), b) for b in range(cq.numel() - 1)]


def _keep_of(rng, q, cq, ck, dropout_p):
    """Each sequence's keep mask (1, Hq, Nq_b, Nk_b): the dense call's rows b cut to its lengths."""
    lq, lk = LENGTHS
    full = dropout_keep_mask(rng, (len(lq), q.shape[1], max(lq), max(lk)), dropout_p)
    return [full[b : b + 1, :, : lq[b], : lk[b]] for b in range(len(lq))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("d", [40, 59, 128])
def test_varlen_dropout_matches_the_reference_with_its_mask(device, dtype, variant, d):
    if device == "cuda" and dtype in (torch.float64, torch.float32):
        pytest.skip("the CUDA varlen op takes float16 / bfloat16 (as flash-attn)")
    dropout_p = 0.3
    q, k, v, cq, ck = _case(device, dtype, 4, 2, d)
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)
    options = _options(variant)
    lq, lk = LENGTHS
    out, lse = torch.ops.flashmod.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), *options, dropout_p, rng)
    _, lse_undropped = torch.ops.flashmod.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), *options)
    for (rq, rk, b), keep in zip(_sequences(cq, ck), _keep_of(rng, q, cq, ck, dropout_p)):
        truth, truth_lse = _sequence_reference(q[rq], k[rk], v[rk], keep, options, dropout_p, torch.float64)
        plain, _ = _sequence_reference(q[rq], k[rk], v[rk], keep, options, dropout_p, dtype)
        assert_within_rule(out[rq], truth, plain, 2, dtype, f"out of sequence {b}")
        # The row sums take the undropped probabilities: lse is dropout's own only by rounding.
        assert torch.equal(torch.isneginf(lse[:, rq]), torch.isneginf(truth_lse)), f"sequence {b}: empty rows"
        finite = torch.isfinite(truth_lse)
        assert torch.allclose(lse[:, rq][finite].double(), truth_lse[finite], atol=1e-3, rtol=0)
        assert torch.allclose(lse[:, rq], lse_undropped[:, rq], atol=1e-4, rtol=0, equal_nan=True)


def _check_gradients(device, dtype, variant, d, dropout_p=0.3):
    q, k, v, cq, ck = _case(device, dtype, 4, 2, d, requires_grad=True)
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)
    options = _options(variant)
    lq, lk = LENGTHS
    out, lse = torch.ops.flashmod.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), *options, dropout_p, rng)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isneginf(lse), 0)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    for (rq, rk, b), keep in zip(_sequences(cq, ck), _keep_of(rng, q, cq, ck, dropout_p)):
        grads = {}
        for ref_dtype in (torch.float64, dtype):
            leaves = [t[r].detach().to(ref_dtype).requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk))]
            o, lse_b = _sequence_reference(*leaves, keep, options, dropout_p, ref_dtype)
            g_l = grad_lse[:, rq].to(ref_dtype)
            seen = torch.isfinite(lse_b)
            loss = (o * grad_out[rq].to(ref_dtype)).sum() + (lse_b[seen] * g_l[seen]).sum()
            got = torch.autograd.grad(loss, leaves, allow_unused=True)
            grads[ref_dtype] = [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)]
        for name, ours, truth, plain, r in zip("qkv", (dq, dk, dv), grads[torch.float64], grads[dtype], (rq, rk, rk)):
            assert_within_rule(ours[r], truth, plain, 3, dtype, f"d{name} of sequence {b}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_varlen_dropout_gradients_match_the_reference_with_its_mask(device, dtype, variant):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA varlen op takes float16 / bfloat16 (as flash-attn)")
    _check_gradients(device, dtype, variant, 40)


@pytest.mark.cuda
@pytest.mark.parametrize("sm90", ["1", "0", "fused"], ids=["default", "portable", "fused_dq"])
@pytest.mark.parametrize("d", [59, 64, 128, 256])
@pytest.mark.parametrize("variant", ["causal", "softcap_causal", "window"])
def test_varlen_dropout_cuda_kernels(monkeypatch, sm90, d, variant):
    """The CUDA kernels' per-sequence dropout variants at each head-dim family (Hopper's backward
    variants at 64 / 128 / 256, its fused dQ variant on packed rows, FLASHMOD_BWD_FUSED_DQ=2, where
    the scores are plain and the head dim pads to 64 or 128, and the portable ones,
    FLASHMOD_DISABLE_SM90=1), fp16."""
    if sm90 == "0":
        monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    if sm90 == "fused":
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    _check_gradients("cuda", torch.float16, variant, d, dropout_p=0.2)


def test_varlen_dropout_through_flash_attn_varlen_func(device):
    """flash_attn_varlen_func draws rng_state from torch's generator: the same seed drops the same
    keys, another seed others; dropout_p = 1 drops every key (output and gradients 0, lse as without
    dropout); every sequence drops about dropout_p of its probabilities."""
    dtype = torch.bfloat16
    q, k, v, cq, ck = _case(device, dtype, 4, 2, 40, requires_grad=True)
    lq, lk = LENGTHS

    def call(p, seed):
        torch.manual_seed(seed)
        return flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), dropout_p=p, return_lse=True)

    a, lse_a = call(0.4, 1)
    b, _ = call(0.4, 1)
    c, _ = call(0.4, 2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    zero, lse_zero = call(1.0, 3)
    _, lse_plain = call(0.0, 3)
    assert torch.equal(zero, torch.zeros_like(zero))
    assert torch.allclose(lse_zero, lse_plain, atol=1e-5, equal_nan=True)
    assert torch.allclose(lse_a, lse_plain, atol=1e-5, equal_nan=True)
    grads = torch.autograd.grad(zero.float().sum() + 0 * lse_zero[torch.isfinite(lse_zero)].sum(), (q, k, v))
    for name, g in zip("qkv", grads):
        assert torch.equal(g, torch.zeros_like(g)), f"d{name} under dropout_p = 1"
    # With v = 1 a query's output is the share of its probability mass kept, scaled by 1 / (1 - p).
    ones = torch.ones_like(v)
    torch.manual_seed(4)
    kept = flashmod.flash_attn_varlen_func(q.detach(), k.detach(), ones, cq, ck, max(lq), max(lk), dropout_p=0.4)
    long_rows = slice(cq[4], cq[5])  # 113 queries against 203 keys
    mean = kept[long_rows].float().mean().item()
    assert abs(mean - 1.0) < 0.05, f"kept mass x 1 / (1 - p) averages {mean:.3f}, not ~1"


def test_varlen_dropout_rejects_what_it_cannot_run(device):
    q, k, v, cq, ck = _case(device, torch.bfloat16, 2, 2, 16)
    lq, lk = LENGTHS
    op = torch.ops.flashmod.attention_varlen
    with pytest.raises(RuntimeError, match=r"dropout_p = 0.1 > 0 needs rng_state"):
        op(q, k, v, cq, ck, max(lq), max(lk), None, False, -1, -1, 0.0, 0.1)
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=r"dropout_p must be a probability in \[0, 1\], got 1.5"):
        op(q, k, v, cq, ck, max(lq), max(lk), None, False, -1, -1, 0.0, 1.5, rng)
    with pytest.raises(RuntimeError, match=r"rng_state must be a contiguous \(2,\) int64 tensor"):
        op(q, k, v, cq, ck, max(lq), max(lk), None, False, -1, -1, 0.0, 0.1, rng.int())
    for call, message in (
        ((q, k, v, cq, ck, max(lq), max(lk), None, False, -1, -1, 0.0, 0.1), "needs rng_state"),
        ((q, k, v, cq, ck, max(lq), max(lk), None, False, -1, -1, 0.0, 0.1, rng[:1]), "rng_state must be"),
    ):
        with pytest.raises(Exception, match=message), torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in call]
            torch.ops.flashmod.attention_varlen(*fakes)
    varlen = flashmod.flash_attn_varlen_func
    with pytest.raises(NotImplementedError, match="forward-mode AD of a call with dropout_p > 0"):
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            varlen(fwAD.make_dual(q, torch.randn_like(q)), k, v, cq, ck, max(lq), max(lk), dropout_p=0.1)
    if device == "cuda":
        with pytest.raises(NotImplementedError, match="float16 or bfloat16 on CUDA"):
            varlen(q.float(), k.float(), v.float(), cq, ck, max(lq), max(lk), dropout_p=0.1)


def test_varlen_dropout_opcheck_and_compile(device):
    q, k, v, cq, ck = _case(device, torch.float16, 2, 1, 32, requires_grad=True)
    lq, lk = LENGTHS
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)
    args = (q, k, v, cq, ck, max(lq), max(lk), None, True, -1, 0, 0.0, 0.25, rng)
    torch.library.opcheck(torch.ops.flashmod.attention_varlen, args)

    def step(q, k, v):
        return flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), dropout_p=0.25, causal=True)

    torch.manual_seed(5)
    eager = step(q, k, v)
    torch.manual_seed(5)
    compiled = torch.compile(step, fullgraph=True)(q, k, v)
    assert compiled.shape == eager.shape and not torch.isnan(compiled).any()
    grads = torch.autograd.grad(compiled.float().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
