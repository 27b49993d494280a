"""The fused CUDA backward against fp64 autograd through the reference: fp16/bf16
(csrc/attention/cuda/bwd_sm80_kernel.h, bwd_sm90_kernel.h) and fp32 (bwd_tf32_kernel.h: the tests
named fp32, and those parametrized over the dtype), all by the rule that gradients stay within 3x
the error of plain torch in the same dtype. Every padded head dim and tile-shape branch (split
dK/dV launches past D = 128), both kernels' masking paths (plain and general), GQA, layouts,
determinism and stream/graph behaviour; on an H100/H200 every tile variant of the Hopper backward
(FLASHMOD_BWD_SM90_TILE)."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from test_attention import layout_mask
from test_attention_backward import check_grads, draw_upstream, fused_grads, make_inputs, op_args, reference_grads
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference

pytestmark = pytest.mark.cuda
DEV = "cuda"
LOW = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [16, 40, 59, 64, 96, 111, 128, 160, 200, 256])
@pytest.mark.parametrize(("nq", "nk"), [(1, 1), (17, 203), (203, 113), (257, 300)])
def test_head_dims_and_sizes(dtype, d, nq, nk):
    check_grads(*make_inputs(DEV, dtype, 2, 2, 2, nq, nk, d))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize(("nq", "nk"), [(113, 203), (203, 113), (1023, 1023), (1, 300)])
def test_causal(dtype, d, bottom_right, nq, nk):
    check_grads(*make_inputs(DEV, dtype, 1, 2, 1, nq, nk, d), is_causal=True, bottom_right=bottom_right)


@pytest.mark.parametrize(("window_left", "window_right"), [(0, 0), (7, 3), (40, -1), (-1, 129), (200, 0)])
@pytest.mark.parametrize("d", [64, 160])
def test_window(window_left, window_right, d):
    q, k, v = make_inputs(DEV, torch.bfloat16, 1, 2, 2, 203, 260, d)
    check_grads(q, k, v, window_left=window_left, window_right=window_right, bottom_right=False)


# Soft caps without a mask take their own Hopper variant for head dims 64/128/256 (blocks the
# window shows whole compute the capped probabilities directly: bwd_common.h, capped_prob); 192
# runs the portable kernels' general variant. Non-causal and causal, sizes past one block.
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_softcap(dtype, d, causal):
    q, k, v = make_inputs(DEV, dtype, 2, 4, 2, 203, 333, d)
    check_grads(q * 3, k * 3, v, softcap=5.0, is_causal=causal)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", [(113, 150), (1, 2, 1, 150), (2, 1, 113, 1)])
def test_masks(dtype, shape):
    q, k, v = make_inputs(DEV, dtype, 2, 2, 2, 113, 150, 64)
    check_grads(q, k, v, attn_mask=torch.rand(shape, device=DEV) > 0.3)
    check_grads(q, k, v, attn_mask=torch.randn(shape, device=DEV, dtype=dtype))
    check_grads(q, k, v, attn_mask=torch.randn(shape, device=DEV), is_causal=True)


@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("d", [64, 256])
def test_gqa_mqa(hq, hkv, d):
    check_grads(*make_inputs(DEV, torch.bfloat16, 2, hq, hkv, 113, 150, d), is_causal=True)


@pytest.mark.parametrize(("use_grad_out", "use_grad_lse"), [(True, False), (False, True), (True, True)])
def test_grad_out_and_grad_lse(use_grad_out, use_grad_lse):
    q, k, v = make_inputs(DEV, torch.float16, 1, 2, 2, 113, 130, 64)
    check_grads(q, k, v, use_grad_out=use_grad_out, use_grad_lse=use_grad_lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 256])
def test_fully_masked_rows_give_zero_gradients(dtype, d):
    """Rows whose keys are all masked get exactly zero dQ (bf16: the Hopper or portable kernels;
    fp32: 3xTF32, checked by its own rule in check_grads_fp32)."""
    q, k, v = make_inputs(DEV, dtype, 1, 2, 2, 70, 90, d)
    mask = torch.rand(70, 90, device=DEV) > 0.5
    mask[5] = False
    mask[40:] = False
    check = check_grads_fp32 if dtype == torch.float32 else check_grads
    dq, dk, dv = check(q, k, v, attn_mask=mask)
    assert torch.all(dq[:, :, 5] == 0) and torch.all(dq[:, :, 40:] == 0)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_keys_no_query_sees_get_zero_gradients():
    """Top-left causal with Nk > Nq: keys past the last query are seen by nobody."""
    q, k, v = make_inputs(DEV, torch.bfloat16, 1, 2, 2, 70, 300, 64)
    _, dk, dv = check_grads(q, k, v, is_causal=True, bottom_right=False)
    assert torch.all(dk[:, :, 70:] == 0) and torch.all(dv[:, :, 70:] == 0)


def test_strided_and_unaligned_inputs():
    """(B, S, H, D) views, a row-strided slice at an odd offset (copied for alignment), odd D."""
    q = torch.randn(2, 113, 4, 59, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 150, 2, 59, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 2, 150, 80, device=DEV, dtype=torch.bfloat16)[..., 3:62]
    dq, dk, dv = check_grads(q, k, v, is_causal=True)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()


# The Hopper backward's fused variant (padded head dim 64 or 128, plain scores: dQ added up by atomics in
# the dK/dV kernel; csrc/attention/cuda/bwd_sm90_launch.h, launch_bwd_fused_dq). The suite's
# fixture turns torch's deterministic algorithms on (to poison allocations), which takes the
# bitwise-reproducible kernels; FLASHMOD_BWD_FUSED_DQ=2 takes the fused variant even then.
FUSED_DQ_CASES = [
    {},
    {"is_causal": True},
    {"is_causal": True, "bottom_right": False},
    {"window_left": 70, "window_right": 5, "bottom_right": False},
]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [40, 59, 64, 97, 111, 128])
@pytest.mark.parametrize(("nq", "nk"), [(1, 1), (17, 203), (203, 113), (257, 300), (1023, 1023)])
@pytest.mark.parametrize("options", FUSED_DQ_CASES, ids=str)
def test_fused_dq(monkeypatch, dtype, d, nq, nk, options):
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    check_grads(*make_inputs(DEV, dtype, 2, 4, 2, nq, nk, d), **options)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (8, 1), (6, 3)])
def test_fused_dq_gqa(monkeypatch, hq, hkv, d):
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    check_grads(*make_inputs(DEV, torch.bfloat16, 2, hq, hkv, 300, 413, d), is_causal=True)


@pytest.mark.parametrize("d", [64, 128])
def test_fused_dq_side_stream_and_cuda_graph(monkeypatch, d):
    """The fused variant (its zeroed fp32 sums allocated and cleared per call) on a side stream and
    replayed from a captured graph with new grad_out values: within the rule each time (the sums'
    order varies, so not bitwise)."""
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 300, 300, d)
    out, lse = torch.ops.flashmod.attention(q, k, v)
    grad_out = torch.randn_like(out)

    def within_rule(grads):
        truth = reference_grads(q, k, v, grad_out, None, torch.float64)
        plain = reference_grads(q, k, v, grad_out, None, torch.bfloat16)
        for name, x, t, ref in zip(("dq", "dk", "dv"), grads, truth, plain):
            assert_within_rule(x, t, ref, 3.0, torch.bfloat16, name)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = torch.ops.flashmod.attention_backward(grad_out, None, q, k, v, out, lse)
    torch.cuda.current_stream().wait_stream(side)
    within_rule(on_side[:3])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.flashmod.attention_backward(grad_out, None, q, k, v, out, lse)
    for _ in range(2):  # a second replay finds the sums cleared again
        grad_out.copy_(torch.randn_like(grad_out))
        graph.replay()
        within_rule(captured[:3])


@pytest.mark.parametrize("d", [59, 64, 128, 256])
@pytest.mark.parametrize("options", [{}, {"is_causal": True}], ids=str)
def test_copy_engine_step_loads_equal_cp_async(monkeypatch, d, options):
    """The Hopper backward's plain kernels load each step's tiles through the copy engine
    (FLASHMOD_BWD_TMA_LOADS=1, the default; 2 in the dK/dV kernel only) or by every thread's
    cp.async (0): the same bytes land, rows past the sequence as zeros, so the gradients are bitwise
    equal (deterministic mode, the suite's fixture: no atomics). At D = 256 the copy engine's loads
    also take another dK/dV kernel (bwd_sm90_halves_kernel.h: the warpgroups split the head dim,
    P and dS through shared memory) than cp.async's (the pair kernel): its products add the same
    bf16 operands in the same order, so bitwise equal too. Odd lengths reach the partial last
    blocks of both kernels; a GQA group shares each kv head."""
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 203, 333, d)
    grad_out, grad_lse = draw_upstream(q)

    def grads(knob):
        monkeypatch.setenv("FLASHMOD_BWD_TMA_LOADS", knob)
        return fused_grads(q, k, v, grad_out, grad_lse, **options)

    cp_async = grads("0")
    for knob in ("1", "2"):
        for name, x, y in zip(("dq", "dk", "dv"), grads(knob), cp_async):
            assert torch.equal(x, y), (knob, name)
    with pytest.raises(RuntimeError, match="FLASHMOD_BWD_TMA_LOADS must be 0, 1 or 2, got 3"):
        grads("3")
    monkeypatch.delenv("FLASHMOD_BWD_TMA_LOADS")
    check_grads(q, k, v, **options)  # and within the rule against fp64 (the default loads)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("options", [{}, {"is_causal": True}], ids=str)
@pytest.mark.parametrize("path", ["default", "portable", "fp32"])
def test_dq_kernel_beside_dkdv(monkeypatch, d, options, path):
    """The backward's dQ kernel runs on a pool stream beside the dK/dV launch, forked after the row
    statistics and joined back by events (FLASHMOD_BWD_DQ_BESIDE=1, the default), or after it on the
    call's stream (0): the same kernels, so bitwise the same gradients (deterministic mode, the suite's
    fixture: no atomics), also when the call is captured in a CUDA graph and replayed with new
    grad_out values, and when it runs on a side stream of its own; on the Hopper kernels, the
    portable mma.sync ones (FLASHMOD_DISABLE_SM90=1) and the fp32 (3xTF32) ones, whose D = 256
    launches dV and dK as two kernels before the fork's join."""
    if path == "portable":
        monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    dtype = torch.float32 if path == "fp32" else torch.bfloat16
    q, k, v = make_inputs(DEV, dtype, 2, 4, 2, 203, 333, d)
    out, lse = torch.ops.flashmod.attention(q, k, v, *op_args(**options))
    grad_out, grad_lse = draw_upstream(q)

    def grads(knob):
        monkeypatch.setenv("FLASHMOD_BWD_DQ_BESIDE", knob)
        return torch.ops.flashmod.attention_backward(grad_out, grad_lse, q, k, v, out, lse, *op_args(**options))[:3]

    serial = grads("0")
    for name, x, y in zip(("dq", "dk", "dv"), grads("1"), serial):
        assert torch.equal(x, y), name
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = grads("1")
    torch.cuda.current_stream().wait_stream(side)
    for name, x, y in zip(("dq", "dk", "dv"), on_side, serial):
        assert torch.equal(x, y), name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grads("1")
    for _ in range(2):
        grad_out.copy_(torch.randn_like(grad_out))
        graph.replay()
        for name, x, y in zip(("dq", "dk", "dv"), captured, grads("0")):
            assert torch.equal(x, y), name
    monkeypatch.delenv("FLASHMOD_BWD_DQ_BESIDE")
    if path == "fp32":  # and within the rule against fp64
        check_grads_fp32(q, k, v, **options)
    else:
        check_grads(q, k, v, **options)


