"""CUDA-only checks of the flashmod.attention kernels (csrc/attention/cuda/); skipped without a GPU.

The device-parametrized suite (test_attention.py) covers the semantics on every device. Here:
the full grid of odd sizes on the tensor-core kernel, fp32's 1e-5 relative accuracy, alignment
fix-ups, bitwise determinism, CUDA-graph capture, non-default streams, 64-bit offsets, and
compute-sanitizer runs.

compute-sanitizer runs tools/cuda_sanitizer_case.py (test_compute_sanitizer below; by hand, see there).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tolerance import assert_within_rule

from flashmod.ops import attention_op
from flashmod.reference import attention_reference

pytestmark = pytest.mark.cuda  # tests/conftest.py skips these without a GPU

LENGTHS = [1, 17, 113, 203, 256, 1023]
HEAD_DIMS = [32, 40, 59, 64, 111, 128, 256]
LOW = [torch.float16, torch.bfloat16]


def run_and_check(q, k, v, mask=None, **opts):
    out, lse = attention_op(q, k, v, mask, **opts)
    dtype = q.dtype
    truth_o, truth_l = attention_reference(q, k, v, mask, compute_dtype=torch.float64, **opts)
    plain_o, plain_l = attention_reference(q, k, v, mask, compute_dtype=dtype, **opts)
    assert_within_rule(out, truth_o, plain_o, 2.0, dtype, "out")
    assert_within_rule(lse, truth_l, plain_l.float(), 2.0, dtype, "lse")
    return out, lse


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Odd sizes on the tensor-core kernel: every (Nq, Nk) pair of LENGTHS at two head dims each, and
# every head dim at a few length pairs.
PAIRS = [(a, b) for a in LENGTHS for b in LENGTHS]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("nq,nk", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_all_length_pairs(dtype, nq, nk, causal):
    d = HEAD_DIMS[(nq * 7 + nk) % len(HEAD_DIMS)]
    q, k, v = rand(2, 4, nq, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype)
    run_and_check(q, k, v, is_causal=causal, bottom_right=bool(nq % 2))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS + [8, 96, 160, 192, 200, 224])
@pytest.mark.parametrize("nq,nk", [(1, 1023), (1023, 1), (203, 256), (256, 203), (113, 17)])
def test_all_head_dims(dtype, d, nq, nk):
    q, k, v = rand(1, 3, nq, d, dtype=dtype), rand(1, 3, nk, d, dtype=dtype), rand(1, 3, nk, d, dtype=dtype)
    run_and_check(q, k, v)
    run_and_check(q, k, v, is_causal=True)


# On an H100/H200 every head dim runs a wgmma kernel (fwd_sm90_ws_kernel.h, fwd_sm90_kernel.h), so the
# suite above tests them there; FLASHMOD_DISABLE_SM90=1 sends the same shapes to the portable
# mma.sync kernel, which A100-class GPUs run.
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [40, 64, 111, 128, 256])
@pytest.mark.parametrize("nq,nk", [(1, 1023), (203, 113), (1023, 203)])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True}, {"softcap": 5.0, "window_left": 50}], ids=str)
def test_portable_kernel_where_sm90_exists(monkeypatch, dtype, d, nq, nk, opts):
    monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    q, k, v = rand(2, 4, nq, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype)
    run_and_check(q, k, v, **opts)


# On an H100/H200 plain-score calls at head dims 33..64 and 97..128 run the warp-specialized TMA
# kernel (fwd_sm90_ws_kernel.h); FLASHMOD_SM90_WS=0 sends them to the FlashAttention-2-style wgmma
# kernel. Both on the same shapes: lengths that end mid-tile (TMA's zero fill past a head's rows
# must never bring in the next head's), both causal alignments, windows, GQA; FLASHMOD_DECODE=0 so
# short query lengths reach these kernels rather than the decode one. At head dims up to 64 both
# tile heights run: 192 rows (three consumers) and, under a right window bound with at most 1024
# query rows, 128 (fwd_sm90_ws_launch.h: FwdWsConfig). Soft-capped scores run it too. Head dims
# 129..192 run its D = 192 variant and 193..256 its D = 256 one (64-key blocks, O stored from
# registers): 179 (odd, element-wise stores), 192 and 256; so does the FlashAttention-2-style
# kernel (its D = 192 form since session 58: 192 of its 256 threads copy the tiles).
@pytest.mark.parametrize("ws", ["1", "0"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [40, 64, 111, 128, 179, 192, 256])
@pytest.mark.parametrize("nq,nk", [(1, 1), (17, 1023), (113, 113), (1023, 1023), (1023, 17), (203, 4099), (2053, 1500)])
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"is_causal": True},
        {"is_causal": True, "bottom_right": False},
        {"window_left": 77, "window_right": 20},
        {"softcap": 5.0, "is_causal": True},
    ],
    ids=str,
)
def test_sm90_ws_kernel_and_fallback(monkeypatch, ws, dtype, d, nq, nk, opts):
    monkeypatch.setenv("FLASHMOD_SM90_WS", ws)
    monkeypatch.setenv("FLASHMOD_DECODE", "0")
    q, k, v = rand(2, 8, nq, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype)
    run_and_check(q, k, v, **opts)


# More tiles than SMs, so each persistent CTA walks several (round-robin without a right window
# bound, claimed from the dynamic scheduler's counter with one): the buffer ring and the barrier
# phases run on across tiles, and tiles whose rows see no key (a left window with top-left
# alignment: rows >= 750; causal bottom-right with Nq > Nk: rows < 323) are skipped by the
# producer and written as empty by the consumers. Under a right window bound a head's query blocks
# end near its last row (1023 rows at D = 64: the first block starts 128 rows before row 0, and
# its rows see no key), or, with FLASHMOD_SM90_WS_END_ALIGNED=0, start at its first. Also one CTA
# per tile throughout, the output stored by the warps instead of the copy engine (the path of
# packed rows and of outputs TMA cannot take), and the FlashAttention-2-style kernel.
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"FLASHMOD_SM90_WS_END_ALIGNED": "0"},
        {"FLASHMOD_SM90_WS_PERSISTENT": "0"},
        {"FLASHMOD_SM90_WS_TMA_STORE": "0"},
        {"FLASHMOD_SM90_WS": "0"},
    ],
    ids=["persistent", "start_aligned", "one_tile_per_cta", "warp_stores", "fa2_style"],
)
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True}, {"window_left": 50, "bottom_right": False}], ids=str)
def test_sm90_ws_many_tiles(monkeypatch, knobs, d, opts):
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    q = rand(3, 16, 1023, d, dtype=torch.bfloat16)
    k, v = rand(3, 4, 700, d, dtype=torch.bfloat16), rand(3, 4, 700, d, dtype=torch.bfloat16)
    out, lse = run_and_check(q, k, v, **opts)
    if opts:  # the rows that see no key
        empty = slice(0, 323) if opts.get("is_causal") else slice(750, None)
        assert (out[:, :, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()


# Under a right window bound a D = 64 consumer whose 64 rows see no key in the right half of its
# last key block computes only the left half (every other consumer when the block boundaries sit on
# the diagonal; D = 128 has no half blocks). The keys it leaves out are hidden, so the result must
# equal the full block's bit for bit (FLASHMOD_SM90_WS_HALF_BLOCKS=0), and both must meet the
# accuracy rule. Lengths where Br divides Nq (384) and where it does not, a window whose right edge
# is not on the diagonal, Nk != Nq (bottom-right and top-left diagonals), GQA, and rows that see no
# key.
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64])
@pytest.mark.parametrize(
    "nq,nk,opts",
    [
        (1024, 1024, {"is_causal": True}),
        (1023, 1023, {"is_causal": True}),
        (384, 384, {"is_causal": True}),
        (203, 517, {"is_causal": True}),
        (517, 203, {"is_causal": True, "bottom_right": False}),
        (700, 700, {"window_left": 77, "window_right": 20}),
        (1000, 1100, {"window_left": -1, "window_right": 64}),
    ],
    ids=str,
)
def test_sm90_ws_half_blocks_equal_full_blocks(monkeypatch, dtype, d, nq, nk, opts):
    monkeypatch.setenv("FLASHMOD_DECODE", "0")
    q = rand(2, 8, nq, d, dtype=dtype)
    k, v = rand(2, 2, nk, d, dtype=dtype), rand(2, 2, nk, d, dtype=dtype)
    out, lse = run_and_check(q, k, v, **opts)
    monkeypatch.setenv("FLASHMOD_SM90_WS_HALF_BLOCKS", "0")
    full_out, full_lse = attention_op(q, k, v, None, **opts)
    assert torch.equal(out, full_out) and torch.equal(lse, full_lse)


# Bool key-padding masks ((B, 1, 1, Nk) and (1, 1, 1, Nk), one bit per key) run the warp-specialized
# kernel: the producer turns each key block's bytes into bits. Random masks (not prefixes), a batch
# row with every key hidden (its rows: output 0, lse -inf), a column stride of 2, more tiles than
# SMs, causal and not, GQA; FLASHMOD_SM90_WS=0 runs the same on the FlashAttention-2-style kernel
# (as do D = 192 / 256, whose 64-key blocks the mask bits do not fit: the launch hands them over).
@pytest.mark.parametrize("ws", ["1", "0"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_batch", [3, 1])
def test_sm90_ws_key_padding_mask(monkeypatch, ws, d, causal, mask_batch):
    monkeypatch.setenv("FLASHMOD_SM90_WS", ws)
    monkeypatch.setenv("FLASHMOD_DECODE", "0")
    q = rand(3, 16, 1023, d, dtype=torch.bfloat16)
    k, v = rand(3, 4, 700, d, dtype=torch.bfloat16), rand(3, 4, 700, d, dtype=torch.bfloat16)
    wide = torch.rand(mask_batch, 1, 1, 1400, device="cuda") > 0.3
    if mask_batch == 3:
        wide[1] = False  # batch row 1 sees no key at all
    mask = wide[..., ::2]
    out, lse = run_and_check(q, k, v, mask, is_causal=causal)
    if mask_batch == 3:
        assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


# Layouts the tensor maps must follow: (B, S, H, D) storage and k/v interleaved in one tensor (TMA
# takes these), and heads broadcast with stride 0 (TMA cannot: the kernel hands the call over).
@pytest.mark.parametrize("ws", ["1", "0"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_sm90_ws_layouts(monkeypatch, ws, d):
    monkeypatch.setenv("FLASHMOD_SM90_WS", ws)
    b, nq, nk, h = 3, 300, 519, 6
    q = rand(b, nq, h, d, dtype=torch.bfloat16).transpose(1, 2)
    kv = rand(b, nk, 2, 3, d, dtype=torch.bfloat16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    run_and_check(q, k, v, is_causal=True)
    k1 = rand(b, 1, nk, d, dtype=torch.bfloat16).expand(b, h, nk, d)
    v1 = rand(b, 1, nk, d, dtype=torch.bfloat16).expand(b, h, nk, d)
    run_and_check(q, k1, v1)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "opts",
    [
        {"window_left": 100, "window_right": 30},
        {"window_left": 0, "window_right": 0},
        {"window_left": 300, "window_right": -1, "bottom_right": False},
        {"softcap": 10.0},
        {"scale": -0.2},
        {"scale": 0.0, "is_causal": True},
    ],
    ids=str,
)
def test_windows_softcap_scale(dtype, d, opts):
    q, k, v = rand(2, 4, 1023, d, dtype=dtype), rand(2, 4, 777, d, dtype=dtype), rand(2, 4, 777, d, dtype=dtype)
    run_and_check(q, k, v, **opts)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive", "additive_f32", "bool_transposed", "padding"])
@pytest.mark.parametrize("d", [64, 192])  # on Hopper 192: the FlashAttention-2-style kernel's D = 192 form
def test_masks_broadcast_and_strides(dtype, kind, d):
    b, h, nq, nk = 2, 4, 203, 300
    q, k, v = rand(b, h, nq, d, dtype=dtype), rand(b, 2, nk, d, dtype=dtype), rand(b, 2, nk, d, dtype=dtype)
    if kind == "bool":
        mask = torch.rand(1, h, nq, nk, device="cuda") > 0.4
        mask[:, :, ::7] = False  # fully masked rows
    elif kind == "bool_transposed":  # column stride != 1
        mask = (torch.rand(b, 1, nk, nq, device="cuda") > 0.4).transpose(-1, -2)
    elif kind == "padding":  # (B, 1, 1, Nk): three broadcast strides
        lengths = torch.randint(1, nk + 1, (b,), device="cuda")
        mask = (torch.arange(nk, device="cuda")[None] < lengths[:, None])[:, None, None, :]
    else:
        mask = torch.randn(nq, nk, device="cuda")
        mask = mask.masked_fill(torch.rand_like(mask) < 0.2, -math.inf)
        mask[5] = -math.inf
        if kind == "additive":
            mask = mask.to(dtype)
    out, lse = run_and_check(q, k, v, mask)
    if kind in ("bool", "additive", "additive_f32"):
        empty_row = 0 if kind == "bool" else 5
        assert (out[:, :, empty_row] == 0).all() and torch.isneginf(lse[:, :, empty_row]).all()


# Additive masks in q's dtype on the warp-specialized kernel's mask rows (kBias, head dims 64 and
# 128; with FLASHMOD_MASK_SHOWN_TILES=0 every read tile's values tested for hiding), and with
# FLASHMOD_SM90_WS_BIAS=0 on the FlashAttention-2-style kernel's staged tiles; the profiler names
# the kernel that ran. Masks: a dense bias per head with rows that see no key
# (finfo.min, -inf); one broadcast over batch and heads (strides 0); transformers' causal + left
# padding as finfo.min, with a band of hidden keys inside (hidden tiles at both ends of a query
# block's range and within it, clear tiles, query blocks that see no key at all); rows padded
# past an odd Nk (row stride > Nk); a dense bias under a window.
@pytest.mark.parametrize("ws_bias", ["1", "1-tested", "0"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["dense", "broadcast", "causal_padding", "padded_rows", "window"])
def test_sm90_ws_additive_mask(monkeypatch, ws_bias, dtype, d, kind):
    monkeypatch.setenv("FLASHMOD_SM90_WS_BIAS", ws_bias[0])
    monkeypatch.setenv("FLASHMOD_MASK_SHOWN_TILES", "0" if ws_bias == "1-tested" else "1")
    monkeypatch.setenv("FLASHMOD_DECODE", "0")
    b, h, nq, nk = 2, 4, 1023, 520
    if kind in ("causal_padding", "padded_rows"):
        nk = 1023 if kind == "causal_padding" else 517
    q, k, v = rand(b, h, nq, d, dtype=dtype), rand(b, 2, nk, d, dtype=dtype), rand(b, 2, nk, d, dtype=dtype)
    hide = torch.finfo(dtype).min
    opts = {}
    empty_rows = []  # (batch, head or None, row): rows that see no key
    if kind in ("dense", "window"):
        mask = (2 * torch.randn(b, h, nq, nk, device="cuda")).to(dtype)
        mask[0, 1, 7] = hide
        mask[1, :, 300] = -math.inf
        empty_rows = [(0, 1, 7), (1, None, 300)]
        if kind == "window":
            opts = {"window_left": 100, "window_right": 30}
    elif kind == "broadcast":
        mask = (2 * torch.randn(1, 1, nq, nk, device="cuda")).to(dtype)
    elif kind == "causal_padding":
        # Stored with rows of 1024 keys (16-byte aligned), seen as 1023.
        store = torch.zeros(b, 1, nq, 1024, device="cuda", dtype=dtype)
        mask = store[..., :nk]
        keys, rows = torch.arange(nk, device="cuda"), torch.arange(nq, device="cuda")
        visible = keys[None, :] <= rows[:, None]
        visible[:, 256:384] = False
        pad = torch.tensor([0, 300], device="cuda")
        visible = visible[None] & (keys[None, None, :] >= pad[:, None, None])
        mask.copy_(torch.where(visible, 0.0, hide)[:, None].to(dtype))
        mask[:, :, 600:] += (0.5 * torch.randn(b, 1, nq - 600, nk, device="cuda")).to(dtype)
        empty_rows = [(1, None, r) for r in (0, 150, 299)]
    else:  # padded_rows
        mask = (2 * torch.randn(b, h, nq, 528, device="cuda")).to(dtype)[..., :nk]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = run_and_check(q, k, v, mask, **opts)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert ("attention_fwd_sm90_ws_kernel" in names) == (hopper and ws_bias != "0"), names
    for bi, hi, row in empty_rows:
        heads = slice(None) if hi is None else hi
        assert (out[bi, heads, row] == 0).all() and torch.isneginf(lse[bi, heads, row]).all()


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_strided_and_unaligned_inputs(dtype):
    # (B, S, H, D) storage, a head-dim slice at an odd offset (not 16-byte aligned: the launcher
    # copies it), and k/v as views of one packed tensor.
    b, nq, nk, h, d = 2, 130, 257, 4, 64
    q = rand(b, nq, h, d, dtype=dtype).transpose(1, 2)
    kv = rand(b, nk, 2, h, d + 3, dtype=dtype)[..., 3:]
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    out, _ = run_and_check(q, k, v, is_causal=True)
    assert out.stride() == torch.empty_like(q).stride()


def test_fp32_relative_error_1e5():
    for nq, nk, d, opts in [
        (203, 1023, 64, {}),
        (1023, 203, 111, {"is_causal": True}),
        (17, 256, 256, {"window_left": 40, "window_right": 3}),
        (256, 113, 32, {"softcap": 4.0}),
    ]:
        q, k, v = (rand(2, 4, n, d, dtype=torch.float32) for n in (nq, nk, nk))
        out, lse = attention_op(q, k, v, **opts)
        ref, ref_lse = attention_reference(q, k, v, compute_dtype=torch.float64, **opts)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel <= 1e-5, (nq, nk, d, opts, rel)
        finite = torch.isfinite(ref_lse)
        assert ((lse.double() - ref_lse)[finite].abs().max().item()) <= 1e-5 * max(
            1.0, ref_lse[finite].abs().max().item()
        )


# fp32 has three kernels: 3xTF32 on the tensor cores (more than 32 query rows) with wgmma on
# Hopper (head dims <= 128, rows 16-byte aligned; FLASHMOD_FP32_WGMMA=0 turns it off) or mma.sync
# (where the device's shared memory takes its tiles: every head dim on Hopper, <= 192 on an A100;
# past 128 two warps share each row tile), and the CUDA-core one (the rest, or everything with
# FLASHMOD_FP32_FFMA=1). All must keep fp32 accuracy on odd sizes, GQA, masks, windows, soft cap
# and unaligned rows (4-byte copies).
@pytest.mark.parametrize("wgmma", ["1", "0"])
@pytest.mark.parametrize("ffma", ["0", "1"])
@pytest.mark.parametrize(
    "nq,nk,d,opts",
    [
        (113, 1023, 8, {}),
        (203, 17, 40, {"is_causal": True}),
        (1023, 203, 59, {"is_causal": True, "bottom_right": True}),
        (256, 777, 64, {"window_left": 100, "window_right": 30}),
        (65, 1, 111, {}),
        (300, 257, 128, {"softcap": 5.0, "scale": -0.3}),
        (150, 333, 72, {"is_causal": True}),  # aligned rows on the 128-wide wgmma tile's zero columns
        (33, 1023, 128, {"mask": "bool"}),
        (129, 300, 64, {"mask": "additive"}),
        (200, 200, 96, {"mask": "padding", "unaligned": True}),
        (203, 300, 160, {"is_causal": True}),
        (113, 1023, 229, {"mask": "bool"}),
        (1023, 257, 256, {"window_left": 100, "window_right": 30}),
        (65, 129, 192, {"softcap": 5.0, "scale": -0.3}),
        (300, 203, 224, {"mask": "additive", "is_causal": True}),
        (200, 200, 250, {"mask": "padding", "unaligned": True}),
        (17, 300, 256, {}),
    ],
    ids=str,
)
def test_fp32_kernels(monkeypatch, ffma, wgmma, nq, nk, d, opts):
    monkeypatch.setenv("FLASHMOD_FP32_FFMA", ffma)
    monkeypatch.setenv("FLASHMOD_FP32_WGMMA", wgmma)
    opts = dict(opts)
    kind, unaligned = opts.pop("mask", None), opts.pop("unaligned", False)
    b, hq, hk = 2, 4, 2
    if unaligned:  # a head-dim slice at an odd offset: rows start off 16-byte boundaries
        q = rand(b, hq, nq, d + 1, dtype=torch.float32)[..., 1:]
        kv = rand(b, hk, nk, 2, d + 3, dtype=torch.float32)[..., 3:]
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    else:
        q, k, v = (
            rand(b, hq, nq, d, dtype=torch.float32),
            rand(b, hk, nk, d, dtype=torch.float32),
            rand(b, hk, nk, d, dtype=torch.float32),
        )
    mask = None
    if kind == "bool":
        mask = torch.rand(1, hq, nq, nk, device="cuda") > 0.3
        mask[:, :, 5] = False  # a row without a visible key: zeros, lse -inf
    elif kind == "additive":
        mask = torch.randn(b, 1, nq, nk, device="cuda")
    elif kind == "padding":
        mask = torch.ones(b, 1, 1, nk, dtype=torch.bool, device="cuda")
        mask[0, ..., nk // 3 :] = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = run_and_check(q, k, v, mask, **opts)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    padded = 32 if d <= 32 else 64 if d <= 64 else 128 if d <= 128 else -(-d // 32) * 32
    # Opt-in shared memory per block the tensor-core kernel takes: Q_i, K_j and V_j (Bc = 64 keys
    # up to head dim 64, else 32; K and V as tf32 halves), rows of padded + 4 floats; past head dim
    # 128 the pairs' exchange of partial S (8 warps x 16 rows x 32 keys).
    bc = 64 if padded <= 64 else 32
    smem = 4 * ((64 + 4 * bc) * (padded + 4) + (8 * 16 * 32 if padded > 128 else 0))
    optin = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
    hopper = torch.cuda.get_device_capability() == (9, 0)
    on_wgmma = hopper and wgmma == "1" and ffma == "0" and nq > 32 and d <= 128 and d % 4 == 0 and not unaligned
    tensor_cores = ffma == "0" and nq > 32 and optin >= smem and not on_wgmma
    assert ("fp32_sm90_kernel" in names) == on_wgmma, names
    assert ("fp32_tc_kernel" in names) == tensor_cores, names
    assert ("fp32_kernel<" in names) == (not tensor_cores and not on_wgmma), names
    ref, _ = attention_reference(q, k, v, mask, compute_dtype=torch.float64, **opts)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, rel
    if kind == "bool":
        assert (out[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()


def test_fp64_rejected_and_head_dim_limit(repo_root):
    # In a subprocess: on the GPU machine's build (g++ 13.3, 2026-11-22) a TORCH_CHECK whose message
    # holds an integer crashed the process (SIGSEGV) instead of raising, on CPU tensors too (see
    # csrc/common/error_message.h); a crash here must fail this test, not end the whole run.
    code = """
