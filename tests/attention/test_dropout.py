"""Fused dropout (flashmod::attention_dropout): the generator's definition (reference.py:
dropout_keep_mask, Philox4x32-10), the kernels against the reference with the same keep mask, the
backward's regenerated choices, the edges (p = 0 and 1, rows without keys), the op's contract, and
how flashmod.attention routes dropout calls."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference, dropout_keep_mask, dropout_threshold, philox4x32_10

LOW = [torch.bfloat16, torch.float16]


def test_philox_known_answers():
    """Random123's published Philox4x32-10 vectors (its kat_vectors file)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        words = philox4x32_10(tuple(torch.tensor([w]) for w in counter), key)
        assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_mask_statistics(p):
    """Each of the eight draws of a call, each key position and each query keeps at the rate 1 - p
    (within 5 sigma), and two rng states disagree as independent draws would."""
    rng = torch.randint(0, 1 << 62, (2,))
    shape = (2, 4, 96, 320)
    keep = dropout_keep_mask(rng, shape, p).double()
    rate = 1 - dropout_threshold(p) / 65536

    def check(fractions, count):
        sigma = math.sqrt(rate * (1 - rate) / count)
        assert (fractions - rate).abs().max() < 5 * sigma, (fractions, rate)

    n = keep.numel()
    check(keep.mean().view(1), n)
    by_draw = keep.view(*shape[:3], -1, 32).unflatten(-1, (4, 8))  # (.., span, word, key % 8)
    check(by_draw.mean((0, 1, 2, 3)).flatten(), n // 32)
    check(keep.mean((0, 1, 2)), n // shape[3])
    check(keep.mean((0, 1, 3)), n // shape[2])
    other = dropout_keep_mask(rng + 1, shape, p).double()
    disagree = (keep != other).double().mean().item()
    expected = 2 * rate * (1 - rate)
    assert abs(disagree - expected) < 5 * math.sqrt(expected * (1 - expected) / n)


def _case(device, dtype, b, hq, hkv, nq, nk, d, mask_kind):
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype)
    k, v = (torch.randn(b, hkv, nk, d, device=device, dtype=dtype) for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, nq, nk, device=device) > 0.3
        mask[:, :, : min(2, nq)] = False  # rows without a visible key
    elif mask_kind == "additive":
        mask = torch.randn(1, hq, nq, nk, device=device).to(dtype)
    return q, k, v, mask


# (b, hq, hkv, nq, nk, d, options, mask): odd lengths and head dims, GQA, both causal alignments,
# a window, a soft cap, bool (with empty rows) and additive masks.
CASES = {
    "plain": (2, 4, 4, 113, 203, 64, {}, None),
    "causal_gqa": (1, 6, 2, 203, 113, 59, {"is_causal": True}, None),
    "causal_top_left": (2, 2, 1, 17, 260, 40, {"is_causal": True, "bottom_right": False}, None),
    "window_softcap": (1, 4, 2, 256, 256, 128, {"window_left": 37, "window_right": 5, "softcap": 20.0}, None),
    "bool_mask": (2, 4, 2, 130, 77, 111, {}, "bool"),
    "additive_mask": (1, 4, 4, 70, 300, 256, {"is_causal": True}, "additive"),
    "one_query": (3, 8, 2, 1, 1023, 128, {}, None),
    # Plain scores over several key blocks at D = 128 / 256: the Hopper forward's dropout variant
    # (128- and 64-key blocks) on a GPU that has it.
    "causal_d128": (1, 4, 2, 300, 333, 128, {"is_causal": True}, None),
    "plain_d256": (1, 2, 2, 150, 203, 256, {}, None),
}


def dropout_reference(q, k, v, dropout_p, keep, cotangents, compute_dtype, **opts):
    """(out, lse, (dq, dk, dv)) of the reference that drops ``keep``'s keys, computed in
    compute_dtype (an additive mask widened to fp64 there), the gradients by autograd with
    ``cotangents`` = (grad_out, grad_lse). opts: attention_op's keywords."""
    xs = tuple(t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v))
    mask = opts.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool and compute_dtype == torch.float64:
        opts = {**opts, "attn_mask": mask.double()}
    o, lse = attention_reference(
        *xs, dropout_p=dropout_p, compute_dtype=compute_dtype, dropout_mask=keep, **opts
    )  # fmt: skip
    cot = tuple(c.to(compute_dtype) for c in cotangents)
    return o, lse, torch.autograd.grad((o, lse), xs, cot)


def check_dropout(q, k, v, dropout_p, rng_state, use_grad_lse=False, upstream=None, **opts):
    """flashmod::attention_dropout's output (2x) and gradients (3x, grad_lse too if asked) against
    the fp64 reference that drops what dropout_keep_mask says, the same math in q's dtype as the
    yardstick (tests/tolerance.py). opts: attention_op's keywords; ``upstream`` = (grad_out,
    grad_lse or None) to use instead of fresh draws. Used by tools/fuzz_backward.py."""
    dtype = q.dtype
    mask = opts.get("attn_mask")
    options = (
        mask, opts.get("scale"), opts.get("is_causal", False), opts.get("bottom_right", True),
        opts.get("window_left", -1), opts.get("window_right", -1), opts.get("softcap", 0.0),
    )  # fmt: skip
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.flashmod.attention_dropout(*inputs, *options, dropout_p, rng_state)
    if upstream is not None:
        grad_out, grad_lse = upstream
    else:
        grad_out = torch.randn_like(out)
        grad_lse = torch.randn_like(lse) if use_grad_lse else None
    cotangents = (grad_out, torch.zeros_like(lse) if grad_lse is None else grad_lse)
    grads = torch.autograd.grad((out, lse), inputs, cotangents)
    keep = dropout_keep_mask(rng_state, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dropout_p)
    truth, plain = (dropout_reference(q, k, v, dropout_p, keep, cotangents, t, **opts) for t in (torch.float64, dtype))
    assert_within_rule(out, truth[0], plain[0], 2, dtype, "out")
    lse_plain32 = attention_reference(*(t.detach() for t in inputs), *options, compute_dtype=torch.float32)[1]
    assert_within_rule(lse, truth[1], lse_plain32, 2, torch.float32, "lse")
    for name, ours, t, pl in zip(("dq", "dk", "dv"), grads, truth[2], plain[2]):
        assert_within_rule(ours, t, pl, 3, dtype, name)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_dropout_matches_reference_with_its_mask(device, dtype, case):
    """Forward (2x) and gradients (3x) against the fp64 reference that drops what
    dropout_keep_mask says, the error of the same math in the inputs' precision as the yardstick."""
    b, hq, hkv, nq, nk, d, opts, mask_kind = CASES[case]
    q, k, v, mask = _case(device, dtype, b, hq, hkv, nq, nk, d, mask_kind)
    rng = torch.randint(0, 1 << 62, (2,), device=device)
    check_dropout(
        q, k, v, 0.17 if case != "plain" else 0.5, rng, use_grad_lse=case == "causal_gqa", attn_mask=mask, **opts
    )


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_portable_kernels_where_the_hopper_ones_run(monkeypatch, case):
    """On a Hopper GPU the wgmma backward runs dropout at D = 64 / 128 / 256 (the cases above);
    FLASHMOD_DISABLE_SM90=1 sends the same calls to the portable mma.sync kernels, which must hold
    the same rule. (Elsewhere the two runs take the same kernels.)"""
    monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    b, hq, hkv, nq, nk, d, opts, mask_kind = CASES[case]
    q, k, v, mask = _case("cuda", torch.bfloat16, b, hq, hkv, nq, nk, d, mask_kind)
    rng = torch.randint(0, 1 << 62, (2,), device="cuda")
    check_dropout(q, k, v, 0.3, rng, use_grad_lse=True, attn_mask=mask, **opts)


# The Hopper backward's fused dQ variant (dQ added up by atomics in the dK/dV kernel, whose dS^T
# already holds the dropped dP) takes plain dropout calls at padded head dims 64 (steps of 128
# queries, two keep words a thread) and 128. FLASHMOD_BWD_FUSED_DQ=2 takes it although the suite's
# fixture turns deterministic algorithms on. (b, hq, hkv, nq, nk, d, options)
FUSED_DQ_CASES = {
    "plain_d128": (2, 4, 2, 203, 333, 128, {}),
    "causal_d111": (1, 6, 2, 1023, 1023, 111, {"is_causal": True}),
    "causal_top_left_d97": (2, 4, 4, 17, 260, 97, {"is_causal": True, "bottom_right": False}),
    "window_d128": (1, 4, 1, 300, 300, 128, {"window_left": 70, "window_right": 5}),
    "plain_d64": (1, 4, 2, 257, 300, 64, {}),
    "causal_d40": (1, 6, 3, 1023, 1023, 40, {"is_causal": True}),
    "causal_top_left_d59": (2, 4, 1, 113, 203, 59, {"is_causal": True, "bottom_right": False}),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("case", list(FUSED_DQ_CASES))
def test_fused_dq_variant(monkeypatch, dtype, case):
    """The fused dQ variant's gradients hold the rule against the fp64 reference with the same keep
    mask, over odd lengths, GQA, both causal alignments and a window."""
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    b, hq, hkv, nq, nk, d, opts = FUSED_DQ_CASES[case]
    q, k, v, _ = _case("cuda", dtype, b, hq, hkv, nq, nk, d, None)
    rng = torch.randint(0, 1 << 62, (2,), device="cuda")
    check_dropout(q, k, v, 0.2, rng, use_grad_lse=True, **opts)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("d", "nq", "is_causal", "fused"),
    # causal: 550 queries a key of 1100
    [(128, 1100, True, True), (128, 500, False, False), (64, 1100, False, True), (64, 1100, True, False)],
)
def test_fused_dq_rule_under_dropout(monkeypatch, d, nq, is_causal, fused):
    """FLASHMOD_BWD_FUSED_DQ=1 takes the fused variant for dropout calls from 512 queries a key at
    D = 128 and from 1024 at D = 64 (backward_dispatch.h: fused_dq_min_queries), over >= 1024 keys,
    with deterministic algorithms off: its dQ then differs from the dQ kernel's in the last bits."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused variant is a Hopper kernel")
    torch.use_deterministic_algorithms(False)
    q, k, v, _ = _case("cuda", torch.bfloat16, 1, 4, 2, nq, 1100, d, None)
    q.requires_grad_()
    grad_out, rng = torch.randn_like(q), torch.randint(0, 1 << 62, (2,), device="cuda")

    def dq(knob):
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", knob)
        out, _ = torch.ops.flashmod.attention_dropout(q, k, v, None, None, is_causal, True, -1, -1, 0.0, 0.2, rng)
        return torch.autograd.grad(out, q, grad_out)[0]

    assert torch.equal(dq("1"), dq("0")) != fused


@pytest.mark.cuda
@pytest.mark.parametrize("fused_dq", ["0", "2"])
def test_cuda_graph_replays_draw_new_masks(monkeypatch, fused_dq):
    """Forward and backward captured in a CUDA graph with rng_state drawn inside it: torch's
    generator advances on every replay, so each replay drops other keys, and what a replay returns
    is an eager call's with that replay's rng_state (bitwise; dQ of the fused variant, summed by
    atomics in no fixed order, to rounding)."""
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", fused_dq)
    q, k, v, _ = _case("cuda", torch.bfloat16, 2, 4, 2, 203, 300, 128, None)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    grad_out = torch.randn_like(q)

    def step(rng):
        out, _ = torch.ops.flashmod.attention_dropout(*inputs, None, None, True, True, -1, -1, 0.0, 0.3, rng)
        return (out, *torch.autograd.grad(out, inputs, grad_out))

    def drawn_step():
        rng = torch.randint(0, 1 << 62, (2,), device="cuda")
        return (rng, *step(rng))

    side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch's graph docs ask
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        drawn_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = drawn_step()
    states = []
    for _ in range(3):
        graph.replay()
        rng = captured[0].clone()
        states.append(rng)
        eager = step(rng)
        for name, x, y in zip(("out", "dq", "dk", "dv"), captured[1:], eager):
            if name == "dq" and fused_dq == "2":
                torch.testing.assert_close(x, y)
            else:
                assert torch.equal(x, y), name
    assert len({tuple(s.tolist()) for s in states}) == 3


def test_same_rng_state_same_result(device):
    """The call is a function of rng_state: bitwise equal outputs and gradients; another state
    drops other keys."""
    q, k, v, _ = _case(device, torch.bfloat16, 2, 4, 2, 150, 150, 64, None)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    rng = torch.randint(0, 1 << 62, (2,), device=device)

    def run(state):
        out, _ = torch.ops.flashmod.attention_dropout(*inputs, None, None, True, True, -1, -1, 0.0, 0.3, state)
        return (out, *torch.autograd.grad(out.float().square().sum(), inputs))

    first, second, other = run(rng), run(rng.clone()), run(rng + 1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], other[0])


def test_dropout_p_zero_and_one(device):
    """p = 0 keeps every key (plain attention); p = 1 drops every one: output and gradients 0, no
    NaN (the survivors' scale is 0, not 1 / 0), lse still the undropped one."""
    q, k, v, _ = _case(device, torch.float16, 1, 4, 4, 65, 97, 64, None)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    rng = torch.randint(0, 1 << 62, (2,), device=device)
    plain_out, plain_lse = attention_reference(q, k, v, is_causal=True)
    for p in (0.0, 1.0):
        out, lse = torch.ops.flashmod.attention_dropout(*inputs, None, None, True, True, -1, -1, 0.0, p, rng)
        grads = torch.autograd.grad(out, inputs, torch.randn_like(out))
        torch.testing.assert_close(lse, plain_lse.float(), atol=2e-3, rtol=2e-3)
        if p == 0.0:
            torch.testing.assert_close(out.float(), plain_out.float(), atol=2e-3, rtol=2e-3)
        else:
            assert not out.any() and not any(g.any() for g in grads)


def test_rows_without_keys(device):
    """A row whose keys are all masked: output 0, lse -inf, gradients finite (0 for its query)."""
    q, k, v, _ = _case(device, torch.bfloat16, 1, 2, 2, 40, 70, 64, None)
    mask = torch.rand(1, 1, 40, 70, device=device) > 0.5
    mask[:, :, 3] = False
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    rng = torch.randint(0, 1 << 62, (2,), device=device)
    out, lse = torch.ops.flashmod.attention_dropout(*inputs, mask, None, False, True, -1, -1, 0.0, 0.4, rng)
    dq, dk, dv = torch.autograd.grad(out, inputs, torch.randn_like(out))
    assert not out[:, :, 3].any() and torch.isneginf(lse[:, :, 3]).all()
    assert all(torch.isfinite(g).all() for g in (out, dq, dk, dv))
    assert not dq[:, :, 3].any()


def test_bad_dropout_arguments(device):
    """Each bad argument raises naming it, the same while tracing (the fake mirrors the C++)."""
    q, k, v, _ = _case(device, torch.bfloat16, 1, 2, 2, 8, 8, 32, None)
    rng = torch.randint(0, 1 << 62, (2,), device=device)
    args = (None, None, False, True, -1, -1, 0.0)
    bad = [
        ((q, k, v, *args, 1.5, rng), r"dropout_p must be a probability in \[0, 1\], got 1.5"),
        ((q, k, v, *args, 0.1, rng.int()), r"rng_state must be a contiguous \(2,\) int64 tensor"),
        ((q, k, v, *args, 0.1, rng[:1]), r"rng_state must be a contiguous \(2,\) int64 tensor"),
        ((q, k.float(), v, *args, 0.1, rng), r"k must have q's dtype"),
    ]
    if device == "cuda":
        bad.append(((q.float(), k.float(), v.float(), *args, 0.1, rng), r"fused dropout takes float16 or bfloat16"))
    for call, message in bad:
        with pytest.raises(RuntimeError, match=message):
            torch.ops.flashmod.attention_dropout(*call)
        with pytest.raises(Exception, match=message), torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in call]
            torch.ops.flashmod.attention_dropout(*fakes)


def test_opcheck(device):
    q, k, v, _ = _case(device, torch.float16, 1, 4, 2, 33, 47, 64, None)
    rng = torch.randint(0, 1 << 62, (2,), device=device)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None, True, True, -1, -1, 0.0, 0.2, rng)
    torch.library.opcheck(torch.ops.flashmod.attention_dropout, args)


