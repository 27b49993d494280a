"""The serving ops: flash_attn_varlen_func (packed ragged batches) and flash_attn_with_kvcache
(decode against a cache, in-place append, paged caches). Oracle: flashmod's dense attention on each
sequence alone (bitwise on the CPU, where every sequence runs the same engine on its view) and the
fp64 reference under the accuracy rule."""

from __future__ import annotations

import pytest
import torch
from paging import packed_into_pages
from tolerance import assert_within_rule

import flashmod
from flashmod import serve_ops
from flashmod.reference import attention_reference
from flashmod.serve_ops import varlen_forward_padded

VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (7, 2)},
    "softcap_causal": {"causal": True, "softcap": 5.0},
}
# (query lengths, key lengths) per sequence: odd sizes, empty and single-token sequences, Nq != Nk.
LENGTHS = {
    "self": ([17, 1, 0, 113, 3], [17, 1, 0, 113, 3]),
    "cross": ([5, 0, 40, 1, 9], [17, 3, 0, 64, 9]),
}


def cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def opts_of(variant):
    o = VARIANTS[variant]
    return {
        "causal": o.get("causal", False),
        "window_size": o.get("window_size", (-1, -1)),
        "softcap": o.get("softcap", 0.0),
    }


def reference(q, k, v, opts, compute_dtype):
    """The reference on one sequence in flash-attn's layout (N, H, D): (out (N, H, D), lse (H, N))."""
    wl, wr = opts["window_size"]
    out, lse = attention_reference(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=opts["causal"], bottom_right=True, window_left=wl, window_right=wr,
        softcap=opts["softcap"], compute_dtype=compute_dtype,
    )  # fmt: skip
    return out[0].transpose(0, 1), lse[0]


def make_varlen(lq, lk, hq, hkv, d, dtype, device, requires_grad=False):
    def one(n, h):
        return torch.randn(sum(n), h, d, dtype=dtype, device=device, requires_grad=requires_grad)

    return one(lq, hq), one(lk, hkv), one(lk, hkv), cu(lq, device), cu(lk, device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_varlen_forward_matches_each_sequence(device, dtype, variant, lengths):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU only")
    lq, lk = LENGTHS[lengths]
    q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, 40, dtype, device)
    opts = opts_of(variant)
    out, lse = flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **opts)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    for b in range(len(lq)):
        qs, ks, vs = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        o_b, l_b = out[cq[b] : cq[b + 1]], lse[:, cq[b] : cq[b + 1]]
        if device == "cpu":
            dense_out, dense_lse = flashmod.flash_attn_func(qs[None], ks[None], vs[None], return_lse=True, **opts)
            assert torch.equal(o_b, dense_out[0]), f"sequence {b}: out differs from flashmod.attention"
            assert torch.equal(l_b, dense_lse[0]), f"sequence {b}: lse differs from flashmod.attention"
        truth, truth_lse = reference(qs, ks, vs, opts, torch.float64)
        plain, _ = reference(qs, ks, vs, opts, dtype)
        assert_within_rule(o_b, truth, plain, 2, dtype, f"out of sequence {b}")
        assert torch.equal(torch.isneginf(l_b), torch.isneginf(truth_lse)), f"sequence {b}: empty rows differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_varlen_gradients_match_each_sequence(device, dtype, variant):
    lq, lk = LENGTHS["cross"]
    q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, 40, dtype, device, requires_grad=True)
    opts = opts_of(variant)
    out = flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **opts)
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    for b in range(len(lq)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        leaves = [t[r].detach().requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk))]
        if device == "cpu":
            dense = flashmod.flash_attn_func(*(t[None] for t in leaves), **opts)
            dense_grads = torch.autograd.grad(dense, leaves, grad_out[rq][None], allow_unused=True)
            for name, ours, theirs, r in zip("qkv", (dq, dk, dv), dense_grads, (rq, rk, rk)):
                theirs = torch.zeros_like(ours[r]) if theirs is None else theirs
                assert torch.equal(ours[r], theirs), f"sequence {b}: d{name} differs from flashmod.attention"

        assert_sequence_grads((dq, dk, dv), leaves, grad_out, rq, rk, opts, dtype, f"of sequence {b}")


def ref_grads(leaves, grad_out, opts, dtype):
    """Reference gradients of one sequence with inputs and math in dtype (None where unused)."""
    xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
    ref_out, _ = reference(*xs, opts, dtype)
    return torch.autograd.grad(ref_out, xs, grad_out.to(dtype), allow_unused=True)


def assert_sequence_grads(grads, leaves, grad_out, rq, rk, opts, dtype, what):
    """The packed gradients (dq, dk, dv) on one sequence's rows (rq of q, rk of k/v; its inputs
    ``leaves``) within the 3x rule against the reference on that sequence alone (0 where unused)."""
    truth, plain = (ref_grads(leaves, grad_out[rq], opts, c) for c in (torch.float64, dtype))
    for name, ours, t, p, r in zip("qkv", grads, truth, plain, (rq, rk, rk)):
        t = torch.zeros_like(ours[r], dtype=torch.float64) if t is None else t
        p = torch.zeros_like(ours[r]) if p is None else p
        assert_within_rule(ours[r], t, p, 3, dtype, f"d{name} {what}")


def test_padded_path_agrees_with_the_varlen_op():
    """fp32's CUDA path (the dense op on a right-aligned padded batch) equals the CPU's per-sequence
    forward, and its gradients through the dense op's autograd equal the per-sequence backward, lse
    and its gradient included (fp64, to rounding)."""
    lq, lk = LENGTHS["cross"]
    q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, 40, torch.float64, "cpu", requires_grad=True)
    for opts in (opts_of("causal"), opts_of("window"), opts_of("plain")):
        wl, wr = opts["window_size"]
        args = (None, opts["causal"], wl, wr, opts["softcap"])
        out, lse = torch.ops.flashmod.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), *args)
        out_p, lse_p = varlen_forward_padded(q, k, v, cq, ck, max(lq), max(lk), *args)
        assert torch.allclose(out_p, out, rtol=0, atol=1e-12) and torch.allclose(lse_p, lse, rtol=0, atol=1e-12)
        grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
        fused = torch.ops.flashmod.attention_varlen_backward(
            grad_out, grad_lse, q, k, v, out, lse, cq, ck, max(lq), max(lk), *args
        )
        padded = torch.autograd.grad((out_p, lse_p), (q, k, v), (grad_out, grad_lse))
        for name, a, b in zip("qkv", fused, padded):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), f"d{name}: {(a - b).abs().max().item():.3e}"


def test_varlen_forward_mode_ad_matches_each_sequence(device):
    """torch.func.jvp through flash_attn_varlen_func carries the tangent (the varlen op has a backward
    only: its autograd returned a silent zero) and equals the dense jvp of each sequence alone."""
    lq, lk = LENGTHS["cross"]
    dtype = torch.float64 if device == "cpu" else torch.float32
    q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, 40, dtype, device)
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    opts = opts_of("causal")

    def varlen(q, k, v):
        return flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **opts)

    _, tangent = torch.func.jvp(varlen, (q, k, v), tangents)
    assert tangent.abs().max() > 0
    for b in range(len(lq)):
        rq, rk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if rq.start == rq.stop:
            continue

        def one(q, k, v):
            return flashmod.flash_attn_func(q[None], k[None], v[None], **opts)[0]

        _, want = torch.func.jvp(one, (q[rq], k[rk], v[rk]), (tangents[0][rq], tangents[1][rk], tangents[2][rk]))
        torch.testing.assert_close(tangent[rq], want, rtol=1e-5, atol=1e-6)


def test_padded_path_gives_nan_rows_for_a_sequence_past_its_max_seqlen():
    """A max_seqlen below a real length (the caller's promise broken; CUDA cannot check it without a
    host sync) gives that sequence NaN rows on the padded path, not wrapped-around neighbours."""
    lq, lk = [3, 7, 2], [4, 7, 5]
    q, k, v, cq, ck = make_varlen(lq, lk, 2, 2, 16, torch.float32, "cpu")
    for max_q, max_k in ((5, 7), (7, 5)):
        out, lse = varlen_forward_padded(q, k, v, cq, ck, max_q, max_k, warn=False)
        bad = slice(3, 10)  # sequence 1's rows
        assert torch.isnan(out[bad]).all() and torch.isnan(lse[:, bad]).all()
        fine = torch.ones(q.shape[0], dtype=torch.bool)
        fine[bad] = False
        want, want_lse = varlen_forward_padded(q, k, v, cq, ck, 7, 7, warn=False)
        torch.testing.assert_close(out[fine], want[fine], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, fine], want_lse[:, fine], rtol=0, atol=0)