import torch, flashmod
x = torch.randn(1, 1, 4, 8, device="cuda", dtype=torch.float64)
try:
    torch.ops.flashmod.attention(x, x, x)
except RuntimeError as e:
    assert "float64 is supported on CPU only" in str(e), e
else:
    raise AssertionError("fp64 accepted on CUDA")
y = torch.randn(1, 1, 4, 264, device="cuda", dtype=torch.float16)
try:
    torch.ops.flashmod.attention(y, y, y)
except RuntimeError as e:
    assert "head_dim must be <= 256" in str(e), e
else:
    raise AssertionError("head_dim 264 accepted on CUDA")
print("checks raised")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, timeout=300)
    assert res.returncode == 0 and "checks raised" in res.stdout, (res.returncode, res.stderr[-2000:])


def test_empty_and_zero_keys():
    q = rand(2, 4, 5, 64, dtype=torch.bfloat16)
    k = rand(2, 4, 0, 64, dtype=torch.bfloat16)
    out, lse = attention_op(q, k, k)
    assert (out == 0).all() and torch.isneginf(lse).all()
    out, lse = attention_op(q[:0], k[:0], k[:0])
    assert out.shape == (0, 4, 5, 64) and lse.shape == (0, 4, 5)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [128, 192])
@pytest.mark.parametrize("dtype", LOW + [torch.float32], ids=str)
def test_bitwise_deterministic_100_runs(dtype, d):
    q, k, v = rand(2, 8, 333, d, dtype=dtype), rand(2, 2, 517, d, dtype=dtype), rand(2, 2, 517, d, dtype=dtype)
    first, first_lse = attention_op(q, k, v, is_causal=True)
    for _ in range(100):
        out, lse = attention_op(q, k, v, is_causal=True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)