def backward_kernel_names(q, k, v, **options) -> set[str]:
    """The CUDA kernels one fused backward call launched (torch.profiler's names)."""
    grad_out, grad_lse = draw_upstream(q)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fused_grads(q, k, v, grad_out, grad_lse, **options)
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_dkdv_kernel_by_loads(monkeypatch, causal):
    """At padded head dim 256 the plain dense backward takes dK / dV from the kernel whose warpgroups
    split the head dim (bwd_sm90_halves_kernel.h) where its loads go through the copy engine, and from
    the pair kernel where they cannot (FLASHMOD_BWD_TMA_LOADS=0 stands in for unaligned rows) or where
    the scores are general (a soft cap); test_copy_engine_step_loads_equal_cp_async compares the two
    kernels' gradients bitwise."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the halves kernel is a Hopper kernel")
    q, k, v = make_inputs(DEV, torch.bfloat16, 1, 4, 2, 150, 131, 256)

    def dkdv_kernels(**options):
        return {n for n in backward_kernel_names(q, k, v, is_causal=causal, **options) if "dkdv" in n or "halves" in n}

    def only(names: set[str], halves: bool) -> bool:
        return bool(names) and all(("halves" in n) == halves for n in names)

    assert only(dkdv_kernels(), True)
    assert only(dkdv_kernels(softcap=30.0), False)
    monkeypatch.setenv("FLASHMOD_BWD_TMA_LOADS", "0")
    assert only(dkdv_kernels(), False)


@pytest.mark.parametrize("widen", ["1", "0"])
@pytest.mark.parametrize("d", [72, 96, 136, 160, 192, 224])
@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"softcap": 20.0, "window_left": 90}], ids=str)
def test_widened_head_dims(monkeypatch, widen, d, options):
    """Head dims between the Hopper kernels' sizes (64 / 128 / 192 / 256) run those kernels with zero
    columns on an H100/H200 (FLASHMOD_SM90_WIDEN=1, the default: 96 on the D = 128 kernels, 160 on
    the D = 192 ones) or the portable mma.sync kernels at their own padded size (0): the output
    within the 2x rule and the gradients within the 3x rule either way, odd lengths ending in
    partial blocks, general scores too; the profiler shows which kernels ran (elsewhere only the
    portable ones exist, and both settings run them)."""
    monkeypatch.setenv("FLASHMOD_SM90_WIDEN", widen)
    monkeypatch.setenv("FLASHMOD_DECODE", "0")
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 203, 333, d)
    out, lse = torch.ops.flashmod.attention(q, k, v, *op_args(**options))
    truth = attention_reference(q, k, v, compute_dtype=torch.float64, **options)
    plain = attention_reference(q, k, v, compute_dtype=q.dtype, **options)
    assert_within_rule(out, truth[0], plain[0], 2.0, q.dtype, "out")
    assert_within_rule(lse, truth[1], plain[1].float(), 2.0, q.dtype, "lse")
    check_grads(q, k, v, **options)
    names = backward_kernel_names(q, k, v, **options)
    portable = {m.group(1) for n in names if (m := re.search(r"attention_(fwd|bwd_dkdv|bwd_dq)_kernel<", n))}
    hopper = {m.group(1) for n in names if (m := re.search(r"attention_(fwd|bwd)_\w*sm90", n))}
    # Without widening, a head dim whose portable size (the next multiple of 32) is a Hopper size
    # (192 among this test's) runs the Hopper kernels of that size.
    own_size = -(-d // 32) * 32
    if torch.cuda.get_device_capability() != (9, 0):
        expected_hopper = set()
    else:
        expected_hopper = {"fwd", "bwd"} if widen == "1" or own_size == 192 else set()
    assert hopper == expected_hopper, names
    on_hopper = {"fwd"} & expected_hopper | ({"bwd_dkdv", "bwd_dq"} if "bwd" in expected_hopper else set())
    assert portable == {"fwd", "bwd_dkdv", "bwd_dq"} - on_hopper, names


@pytest.mark.parametrize("d", [40, 64, 96, 128, 160, 256])
@pytest.mark.parametrize("kernels", ["seven_matmuls", "fused_dq", "portable"])
def test_staged_gradient_stores_equal_direct_stores(monkeypatch, d, kernels):
    """The fp16/bf16 backward's warps write gradient rows through shared memory as whole 16-byte
    chunks where the rows are aligned (FLASHMOD_BWD_STAGED_STORES=1, the default) or straight from
    the accumulators (0): the same values, bitwise (deterministic mode; the Hopper fused variant's
    dQ adds up by atomics, so only its dK / dV compare), on the Hopper kernels and the portable
    mma.sync ones. Odd lengths end in partial blocks, head dims 40 and 96 in partial column blocks;
    the suite's fixture poisons the gradients' memory, so a row or chunk that is not written shows."""
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 203, 333, d)
    grad_out, grad_lse = draw_upstream(q)
    fused = kernels == "fused_dq"
    if fused:
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    if kernels == "portable":
        monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")

    def grads(knob):
        monkeypatch.setenv("FLASHMOD_BWD_STAGED_STORES", knob)
        return fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)

    direct, staged = grads("0"), grads("1")
    for name, x, y in list(zip(("dq", "dk", "dv"), staged, direct))[1 if fused else 0 :]:
        assert torch.equal(x, y), name
    monkeypatch.delenv("FLASHMOD_BWD_STAGED_STORES")
    check_grads(q, k, v, is_causal=True)  # and within the rule against fp64 (the default stores)


# The fused dQ variant's scheduling choices, each a knob whose default is the new order:
# FLASHMOD_BWD_DEFERRED_FENCES (at padded head dim 64, its dS^T and dQ tiles fenced after the work
# that follows their stores, or right behind them) and FLASHMOD_BWD_FUSED_OVERLAP (at 128, the
# gradient products left in flight across the loop top, or waited for at the step's end).
FUSED_SCHEDULE_KNOBS = [
    ("FLASHMOD_BWD_DEFERRED_FENCES", 40),
    ("FLASHMOD_BWD_DEFERRED_FENCES", 64),
    ("FLASHMOD_BWD_FUSED_OVERLAP", 111),
    ("FLASHMOD_BWD_FUSED_OVERLAP", 128),
]


@pytest.mark.parametrize(("knob", "d"), FUSED_SCHEDULE_KNOBS)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_schedule_knobs_keep_the_gradients(monkeypatch, knob, d, causal):
    """Either way of a fused-variant scheduling knob: dK / dV bitwise the same (only when work is
    waited for changes; dQ adds up by atomics, so it is checked against fp64 both ways)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused variant is a Hopper kernel")
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    # 1023 queries and keys: partial steps and key blocks, and enough sums that the fused dQ's
    # last bits differ from the dQ kernel's somewhere. GQA 4 / 2.
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 1023, 1023, d)
    grad_out, grad_lse = draw_upstream(q)

    def grads(value):
        monkeypatch.setenv(knob, value)
        return fused_grads(q, k, v, grad_out, grad_lse, is_causal=causal)

    new_order, old_order = grads("1"), grads("0")
    for name, x, y in list(zip(("dq", "dk", "dv"), new_order, old_order))[1:]:
        assert torch.equal(x, y), name
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "0")
    assert not torch.equal(grads("1")[0], new_order[0]), "dQ came from the dQ kernel, not the fused variant"
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    for value in ("1", "0"):
        monkeypatch.setenv(knob, value)
        check_grads(q, k, v, is_causal=causal)


