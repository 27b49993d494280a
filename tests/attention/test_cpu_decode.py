"""CPU decode path (csrc/attention/cpu/engine_decode.h decode_tasks): up to 8 queries per head, the query heads
of a kv group in one task, and the visible keys split across threads (partial softmax states merged
in split order) when the heads alone cannot keep every thread busy."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within_rule

import flashmod
from flashmod.reference import attention_reference

OPTS = {
    "plain": {},
    "causal_bottom_right": {"is_causal": True, "bottom_right": True},
    "causal_top_left": {"is_causal": True, "bottom_right": False},
    "window": {"window_left": 300, "window_right": 0, "bottom_right": True},
    "window_both": {"window_left": 50, "window_right": 700, "bottom_right": False},
    "softcap": {"softcap": 5.0, "is_causal": True, "bottom_right": True},
}


def check(q, k, v, mask=None, **opts):
    out, lse = flashmod.attention_op(q, k, v, mask, **opts)
    truth = attention_reference(q, k, v, mask, compute_dtype=torch.float64, **opts)
    plain = attention_reference(q, k, v, mask, compute_dtype=q.dtype, **opts)
    plain32 = attention_reference(q, k, v, mask, compute_dtype=torch.float32, **opts)
    assert_within_rule(out, truth[0], plain[0], 2, q.dtype, "out")
    assert_within_rule(lse, truth[1], plain32[1], 2, torch.float32, "lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(truth[1])), "fully masked rows differ"
    return out, lse


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("variant", list(OPTS))
@pytest.mark.parametrize("b,hq,hkv,nq,nk,d", [(1, 1, 1, 1, 4097, 64), (1, 8, 2, 3, 2049, 128), (2, 4, 4, 1, 1023, 64)])
def test_cpu_decode_matches_reference(threads, dtype, variant, b, hq, hkv, nq, nk, d):
    torch.manual_seed(nk + nq)
    q = torch.randn(b, hq, nq, d, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, dtype=dtype)
    check(q, k, v, **OPTS[variant])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_decode_masks_and_fully_masked_rows(threads, dtype):
    torch.manual_seed(0)
    b, hq, hkv, nq, nk, d = 2, 6, 2, 2, 4097, 64
    q = torch.randn(b, hq, nq, d, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, dtype=dtype)
    mask = torch.rand(b, hq, nq, nk) > 0.3
    mask[0, 1, 0] = False  # a fully masked row
    mask[1, :, 1, 2000:] = False  # visible keys only in the first splits
    out, lse = check(q, k, v, mask)
    assert torch.all(out[0, 1, 0] == 0) and torch.isneginf(lse[0, 1, 0])
    additive = torch.zeros(b, 1, nq, nk, dtype=dtype).masked_fill(torch.rand(b, 1, nq, nk) > 0.5, float("-inf"))
    additive[1, 0, 0] = float("-inf")
    out, lse = check(q, k, v, additive, is_causal=True, bottom_right=True)
    assert torch.all(out[1, :, 0] == 0) and torch.isneginf(lse[1, :, 0]).all()
    # A window that no key reaches: every row empty.
    out, lse = flashmod.attention_op(q, k, v, window_left=0, window_right=0, bottom_right=False)
    assert torch.isneginf(lse[:, :, nk:]).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_decode_split_deterministic(threads, dtype):
    torch.manual_seed(1)
    q = torch.randn(1, 4, 1, 128, dtype=dtype)
    k = torch.randn(1, 1, 9001, 128, dtype=dtype)
    v = torch.randn(1, 1, 9001, 128, dtype=dtype)
    first = flashmod.attention_op(q, k, v, is_causal=True, bottom_right=True)
    for _ in range(10):
        out, lse = flashmod.attention_op(q, k, v, is_causal=True, bottom_right=True)
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