def test_attention_routes_dropout_to_the_fused_op(device):
    """flashmod.attention with dropout draws rng_state from torch's generator and runs the fused op
    (CPU: every dtype; CUDA: fp16/bf16 where built): after the same seed, the reference with that
    state's mask gives its output. A mask that requires grad goes to attention_dropout_reference,
    which drops by torch's generator: other keys."""
    q, k, v, _ = _case(device, torch.bfloat16, 2, 4, 2, 77, 99, 64, None)
    bias = torch.zeros(77, 99, device=device, dtype=torch.bfloat16)

    def output(mask):
        torch.manual_seed(11)
        return flashmod.attention(q, k, v, mask, dropout_p=0.25, is_causal=True).float()

    torch.manual_seed(11)
    rng = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device)
    keep = dropout_keep_mask(rng, (2, 4, 77, 99), 0.25)
    ref, _ = attention_reference(q, k, v, None, None, True, False, -1, -1, 0.0, 0.25, dropout_mask=keep)
    fused = device == "cpu" or flashmod.ops.HAS_CUDA_DROPOUT_KERNELS
    assert torch.allclose(output(bias), ref.float(), atol=2e-2, rtol=2e-2) == fused
    assert not torch.allclose(output(bias.requires_grad_()), ref.float(), atol=2e-2, rtol=2e-2)