def test_fused_dq_follows_the_knob_walk_length_and_deterministic_mode(monkeypatch):
    """FLASHMOD_BWD_FUSED_DQ=1 takes the fused variant only where each key sees enough queries
    (>= 1024 on average at D = 128, under a causal or window bound too), over >= 1024 keys, and
    with deterministic algorithms off; its fp32 sums run in another order than the dQ kernel's, so the
    two dQ differ in their last bits, while the dQ kernel's runs are bitwise equal."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused variant is a Hopper kernel")

    def grads(knob, nq, nk, **options):
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", knob)
        q_, go, gl = (t[:, :, :nq].contiguous() for t in (q, grad_out, grad_lse))
        k_, v_ = (t[:, :, :nk].contiguous() for t in (k, v))
        return fused_grads(q_, k_, v_, go, gl, **options)

    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 2100, 2100, 128)
    grad_out, grad_lse = draw_upstream(q)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    kernels = grads("0", 1100, 1100)
    assert same(grads("1", 1100, 1100), kernels)  # deterministic algorithms on (the fixture)
    torch.use_deterministic_algorithms(False)
    assert not torch.equal(grads("1", 1100, 1100)[0], kernels[0]), "dQ came from the dQ kernel"
    # Walks too short for the adds: fewer queries, fewer keys, causal (550 queries a key) and a band
    # of 901; a band of 1901 (all 1100 queries for most keys) and causal over 2100 (1050 a key)
    # take the fused variant.
    for nq, nk, options in (
        (1023, 1100, {}),
        (1100, 1023, {}),
        (1100, 1100, {"is_causal": True}),
        (1100, 1100, {"window_left": 600, "window_right": 300}),
    ):
        assert same(grads("1", nq, nk, **options), grads("0", nq, nk, **options)), (nq, nk, options)
    for n, options in ((1100, {"window_left": 1500, "window_right": 400}), (2100, {"is_causal": True})):
        assert not torch.equal(grads("1", n, n, **options)[0], grads("0", n, n, **options)[0]), options
    causal = grads("0", 1100, 1100, is_causal=True)
    assert not torch.equal(grads("2", 1100, 1100, is_causal=True)[0], causal[0])
    with pytest.raises(RuntimeError, match="FLASHMOD_BWD_FUSED_DQ must be 0, 1 or 2, got 3"):
        grads("3", 1100, 1100)


def test_fused_dq_rule_at_head_dim_64(monkeypatch):
    """At head dims 33-64 (a fused step of 128 queries) FLASHMOD_BWD_FUSED_DQ=1 takes the fused
    variant from 1024 queries a key sees, as at D = 128 (backward_dispatch.h: fused_dq_min_queries):
    1100 queries over 1100 keys take it, causal (550 a key) not, causal over 2100 (1050 a key) do."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused variant is a Hopper kernel")
    torch.use_deterministic_algorithms(False)
    for n, causal, fused in ((1100, False, True), (1100, True, False), (2100, True, True)):
        q, k, v = make_inputs(DEV, torch.bfloat16, 1, 4, 2, n, n, 64)
        grad_out, grad_lse = draw_upstream(q)
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "0")
        kernels = fused_grads(q, k, v, grad_out, grad_lse, is_causal=causal)
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "1")
        default = fused_grads(q, k, v, grad_out, grad_lse, is_causal=causal)
        # The fused sums add in another order than the dQ kernel: dQ differs in its last bits.
        assert torch.equal(default[0], kernels[0]) != fused, (n, causal, "fused" if fused else "dQ kernel")