def test_varlen_rejects_bad_cu_seqlens(device):
    q, k, v, cq, ck = make_varlen([3, 4], [3, 4], 2, 2, 16, torch.bfloat16, device)
    call = flashmod.flash_attn_varlen_func
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be int32, got torch.int64"):
        call(q, k, v, cq.long(), ck, 4, 4)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must be a 1-D tensor, got a 2-D"):
        call(q, k, v, cq, ck[None], 4, 4)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k must have cu_seqlens_q's length \(batch \+ 1\) = 3"):
        call(q, k, v, cq, ck[:2], 4, 4)
    with pytest.raises(RuntimeError, match="max_seqlen_q must be >= 0, got -1"):
        call(q, k, v, cq, ck, -1, 4)
    with pytest.raises(RuntimeError, match="q must be a 3-D tensor"):
        call(q[None], k, v, cq, ck, 4, 4)
    if device == "cpu":  # values: read on the CPU only (on CUDA they would cost a sync)
        bad = torch.tensor([0, 5, 3], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 5"):
            call(q, k, v, bad, ck, 5, 4)
        with pytest.raises(RuntimeError, match=r"cu_seqlens_k\[-1\] must equal k.size\(0\) = 7, got 6"):
            call(q, k, v, cq, torch.tensor([0, 3, 6], dtype=torch.int32), 4, 4)
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[0\] must be 0, got 1"):
            call(q, k, v, torch.tensor([1, 3, 7], dtype=torch.int32), ck, 4, 4)
        with pytest.raises(RuntimeError, match="sequence 1 of cu_seqlens_q has length 4, more than max_seqlen_q = 3"):
            call(q, k, v, cq, ck, 3, 4)


def make_cache(b, s, hkv, d, dtype, device):
    return (torch.randn(b, s, hkv, d, dtype=dtype, device=device) for _ in range(2))


def kvcache_dtypes(device):
    return [torch.bfloat16] if device == "cuda" else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("sq", [1, 3, 17])
def test_kvcache_appends_in_place_and_attends_to_valid_keys(device, variant, sq):
    opts = opts_of(variant)
    for dtype in kvcache_dtypes(device):
        B, S, hq, hkv, d, s_new = 4, 203, 8, 2, 64, 2
        k_cache, v_cache = make_cache(B, S, hkv, d, dtype, device)
        q = torch.randn(B, sq, hq, d, dtype=dtype, device=device)
        k_new, v_new = (torch.randn(B, s_new, hkv, d, dtype=dtype, device=device) for _ in range(2))
        seqlens = torch.tensor([0, 1, 113, S - s_new], dtype=torch.int32, device=device)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        out, lse = flashmod.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, return_lse=True, **opts
        )
        assert out.shape == q.shape and lse.shape == (B, hq, sq)
        written = torch.zeros(B, S, dtype=torch.bool, device=device)
        for b in range(B):
            n = int(seqlens[b])
            written[b, n : n + s_new] = True
            assert torch.equal(k_cache[b, n : n + s_new], k_new[b]) and torch.equal(v_cache[b, n : n + s_new], v_new[b])
        assert torch.equal(k_cache[~written], k_before[~written]), "an untouched k_cache slot changed"
        assert torch.equal(v_cache[~written], v_before[~written]), "an untouched v_cache slot changed"
        for b in range(B):
            n = int(seqlens[b]) + s_new
            ks, vs = k_cache[b, :n], v_cache[b, :n]
            truth, _ = reference(q[b], ks, vs, opts, torch.float64)
            plain, _ = reference(q[b], ks, vs, opts, dtype)
            assert_within_rule(out[b], truth, plain, 2, dtype, f"out of row {b}")
            if device == "cpu":
                # The op itself: flash_attn_func would, like flash-attn, drop a window side that
                # reaches past this row's few keys, where the cache call (again like flash-attn's)
                # judges the window against the cache's capacity.
                wl, wr = opts["window_size"]
                dense, _ = flashmod.attention_op(
                    q[b : b + 1].transpose(1, 2),
                    ks[None].transpose(1, 2),
                    vs[None].transpose(1, 2),
                    is_causal=opts["causal"],
                    window_left=wl,
                    window_right=wr,
                    softcap=opts["softcap"],
                )
                assert torch.equal(out[b], dense[0].transpose(0, 1)), f"row {b}: differs from flashmod.attention"


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
def test_kvcache_paged_equals_contiguous(device, page_size):
    for dtype in kvcache_dtypes(device):
        B, pages_per_row, hq, hkv, d, s_new = 3, 4, 8, 8, 128, 1
        S = pages_per_row * page_size
        k_cont, v_cont = make_cache(B, S, hkv, d, dtype, device)
        # The same keys in a shuffled pool of pages, with spare pages nobody owns.
        n_pages = B * pages_per_row + 3
        perm = torch.randperm(n_pages, device=device)[: B * pages_per_row].to(torch.int32)
        table = perm.reshape(B, pages_per_row)
        k_pool = torch.randn(n_pages, page_size, hkv, d, dtype=dtype, device=device)
        v_pool = torch.randn_like(k_pool)
        k_pool[table.long()] = k_cont.reshape(B, pages_per_row, page_size, hkv, d)
        v_pool[table.long()] = v_cont.reshape(B, pages_per_row, page_size, hkv, d)
        pool_before = k_pool.clone()
        q = torch.randn(B, 1, hq, d, dtype=dtype, device=device)
        k_new, v_new = (torch.randn(B, s_new, hkv, d, dtype=dtype, device=device) for _ in range(2))
        seqlens = torch.tensor([page_size - 1, 0, S - 1], dtype=torch.int32, device=device)
        paged = flashmod.flash_attn_with_kvcache(
            q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True
        )
        cont = flashmod.flash_attn_with_kvcache(q, k_cont, v_cont, k_new, v_new, cache_seqlens=seqlens, causal=True)
        assert torch.equal(paged, cont), f"page_size {page_size}: paged differs from contiguous"
        assert torch.equal(k_pool[table.long()].reshape(B, S, hkv, d), k_cont), "paged append differs"
        spare = torch.ones(n_pages, dtype=torch.bool, device=device)
        spare[table.long().flatten()] = False
        assert torch.equal(k_pool[spare], pool_before[spare]), "a page outside the table changed"


@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kvcache_paged_decode_equals_contiguous_cpu(page_size, variant):
    """Decode-shaped calls on a paged CPU cache (the decode engine reads each key block's rows through
    the block table in place) give the contiguous cache's results bit for bit: pages that split the
    engine's key blocks unevenly (48), caches long enough to be cut into splits (512+ keys a split),
    odd lengths, one and three queries, GQA, head dims that the decode engine takes (64) and, on
    AVX-512, one it leaves to the gathering path (40); within the rule against the fp64 reference
    too. (CUDA's paged decode: test_kvcache_paged_equals_contiguous and the key-split test.)"""
    opts = opts_of(variant)
    device = "cpu"
    for dtype in kvcache_dtypes(device):
        for d, sq in ((64, 1), (40, 3)):
            # Three kv heads: on CI's two threads the CPU decode cuts the longer rows into splits.
            B, hq, hkv, pages_per_row = 3, 12, 3, 1536 // page_size
            S = pages_per_row * page_size
            k_cont, v_cont = make_cache(B, S, hkv, d, dtype, device)
            k_pool, v_pool, table, _ = paged_copy(k_cont, v_cont, page_size)
            q = torch.randn(B, sq, hq, d, dtype=dtype, device=device)
            seqlens = torch.tensor([1, 1100, S - 17], dtype=torch.int32, device=device)
            paged = flashmod.flash_attn_with_kvcache(
                q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table, **opts
            )
            cont = flashmod.flash_attn_with_kvcache(q, k_cont, v_cont, cache_seqlens=seqlens, **opts)
            assert torch.equal(paged, cont), f"{dtype}, d {d}, sq {sq}: paged differs from contiguous"
            for b in range(B):
                n = int(seqlens[b])
                truth, _ = reference(q[b], k_cont[b, :n], v_cont[b, :n], opts, torch.float64)
                plain, _ = reference(q[b], k_cont[b, :n], v_cont[b, :n], opts, dtype)
                assert_within_rule(paged[b], truth, plain, 2, dtype, f"{dtype}, d {d}, sq {sq}, row {b}")


