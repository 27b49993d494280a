"""flashmod.attention against the reference, on every device, over a grid of odd sizes.

Each check draws fresh random inputs and holds the result to flash-attn's rule (tests/tolerance.py):
forward error <= 2x, gradient error <= 3x the error of plain attention in the same precision.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (Nq, Nk, D): every length in {1, 17, 113, 203, 256, 1023} on both sides, every head dim in
# {32, 40, 59, 64, 111, 128, 256}, none of them a multiple of a kernel tile except on purpose.
SHAPES = [
    (1, 1, 32),
    (1, 17, 40),
    (17, 1, 59),
    (113, 203, 64),
    (203, 113, 111),
    (256, 256, 128),
    (17, 1023, 256),
    (1023, 17, 40),
    (203, 1023, 59),
    (1023, 1023, 64),
]


def padding_mask(b, hq, nq, nk, device):
    """(B, 1, 1, Nk) bool: the last keys of each batch row are padding (left unmasked: >= 1 key)."""
    lengths = torch.randint(1, nk + 1, (b,), device=device)
    return (torch.arange(nk, device=device)[None, :] < lengths[:, None])[:, None, None, :]


def random_bool_mask(b, hq, nq, nk, device):
    """(Nq, Nk) bool with some rows fully masked."""
    mask = torch.rand(nq, nk, device=device) > 0.3
    mask[::5] = False
    return mask


def additive_mask(b, hq, nq, nk, device, dtype=None):
    """(1, Hq, Nq, Nk) additive float mask with some -inf entries."""
    m = torch.randn(1, hq, nq, nk, device=device)
    m = m.masked_fill(torch.rand_like(m) < 0.2, -math.inf)
    return m


# name -> (Hq, Hkv, op options, mask factory or None, layout, mask dtype rule)
VARIANTS = {
    "plain": (4, 4, {}, None, "bhsd"),
    "causal_top_left": (4, 2, {"is_causal": True, "bottom_right": False}, None, "bhsd"),
    "causal_bottom_right_mqa": (6, 1, {"is_causal": True, "bottom_right": True}, None, "bshd"),
    "window_bottom_right": (4, 2, {"window_left": 23, "window_right": 0}, None, "bhsd"),
    "window_top_left": (4, 4, {"window_left": 7, "window_right": 11, "bottom_right": False}, None, "bshd"),
    "softcap_causal_scale": (4, 2, {"softcap": 5.0, "is_causal": True, "scale": 0.3}, None, "bhsd"),
    "padding_bool_mask_gqa": (6, 2, {}, padding_mask, "bshd"),
    "bool_mask_empty_rows": (4, 4, {"is_causal": True, "bottom_right": False}, random_bool_mask, "bhsd"),
    "additive_mask": (4, 2, {"softcap": 3.0}, additive_mask, "bhsd"),
    "fp32_additive_mask": (4, 4, {"window_left": 50, "window_right": 50}, additive_mask, "bhsd"),
}


def make_qkv(b, hq, hkv, nq, nk, d, dtype, device, layout="bhsd", requires_grad=False):
    """Random q, k, v as (B, H, S, D) tensors; for 'bshd' they are transposed (B, S, H, D) storage."""

    def one(h, n):
        if layout == "bshd":
            x = torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2)
        else:
            x = torch.randn(b, h, n, d, device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    return one(hq, nq), one(hkv, nk), one(hkv, nk)


def make_case(variant, nq, nk, d, dtype, device, b=2, requires_grad=False):
    hq, hkv, opts, mask_fn, layout = VARIANTS[variant]
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, dtype, device, layout, requires_grad)
    mask = None
    if mask_fn is not None:
        mask = mask_fn(b, hq, nq, nk, device)
        if mask.dtype != torch.bool and not variant.startswith("fp32"):
            mask = mask.to(dtype)
    return q, k, v, mask, opts


def references(q, k, v, mask, opts, dtype):
    truth = attention_reference(q, k, v, mask, compute_dtype=torch.float64, **opts)
    plain = attention_reference(q, k, v, mask, compute_dtype=dtype, **opts)
    return truth, plain


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("nq,nk,d", SHAPES)
def test_forward_matches_reference(device, dtype, variant, nq, nk, d):
    q, k, v, mask, opts = make_case(variant, nq, nk, d, dtype, device)
    out, lse = flashmod.attention_op(q, k, v, mask, **opts)
    (out_truth, lse_truth), (out_plain, lse_plain) = references(q, k, v, mask, opts, dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == q.shape[:3]
    assert_within_rule(out, out_truth, out_plain, 2, dtype, "out")
    # Our lse is fp32 from low-precision inputs; plain attention's is fp32 too (compute_dtype=fp32).
    lse_plain32 = attention_reference(q, k, v, mask, compute_dtype=torch.float32, **opts)[1]
    assert_within_rule(lse, lse_truth, lse_plain32, 2, torch.float32, "lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_truth)), "fully masked rows differ"


GRAD_SHAPES = [(1, 17, 40), (113, 203, 64), (203, 113, 59), (256, 256, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("nq,nk,d", GRAD_SHAPES)
def test_gradients_match_reference(device, dtype, variant, nq, nk, d):
    q, k, v, mask, opts = make_case(variant, nq, nk, d, dtype, device, requires_grad=True)
    out, lse = flashmod.attention_op(q, k, v, mask, **opts)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    def reference_grads(compute_dtype, cast):
        leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
        ref_out, _ = attention_reference(*leaves, mask, compute_dtype=compute_dtype, **opts)
        return torch.autograd.grad(ref_out, leaves, grad_out.to(ref_out.dtype))

    truth = reference_grads(torch.float64, torch.float64)
    plain = reference_grads(dtype, dtype)
    for name, ours, t, p in zip("qkv", grads, truth, plain):
        assert ours.dtype == dtype
        assert_within_rule(ours, t, p, 3, dtype, f"d{name}")


def test_lse_gradient(device):
    """Gradients flow through the returned lse too (d lse / d s = p)."""
    q, k, v = make_qkv(2, 4, 2, 37, 53, 40, torch.float32, device, requires_grad=True)
    mask = padding_mask(2, 4, 37, 53, device)
    out, lse = flashmod.attention_op(q, k, v, mask, is_causal=True)
    weights = torch.randn_like(lse)
    (out.square().sum() + (lse * weights).sum()).backward()
    # The same loss through the reference in fp64 (the truth) and in fp32 (plain attention), held
    # to the gradients' rule like every other gradient test.
    grads = {}
    for dtype in (torch.float64, torch.float32):
        q2, k2, v2 = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        ref_out, ref_lse = attention_reference(q2, k2, v2, mask, is_causal=True)
        (ref_out.square().sum() + (ref_lse * weights.to(dtype)).sum()).backward()
        grads[dtype] = (q2.grad, k2.grad, v2.grad)
    for name, ours, truth, plain in zip("qkv", (q, k, v), grads[torch.float64], grads[torch.float32]):
        assert_within_rule(ours.grad, truth, plain, 3, torch.float32, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_are_zero_without_nan(device, dtype):
    """Rows with no visible key: out 0, lse -inf, and zero (not NaN) gradients."""
    b, h, nq, nk, d = 2, 4, 29, 13, 40
    q, k, v = make_qkv(b, h, h, nq, nk, d, dtype, device, requires_grad=True)
    # Bottom-right causal with Nq > Nk: the first Nq - Nk queries see no key at all.
    mask = torch.rand(b, 1, nq, nk, device=device) > 0.2
    mask[:, :, -3:] = False  # and the last three rows are masked out explicitly
    out, lse = flashmod.attention_op(q, k, v, mask, is_causal=True, bottom_right=True)
    visible = mask & torch.ones(nq, nk, device=device, dtype=torch.bool).tril(nk - nq)
    empty = (~visible.any(-1)).expand(b, h, nq)
    assert empty[:, :, : nq - nk].all() and empty[:, :, -3:].all()
    assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert (out[empty] == 0).all()
    out.sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    assert (q.grad[empty] == 0).all()


def test_float_mask_all_neg_inf_row(device):
    q, k, v = make_qkv(1, 2, 2, 5, 7, 32, torch.float32, device, requires_grad=True)
    mask = torch.zeros(5, 7, device=device)
    mask[2] = -math.inf
    out, lse = flashmod.attention_op(q, k, v, mask)
    assert (out[:, :, 2] == 0).all() and torch.isneginf(lse[:, :, 2]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :, 2] == 0).all()


def layout_mask(kind, layout, b, hq, nq, nk, dtype, device):
    """A mask of `kind` (bool / additive in q's dtype / additive fp32) in `layout`: "rows" (B, 1, Nq, Nk)
    contiguous, "keys-strided" the same values stored transposed (key stride != 1), "key-padding"
    (B, 1, 1, Nk) expanded over the queries (row stride 0), "per-head" (B, Hq, Nq, Nk), "padded-rows"
    (B, 1, Nq, Nk) sliced from rows padded to a multiple of 16 keys and 16 more (16-byte aligned row
    starts whatever Nk is: the Hopper kernel stages such additive masks in shared memory, the last
    chunk of a row partly). Its hidden
    entries form a causal staircase plus random holes in the second half of the keys, so tiles are
    hidden, clear or mixed; additive masks hide with -inf, finfo(fp32).min and -1e9 alike."""
    rows = 1 if layout == "key-padding" else nq
    heads = hq if layout == "per-head" else 1
    # Holes and nonzero biases only in the second half of the keys: the first half's tiles below
    # the staircase are clear (every key shown, nothing added), which the CUDA kernels skip masking.
    second_half = torch.arange(nk, device=device) >= nk // 2
    visible = (torch.rand(b, heads, rows, nk, device=device) > 0.2) | ~second_half
    if rows > 1:
        visible &= torch.ones(rows, nk, dtype=torch.bool, device=device).tril(nk - nq)
    if kind == "bool":
        mask = visible
    else:
        hide = torch.tensor([-math.inf, torch.finfo(torch.float32).min, -1e9], device=device)
        values = torch.randn(visible.shape, device=device) * second_half
        mask = torch.where(visible, values, hide[torch.randint(0, 3, visible.shape, device=device)])
        mask = mask.to(dtype if kind == "additive" else torch.float32)
    if layout == "keys-strided":
        mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "key-padding":
        mask = mask.expand(b, 1, nq, nk)
    if layout == "padded-rows":
        padded = torch.full((*mask.shape[:-1], (nk + 15) // 16 * 16 + 16), 7, dtype=mask.dtype, device=device)
        padded[..., :nk] = mask
        mask = padded[..., :nk]
    return mask


@pytest.mark.parametrize(
    "dtype,kind",
    [(torch.float32, "bool"), (torch.float32, "additive"), (torch.bfloat16, "bool")]
    + [(torch.bfloat16, "additive"), (torch.bfloat16, "additive-fp32")],
    ids=str,
)
@pytest.mark.parametrize("layout", ["rows", "keys-strided", "key-padding", "per-head", "padded-rows"])
@pytest.mark.parametrize(
    "nq,nk,d",
    [(113, 203, 59), (203, 113, 40), (300, 300, 64), (130, 257, 96), (500, 700, 128)]
    + [(113, 256, 128), (77, 136, 64), (45, 200, 256)],  # Nk % 8 == 0: row-major masks are staged too
)
def test_mask_layouts_match_reference(device, dtype, kind, layout, nq, nk, d):
    """Every mask kind in every stride pattern the kernels read differently (the CPU transposes
    row-major blocks in registers, broadcasts a key-padding row, walks strided keys one by one and
    skips tiles the mask hides; CUDA classifies tiles as hidden, clear or mixed first), on lengths
    that leave partial vector blocks and tiles."""
    q, k, v = make_qkv(2, 4, 2, nq, nk, d, dtype, device)
    mask = layout_mask(kind, layout, 2, 4, nq, nk, dtype, device)
    out, lse = flashmod.attention_op(q, k, v, mask)
    (out_truth, lse_truth), (out_plain, _) = references(q, k, v, mask, {}, dtype)
    lse_plain32 = attention_reference(q, k, v, mask, compute_dtype=torch.float32)[1]
    assert_within_rule(out, out_truth, out_plain, 2, dtype, "out")
    assert_within_rule(lse, lse_truth, lse_plain32, 2, torch.float32, "lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_truth)), "fully masked rows differ"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "opts", [{"softcap": 3.0}, {"window_left": 40, "window_right": 9, "bottom_right": False}], ids=str
)
def test_stageable_additive_mask_with_transforms(device, d, opts):
    """A bf16 additive mask whose rows the Hopper forward stages (Nk % 8 == 0, contiguous) under a
    soft cap or a window, which that path decides per block (staged_mask.h, score_mask.h)."""
    q, k, v = make_qkv(2, 4, 2, 77, 136, d, torch.bfloat16, device)
    mask = layout_mask("additive", "per-head", 2, 4, 77, 136, torch.bfloat16, device)
    out, lse = flashmod.attention_op(q, k, v, mask, **opts)
    (out_truth, lse_truth), (out_plain, _) = references(q, k, v, mask, opts, torch.bfloat16)
    lse_plain32 = attention_reference(q, k, v, mask, compute_dtype=torch.float32, **opts)[1]
    assert_within_rule(out, out_truth, out_plain, 2, torch.bfloat16, "out")
    assert_within_rule(lse, lse_truth, lse_plain32, 2, torch.float32, "lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_truth)), "fully masked rows differ"


@pytest.mark.parametrize("b,nq,nk", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)])
def test_empty_dimensions(device, b, nq, nk):
    q, k, v = make_qkv(b, 4, 2, nq, nk, 32, torch.float32, device, requires_grad=True)
    out, lse = flashmod.attention_op(q, k, v, is_causal=True)
    assert out.shape == (b, 4, nq, 32) and lse.shape == (b, 4, nq)
    if nk == 0:
        assert (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert not torch.isnan(q.grad).any()


def test_sdpa_convention_matches_torch(device):
    q, k, v = make_qkv(2, 8, 2, 77, 77, 64, torch.float32, device)
    for is_causal in (False, True):
        ours = flashmod.attention(q, k, v, is_causal=is_causal)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    mask = torch.randn(2, 1, 77, 77, device=device)
    torch.testing.assert_close(
        flashmod.attention(q, k, v, attn_mask=mask),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        rtol=1e-5,
        atol=1e-5,
    )


def test_flash_attn_convention(device):
    """(B, S, H, D) in and out, causal aligned bottom-right (query Nq-1 sees key Nk-1)."""
    b, nq, nk, h, d = 2, 19, 45, 4, 40
    q = torch.randn(b, nq, h, d, device=device)
    k = torch.randn(b, nk, 2, d, device=device)
    v = torch.randn(b, nk, 2, d, device=device)
    out, lse = flashmod.flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softcap=4.0, return_lse=True)
    assert out.shape == (b, nq, h, d) and out.is_contiguous() and lse.shape == (b, h, nq)
    ref, ref_lse = attention_reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
        is_causal=True, bottom_right=True, window_left=9, softcap=4.0,
    )  # fmt: skip
    torch.testing.assert_close(out, ref.transpose(1, 2).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5)
    # The last query sees exactly keys Nk-1-9 .. Nk-1.
    last = (
        torch.softmax(torch.tanh(q[:, -1, 0] @ k[:, -10:, 0].transpose(-1, -2) / math.sqrt(d) / 4.0) * 4.0, -1)
        @ v[:, -10:, 0]
    )
    torch.testing.assert_close(out[:, -1, 0], last.diagonal().T if last.dim() == 3 else last, rtol=1e-5, atol=1e-5)


def test_output_keeps_query_layout(device):
    q, k, v = make_qkv(2, 4, 4, 33, 33, 64, torch.float16, device, layout="bshd")
    out, _ = flashmod.attention_op(q, k, v)
    assert out.transpose(1, 2).is_contiguous(), "a (B, S, H, D) query should give a (B, S, H, D) output"
    q2, k2, v2 = make_qkv(2, 4, 4, 33, 33, 64, torch.float16, device)
    assert flashmod.attention_op(q2, k2, v2)[0].is_contiguous()
    # A last dimension with stride != 1 is accepted (copied once), not misread.
    q3 = torch.randn(2, 4, 64, 33, device=device, dtype=torch.float16).transpose(-1, -2)
    ref = attention_reference(q3, k2, v2, compute_dtype=torch.float64)[0]
    torch.testing.assert_close(flashmod.attention_op(q3, k2, v2)[0].double(), ref, rtol=2e-3, atol=2e-3)


def test_dropout_is_applied_in_training_only(device):
    q, k, v = make_qkv(2, 4, 4, 64, 64, 32, torch.float32, device)
    plain = flashmod.attention(q, k, v)
    dropped = flashmod.attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(plain, dropped), "dropout_p > 0 must not be ignored"
    module = flashmod.FlashAttention(dropout=0.5, layout="bhsd")
    module.eval()
    torch.testing.assert_close(module(q, k, v), plain)
    module.train()
    assert not torch.allclose(module(q, k, v), plain)
    # Expectation is preserved: the mean over many draws approaches the plain output.
    mean = torch.stack([flashmod.attention(q, k, v, dropout_p=0.5) for _ in range(400)]).mean(0)
    assert (mean - plain).abs().mean() < 0.1 * plain.abs().mean()


def gradcheck_dtype(device: str) -> tuple[torch.dtype, dict]:
    """gradcheck's inputs: fp64 on CPU; fp32 on CUDA, where flashmod.attention takes no fp64, with
    a step and tolerances for fp32 (central differences at eps = 1e-3 carry about 1e-4 of rounding;
    dropping other keys in the backward than in the forward moves gradients by about 0.1)."""
    if device == "cpu":
        return torch.float64, {}
    return torch.float32, {"eps": 1e-3, "atol": 5e-3, "rtol": 5e-3}


@pytest.mark.parametrize("chunked", [True, False], ids=["row_chunks", "one_pass"])
def test_dropout_fallback_keeps_no_score_matrix(device, monkeypatch, chunked):
    """The dropout fallback (the reference) runs large calls in query-row chunks under activation
    checkpointing: autograd then holds no (B, Hq, Nq, Nk) tensor, and the backward, recomputing each
    chunk with its saved random state (the CUDA generator's on CUDA), drops the same keys: the
    gradients are those of the forward (gradcheck with the seed fixed per call), GQA, causal, a soft
    cap and an additive mask that takes a gradient included. Small limits force four chunks of 4
    rows; the one-pass path (a limit past the call) is the control that holds the score matrices."""
    monkeypatch.setattr(flashmod.reference, "DROPOUT_ONE_PASS_ELEMENTS", 200 if chunked else 1 << 30)
    monkeypatch.setattr(flashmod.reference, "BACKWARD_CHUNK_ELEMENTS", 100)
    dtype, tolerances = gradcheck_dtype(device)
    q, k, v = make_qkv(1, 2, 1, 13, 11, 4, dtype, device, requires_grad=True)
    mask = torch.randn(1, 1, 13, 11, device=device, dtype=dtype, requires_grad=True)

    def dropped(q, k, v, mask):
        torch.manual_seed(7)
        return flashmod.attention(q, k, v, mask, dropout_p=0.3, is_causal=True, softcap=2.0)

    score_sized = []

    def pack(t):
        if t.numel() >= 2 * 13 * 11:
            score_sized.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dropped(q, k, v, mask)
    assert (score_sized == []) == chunked, score_sized
    assert torch.autograd.gradcheck(dropped, (q, k, v, mask), **tolerances)
    # Dropout still drops: the expectation over draws approaches the plain output.
    plain = flashmod.attention(q, k, v, mask, is_causal=True, softcap=2.0)
    assert not torch.allclose(out, plain)
    mean = torch.stack([flashmod.attention(q, k, v, mask, 0.3, True, softcap=2.0) for _ in range(400)]).mean(0)
    assert (mean - plain).abs().mean() < 0.1 * plain.abs().mean()


@pytest.mark.parametrize("chunked", [True, False], ids=["row_chunks", "one_pass"])
def test_dropout_under_compile_fullgraph(device, monkeypatch, chunked):
    """Dropout on the reference runs as an op (flashmod::attention_dropout_reference) whose checks
    run inside it, so torch.compile(fullgraph=True) traces the call (its torch._check messages
    stopped Dynamo when the checks ran in the traced Python): the same seed gives the same output,
    the gradients are those of the forward (gradcheck through the compiled call), and a bad input
    gets the op's named error while compiling. A bias that requires grad keeps the call on the
    reference (the fused op's own compile test is test_dropout.py's)."""
    monkeypatch.setattr(flashmod.reference, "DROPOUT_ONE_PASS_ELEMENTS", 200 if chunked else 1 << 30)
    monkeypatch.setattr(flashmod.reference, "BACKWARD_CHUNK_ELEMENTS", 100)
    torch._dynamo.reset()
    dtype, tolerances = gradcheck_dtype(device)
    q, k, v = make_qkv(1, 2, 1, 13, 11, 4, dtype, device, requires_grad=True)
    bias = torch.zeros(13, 11, device=device, dtype=dtype, requires_grad=True)
    compiled = torch.compile(
        lambda q, k, v: flashmod.attention(q, k, v, bias, dropout_p=0.3, is_causal=True), fullgraph=True
    )

    def seeded(q, k, v):
        torch.manual_seed(3)
        return compiled(q, k, v)

    out = seeded(q, k, v)
    assert torch.equal(out, seeded(q, k, v))
    assert not torch.allclose(out, flashmod.attention(q, k, v, is_causal=True))
    assert torch.autograd.gradcheck(seeded, (q, k, v), **tolerances)
    with pytest.raises(Exception, match=r"flashmod.attention: k and v must have q's head_dim 4, got k "):
        compiled(q, k[..., :3], v)