@pytest.mark.parametrize(("dtype", "d"), [(torch.bfloat16, 128), (torch.bfloat16, 192), (torch.float32, 128)], ids=str)
def test_deterministic_over_100_runs(dtype, d):
    """The fused backward (bf16: the Hopper or portable kernels, at D = 192 the Hopper pair tile;
    fp32: 3xTF32) is bitwise the same on every run: no atomics."""
    q, k, v = make_inputs(DEV, dtype, 2, 8, 2, 1023, 1100, d)
    grad_out, grad_lse = draw_upstream(q)
    first = fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)
    for _ in range(100):
        again = fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_side_stream_and_cuda_graph(dtype):
    """The backward on a side stream matches the default stream's, and a captured graph replays
    with new grad_out values (fp16: the Hopper or portable kernels; fp32: 3xTF32)."""
    q, k, v = make_inputs(DEV, dtype, 2, 4, 2, 300, 300, 64)
    out, lse = torch.ops.flashmod.attention(q, k, v)
    grad_out = torch.randn_like(out)
    expected = torch.ops.flashmod.attention_backward(grad_out, None, q, k, v, out, lse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = torch.ops.flashmod.attention_backward(grad_out, None, q, k, v, out, lse)
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(expected, on_side):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.flashmod.attention_backward(grad_out, None, q, k, v, out, lse)
    grad_out.copy_(torch.randn_like(grad_out))
    graph.replay()
    fresh = torch.ops.flashmod.attention_backward(grad_out, None, q, k, v, out, lse)
    for a, b in zip(fresh, captured):
        assert torch.equal(a, b)


def test_training_step_matches_reference():
    """autograd through flashmod.attention reaches the fused kernel (a bf16 training step)."""
    import flashmod

    q, k, v = (t.requires_grad_() for t in make_inputs(DEV, torch.bfloat16, 2, 4, 2, 200, 200, 64))
    out = flashmod.attention(q, k, v, is_causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    out_ref, lse = torch.ops.flashmod.attention(q.detach(), k.detach(), v.detach(), None, None, True, False)
    expected = torch.ops.flashmod.attention_backward(
        grad_out, None, q.detach(), k.detach(), v.detach(), out_ref, lse, None, None, True, False
    )
    for leaf, e in zip((q, k, v), expected):
        assert torch.equal(leaf.grad, e)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"is_causal": True, "bottom_right": False},
        {"softcap": 5.0},
        {"window_left": 30, "window_right": 5},
    ],
    ids=["dense", "causal", "causal_top_left", "softcap", "window"],
)
def test_portable_kernel_where_the_hopper_one_runs(monkeypatch, d, options):
    """On an H100 the wgmma backward serves D = 64/128/256 by default; FLASHMOD_DISABLE_SM90=1 runs the
    portable mma.sync kernels on the same inputs, and both must hold the accuracy rule."""
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 203, 317, d)
    check_grads(q, k, v, **options)
    monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    check_grads(q, k, v, **options)
    mask = torch.randn(203, 317, device=DEV)
    check_grads(q, k, v, attn_mask=mask)