def test_dropout_op_under_compile_fullgraph(device):
    """The op traces (its fake) and the compiled call equals the eager one bitwise, gradients
    too; flashmod.attention with dropout compiles whole."""
    q, k, v, _ = _case(device, torch.float16, 1, 4, 2, 90, 130, 64, None)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    rng = torch.randint(0, 1 << 62, (2,), device=device)

    def call(q, k, v, rng):
        return torch.ops.flashmod.attention_dropout(q, k, v, None, None, True, True, -1, -1, 0.0, 0.3, rng)[0]

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    eager, traced = call(*inputs, rng), compiled(*inputs, rng)
    assert torch.equal(eager, traced)
    grad = torch.randn_like(eager)
    assert all(
        torch.equal(a, b)
        for a, b in zip(torch.autograd.grad(eager, inputs, grad), torch.autograd.grad(traced, inputs, grad))
    )
    whole = torch.compile(lambda q, k, v: flashmod.attention(q, k, v, dropout_p=0.3), fullgraph=True)
    torch.manual_seed(5)
    first = whole(*inputs)
    torch.manual_seed(5)
    assert torch.equal(first, whole(*inputs))


def test_double_backward(device):
    """Gradients of the gradients (a gradient penalty under dropout) go through the reference with
    the forward's keep mask: gradgradcheck in fp64 on the CPU (out only: lse is an fp32 output, too
    coarse for finite differences); on CUDA the same rng_state drops the same keys, so bf16 there
    matches the CPU's fp64 within bf16's precision."""
    rng = torch.randint(0, 1 << 62, (2,))
    shape = (1, 4, 2, 13, 21, 16)  # b, hq, hkv, nq, nk, d

    def penalty(q, k, v, state):
        out = torch.ops.flashmod.attention_dropout(q, k, v, None, None, True, True, -1, -1, 0.0, 0.3, state)[0]
        dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad(dq.float().square().sum() + (dk.float() * dv.float()).sum(), (q, k, v))

    q64, k64, v64, _ = _case("cpu", torch.float64, *shape, None)
    if device == "cpu":
        out_only = lambda q, k, v: torch.ops.flashmod.attention_dropout(  # noqa: E731
            q, k, v, None, None, True, True, -1, -1, 0.0, 0.3, rng
        )[0]
        inputs = tuple(t.requires_grad_() for t in (q64, k64, v64))
        assert torch.autograd.gradgradcheck(out_only, inputs, fast_mode=True)
        return
    inputs = tuple(t.to(device, torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
    ours = penalty(*inputs, rng.to(device))
    truth = penalty(*(t.requires_grad_() for t in (q64, k64, v64)), rng)
    for name, a, b in zip(("q", "k", "v"), ours, truth):
        err = (a.double().cpu() - b).abs().max().item()
        assert err <= 0.05 * b.abs().max().item(), f"d{name}: {err:.3e} against {b.abs().max().item():.3e}"


def test_forward_mode(device):
    """Forward-mode AD (torch.func.jvp; flashmod.attention's path too) takes the forward's keep mask:
    gradcheck's forward-AD check in fp64 on the CPU, with an additive mask that carries a tangent;
    on CUDA bf16 against the CPU's fp64 with the same rng_state."""
    rng = torch.randint(0, 1 << 62, (2,))
    q64, k64, v64, mask64 = _case("cpu", torch.float64, 1, 4, 2, 13, 21, 16, "additive")

    def op(q, k, v, mask, state):
        return torch.ops.flashmod.attention_dropout(q, k, v, mask, None, True, True, -1, -1, 0.0, 0.3, state)[0]

    if device == "cpu":
        inputs = tuple(t.requires_grad_() for t in (q64, k64, v64, mask64))
        assert torch.autograd.gradcheck(
            lambda *x: op(*x, rng), inputs, check_forward_ad=True, check_backward_ad=False, fast_mode=True
        )
        return
    tangents = tuple(torch.randn_like(t) for t in (q64, k64, v64, mask64))
    _, truth = torch.func.jvp(lambda *x: op(*x, rng), (q64, k64, v64, mask64), tangents)
    primals = tuple(t.to(device, torch.bfloat16) for t in (q64, k64, v64, mask64))
    _, ours = torch.func.jvp(
        lambda *x: op(*x, rng.to(device)), primals, tuple(t.to(device, torch.bfloat16) for t in tangents)
    )
    err = (ours.double().cpu() - truth).abs().max().item()
    assert err <= 0.05 * truth.abs().max().item(), f"out tangent: {err:.3e} against {truth.abs().max().item():.3e}"


def test_fallback_without_cuda_kernels_matches_the_kernels():
    """What a build without the CUDA kernels registers for CUDA (the reference with the keep mask,
    ops._attention_dropout_by_reference and its backward), run here on the CPU against the CPU
    kernels: the same output and gradients (fp64)."""
    q, k, v, mask = _case("cpu", torch.float64, 2, 4, 2, 19, 45, 24, "bool")
    rng = torch.randint(0, 1 << 62, (2,))
    args = (q, k, v, mask, None, True, True, 9, -1, 0.0, 0.35, rng)
    out, lse = torch.ops.flashmod.attention_dropout(*args)
    ref_out, ref_lse = flashmod.ops._attention_dropout_by_reference(*args)
    torch.testing.assert_close(ref_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref_lse, lse)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.ops.flashmod.attention_dropout_backward(grad_out, grad_lse, q, k, v, out, lse, *args[3:])
    ref_grads = flashmod.ops._attention_dropout_backward_by_reference(grad_out, grad_lse, q, k, v, out, lse, *args[3:])
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ref, ours, rtol=1e-10, atol=1e-10)