def test_cuda_graph_capture_and_replay():
    q, k, v = (rand(2, 4, 300, 64, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(300, 300, device="cuda") > 0.2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (lazy init, attribute setting)
        attention_op(q, k, v, mask, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention_op(q, k, v, mask, is_causal=True)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_op(q, k, v, mask, is_causal=True)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


# The dynamic tile scheduler's counter is zeroed in the stream before each launch: a captured
# graph must replay that too, or the second replay would start past the first tiles and leave
# them unwritten (the outputs are poisoned between replays to show it).
@pytest.mark.parametrize("d", [128, 192])
def test_sm90_ws_dynamic_schedule_replays_in_cuda_graph(d):
    q, k, v = (rand(3, 16, 1023, d, dtype=torch.bfloat16) for _ in range(3))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        attention_op(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention_op(q, k, v, is_causal=True)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = attention_op(q, k, v, is_causal=True)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    truth_o, truth_l = attention_reference(q, k, v, None, compute_dtype=torch.float64, is_causal=True)
    plain_o, plain_l = attention_reference(q, k, v, None, compute_dtype=q.dtype, is_causal=True)
    assert_within_rule(out, truth_o, plain_o, 2.0, q.dtype, "out")
    assert_within_rule(lse, truth_l, plain_l.float(), 2.0, q.dtype, "lse")


# Eager calls share the stream's scheduler counters, which the last CTA of each launch zeroes
# again: launches of different grids, one after another on two streams, must each compute every
# tile (fresh inputs per call, so a tile left unwritten cannot hold a right answer from before),
# bitwise as with a memset per call.
def test_sm90_ws_dynamic_schedule_shared_counters(monkeypatch):
    shapes = [(3, 16, 1023, 128), (1, 4, 300, 64), (2, 8, 2000, 128), (1, 2, 129, 64)]
    side = torch.cuda.Stream()
    for round_ in range(3):
        for stream in (torch.cuda.current_stream(), side):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for b, h, n, d in shapes:
                    q, k, v = (rand(b, h, n, d, dtype=torch.bfloat16) for _ in range(3))
                    monkeypatch.delenv("FLASHMOD_STREAM_COUNTERS", raising=False)
                    out, lse = attention_op(q, k, v, is_causal=True)
                    monkeypatch.setenv("FLASHMOD_STREAM_COUNTERS", "0")
                    ref, ref_lse = attention_op(q, k, v, is_causal=True)
                    assert torch.equal(out, ref) and torch.equal(lse, ref_lse), (round_, b, h, n, d)
            torch.cuda.current_stream().wait_stream(stream)
    truth_o, _ = attention_reference(q, k, v, None, compute_dtype=torch.float64, is_causal=True)
    plain_o, _ = attention_reference(q, k, v, None, compute_dtype=q.dtype, is_causal=True)
    assert_within_rule(out, truth_o, plain_o, 2.0, q.dtype, "out")


def test_non_default_stream():
    q, k, v = (rand(2, 4, 1000, 128, dtype=torch.float16) for _ in range(3))
    expected, _ = attention_op(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # the kernel must queue behind this, not on stream 0
        out, _ = attention_op(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)


def test_offsets_past_2_pow_31():
    # (B, S, H, D) storage of 4 * 65600 * 64 * 128 = 2.15e9 elements > 2^31 per tensor (4.3 GB in
    # bf16; ~18 GB for q, k, v, out). A +-32 window keeps the arithmetic small.
    b, n, h, d, w = 4, 65600, 64, 128, 32
    if torch.cuda.get_device_properties(0).total_memory < 30 * 2**30:
        pytest.skip("needs ~20 GB of GPU memory")
    assert b * n * h * d > 2**31
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    opts = {"window_left": w, "window_right": w, "bottom_right": False}
    out, lse = attention_op(q, k, v, **opts)
    for bi, hi, i0 in [(b - 1, h - 1, n - 50), (b - 1, 17, 1000), (0, 0, 0), (2, 40, 33000)]:
        rows = slice(i0, min(n, i0 + 50))
        k0, k1 = max(0, i0 - w), min(n, i0 + 50 + w)
        qs = q[bi : bi + 1, hi : hi + 1, rows]
        ks, vs = k[bi : bi + 1, hi : hi + 1, k0:k1], v[bi : bi + 1, hi : hi + 1, k0:k1]
        i = torch.arange(rows.start, rows.stop, device="cuda")[:, None]
        j = torch.arange(k0, k1, device="cuda")[None, :]
        mask = (j >= i - w) & (j <= i + w)
        truth, _ = attention_reference(qs, ks, vs, mask, compute_dtype=torch.float64)
        plain, _ = attention_reference(qs, ks, vs, mask, compute_dtype=torch.bfloat16)
        assert_within_rule(out[bi : bi + 1, hi : hi + 1, rows], truth, plain, 2.0, torch.bfloat16, "out")
    del q, k, v, out, lse
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Decode path (Nq <= 64: csrc/attention/cuda/fwd_sm80_launch.h's decode kernel with GQA packing and split-KV).
# The host picks packing and the split count from the shapes; the FLASHMOD_DECODE* knobs of
# csrc/attention/cuda/attention_cuda.cpp force each choice, so every case runs under all of them.
DECODE_MODES = {
    "heuristic": {},
    "prefill_kernel": {"FLASHMOD_DECODE": "0"},
    "packed_1split": {"FLASHMOD_DECODE_SPLITS": "1"},
    "unpacked_1split": {"FLASHMOD_DECODE_PACK": "0", "FLASHMOD_DECODE_SPLITS": "1"},
    "packed_5splits": {"FLASHMOD_DECODE_SPLITS": "5"},
    "unpacked_3splits": {"FLASHMOD_DECODE_PACK": "0", "FLASHMOD_DECODE_SPLITS": "3"},
    "packed_64splits": {"FLASHMOD_DECODE_SPLITS": "64"},  # many empty splits at small Nk
    # The split-KV combine as its own kernel instead of each tile's last CTA: bitwise the same as
    # packed_5splits / unpacked_3splits.
    "packed_5splits_kernel": {"FLASHMOD_DECODE_SPLITS": "5", "FLASHMOD_DECODE_FUSED_COMBINE": "0"},
    "unpacked_3splits_kernel": {
        "FLASHMOD_DECODE_PACK": "0",
        "FLASHMOD_DECODE_SPLITS": "3",
        "FLASHMOD_DECODE_FUSED_COMBINE": "0",
    },
    # The fused combine's counters zeroed by a memset per call instead of the stream's shared ones
    # (which each tile's last CTA leaves zero): bitwise the same as packed_5splits. Every mode
    # runs after others on the same stream, so a counter left nonzero shows as a wrong answer.
    "packed_5splits_memset": {"FLASHMOD_DECODE_SPLITS": "5", "FLASHMOD_STREAM_COUNTERS": "0"},
}
DECODE_KNOBS = (
    "FLASHMOD_DECODE",
    "FLASHMOD_DECODE_PACK",
    "FLASHMOD_DECODE_SPLITS",
    "FLASHMOD_DECODE_FUSED_COMBINE",
    "FLASHMOD_STREAM_COUNTERS",
)


def use_decode_mode(monkeypatch, mode):
    """Sets the knobs of ``mode`` (and clears the others) until the test ends."""
    for name in DECODE_KNOBS:
        monkeypatch.delenv(name, raising=False)
    for name, value in DECODE_MODES[mode].items():
        monkeypatch.setenv(name, value)


def check_all_decode_modes(monkeypatch, q, k, v, mask=None, **opts):
    """Checks every mode against one reference; returns {mode: (out, lse)}."""
    dtype = q.dtype
    truth_o, truth_l = attention_reference(q, k, v, mask, compute_dtype=torch.float64, **opts)
    plain_o, plain_l = attention_reference(q, k, v, mask, compute_dtype=dtype, **opts)
    results = {}
    for mode in DECODE_MODES:
        use_decode_mode(monkeypatch, mode)
        out, lse = attention_op(q, k, v, mask, **opts)
        assert_within_rule(out, truth_o, plain_o, 2.0, dtype, f"out [{mode}]")
        assert_within_rule(lse, truth_l, plain_l.float(), 2.0, dtype, f"lse [{mode}]")
        results[mode] = (out, lse)
    same = (
        ("packed_5splits", "packed_5splits_kernel"),
        ("unpacked_3splits", "unpacked_3splits_kernel"),
        ("packed_5splits", "packed_5splits_memset"),
    )
    for fused, kernel in same:
        for a, b in zip(results[fused], results[kernel]):  # bitwise, NaN rows included
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"{fused} != {kernel}")
    return results


DECODE_OPTS = [
    {},
    {"is_causal": True, "bottom_right": True},
    {"is_causal": True, "bottom_right": False},
    {"window_left": 700, "window_right": 0},
    {"softcap": 8.0},
    {"window_left": 50, "window_right": 20, "bottom_right": False, "softcap": 5.0},
]


@pytest.mark.parametrize("nq", [1, 3, 16])
@pytest.mark.parametrize("nk", [1, 17, 1023, 4099, 70000])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gqa_split(monkeypatch, nq, nk, group):
    case = nq * 31 + nk * 7 + group
    dtype = LOW[case % 2]
    d = (64, 128, 59)[case % 3]
    opts = DECODE_OPTS[case % len(DECODE_OPTS)]
    heads_kv = 2
    q = rand(1, heads_kv * group, nq, d, dtype=dtype)
    k, v = rand(1, heads_kv, nk, d, dtype=dtype), rand(1, heads_kv, nk, d, dtype=dtype)
    check_all_decode_modes(monkeypatch, q, k, v, **opts)


@pytest.mark.parametrize("opts", DECODE_OPTS, ids=str)
def test_decode_options_long_kv(monkeypatch, opts):
    # Every option on the shape split-KV is for: GQA 8, long Nk, D = 128.
    q, k, v = (
        rand(2, 16, 1, 128, dtype=torch.bfloat16),
        rand(2, 2, 4099, 128, dtype=torch.bfloat16),
        rand(2, 2, 4099, 128, dtype=torch.bfloat16),
    )
    check_all_decode_modes(monkeypatch, q, k, v, **opts)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("nq", [1, 3, 16])
def test_decode_bool_mask_empty_rows_and_splits(monkeypatch, dtype, nq):
    # A mask stops GQA packing, so this is split-KV on per-head rows. Row 0 of every head sees no
    # key (0 / -inf); row -1 sees only keys < 40, so every split but the first is empty for it.
    b, hkv, group, nk, d = 2, 2, 4, 4099, 64
    q = rand(b, hkv * group, nq, d, dtype=dtype)
    k, v = rand(b, hkv, nk, d, dtype=dtype), rand(b, hkv, nk, d, dtype=dtype)
    mask = torch.rand(b, hkv * group, nq, nk, device="cuda") > 0.3
    mask[:, :, 0] = False
    mask[:, :, -1, 40:] = False
    for mode, (out, lse) in check_all_decode_modes(monkeypatch, q, k, v, mask, is_causal=True).items():
        assert (out[:, :, 0] == 0).all() and torch.isneginf(lse[:, :, 0]).all(), mode
    # Every row fully masked: all splits empty everywhere.
    none = torch.zeros(1, 1, nq, nk, dtype=torch.bool, device="cuda")
    for mode in DECODE_MODES:
        use_decode_mode(monkeypatch, mode)
        out, lse = attention_op(q, k, v, none)
        assert (out == 0).all() and torch.isneginf(lse).all(), mode


def test_decode_rows_without_visible_keys(monkeypatch):
    # Bottom-right causal with Nk < Nq: positions 0..5 see no key (0 / -inf), also when packed;
    # then a narrow top-left window over a long Nk: most splits are empty for every row.
    q = rand(1, 8, 16, 64, dtype=torch.float16)
    k, v = rand(1, 2, 10, 64, dtype=torch.float16), rand(1, 2, 10, 64, dtype=torch.float16)
    for mode, (out, lse) in check_all_decode_modes(monkeypatch, q, k, v, is_causal=True).items():
        assert (out[:, :, :6] == 0).all() and torch.isneginf(lse[:, :, :6]).all(), mode
    k, v = rand(1, 2, 5000, 64, dtype=torch.float16), rand(1, 2, 5000, 64, dtype=torch.float16)
    check_all_decode_modes(monkeypatch, q, k, v, window_left=2, window_right=0, bottom_right=False)


@pytest.mark.parametrize("nq", [1, 3])
def test_decode_bshd_layout(monkeypatch, nq):
    # (B, S, H, D) storage: Nq = 1 packs through the head stride; Nq = 3 cannot pack (its rows
    # are not one stride apart) and must fall back to per-head rows.
    q = rand(2, nq, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    kv = rand(2, 3000, 2, 2, 128, dtype=torch.bfloat16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    for mode, (out, _) in check_all_decode_modes(monkeypatch, q, k, v, is_causal=True).items():
        assert out.stride() == torch.empty_like(q).stride(), mode


def test_decode_batch_past_grid_z_limit(monkeypatch):
    # The decode grid is (splits x query blocks, heads, batch) while heads and batch fit gridDim's
    # y / z limit (65535); past it the CTAs find their tiles from a flat index instead.
    b = 65535 + 3
    q = rand(b, 2, 1, 64, dtype=torch.float16)
    k, v = rand(b, 1, 17, 64, dtype=torch.float16), rand(b, 1, 17, 64, dtype=torch.float16)
    check_all_decode_modes(monkeypatch, q, k, v, is_causal=True)


def test_decode_split_deterministic(monkeypatch):
    q = rand(1, 32, 1, 128, dtype=torch.bfloat16)
    k, v = rand(1, 8, 20000, 128, dtype=torch.bfloat16), rand(1, 8, 20000, 128, dtype=torch.bfloat16)
    for mode in ("heuristic", "packed_5splits", "unpacked_3splits"):
        use_decode_mode(monkeypatch, mode)
        first, first_lse = attention_op(q, k, v)
        for _ in range(20):
            out, lse = attention_op(q, k, v)
            assert torch.equal(out, first) and torch.equal(lse, first_lse), mode


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["attention_fwd", "attention_bwd"])
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer(tool, kernels, repo_root):
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("compute-sanitizer not found")
    cmd = [exe, "--tool", tool, "--kernel-name", f"kns={kernels}", "--error-exitcode", "1",
           sys.executable, str(repo_root / "tools" / "cuda_sanitizer_case.py")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root, timeout=600)
    assert res.returncode == 0 and "sanitizer case done" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]
    assert (
        "ERROR SUMMARY: 0 errors" in res.stdout + res.stderr
        or "RACECHECK SUMMARY: 0 hazards" in res.stdout + res.stderr
    )