# ------------------------------------------------------------------------------------------------
# fp32 (3xTF32 tensor-core products): the same rule as fp16/bf16, against plain fp32 torch.


def check_grads_fp32(q, k, v, attn_mask=None, use_grad_lse=True, **options):
    """Fused fp32 gradients within 3x plain fp32 torch's error against fp64 (autograd through the
    reference in both); returns (dq, dk, dv)."""
    b, hq, nq, _ = q.shape
    grad_out = torch.randn_like(q)
    grad_lse = torch.randn(b, hq, nq, device=DEV) if use_grad_lse else None
    opts = dict(options, attn_mask=attn_mask) if attn_mask is not None else options
    ours = fused_grads(q, k, v, grad_out, grad_lse, **opts)
    truth = reference_grads(q, k, v, grad_out, grad_lse, torch.float64, **opts)
    plain = reference_grads(q, k, v, grad_out, grad_lse, torch.float32, **opts)
    for name, x, t, pl, ref in zip(("dq", "dk", "dv"), ours, truth, plain, (q, k, v)):
        assert x.shape == ref.shape and x.dtype == torch.float32, name
        assert_within_rule(x, t, pl, 3.0, torch.float32, f"fp32 {name}")
    return ours


@pytest.mark.parametrize("d", [16, 40, 59, 64, 96, 111, 128, 160, 200, 256])
@pytest.mark.parametrize(("nq", "nk"), [(1, 1), (17, 203), (203, 113), (257, 300)])
def test_fp32_head_dims_and_sizes(d, nq, nk):
    check_grads_fp32(*make_inputs(DEV, torch.float32, 2, 2, 2, nq, nk, d))


FP32_FUSED_DQ_CASES = {
    "plain": (2, 2, 2, 203, 113, {}),
    "one": (1, 2, 1, 1, 1, {}),
    "causal": (1, 2, 1, 1023, 1023, {"is_causal": True}),
    "top-left": (1, 2, 2, 203, 113, {"is_causal": True, "bottom_right": False}),
    "gqa": (2, 6, 3, 113, 150, {"is_causal": True}),
    "mqa": (1, 8, 1, 17, 203, {}),
    "window": (1, 2, 2, 203, 260, {"window_left": 7, "window_right": 3, "bottom_right": False}),
    "softcap": (1, 2, 2, 113, 150, {"softcap": 5.0, "is_causal": True}),
    "scale": (1, 2, 2, 113, 150, {"scale": -0.3}),
    "bool-mask": (2, 2, 2, 113, 150, {"attn_mask": "bool"}),
    "additive": (2, 2, 2, 113, 150, {"attn_mask": "additive", "is_causal": True}),
}