def test_kvcache_batch_idx_int_seqlens_and_no_append(device):
    dtype = torch.bfloat16
    B, hq, hkv, d = 2, 4, 4, 32
    k_cache, v_cache = make_cache(5, 40, hkv, d, dtype, device)
    q = torch.randn(B, 1, hq, d, dtype=dtype, device=device)
    idx = torch.tensor([4, 1], dtype=torch.int32, device=device)
    out = flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=17, cache_batch_idx=idx)
    for b in range(B):
        ks, vs = k_cache[int(idx[b]), :17], v_cache[int(idx[b]), :17]
        truth, _ = reference(q[b], ks, vs, opts_of("plain"), torch.float64)
        plain, _ = reference(q[b], ks, vs, opts_of("plain"), dtype)
        assert_within_rule(out[b], truth, plain, 2, dtype, f"row {b}")
    # No cache_seqlens: the whole cache.
    full = flashmod.flash_attn_with_kvcache(q, k_cache[:B], v_cache[:B])
    dense = flashmod.flash_attn_func(q, k_cache[:B], v_cache[:B])
    assert torch.equal(full, dense)


def small_kvcache_step(device):
    """A bf16 decode step for the error tests: k_cache, v_cache (2, 32, 2, 16), q (2, 1, 4, 16), one new
    key per row (also used as its value), cache_seqlens [3, 4]."""
    dtype = torch.bfloat16
    k_cache, v_cache = make_cache(2, 32, 2, 16, dtype, device)
    q = torch.randn(2, 1, 4, 16, dtype=dtype, device=device)
    kn = torch.randn(2, 1, 2, 16, dtype=dtype, device=device)
    return k_cache, v_cache, q, kn, torch.tensor([3, 4], dtype=torch.int32, device=device)


def test_kvcache_rejects_bad_inputs(device):
    k_cache, v_cache, q, kn, seqlens = small_kvcache_step(device)
    call = flashmod.flash_attn_with_kvcache
    with pytest.raises(RuntimeError, match="k and v must be given together, got k without v"):
        call(q, k_cache, v_cache, kn, None, cache_seqlens=seqlens)
    with pytest.raises(RuntimeError, match=r"appending k/v needs cache_seqlens"):
        call(q, k_cache, v_cache, kn, kn)
    with pytest.raises(RuntimeError, match="cache_seqlens must be int32, got torch.int64"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens.long())
    with pytest.raises(RuntimeError, match="cache_batch_idx cannot be combined with block_table"):
        table = torch.zeros(2, 2, dtype=torch.int32, device=device)
        call(q, k_cache, v_cache, cache_batch_idx=seqlens, block_table=table)
    with pytest.raises(RuntimeError, match="k_cache must have stride 1 in its last dimension"):
        call(q, k_cache.transpose(-1, -2).contiguous().transpose(-1, -2), v_cache)
    with pytest.raises(RuntimeError, match=r"k must have shape \(batch, seqlen_new, heads_k, head_dim\)"):
        call(q, k_cache, v_cache, kn[:, :, :1], kn[:, :, :1], cache_seqlens=seqlens)
    if device == "cpu":
        before = k_cache.clone()
        with pytest.raises(RuntimeError, match=r"cache_seqlens\[1\] = 32 plus the 1 new tokens must fit"):
            call(q, k_cache, v_cache, kn, kn, cache_seqlens=torch.tensor([3, 32], dtype=torch.int32))
        assert torch.equal(k_cache, before), "a refused call wrote to the cache"


def rotary_tables(seqlen, rotary_dim, dtype, device):
    """cos / sin (seqlen, rotary_dim / 2) of RoPE's angles (base 10000), in dtype."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(seqlen, dtype=torch.float64, device=device)[:, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_ref(x, cos, sin, positions, interleaved):
    """x (B, S, H, D) rotated at positions (B, S) in fp64, by complex multiplication: features (2i, 2i + 1)
    (interleaved) or (i, i + rotary_dim / 2) are one complex number times cos + i sin."""
    half = cos.shape[1]
    x64 = x.double()
    rot = x64[..., : 2 * half]
    re, im = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    turned = torch.complex(re, im) * torch.complex(cos.double()[positions], sin.double()[positions])[:, :, None]
    if interleaved:
        rot = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    else:
        rot = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((rot, x64[..., 2 * half :]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("variant", ["plain", "causal", "window"])
@pytest.mark.parametrize("rotary_dim", [32, 64])
def test_kvcache_rotary_as_flash_attn(device, interleaved, variant, rotary_dim):
    """flash-attn's rotary_cos / rotary_sin: the new keys rotated at cache_seqlens[b] + i before they are
    appended; the queries at cache_seqlens[b] + i when causal or windowed, else all at cache_seqlens[b];
    the first rotary_dim features only. Checked against an fp64 rotation by complex multiplication: the
    cache's new rows to the rounding of the dtype, the output by the rule against fp64 attention."""
    opts = opts_of(variant)
    for dtype in kvcache_dtypes(device):
        B, S, hq, hkv, d, s_new = 3, 96, 8, 2, 64, 3
        k_cache, v_cache = make_cache(B, S, hkv, d, dtype, device)
        k_before = k_cache.clone()
        q = torch.randn(B, s_new, hq, d, dtype=dtype, device=device)
        k_new, v_new = (torch.randn(B, s_new, hkv, d, dtype=dtype, device=device) for _ in range(2))
        seqlens = torch.tensor([0, 17, S - s_new], dtype=torch.int32, device=device)
        cos, sin = rotary_tables(S, rotary_dim, dtype, device)
        out = flashmod.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=interleaved, **opts,
        )  # fmt: skip
        steps = torch.arange(s_new, device=device)
        k_pos = seqlens.long()[:, None] + steps
        q_pos = k_pos if variant != "plain" else seqlens.long()[:, None].expand(B, s_new)
        k_rot, q_rot = rotary_ref(k_new, cos, sin, k_pos, interleaved), rotary_ref(q, cos, sin, q_pos, interleaved)
        ulp = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}[dtype]
        for b in range(B):
            n = int(seqlens[b])
            torch.testing.assert_close(
                k_cache[b, n : n + s_new].double(), k_rot[b], rtol=ulp, atol=ulp, msg=f"rotated keys of row {b}"
            )
            assert torch.equal(v_cache[b, n : n + s_new], v_new[b]), "values are not rotated"
            assert torch.equal(k_cache[b, :n], k_before[b, :n]) and torch.equal(
                k_cache[b, n + s_new :], k_before[b, n + s_new :]
            ), f"row {b}: a cache slot outside the append changed"
            ks64 = torch.cat((k_before[b, :n].double(), k_rot[b]))
            vs = v_cache[b, : n + s_new]
            truth, _ = reference(q_rot[b], ks64, vs.double(), opts, torch.float64)
            plain, _ = reference(q_rot[b].to(dtype), ks64.to(dtype), vs, opts, dtype)
            assert_within_rule(out[b], truth, plain, 2, dtype, f"{variant} interleaved={interleaved} row {b}")