@pytest.mark.parametrize("d", [16, 40, 59, 64, 96, 111, 128, 160, 229, 256])
@pytest.mark.parametrize("case", FP32_FUSED_DQ_CASES)
def test_fp32_fused_dq(monkeypatch, d, case):
    """The fp32 backward's fused dQ (the dK/dV kernel, past D = 128 its dK launch, adds dQ into grad_q
    by atomics and no dQ kernel runs; FLASHMOD_BWD_FUSED_DQ=2 takes it although the suite runs
    deterministic algorithms): dK and dV bitwise those of the dQ-kernel path, dQ within the rule
    against fp64, a query row whose keys are all hidden gets dQ 0, and the profiler sees the dQ
    kernel with the knob at 0 only."""
    b, hq, hkv, nq, nk, options = FP32_FUSED_DQ_CASES[case]
    q, k, v = make_inputs(DEV, torch.float32, b, hq, hkv, nq, nk, d)
    options = dict(options)
    if options.get("attn_mask") == "bool":
        mask = torch.rand(b, 1, nq, nk, device=DEV) > 0.3
        mask[:, :, 5] = False  # a row that sees no key
        options["attn_mask"] = mask
    elif options.get("attn_mask") == "additive":
        options["attn_mask"] = torch.randn(1, hq, nq, nk, device=DEV)
    grad_out, grad_lse = draw_upstream(q)

    def grads(knob):
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", knob)
        return fused_grads(q, k, v, grad_out, grad_lse, **options)

    dq_kernel = grads("0")
    fused = grads("2")
    assert torch.equal(fused[1], dq_kernel[1]) and torch.equal(fused[2], dq_kernel[2]), "dk / dv"
    if case == "bool-mask":
        assert torch.all(fused[0][:, :, 5] == 0)
    for knob in ("0", "2"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            grads(knob)
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        assert any("tf32_dq_kernel" in n for n in names) == (knob == "0"), (knob, names)
    check_grads_fp32(q, k, v, **options)  # dQ (and dK, dV) within the rule, fresh upstream draws


def tf32_wide_smem(d, pairs):
    """Opt-in shared memory per block the fp32 backward's wide tiles take at head dim d (a multiple
    of 32): two own tiles of 64 rows, two streamed ones of 16 rows in two stages (rows of d + 4
    floats), 16 lse2 and delta in two stages, for the pairs the 8 warps' exchange of partial S^T
    and dP^T (16 x 16 floats each), and the fused dQ's 16 x 72 dS tile."""
    exchange = 8 * 2 * 16 * 16 if pairs else 0
    return 4 * (2 * 64 * (d + 4) + 4 * 16 * (d + 4) + 4 * 16 + exchange) + 4 * 16 * 72


@pytest.mark.parametrize("d", [160, 192, 200, 229, 256])
@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "window", "softcap", "bool-mask", "additive"])
@pytest.mark.parametrize("fused_dq", ["0", "2"])
def test_fp32_wide_tiles(monkeypatch, d, case, fused_dq):
    """Past D = 128 the fp32 backward takes the widest tiles the device's shared memory takes: at
    D = 192 / 256 8 warps in pairs that split the head dim, else 4 warps of whole rows (Hopper; an
    A100 at D = 160 / 192), else the 2-warp tiles every sm_80+ device fits. FLASHMOD_BWD_TF32_WIDE
    0 forces those, 2 rules out the pairs: the profiler sees the tiles each setting should run, and
    each gives gradients within the rule against fp64, with the dQ kernel and with the fused dQ."""
    b, hq, hkv, nq, nk, options = FP32_FUSED_DQ_CASES[case]
    q, k, v = make_inputs(DEV, torch.float32, b, hq, hkv, nq, nk, d)
    options = dict(options)
    if options.get("attn_mask") == "bool":
        options["attn_mask"] = torch.rand(b, 1, nq, nk, device=DEV) > 0.3
    elif options.get("attn_mask") == "additive":
        options["attn_mask"] = torch.randn(1, hq, nq, nk, device=DEV)
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", fused_dq)
    padded = -(-d // 32) * 32
    optin = torch.cuda.get_device_properties(DEV).shared_memory_per_block_optin
    pairs_fit = padded % 64 == 0 and optin >= tf32_wide_smem(padded, True)
    quads_fit = optin >= tf32_wide_smem(padded, False)
    for knob in ("0", "1", "2"):
        monkeypatch.setenv("FLASHMOD_BWD_TF32_WIDE", knob)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            check_grads_fp32(q, k, v, **options)
            torch.cuda.synchronize()
        names = " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        warps = {int(w) for w in re.findall(r"Tf32BwdTraits<\d+, (\d+), 16", names)}
        if knob == "1" and pairs_fit:  # the dK/dV kernels on 8 warps; the dQ kernel on 4
            expected = {8} if fused_dq == "2" else {8, 4}
        else:
            expected = {4} if knob != "0" and quads_fit else {2}
        assert warps == expected, (knob, names)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bottom_right", [True, False])
@pytest.mark.parametrize(("nq", "nk"), [(113, 203), (203, 113), (1023, 1023), (1, 300)])
def test_fp32_causal(d, bottom_right, nq, nk):
    q, k, v = make_inputs(DEV, torch.float32, 1, 2, 1, nq, nk, d)
    check_grads_fp32(q, k, v, is_causal=True, bottom_right=bottom_right)


@pytest.mark.parametrize(("window_left", "window_right"), [(0, 0), (7, 3), (40, -1), (-1, 129), (200, 0)])
@pytest.mark.parametrize("d", [40, 160])
def test_fp32_window(window_left, window_right, d):
    q, k, v = make_inputs(DEV, torch.float32, 1, 2, 2, 203, 260, d)
    check_grads_fp32(q, k, v, window_left=window_left, window_right=window_right, bottom_right=False)


@pytest.mark.parametrize("d", [64, 192])
def test_fp32_softcap_and_scale(d):
    q, k, v = make_inputs(DEV, torch.float32, 1, 2, 2, 113, 150, d)
    check_grads_fp32(q * 3, k * 3, v, softcap=5.0, is_causal=True)
    check_grads_fp32(q, k, v, scale=-0.3)


def key_padding_masks(b, nk):
    """(B, 1, 1, Nk) bool masks: right padding at lengths around 64- and 128-key block edges (a
    batch row with every key hidden, one with none), the same as left padding, random holes, and
    one row broadcast over the batch."""
    lengths = torch.tensor([0, 1, 64, 129, 200, nk], device=DEV)[:b]
    keys = torch.arange(nk, device=DEV)
    right = keys[None] < lengths[:, None]
    left = keys[None] >= (nk - lengths)[:, None]
    holes = torch.rand(b, nk, device=DEV) > 0.2
    return [m[:, None, None, :] for m in (right, left, holes, right[4:5])]


# Key-padding masks take their own path through the general kernels: key blocks the mask hides
# get no step (dK/dV) or are dropped from the ends of the range (dQ), and blocks it shows whole
# run the plain elementwise code (bwd_common.h: vote_key_mask). Hopper (64, 128, 256) and portable
# (80) head dims; a soft cap keeps the general code but still skips hidden blocks.
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True}, {"softcap": 5.0}], ids=str)
def test_key_padding_masks(dtype, d, opts):
    q, k, v = make_inputs(DEV, dtype, 6, 4, 2, 203, 333, d)
    for mask in key_padding_masks(6, 333):
        check_grads(q, k, v, attn_mask=mask, **opts)


def tiled_masks(b, hq, nq, nk, dtype):
    """Masks whose 64 x 64 tiles are hidden, clear and mixed (the classes the fp16/bf16 backward
    skips, runs plainly and masks element by element: bwd_common.h, bwd_tile_class): transformers'
    causal + padding mask as (B, 1, Nq, Nk) bool, with right- and left-padded rows (a left-padded
    row's first queries see no key) and one row padded to nothing; the same as an additive 0 / -inf
    mask in q's dtype; a per-head causal band of its own width per head in fp32 (a GQA group's
    heads hide different tiles, so the dK/dV walk takes their union); and packed documents
    (block-diagonal, causal inside): hidden tiles inside the walks."""
    lengths = torch.tensor([nk, nk - 70, 0, 130], device=DEV)[:b]
    keys = torch.arange(nk, device=DEV)
    right = keys[None] < lengths[:, None]
    left = keys[None] >= (nk - lengths)[:, None]
    padding = torch.where((torch.arange(b, device=DEV) % 2 == 1)[:, None], left, right)
    causal = torch.ones(nq, nk, dtype=torch.bool, device=DEV).tril(nk - nq)
    hf = causal & padding[:, None, None, :]
    additive = torch.zeros(hf.shape, device=DEV, dtype=dtype).masked_fill(~hf, -math.inf)
    rows = torch.arange(nq, device=DEV)[:, None] + (nk - nq)
    width = torch.tensor([40, 100, 200, 1000][:hq] + [64] * max(0, hq - 4), device=DEV)
    band = torch.where((rows >= keys) & (rows - keys < width[:, None, None]), 0.0, -math.inf)
    band = (band + 0.5 * torch.randn(b, hq, nq, nk, device=DEV)).float()
    doc_q, doc_k = (rows - (nk - nq)) * 3 // nq, keys * 3 // nk  # 3 documents
    documents = (doc_q == doc_k) & causal
    return {"hf_bool": hf, "hf_additive": additive, "per_head_band": band, "documents": documents}


# Every other mask goes through tile classes (classify_bwd_mask_tiles): hidden tiles at the ends
# of a walk are dropped, clear ones take the plain code, mixed ones the per-element mask; on the
# Hopper kernels (64, 128, 256) and the portable ones (96; and all four with FLASHMOD_DISABLE_SM90),
# whose tiles (32 to 128 rows) nest in the classified 64 x 64 ones or tile them.
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
def test_tile_classified_masks(monkeypatch, dtype, d, portable):
    if portable:
        monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    q, k, v = make_inputs(DEV, dtype, 4, 4, 2, 203, 333, d)
    for name, mask in tiled_masks(4, 4, 203, 333, dtype).items():
        check_grads(q, k, v, attn_mask=mask)
        if name == "hf_bool":  # with a soft cap the clear tiles stay on the general code
            check_grads(q, k, v, attn_mask=mask, softcap=5.0)


# At D = 256 (and the head dims widened to it) a mask that stages takes a variant that reads every
# tile from shared memory, with no plain steps beside it, yet drops hidden tiles at both ends of a
# walk: transformers' causal + padding mask as 0 / -inf in q's dtype with 16-byte-aligned rows (Nk =
# 336), and a dense bias with rows that see no key.
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [229, 256])
def test_staged_masks_wide_head_dims(dtype, d):
    q, k, v = make_inputs(DEV, dtype, 4, 4, 2, 203, 336, d)
    check_grads(q, k, v, attn_mask=tiled_masks(4, 4, 203, 336, dtype)["hf_additive"])
    bias = torch.randn(4, 4, 203, 336, device=DEV, dtype=dtype)
    bias[:, :, 5::37] = -math.inf
    bias[:, 1, :, 100:250] = torch.finfo(dtype).min
    check_grads(q, k, v, attn_mask=bias)
    check_grads(q, k, v, attn_mask=bias, is_causal=True)


def test_tile_classified_mask_gradient():
    """A learned bias under a causal + padding staircase: the mask's own gradient (written by the
    general code, never the plain one) stays within the rule, and is 0 on the hidden tiles the
    kernels skip."""
    q, k, v = make_inputs(DEV, torch.bfloat16, 2, 4, 2, 203, 333, 128)
    hf = tiled_masks(2, 4, 203, 333, torch.float32)["hf_bool"]
    bias = torch.randn(2, 4, 203, 333, device=DEV).masked_fill(~hf, -math.inf)
    grad_out = torch.randn_like(q)

    def mask_grad(fn, *inputs, **kw):
        m = inputs[3].clone().requires_grad_()
        out = fn(*inputs[:3], m, **kw)[0]
        return torch.autograd.grad(out, m, grad_out.to(out.dtype))[0]

    ours = mask_grad(flashmod.attention_op, q, k, v, bias)
    truth = mask_grad(attention_reference, q.double(), k.double(), v.double(), bias.double())
    plain = mask_grad(attention_reference, q, k, v, bias.bfloat16(), compute_dtype=torch.bfloat16)
    assert_within_rule(ours, truth, plain, 3, torch.bfloat16, "mask grad")
    assert (ours[~hf.expand_as(ours)] == 0).all()


# Additive masks in q's dtype without a soft cap take fast paths of their own at D = 128 on the
# Hopper kernels (bwd_common.h): the dK/dV kernel reads tiles staged in shared memory where the
# rows are 16-byte aligned (bwd_stages_mask), the dQ kernel batches its global loads in any layout.
# Layouts that stage (Nk % 8 == 0; rows padded past an odd Nk, the last chunk partial) and ones
# that do not (keys strided, key-padding rows broadcast with an odd Nk), per-head masks under GQA,
# causal and not (the staged path's window test), odd query counts (rows past Nq zero-filled).
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("d", [64, 128, 229, 256])
@pytest.mark.parametrize("layout", ["rows", "padded-rows", "keys-strided", "per-head", "key-padding"])
@pytest.mark.parametrize(("nq", "nk"), [(203, 256), (130, 333)])
def test_additive_mask_layouts(dtype, d, layout, nq, nk):
    q, k, v = make_inputs(DEV, dtype, 2, 4, 2, nq, nk, d)
    mask = layout_mask("additive", layout, 2, 4, nq, nk, dtype, DEV)
    check_grads(q, k, v, attn_mask=mask)
    check_grads(q, k, v, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True}], ids=str)