def test_kvcache_rotary_paged_equals_contiguous_and_int_seqlens(device):
    """Rotary through a shuffled page pool gives the contiguous cache's output and rows, and an int
    cache_seqlens the tensor's."""
    dtype = torch.bfloat16
    B, S, hkv, d = 2, 64, 2, 64
    k_cache, v_cache = make_cache(B, S, hkv, d, dtype, device)
    k_pool, v_pool, table, _ = paged_copy(k_cache, v_cache, 16)
    q = torch.randn(B, 1, 4, d, dtype=dtype, device=device)
    k_new, v_new = (torch.randn(B, 1, hkv, d, dtype=dtype, device=device) for _ in range(2))
    cos, sin = rotary_tables(S, 32, dtype, device)
    kw = {"rotary_cos": cos, "rotary_sin": sin, "causal": True}
    out = flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=40, **kw)
    seqlens = torch.full((B,), 40, dtype=torch.int32, device=device)
    out_paged = flashmod.flash_attn_with_kvcache(
        q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, block_table=table, **kw
    )
    torch.testing.assert_close(out_paged, out, rtol=0, atol=0 if device == "cpu" else 1e-2)
    row = k_pool[table[:, 40 // 16].long(), 40 % 16]
    assert torch.equal(row, k_cache[:, 40]), "the paged append wrote other rotated keys"


def test_kvcache_rotary_rejects_bad_inputs_and_positional_flash_attn_order(device):
    k_cache, v_cache, q, kn, seqlens = small_kvcache_step(device)
    cos, sin = rotary_tables(32, 8, q.dtype, device)
    call = flashmod.flash_attn_with_kvcache
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin come together"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, rotary_cos=cos)
    with pytest.raises(ValueError, match="so k and v must be given"):
        call(q, k_cache, v_cache, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(ValueError, match="need cache_seqlens"):
        call(q, k_cache, v_cache, kn, kn, rotary_cos=cos, rotary_sin=sin)
    with pytest.raises(TypeError, match="rotary_cos must have q's dtype torch.bfloat16, got torch.float32"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, rotary_cos=cos.float(), rotary_sin=sin)
    with pytest.raises(ValueError, match=r"rotary_sin must have rotary_cos's shape \[32, 4\], got \[32, 3\]"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin[:, :3])
    wide_cos, wide_sin = rotary_tables(32, 18, q.dtype, device)
    with pytest.raises(ValueError, match=r"must be in \[1, head_dim / 2 = 8\], got 9"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, rotary_cos=wide_cos, rotary_sin=wide_sin)
    with pytest.raises(ValueError, match="at least the cache's 32, got 31"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, rotary_cos=cos[:31], rotary_sin=sin[:31])
    with pytest.raises(TypeError, match=r"num_splits must be an int >= 0 .*, got -1"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, num_splits=-1)
    assert call(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3).shape == q.shape  # taken, a hint
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        call(q, k_cache, v_cache, kn, kn, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1)
    # flash-attn's positional order: (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, ...)
    with pytest.raises(TypeError, match="got torch.bfloat16 .flash-attn passes rotary_cos, rotary_sin, cache_seqlens"):
        call(q, k_cache, v_cache, kn, kn, cos, sin, seqlens)
    with pytest.raises(RuntimeError, match="block_table must be a 2-D tensor .* in this order after v"):
        call(q, k_cache, v_cache, kn, kn, None, None, seqlens)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("page_size", [16, 48])
def test_varlen_block_table_matches_each_sequence(device, variant, lengths, page_size):
    """flash-attn's paged varlen (block_table): k/v as page pools, each sequence's keys the first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] rows of its pages; every sequence by the rule against the fp64
    reference on it alone (empty sequences included), out and lse."""
    opts = opts_of(variant)
    lq, lk = LENGTHS[lengths]
    for dtype in kvcache_dtypes(device):
        q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, 64, dtype, device)
        k_pool, v_pool, table = packed_into_pages(k, v, lk, page_size)
        out, lse = flashmod.flash_attn_varlen_func(
            q, k_pool, v_pool, cq, ck, max(lq), max(lk), return_lse=True, block_table=table, **opts
        )
        assert out.shape == q.shape and lse.shape == (4, q.shape[0])
        for b in range(len(lq)):
            qs, ks, vs = q[cq[b] : cq[b + 1]], k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
            truth, truth_lse = reference(qs, ks, vs, opts, torch.float64)
            plain, _ = reference(qs, ks, vs, opts, dtype)
            assert_within_rule(out[cq[b] : cq[b + 1]], truth, plain, 2, dtype, f"{variant} sequence {b}")
            torch.testing.assert_close(lse[:, cq[b] : cq[b + 1]].double(), truth_lse, rtol=1e-4, atol=1e-4)


def test_varlen_block_table_is_forward_only_and_checks_pools(device):
    dtype = torch.bfloat16
    q, k, v, cq, ck = make_varlen([3, 5], [7, 2], 4, 2, 16, dtype, device, requires_grad=True)
    k_pool, _, table = packed_into_pages(k.detach(), v.detach(), [7, 2], 16)
    with pytest.raises(RuntimeError, match="with block_table the call is forward only"):
        flashmod.flash_attn_varlen_func(q, k_pool, k_pool, cq, ck, 5, 7, block_table=table)
    with pytest.raises(ValueError, match=r"with block_table, k must be a page pool .* got a 3-D tensor"):
        flashmod.flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), cq, ck, 5, 7, block_table=table)
    with torch.no_grad():
        out = flashmod.flash_attn_varlen_func(q, k_pool, k_pool, cq, ck, 5, 7, block_table=table, causal=True)
    assert out.shape == q.shape and not out.requires_grad


def test_kvcache_block_table_past_the_used_pages_is_not_read(device):
    """Servers pad block tables (e.g. with -1): only the pages a row reads, cache_seqlens + the new
    tokens, are looked up."""
    dtype = kvcache_dtypes(device)[-1]
    page, hkv, d = 16, 2, 64
    k_pool, v_pool = make_cache(8, page, hkv, d, dtype, device)
    q = torch.randn(2, 1, 4, d, dtype=dtype, device=device)
    kn, vn = (torch.randn(2, 1, hkv, d, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.tensor([3, 20], dtype=torch.int32, device=device)  # one page, two pages
    full = torch.tensor([[5, 6, 7], [2, 0, 1]], dtype=torch.int32, device=device)
    padded = torch.tensor([[5, -1, -1], [2, 0, -1]], dtype=torch.int32, device=device)
    kp, vp = k_pool.clone(), v_pool.clone()
    want = flashmod.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=seqlens, block_table=full)
    got = flashmod.flash_attn_with_kvcache(q, k_pool, v_pool, kn, vn, cache_seqlens=seqlens, block_table=padded)
    assert torch.equal(got, want)
    assert torch.equal(k_pool, kp) and torch.equal(v_pool, vp), "the same append into the same pages"


def test_kvcache_rejects_appends_that_other_rows_read():
    """Two batch rows appending to one cache row (cache_batch_idx), or a row appending to a page
    another row reads, would each attend to the other's new keys: refused where the values can be
    read without a device sync (CPU; on CUDA it is the caller's error, as is an overflow)."""
    dtype, d = torch.float32, 16
    k_cache, v_cache = make_cache(4, 32, 1, d, dtype, "cpu")
    q = torch.randn(2, 1, 2, d, dtype=dtype)
    kn, vn = (torch.randn(2, 1, 1, d, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([10, 20], dtype=torch.int32)
    shared = torch.tensor([3, 3], dtype=torch.int32)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match=r"cache_batch_idx\[0\] and cache_batch_idx\[1\] are both 3"):
        flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=seqlens, cache_batch_idx=shared)
    assert torch.equal(k_cache, before), "a refused call wrote to the cache"
    # Reading one cache row from two batch rows is fine (a shared prefix).
    out = flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=shared)
    for b in range(2):
        ks, vs = k_cache[3, : int(seqlens[b])], v_cache[3, : int(seqlens[b])]
        truth, _ = reference(q[b], ks, vs, opts_of("plain"), torch.float64)
        assert torch.allclose(out[b].double(), truth, atol=1e-5), f"row {b}"
    # Pages: a shared first page read by both rows, each appending into a page of its own...
    k_pool, v_pool = make_cache(6, 8, 1, d, dtype, "cpu")
    pages = torch.tensor([5, 2], dtype=torch.int32)
    table = torch.tensor([[0, 1], [0, 4]], dtype=torch.int32)
    out = flashmod.flash_attn_with_kvcache(q, k_pool, v_pool, kn, vn, cache_seqlens=pages + 6, block_table=table)
    assert torch.equal(k_pool[1, 3], kn[0, 0]) and torch.equal(k_pool[4, 0], kn[1, 0])
    # ...but not into the shared page, nor into a page another row reads.
    for table, seqlens, page in (([[0, 1], [0, 4]], [5, 9], 0), ([[0, 1], [4, 1]], [9, 12], 1)):
        before = k_pool.clone()
        with pytest.raises(RuntimeError, match=f"appends to page {page} .* which other rows or columns also read"):
            flashmod.flash_attn_with_kvcache(
                q, k_pool, v_pool, kn, vn, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32),
                block_table=torch.tensor(table, dtype=torch.int32),
            )  # fmt: skip
        assert torch.equal(k_pool, before), "a refused call wrote to the cache"


def test_kvcache_is_not_differentiable_and_says_so(device):
    dtype = kvcache_dtypes(device)[-1]
    k_cache, v_cache = make_cache(2, 32, 2, 16, dtype, device)
    q = torch.randn(2, 1, 4, 16, dtype=dtype, device=device, requires_grad=True)
    seqlens = torch.tensor([3, 8], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="not differentiable, got q requiring grad"):
        flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    with torch.no_grad():
        out = flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert not out.requires_grad
    with pytest.raises(TypeError, match="cache_seqlens must be an int or an int32 tensor, got a bool"):
        flashmod.flash_attn_with_kvcache(q.detach(), k_cache, v_cache, cache_seqlens=True)
    with pytest.raises(RuntimeError, match="block_table must be a 2-D tensor"):
        flashmod.flash_attn_with_kvcache(
            q.detach(), k_cache, v_cache, block_table=torch.zeros(2, dtype=torch.int32, device=device)
        )


def test_kvcache_refuses_forward_mode_tangents_and_expanded_caches_it_appends_to(device):
    """Two ways the call once answered silently: a forward-mode tangent (dropped: a zero tangent)
    and an expanded cache (stride 0 over rows), where one row's append lands in another's keys."""
    dtype = kvcache_dtypes(device)[-1]
    k_cache, v_cache = make_cache(2, 32, 2, 16, dtype, device)
    q = torch.randn(2, 1, 4, 16, dtype=dtype, device=device)
    seqlens = torch.tensor([3, 8], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"not differentiable, got q \(a forward-mode tangent\)"):
        torch.func.jvp(
            lambda q: flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens), (q,), (q,)
        )
    shared_k, shared_v = (t[:1].expand(2, -1, -1, -1) for t in (k_cache, v_cache))
    kn, vn = (torch.randn(2, 1, 2, 16, dtype=dtype, device=device) for _ in range(2))
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="appending k/v writes k_cache in place, so its rows must not share"):
        flashmod.flash_attn_with_kvcache(q, shared_k, shared_v, kn, vn, cache_seqlens=seqlens)
    assert torch.equal(k_cache, before)
    # Reading an expanded cache without appending is fine: every row sees the same keys.
    out = flashmod.flash_attn_with_kvcache(q, shared_k, shared_v, cache_seqlens=seqlens)
    want = flashmod.flash_attn_with_kvcache(q, shared_k.contiguous(), shared_v.contiguous(), cache_seqlens=seqlens)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_serving_ops_compile_fullgraph(device):
    dtype = torch.bfloat16
    lq = [5, 0, 17]
    q, k, v, cq, ck = make_varlen(lq, lq, 4, 2, 32, dtype, device, requires_grad=True)

    def step(q, k, v):
        return flashmod.flash_attn_varlen_func(q, k, v, cq, ck, 17, 17, causal=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager_grads = torch.autograd.grad(step(q, k, v), (q, k, v))
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)

    k_cache, v_cache = make_cache(2, 32, 2, 32, dtype, device)
    kc_eager, vc_eager = k_cache.clone(), v_cache.clone()
    qd = torch.randn(2, 1, 4, 32, dtype=dtype, device=device)
    kn, vn = (torch.randn(2, 1, 2, 32, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.tensor([3, 30], dtype=torch.int32, device=device)

    def decode(qd, kc, vc, kn, vn):
        return flashmod.flash_attn_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)

    out = torch.compile(decode, fullgraph=True, backend="aot_eager")(qd, k_cache, v_cache, kn, vn)
    out_eager = decode(qd, kc_eager, vc_eager, kn, vn)
    assert torch.equal(out, out_eager)
    assert torch.equal(k_cache, kc_eager) and torch.equal(v_cache, vc_eager), "compiled call lost the cache append"

    cos, sin = rotary_tables(32, 16, dtype, device)

    def decode_rotary(qd, kc, vc, kn, vn):
        return flashmod.flash_attn_with_kvcache(
            qd, kc, vc, kn, vn, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False
        )

    out = torch.compile(decode_rotary, fullgraph=True, backend="aot_eager")(qd, k_cache, v_cache, kn, vn)
    out_eager = decode_rotary(qd, kc_eager, vc_eager, kn, vn)
    assert torch.equal(out, out_eager)
    assert torch.equal(k_cache, kc_eager), "compiled rotary call appended other keys"

    with pytest.raises(Exception, match="cu_seqlens_q must be int32"):
        torch.compile(lambda q: flashmod.flash_attn_varlen_func(q, k, v, cq.long(), ck, 17, 17), fullgraph=True)(q)


@pytest.mark.cuda
def test_varlen_cuda_fp32_runs_padded_with_a_warning():
    """The CUDA varlen kernels take fp16/bf16 (as flash-attn's); flash_attn_varlen_func serves fp32
    through the dense kernels on a padded copy, saying so, and the op itself refuses it."""
    q, k, v, cq, ck = make_varlen([3, 0, 9], [5, 2, 9], 2, 2, 16, torch.float32, "cuda", requires_grad=True)
    serve_ops._warn_fp32_varlen_once.cache_clear()  # warned once per process: another test may have been first
    with pytest.warns(UserWarning, match="float32 on CUDA has no variable-length kernel"):
        out = flashmod.flash_attn_varlen_func(q, k, v, cq, ck, 9, 9, causal=True)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    expected = flashmod.flash_attn_varlen_func(*cpu, cq.cpu(), ck.cpu(), 9, 9, causal=True)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(expected)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad.cuda()), torch.autograd.grad(expected, cpu, grad)):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="q must be float16 or bfloat16 on CUDA, got torch.float32"):
        torch.ops.flashmod.attention_varlen(q, k, v, cq, ck, 9, 9)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["default", "portable"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("variant", ["plain", "causal", "softcap_causal"])
def test_cuda_serving_prefill_kernels(monkeypatch, kernel, d, variant):
    """Prefill-shaped serving calls (varlen forward and its fused backward; a KV cache with more than
    64 new queries, contiguous, in whole-block pages and in small pages) on the wgmma kernel's
    per-sequence variants (the default on an H100/H200 for these head dims) and on the portable
    kernel: each sequence within the rule against fp64, gradients deterministic, paged equal to
    contiguous."""
    if kernel == "portable":
        monkeypatch.setenv("FLASHMOD_DISABLE_SM90", "1")
    opts, dtype = opts_of(variant), torch.bfloat16
    lq, lk = [0, 1, 130, 77, 300], [5, 1, 130, 200, 300]
    q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, d, dtype, "cuda", requires_grad=True)
    out = flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **opts)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    out_again = flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), **opts)
    again = torch.autograd.grad(out_again, (q, k, v), grad_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "the varlen backward is not deterministic"
    for b in range(len(lq)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        leaves = [t[r].detach() for t, r in ((q, rq), (k, rk), (v, rk))]
        truth, _ = reference(*leaves, opts, torch.float64)
        plain, _ = reference(*leaves, opts, dtype)
        assert_within_rule(out[rq], truth, plain, 2, dtype, f"varlen sequence {b}")
        assert_sequence_grads(grads, leaves, grad_out, rq, rk, opts, dtype, f"of varlen sequence {b}")

    B, S, sq, hq, hkv = 3, 512, 100, 4, 2
    k_cont, v_cont = make_cache(B, S, hkv, d, dtype, "cuda")
    q = torch.randn(B, sq, hq, d, dtype=dtype, device="cuda")
    seqlens = torch.tensor([0, 37, S - sq], dtype=torch.int32, device="cuda")
    k_new, v_new = (torch.randn(B, sq, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    results = {}
    for page_size in (None, 16, 256):
        if page_size is None:
            kc, vc, table = k_cont.clone(), v_cont.clone(), None
        else:
            per_row = S // page_size
            table = torch.randperm(B * per_row, device="cuda").to(torch.int32).reshape(B, per_row)
            kc = torch.empty(B * per_row, page_size, hkv, d, dtype=dtype, device="cuda")
            vc = torch.empty_like(kc)
            kc[table.long()] = k_cont.reshape(B, per_row, page_size, hkv, d)
            vc[table.long()] = v_cont.reshape(B, per_row, page_size, hkv, d)
        results[page_size] = flashmod.flash_attn_with_kvcache(
            q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table, **opts
        )
    for page_size in (16, 256):
        assert torch.equal(results[page_size], results[None]), f"pages of {page_size} differ from contiguous"
    for b in range(B):
        n = int(seqlens[b])
        ks, vs = torch.cat([k_cont[b, :n], k_new[b]]), torch.cat([v_cont[b, :n], v_new[b]])
        truth, _ = reference(q[b], ks, vs, opts, torch.float64)
        plain, _ = reference(q[b], ks, vs, opts, dtype)
        assert_within_rule(results[None][b], truth, plain, 2, dtype, f"kvcache row {b}")


@pytest.mark.cuda
@pytest.mark.parametrize("ws", ["1", "0"])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("variant", ["plain", "causal", "window"])
def test_varlen_neighbouring_rows_never_leak(monkeypatch, ws, d, variant):
    """Packed sequences on the warp-specialized kernel (FLASHMOD_SM90_WS=1 on an H100/H200; 0: the
    FlashAttention-2-style one): its row boxes run past a sequence's end into the next sequence,
    whose keys and values here are inf and NaN. Each clean sequence must match the reference alone,
    across many tiles per sequence (1023 and 300 rows: 8 and 3 query blocks, more tiles than SMs
    with 8 heads), GQA 8/2, empty and one-row sequences, Nq != Nk."""
    monkeypatch.setenv("FLASHMOD_SM90_WS", ws)
    opts, dtype = opts_of(variant), torch.bfloat16
    lq, lk = [300, 17, 1023, 0, 129, 1], [300, 33, 1023, 5, 200, 1]
    q, k, v, cq, ck = make_varlen(lq, lk, 8, 2, d, dtype, "cuda")
    poisoned = (1, 4)
    for b in poisoned:
        rk = slice(ck[b], ck[b + 1])
        k[rk] = float("inf")
        v[rk] = float("nan")
        v[rk][::2] = float("inf")
    for _ in range(2):  # many claims of the tile counter; a second call must start from zero again
        out, lse = flashmod.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **opts)
    for b in range(len(lq)):
        if b in poisoned:
            continue
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        truth, truth_lse = reference(q[rq], k[rk], v[rk], opts, torch.float64)
        plain, plain_lse = reference(q[rq], k[rk], v[rk], opts, dtype)
        assert_within_rule(out[rq], truth, plain, 2, dtype, f"sequence {b}")
        assert_within_rule(lse[:, rq], truth_lse, plain_lse.float(), 2, dtype, f"lse of sequence {b}")


@pytest.mark.cuda
@pytest.mark.parametrize("d", [40, 64, 128])
@pytest.mark.parametrize("variant", ["plain", "causal", "window"])
def test_varlen_fused_dq_keeps_sequences_apart(monkeypatch, d, variant):
    """The Hopper backward's fused dQ variant on packed rows (FLASHMOD_BWD_FUSED_DQ=2 on an H100/H200; the
    dQ kernel elsewhere): its step boxes of 64 (D = 128) or 128 (D <= 64) queries run past a sequence's last
    row into the next sequence, whose queries, keys, values and output gradients here are inf and NaN, and
    its fp32 sums are laid out by sequence. Every clean sequence's gradients must be within the rule
    against the fp64 reference alone: partial and whole last steps (300, 1023, 129, 256 rows), an empty and
    a one-row sequence, GQA 8/2, Nq != Nk, and a second call, which must find the sums cleared."""
    monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "2")
    opts, dtype = opts_of(variant), torch.bfloat16
    lq, lk = [300, 17, 1023, 0, 129, 1, 256], [300, 33, 1023, 5, 200, 1, 256]
    q, k, v, cq, ck = make_varlen(lq, lk, 8, 2, d, dtype, "cuda")
    grad_out = torch.randn_like(q)
    poisoned = (1, 4)
    for b in poisoned:
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        q[rq], grad_out[rq] = float("inf"), float("nan")
        k[rk], v[rk] = float("inf"), float("nan")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    for _ in range(2):
        out = flashmod.flash_attn_varlen_func(*leaves, cq, ck, max(lq), max(lk), **opts)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad_out)
    for b in range(len(lq)):
        if b in poisoned:
            continue
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        mine = [t[r].detach() for t, r in ((q, rq), (k, rk), (v, rk))]
        assert_sequence_grads((dq, dk, dv), mine, grad_out, rq, rk, opts, dtype, f"of sequence {b}")
    # The fused sums add in another order than the dQ kernel, so dQ differs in its last bits; not so
    # under a band of 10 keys, where each query's dQ takes one or two partials.
    if torch.cuda.get_device_capability() == (9, 0) and variant != "window":
        monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", "0")
        out = flashmod.flash_attn_varlen_func(*leaves, cq, ck, max(lq), max(lk), **opts)
        clean = slice(cq[2], cq[3])
        assert not torch.equal(torch.autograd.grad(out, leaves, grad_out)[0][clean], dq[clean]), "the dQ kernel ran"


@pytest.mark.cuda
def test_varlen_fused_dq_rule_takes_the_mean_lengths(monkeypatch):
    """FLASHMOD_BWD_FUSED_DQ=1 (deterministic algorithms off) takes the fused variant for packed rows
    by their mean lengths (backward_dispatch.h: fused_dq_wanted). Two sequences of 1100 tokens take it
    at D = 128, causal too (where dense rows of 1100 would not), and at D = 64 without causality (1100
    queries a key; causal: 550, no); 1100 and 100 (mean 600) do not, whatever max_seqlen says. Two-sided
    bands: at D = 128 a band of 1023 queries takes it, a causal band of 64 does not; at D = 64 a band of
    1023 does not (2048 in a two-sided band there)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused variant is a Hopper kernel")
    torch.use_deterministic_algorithms(False)
    cases = (
        (128, [1100, 1100], (-1, -1), True),
        (128, [1100, 1100], (-1, 0), True),
        (128, [1100, 100], (-1, -1), False),
        (128, [1100, 1100], (63, 0), False),
        (128, [1100, 1100], (511, 511), True),
        (64, [1100, 1100], (-1, -1), True),
        (64, [1100, 1100], (-1, 0), False),
        (64, [1100, 1100], (511, 511), False),
    )
    for d, lengths, (wl, wr), fused in cases:
        q, k, v, cq, ck = make_varlen(lengths, lengths, 4, 2, d, torch.bfloat16, "cuda")
        args = (q, k, v, cq, ck, max(lengths), max(lengths), None, False, wl, wr)
        out, lse = torch.ops.flashmod.attention_varlen(*args)
        grad_out = torch.randn_like(out)
        dq = {}
        for knob in ("0", "1"):
            monkeypatch.setenv("FLASHMOD_BWD_FUSED_DQ", knob)
            bwd_args = (q, k, v, out, lse, cq, ck, max(lengths), max(lengths), None, False, wl, wr)
            dq[knob] = torch.ops.flashmod.attention_varlen_backward(grad_out, None, *bwd_args)[0]
        assert torch.equal(dq["0"], dq["1"]) != fused, (d, lengths, wl, wr, "fused" if fused else "dQ kernel")


@pytest.mark.cuda
def test_varlen_deterministic_needs_torch_deterministic_mode_on_cuda():
    """deterministic=True on flash_attn_varlen_func promises a bitwise reproducible backward, as on
    flash_attn_func: under torch.use_deterministic_algorithms(True) (this suite's fixture) the packed
    backward is one (two runs bitwise equal); without it a call that will be differentiated raises (the
    Hopper backward may add dQ up by atomics on packed rows too), a call that will not runs."""
    lengths = [300, 17, 1100]
    q, k, v, cq, ck = make_varlen(lengths, lengths, 4, 2, 128, torch.bfloat16, "cuda")
    grads = [t.clone().requires_grad_() for t in (q, k, v)]
    args = (cq, ck, max(lengths), max(lengths))
    out = flashmod.flash_attn_varlen_func(*grads, *args, causal=True, deterministic=True)
    grad_out = torch.randn_like(out)
    first, again = (torch.autograd.grad(out, grads, grad_out, retain_graph=True) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch.use_deterministic_algorithms(False)
    with pytest.raises(RuntimeError, match=r"deterministic=True needs torch.use_deterministic_algorithms\(True\)"):
        flashmod.flash_attn_varlen_func(*grads, *args, causal=True, deterministic=True)
    out = flashmod.flash_attn_varlen_func(q, k, v, *args, causal=True, deterministic=True)
    assert torch.equal(out, flashmod.flash_attn_varlen_func(q, k, v, *args, causal=True))


@pytest.mark.cuda
def test_kvcache_cuda_graph_capture():
    """A decode step captured in a CUDA graph replays with new cache lengths (no host sync, no
    value-dependent allocation inside the op)."""
    dtype, B, S, hq, hkv, d = torch.bfloat16, 4, 1024, 32, 8, 128
    k_cache, v_cache = make_cache(B, S, hkv, d, dtype, "cuda")
    q = torch.randn(B, 1, hq, d, dtype=dtype, device="cuda")
    kn, vn = (torch.randn(B, 1, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    seqlens = torch.tensor([5, 100, 700, 1000], dtype=torch.int32, device="cuda")

    def step():
        return flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=seqlens, causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture (allocator, occupancy cache)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqlens.copy_(torch.tensor([0, 200, 10, 1022], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    for b in range(B):
        n = int(seqlens[b]) + 1
        assert torch.equal(k_cache[b, n - 1], kn[b, 0])
        truth, _ = reference(q[b], k_cache[b, :n], v_cache[b, :n], opts_of("causal"), torch.float64)
        plain, _ = reference(q[b], k_cache[b, :n], v_cache[b, :n], opts_of("causal"), dtype)
        assert_within_rule(out[b], truth, plain, 2, dtype, f"replayed row {b}")


def paged_copy(k_cont, v_cont, page_size, spare=3):
    """The caches (B, S, Hkv, D) as a shuffled pool of pages with spare pages nobody owns: (k_pool,
    v_pool, block_table, the pool's spare-page mask)."""
    B, S, hkv, d = k_cont.shape
    n = S // page_size
    perm = torch.randperm(B * n + spare, device=k_cont.device)[: B * n].to(torch.int32)
    table = perm.reshape(B, n)
    k_pool = torch.randn(B * n + spare, page_size, hkv, d, dtype=k_cont.dtype, device=k_cont.device)
    v_pool = torch.randn_like(k_pool)
    k_pool[table.long()] = k_cont.reshape(B, n, page_size, hkv, d)
    v_pool[table.long()] = v_cont.reshape(B, n, page_size, hkv, d)
    unowned = torch.ones(B * n + spare, dtype=torch.bool, device=k_cont.device)
    unowned[table.long().flatten()] = False
    return k_pool, v_pool, table, unowned


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [0, 16, 8, 48, 256])
@pytest.mark.parametrize("s_new", [1, 5, 70])
@pytest.mark.parametrize(
    "knobs", ["FLASHMOD_DECODE_SPLITS=0", "FLASHMOD_DECODE_SPLITS=3", "FLASHMOD_DECODE_KEY_SPLIT=0"]
)
def test_kvcache_fused_append_equals_append_kernel(monkeypatch, page_size, s_new, knobs):
    """Decode-shaped calls append inside the attention kernel (new rows read from k/v, written by one
    CTA per kv head); the result and the caches are bitwise those of the separate append kernel,
    with new rows across key-block (64) and page boundaries, more new rows than a key block, split-KV
    (the heuristic's and 3 forced), GQA 32/8 packed and (Sq = 2, causal) unpacked, tiles of <= 16
    rows on the key-split kernel and (FLASHMOD_DECODE_KEY_SPLIT=0) the row-split one,
    contiguous (0) and paged caches; no slot outside the appended ones changes."""
    monkeypatch.setenv(*knobs.split("="))
    dtype, B, hq, hkv, d = torch.bfloat16, 5, 32, 8, 128
    S = 768
    k_cont, v_cont = make_cache(B, S, hkv, d, dtype, "cuda")
    seqlens = torch.tensor([0, 63, 64 - s_new % 64, 250, S - s_new], dtype=torch.int32, device="cuda")
    k_new, v_new = (torch.randn(B, s_new, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    for sq, causal in ((1, False), (2, True)):
        q = torch.randn(B, sq, hq, d, dtype=dtype, device="cuda")
        results = {}
        for fused in ("1", "0"):
            monkeypatch.setenv("FLASHMOD_KVCACHE_FUSED_APPEND", fused)
            if page_size:
                k_pool, v_pool, table, unowned = paged_copy(k_cont, v_cont, page_size)
                caches, kw = (k_pool, v_pool), {"block_table": table}
            else:
                caches, kw = (k_cont.clone(), v_cont.clone()), {}
            before = [c.clone() for c in caches]
            out, lse = flashmod.flash_attn_with_kvcache(
                q, *caches, k_new, v_new, cache_seqlens=seqlens, causal=causal, return_lse=True, **kw
            )
            if page_size:
                # Back to the contiguous layout; pages outside the table must be untouched.
                for c, c0 in zip(caches, before):
                    assert torch.equal(c[unowned], c0[unowned]), "a page outside the table changed"
                caches = [c[table.long()].reshape(B, S, hkv, d) for c in caches]
                before = [c[table.long()].reshape(B, S, hkv, d) for c in before]
            written = torch.zeros(B, S, dtype=torch.bool, device="cuda")
            for b in range(B):
                n = int(seqlens[b])
                written[b, n : n + s_new] = True
                assert torch.equal(caches[0][b, n : n + s_new], k_new[b]), f"fused={fused}: row {b} k not appended"
                assert torch.equal(caches[1][b, n : n + s_new], v_new[b]), f"fused={fused}: row {b} v not appended"
            for c, c0 in zip(caches, before):
                assert torch.equal(c[~written], c0[~written]), f"fused={fused}: an untouched cache slot changed"
            results[fused] = (out, lse)
        assert torch.equal(results["1"][0], results["0"][0]), "fused append: out differs from the append kernel's"
        assert torch.equal(results["1"][1], results["0"][1]), "fused append: lse differs from the append kernel's"
        for b in (0, 3):
            ks = torch.cat([k_cont[b, : int(seqlens[b])], k_new[b]])
            vs = torch.cat([v_cont[b, : int(seqlens[b])], v_new[b]])
            truth, _ = reference(q[b], ks, vs, opts_of("causal" if causal else "plain"), torch.float64)
            plain, _ = reference(q[b], ks, vs, opts_of("causal" if causal else "plain"), dtype)
            assert_within_rule(results["1"][0][b], truth, plain, 2, dtype, f"row {b}")


@pytest.mark.cuda
# Head dims padded to 128 (the key-split kernel's) and 40 (padded to 64: row split either way).
@pytest.mark.parametrize("d", [104, 120, 128, 40])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("key_split", ["1", "0"])
def test_kvcache_key_split_kernel_odd_shapes(monkeypatch, d, group, key_split):
    """Decode tiles of <= 16 rows at head dims padded to 128 run the key-split kernel (every warp
    on its quarter of each key block, the warps' softmax states merged after the loop; soft caps
    stay on the row-split one) and, with FLASHMOD_DECODE_KEY_SPLIT=0, the row-split one: both
    within the rule on odd cache lengths (1, 17, 113, 1023), one and two queries, GQA 1 / 4 / 8,
    causal and windows, contiguous and 16-token paged caches, with NaN in every slot past a row's
    length, so a key read that should not be shows."""
    monkeypatch.setenv("FLASHMOD_DECODE_KEY_SPLIT", key_split)
    dtype, hkv, S = torch.bfloat16, 2, 1040
    seqlens = torch.tensor([1, 17, 113, 1023], dtype=torch.int32, device="cuda")
    B = len(seqlens)
    k_cont, v_cont = make_cache(B, S, hkv, d, dtype, "cuda")
    for b in range(B):
        k_cont[b, int(seqlens[b]) :] = float("nan")
        v_cont[b, int(seqlens[b]) :] = float("nan")
    for sq, variant in ((1, "plain"), (2, "causal"), (1, "window"), (2, "softcap_causal")):
        opts = opts_of(variant)
        q = torch.randn(B, sq, hkv * group, d, dtype=dtype, device="cuda")
        for page_size in (0, 16):
            if page_size:
                k_pool, v_pool, table, _ = paged_copy(k_cont, v_cont, page_size)
                caches, kw = (k_pool, v_pool), {"block_table": table}
            else:
                caches, kw = (k_cont, v_cont), {}
            out = flashmod.flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens, **opts, **kw)
            for b in range(B):
                n = int(seqlens[b])
                ks, vs = k_cont[b, :n], v_cont[b, :n]
                truth, _ = reference(q[b], ks, vs, opts, torch.float64)
                plain, _ = reference(q[b], ks, vs, opts, dtype)
                where = f"row {b} ({n} keys), sq {sq}, {variant}, pages {page_size}"
                assert_within_rule(out[b], truth, plain, 2, dtype, where)


@pytest.mark.cuda
def test_kvcache_fused_append_with_cache_batch_idx(monkeypatch):
    """The fused append writes through cache_batch_idx (rows of a larger cache, out of order): the
    same caches and result as the append kernel, other cache rows untouched."""
    dtype, B, hq, hkv, d, s_new = torch.bfloat16, 3, 8, 2, 64, 3
    k_cache, v_cache = make_cache(6, 300, hkv, d, dtype, "cuda")
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([10, 297, 128], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, hq, d, dtype=dtype, device="cuda")
    kn, vn = (torch.randn(B, s_new, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    results = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("FLASHMOD_KVCACHE_FUSED_APPEND", fused)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flashmod.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, cache_batch_idx=idx)
        results[fused] = (out, kc, vc)
    for a, b in zip(results["1"], results["0"]):
        assert torch.equal(a, b), "fused append with cache_batch_idx differs from the append kernel"
    untouched = [r for r in range(6) if r not in idx.tolist()]
    assert torch.equal(results["1"][1][untouched], k_cache[untouched]), "a cache row outside cache_batch_idx changed"


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 8, 16, 32, 48, 100])
@pytest.mark.parametrize("knobs", ["FLASHMOD_DECODE_SPLITS=0", "FLASHMOD_DECODE_SPLITS=5"])
def test_kvcache_small_pages_equal_contiguous_on_long_caches(monkeypatch, page_size, knobs):
    """Pages smaller than (or misaligned with) a 64-key block load row by row, each thread stepping
    through its rows' pages: bitwise the contiguous result over caches of a few thousand keys with
    uneven lengths, split-KV, windows and softcap, with and without an append."""
    monkeypatch.setenv(*knobs.split("="))
    dtype, B, hq, hkv, d = torch.bfloat16, 3, 32, 8, 128
    S = (2100 // page_size) * page_size
    k_cont, v_cont = make_cache(B, S, hkv, d, dtype, "cuda")
    seqlens = torch.tensor([S - 1, 1, 1000 + page_size // 2], dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, hq, d, dtype=dtype, device="cuda")
    kn, vn = (torch.randn(B, 1, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    for opts in ({}, {"window_size": (300, 0), "softcap": 20.0}):
        k_pool, v_pool, table, _ = paged_copy(k_cont, v_cont, page_size)
        for new in ((), (kn, vn)):
            kc, vc = k_cont.clone(), v_cont.clone()
            cont = flashmod.flash_attn_with_kvcache(q, kc, vc, *new, cache_seqlens=seqlens, **opts)
            paged = flashmod.flash_attn_with_kvcache(
                q, k_pool, v_pool, *new, cache_seqlens=seqlens, block_table=table, **opts
            )
            assert torch.equal(paged, cont), f"page_size {page_size}, {opts}, append {bool(new)}: paged != contiguous"
            assert torch.equal(k_pool[table.long()].reshape(B, S, hkv, d), kc), "paged append differs"


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("page_size", [8, 16, 32, 48])
def test_kvcache_pages_by_copy_engine_equal_cp_async(monkeypatch, d, page_size):
    """On a Hopper GPU the decode kernel brings whole key blocks of a cache paged in pages shorter
    than a block in through the copy engine (a tensor map over the pool, a box per page: pages of 8,
    16 and 32 tokens) and the rest (the block holding the appended keys, a partial last block, pages
    of 48, head dim 96) by cp.async; FLASHMOD_DECODE_TMA=0 copies everything by cp.async. Both give
    bitwise the same output, lse and pools, over uneven cache lengths (empty, within one block, whole
    blocks, one past), with and without an append, with split-KV (two splits of 18 key blocks: the
    copy engine takes splits of at least 16), GQA 32/8 and a window. Every slot past a row's valid
    length and every unowned page holds NaN: no copy may read one."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the copy engine's path exists on sm_90 only")
    monkeypatch.setenv("FLASHMOD_DECODE_SPLITS", "2")
    dtype, B, hq, hkv, S = torch.bfloat16, 6, 32, 8, 2304
    seqlens = torch.tensor([0, 63, 64, 65, 1000, S - 1], dtype=torch.int32, device="cuda")
    k_cont, v_cont = make_cache(B, S, hkv, d, dtype, "cuda")
    for c in (k_cont, v_cont):
        for b in range(B):
            c[b, int(seqlens[b]) :] = float("nan")
    q = torch.randn(B, 1, hq, d, dtype=dtype, device="cuda")
    kn, vn = (torch.randn(B, 1, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
    k_pool, v_pool, table, unowned = paged_copy(k_cont, v_cont, page_size)
    k_pool[unowned], v_pool[unowned] = float("nan"), float("nan")
    for opts in ({}, {"causal": True, "window_size": (700, 0)}):
        for new in ((), (kn, vn)):
            results = []
            for tma in ("1", "0"):
                monkeypatch.setenv("FLASHMOD_DECODE_TMA", tma)
                kp, vp = k_pool.clone(), v_pool.clone()
                out, lse = flashmod.flash_attn_with_kvcache(
                    q, kp, vp, *new, cache_seqlens=seqlens, block_table=table, return_lse=True, **opts
                )
                results.append((out, lse, kp, vp))
            what = f"pages of {page_size}, d {d}, {opts}, append {bool(new)}"
            assert not results[0][0].isnan().any(), f"{what}: a NaN slot was read"
            for got, want, name in zip(results[0], results[1], ("out", "lse", "k_pool", "v_pool")):
                if name.endswith("pool"):  # bit patterns: the NaN slots compare too
                    got, want = got.view(torch.int16), want.view(torch.int16)
                assert torch.equal(got, want), f"{what}: {name} differs between the copy engine and cp.async"
    b = 4  # one row against the reference, to tie both paths to the truth
    n = int(seqlens[b])
    truth, _ = reference(q[b], k_cont[b, :n], v_cont[b, :n], opts_of("plain"), torch.float64)
    plain, _ = reference(q[b], k_cont[b, :n], v_cont[b, :n], opts_of("plain"), dtype)
    monkeypatch.setenv("FLASHMOD_DECODE_TMA", "1")
    out = flashmod.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table)
    assert_within_rule(out[b], truth, plain, 2, dtype, f"pages of {page_size}, d {d}: row {b}")


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_kvcache_decode_step_lengths_pages_and_groups(d):
    """A decode step within the accuracy rule on every batch row: cache lengths 0, 1, 31, 33 and
    3000 (empty, partial and whole key blocks, split-KV), one new row appended, GQA 4 and 16,
    contiguous and 16-token pages, causal with and without a window."""
    dtype, B, hkv, S = torch.bfloat16, 5, 2, 3072
    seqlens = torch.tensor([0, 1, 31, 33, 3000], dtype=torch.int32, device="cuda")
    for group, page_size, window in ((4, 0, (-1, -1)), (16, 16, (700, 0))):
        k_cont, v_cont = make_cache(B, S, hkv, d, dtype, "cuda")
        q = torch.randn(B, 1, hkv * group, d, dtype=dtype, device="cuda")
        kn, vn = (torch.randn(B, 1, hkv, d, dtype=dtype, device="cuda") for _ in range(2))
        if page_size:
            k_pool, v_pool, table, _ = paged_copy(k_cont, v_cont, page_size)
            caches, kw = (k_pool, v_pool), {"block_table": table}
        else:
            caches, kw = (k_cont.clone(), v_cont.clone()), {}
        out, lse = flashmod.flash_attn_with_kvcache(
            q, *caches, kn, vn, cache_seqlens=seqlens, causal=True, window_size=window, return_lse=True, **kw
        )
        opts = {"causal": True, "window_size": window, "softcap": 0.0}
        for b in range(B):
            n = int(seqlens[b])
            ks = torch.cat([k_cont[b, :n], kn[b]])
            vs = torch.cat([v_cont[b, :n], vn[b]])
            truth_o, truth_l = reference(q[b], ks, vs, opts, torch.float64)
            plain_o, plain_l = reference(q[b], ks, vs, opts, dtype)
            assert_within_rule(out[b], truth_o, plain_o, 2, dtype, f"group {group}, row {b}: out")
            assert_within_rule(lse[b], truth_l, plain_l.float(), 2, dtype, f"group {group}, row {b}: lse")


def test_serving_functions_validate_like_flash_attn_func(device):
    """window_size must be a pair of ints, tensors must be tensors, and a window side reaching over
    max_seqlen_k (varlen) or the cache's capacity (kvcache) is unbounded, as in flash-attn."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lq, lk = [3, 9], [12, 2]
    q, k, v, cq, ck = make_varlen(lq, lk, 4, 2, 32, dtype, device)
    varlen = flashmod.flash_attn_varlen_func
    with pytest.raises(TypeError, match=r"flash_attn_varlen_func: window_size must be a pair of ints"):
        varlen(q, k, v, cq, ck, 9, 12, window_size=5)
    with pytest.raises(TypeError, match=r"flash_attn_varlen_func: k must be a torch.Tensor, got builtins.NoneType"):
        varlen(q, None, v, cq, ck, 9, 12)
    with pytest.raises(ValueError, match=r"dropout_p must be a probability in \[0, 1\], got -0.5"):
        varlen(q, k, v, cq, ck, 9, 12, dropout_p=-0.5)
    unbounded = varlen(q, k, v, cq, ck, 9, 12, causal=True, window_size=(-1, -1))
    assert torch.equal(varlen(q, k, v, cq, ck, 9, 12, causal=True, window_size=(12, 40)), unbounded)
    literal = varlen(q, k, v, cq, ck, 9, 12, causal=True, window_size=(2, 0))
    assert not torch.equal(literal, unbounded), "a window side under max_seqlen_k must still apply"

    k_cache, v_cache = make_cache(2, 32, 2, 32, dtype, device)
    qd = torch.randn(2, 1, 4, 32, dtype=dtype, device=device)
    with pytest.raises(TypeError, match=r"flash_attn_with_kvcache: window_size must be a pair of ints"):
        flashmod.flash_attn_with_kvcache(qd, k_cache, v_cache, window_size=None)
    full = flashmod.flash_attn_with_kvcache(qd, k_cache, v_cache, causal=True)
    assert torch.equal(flashmod.flash_attn_with_kvcache(qd, k_cache, v_cache, causal=True, window_size=(32, 0)), full)