def test_fp32_key_padding_masks(d, opts):
    q, k, v = make_inputs(DEV, torch.float32, 6, 2, 1, 203, 333, d)
    for mask in key_padding_masks(6, 333):
        check_grads_fp32(q, k, v, attn_mask=mask, **opts)


@pytest.mark.parametrize("shape", [(113, 150), (1, 2, 1, 150), (2, 1, 113, 1)])
def test_fp32_masks(shape):
    q, k, v = make_inputs(DEV, torch.float32, 2, 2, 2, 113, 150, 59)
    check_grads_fp32(q, k, v, attn_mask=torch.rand(shape, device=DEV) > 0.3)
    check_grads_fp32(q, k, v, attn_mask=torch.randn(shape, device=DEV), is_causal=True)


@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("d", [64, 256])
def test_fp32_gqa_mqa(hq, hkv, d):
    check_grads_fp32(*make_inputs(DEV, torch.float32, 2, hq, hkv, 113, 150, d), is_causal=True)


@pytest.mark.parametrize("use_grad_lse", [False, True])
def test_fp32_grad_lse(use_grad_lse):
    check_grads_fp32(*make_inputs(DEV, torch.float32, 1, 2, 2, 113, 130, 64), use_grad_lse=use_grad_lse)


def test_fp32_strided_unaligned_and_empty_inputs():
    """(B, S, H, D) views, a row-strided slice at an odd offset (copied for alignment), odd D, and
    tensors with no rows."""
    q = torch.randn(2, 113, 4, 59, device=DEV).transpose(1, 2)
    k = torch.randn(2, 150, 2, 59, device=DEV).transpose(1, 2)
    v = torch.randn(2, 2, 150, 80, device=DEV)[..., 3:62]
    dq, dk, dv = check_grads_fp32(q, k, v, is_causal=True)
    assert dq.stride() == q.stride() and dk.stride() == k.stride()
    for nq, nk in ((0, 5), (5, 0)):
        q, k, v = make_inputs(DEV, torch.float32, 1, 2, 2, nq, nk, 64)
        grads = fused_grads(q, k, v, torch.randn_like(q), None)
        assert all(g.shape == t.shape and not g.isnan().any() for g, t in zip(grads, (q, k, v)))
        assert all(torch.all(g == 0) for g in grads)


def hopper_tiles() -> list[tuple[str, int]]:
    """(name, head dim) of every tile the Hopper backward is built with (tools/gen_kernels.py)."""
    path = Path(__file__).resolve().parents[2] / "tools" / "gen_kernels.py"
    spec = importlib.util.spec_from_file_location("gen_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    family = next(f for f in module.FAMILIES if f.name == "bwd_sm90")
    return [(t.name, d) for _, t, d in family.tile_entries()]


def needs_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FLASHMOD_BWD_SM90_TILE picks among the Hopper (sm_90a) kernels only")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize(("tile", "d"), hopper_tiles(), ids=[f"{n}-d{d}" for n, d in hopper_tiles()])
def test_hopper_tile(monkeypatch, tile, d, dtype):
    """Each tile variant alone: odd and unequal sizes (partial blocks, a single row), both causal
    alignments (whole-step skipping, diagonal blocks), a window, GQA, the general path (soft cap,
    bool mask), keys no query sees, and run-to-run bitwise equality."""
    needs_hopper()
    monkeypatch.setenv("FLASHMOD_BWD_SM90_TILE", tile)
    for nq, nk in [(1, 1), (17, 203), (203, 113), (257, 300)]:
        check_grads(*make_inputs(DEV, dtype, 2, 4, 2, nq, nk, d))
    for bottom_right in (True, False):
        check_grads(*make_inputs(DEV, dtype, 1, 2, 1, 300, 457, d), is_causal=True, bottom_right=bottom_right)
    check_grads(*make_inputs(DEV, dtype, 1, 2, 1, 1023, 1023, d), is_causal=True)
    q, k, v = make_inputs(DEV, dtype, 1, 2, 2, 203, 260, d)
    check_grads(q, k, v, window_left=40, window_right=3, bottom_right=False)
    check_grads(q * 3, k * 3, v, softcap=5.0, is_causal=True)
    check_grads(q, k, v, attn_mask=torch.rand(203, 260, device=DEV) > 0.3)
    _, dk, dv = check_grads(*make_inputs(DEV, dtype, 1, 2, 2, 70, 300, d), is_causal=True, bottom_right=False)
    assert torch.all(dk[:, :, 70:] == 0) and torch.all(dv[:, :, 70:] == 0)
    q, k, v = make_inputs(DEV, dtype, 2, 8, 2, 1100, 1023, d)
    grad_out, grad_lse = draw_upstream(q)
    first = fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)
    for _ in range(5):
        for a, b in zip(first, fused_grads(q, k, v, grad_out, grad_lse, is_causal=True)):
            assert torch.equal(a, b)


def test_hopper_tile_knob_names_what_is_built(monkeypatch):
    needs_hopper()
    q, k, v = make_inputs(DEV, torch.bfloat16, 1, 2, 2, 64, 64, 64)
    out, lse = torch.ops.flashmod.attention(q, k, v)
    monkeypatch.setenv("FLASHMOD_BWD_SM90_TILE", "no-such-tile")
    with pytest.raises(RuntimeError, match=r"FLASHMOD_BWD_SM90_TILE=no-such-tile .*head dim 64.*base"):
        torch.ops.flashmod.attention_backward(torch.randn_like(out), None, q, k, v, out, lse)
