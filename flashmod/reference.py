"""The one reference implementation of flashmod's attention, in plain torch.

It serves the tests (``attention_reference`` in fp32/fp64 is the ground truth, in low precision it
is "plain PyTorch attention" for the error-ratio rule), the benchmarks, the dropout training
fallback, and, as ``attention_backward_chunked`` (probabilities recomputed from the saved
log-sum-exp a chunk of queries at a time, so no ``Nq x Nk`` tensor is held), the oracle of the fused
backward kernels, which stands in for the CUDA one only in builds without it (flashmod/ops.py).
Semantics, shared with the kernels:

* ``q (B, Hq, Nq, D)``, ``k``/``v (B, Hkv, Nk, D)``; q-head ``h`` reads kv-head ``h // (Hq // Hkv)``.
* score = ``scale * q @ k^T``; if ``softcap > 0`` then ``softcap * tanh(score / softcap)``; then the
  mask: bool (True = attend) or additive float, broadcastable to ``(B, Hq, Nq, Nk)``. An additive
  value at or below ``HIDING_MASK_VALUE`` hides its key as ``False`` would (HF's ``finfo.min``,
  ``-1e9``: a row of only such keys has no fp32 lse that still carries its row sum).
* key ``j`` is visible to query ``i`` iff ``i + off - window_left <= j <= i + off + window_right``
  (a negative bound is unbounded), with ``off = Nk - Nq`` (bottom-right) or ``0`` (top-left);
  ``is_causal`` sets ``window_right = 0``.
* a row with no visible key has output 0 and lse ``-inf``; a NaN or +inf among a row's visible
  scores makes its output and lse NaN (SDPA's math backend gives the same outputs).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Additive mask values at or below this hide their key (csrc/common/additive_mask.h says why).
HIDING_MASK_VALUE = -32768.0

# Elements of one backward chunk's (B, Hq, rows, Nk) score tensor: about 64 MB per fp32 buffer.
BACKWARD_CHUNK_ELEMENTS = 1 << 24

# The dropout fallback's (B, Hq, Nq, Nk) scores above which it runs in row chunks (256 MB per fp32
# tensor; one pass keeps about five for autograd). Chunks recompute their forward in the backward,
# which costs most where the call is small (CPU, 2 threads, fp32, causal, forward + backward, one
# pass against chunks: B 4, H 8, N 1k, D 64 1.29 s / 2.03 s, peak RSS 1155 / 840 MiB; B 1, H 8,
# N 4k 7.22 s / 7.73 s, peak RSS 3596 / 895 MiB).
DROPOUT_ONE_PASS_ELEMENTS = 1 << 26


_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of ``a * b`` for a 32-bit constant ``a`` and int64 tensor ``b``
    of 32-bit values, without leaving int64: ``b`` in 16-bit halves."""
    low_part, high_part = a * (b & 0xFFFF), a * (b >> 16)  # each below 2^48
    s = low_part + ((high_part & 0xFFFF) << 16)  # below 2^49
    return (high_part >> 16) + (s >> 32), s & _MASK32


def philox4x32_10(counter: tuple[Tensor, ...], key: tuple[int, int]) -> tuple[Tensor, ...]:
    """Philox4x32-10 (Salmon et al., SC'11) on int64 tensors holding 32-bit words: four counter
    words (broadcastable), two key words -> four output words. The fused dropout kernels'
    generator (csrc/attention/cuda/dropout.h)."""
    x0, x1, x2, x3 = counter
    k0, k1 = key
    for round_ in range(10):
        if round_ > 0:  # the Weyl key schedule between rounds
            k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
        hi0, lo0 = _mulhilo32(0xD2511F53, x0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
    return x0, x1, x2, x3


def dropout_threshold(dropout_p: float) -> int:
    """The 16-bit draw at and above which a probability is kept: round(dropout_p * 2^16)."""
    return int(math.floor(dropout_p * 65536.0 + 0.5))


def dropout_keep_mask(rng_state: Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> Tensor:
    """Bool ``(B, Hq, Nq, Nk)``: which probabilities ``flashmod::attention_dropout`` keeps for
    ``rng_state`` (two int64 words), the definition the CUDA kernels follow (dropout.h).

    Query ``i`` of head ``bh = b * Hq + h`` keeps key ``j`` iff the 16-bit draw
    ``2 * ((j % 32) / 8) + j % 2`` (low half of a word first) of Philox4x32-10 with key
    ``(lo, hi words of rng_state[0])`` and counter ``(4 * (j / 32) + (j % 8) / 2, i, bh,
    lo word of rng_state[1])`` is ``>= dropout_threshold(dropout_p)``. Memory: int64 tensors of
    up to ``B * Hq * Nq * Nk`` elements; for tests and small calls.
    """
    batch, heads, seqlen_q, seqlen_k = shape
    seed, stream = (int(w) & ((1 << 64) - 1) for w in rng_state.tolist())
    device = rng_state.device
    spans = -(-seqlen_k // 32)
    calls = torch.arange(4 * spans, device=device).view(1, 1, -1)
    rows = torch.arange(seqlen_q, device=device).view(1, -1, 1)
    heads_ = torch.arange(batch * heads, device=device).view(-1, 1, 1)
    words = philox4x32_10(
        (calls, rows, heads_, torch.tensor(stream & _MASK32, device=device)), (seed & _MASK32, seed >> 32)
    )
    words = torch.stack(torch.broadcast_tensors(*words), -1)  # (B * Hq, Nq, calls, 4)
    j = torch.arange(seqlen_k, device=device)
    draws = words[:, :, 4 * (j // 32) + (j % 8) // 2, (j % 32) // 8] >> (16 * (j % 2)) & 0xFFFF
    return (draws >= dropout_threshold(dropout_p)).view(batch, heads, seqlen_q, seqlen_k)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def effective_window(is_causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    return window_left, (0 if is_causal else window_right)


def visible_keys(
    rows: Tensor, seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, bottom_right: bool
) -> Tensor | None:
    """Bool ``(len(rows), Nk)`` of keys inside the causal/sliding window, or None when unbounded."""
    if window_left < 0 and window_right < 0:
        return None
    diagonal = rows[:, None] + (seqlen_k - seqlen_q if bottom_right else 0)
    cols = torch.arange(seqlen_k, device=rows.device)[None, :]
    visible = torch.ones(rows.numel(), seqlen_k, dtype=torch.bool, device=rows.device)
    if window_left >= 0:
        visible &= cols >= diagonal - window_left
    if window_right >= 0:
        visible &= cols <= diagonal + window_right
    return visible


def _grouped(x: Tensor, heads_kv: int) -> Tensor:
    """(B, Hq, ...) -> (B, Hkv, G, ...) without copying: GQA by broadcasting, not repeat_kv."""
    return x.unflatten(1, (heads_kv, x.shape[1] // heads_kv if heads_kv else 0))


def _masked_scores(
    q: Tensor,
    k: Tensor,
    attn_mask: Tensor | None,
    rows: Tensor,
    seqlen_q: int,
    scale: float,
    softcap: float,
    window: tuple[int, int],
    bottom_right: bool,
) -> tuple[Tensor, Tensor | None]:
    """Scores for the query rows ``rows``: q is (B, Hkv, G, r, D) and k is (B, Hkv, Nk, D) in the
    compute dtype. Returns (scores after softcap and masks, tanh(raw/softcap) or None)."""
    batch, heads_kv, group = q.shape[:3]
    seqlen_k = k.shape[2]
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    tanh_s = None
    if softcap > 0:
        tanh_s = torch.tanh(s / softcap)
        s = softcap * tanh_s
    if attn_mask is not None:
        m = attn_mask.expand(batch, heads_kv * group, seqlen_q, seqlen_k)[:, :, rows]
        m = _grouped(m, heads_kv)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, -math.inf)
        else:
            s = (s + m.to(s.dtype)).masked_fill(m <= HIDING_MASK_VALUE, -math.inf)
    visible = visible_keys(rows, seqlen_q, seqlen_k, window[0], window[1], bottom_right)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    return s, tanh_s


def _finite_lse(lse: Tensor) -> Tensor:
    """lse with -inf (fully masked rows) replaced by 0, so exp(-inf - lse) is 0, never NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _chunk_probs(s: Tensor, lse: Tensor) -> Tensor:
    """P of whole rows of scores from their saved lse, each row normalized exactly (the kernel's lse
    carries fast-exp rounding, ~1e-6 relative in fp32 on CUDA, that would otherwise scale the row's
    every gradient). Hidden keys (-inf) get 0 even in a NaN row (lse NaN), whose NaN stays on its
    visible keys, as autograd through the materialized softmax has it."""
    p = torch.exp(s - _finite_lse(lse)[..., None])
    row_sum = p.sum(-1, keepdim=True)
    p = p / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    return p.masked_fill(torch.isneginf(s), 0)


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    bottom_right: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    compute_dtype: torch.dtype | None = None,
    return_probs: bool = False,
    dropout_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Attention materialized in ``compute_dtype`` (default: fp32, fp64 for fp64 inputs).

    Returns ``(out, lse)`` in ``compute_dtype``, plus the probabilities if ``return_probs``.
    Differentiable; with ``dropout_p > 0`` the probabilities are dropped out (training fallback):
    by torch's generator, or, given ``dropout_mask`` (bool ``(B, Hq, Nq, Nk)``, True = kept: the
    fused kernels' choices, ``dropout_keep_mask``), where it is False (survivors scaled by
    ``1 / (1 - dropout_p)``, 0 at ``dropout_p = 1``).
    There, once the ``(B, Hq, Nq, Nk)`` scores pass ``DROPOUT_ONE_PASS_ELEMENTS``, the query rows
    run in chunks of the backward's budget under activation checkpointing: autograd keeps each
    chunk's inputs, not its probabilities and dropout mask, and the backward recomputes a chunk with
    the random state it had, so the same keys are dropped (memory O(chunk x Nk) instead of several
    ``Nq x Nk`` tensors a call, for a second forward pass in the backward).
    """
    dtype = compute_dtype or compute_dtype_for(q.dtype)
    batch, heads_q, seqlen_q, head_dim = q.shape
    args = (
        k, v, attn_mask, seqlen_q, resolve_scale(scale, head_dim), softcap,
        effective_window(is_causal, window_left, window_right), bottom_right, dropout_p, dtype,
    )  # fmt: skip
    if dropout_mask is not None:
        out, lse, p = _attention_rows(q, 0, *args, return_probs=True, dropout_mask=dropout_mask)
        return (out, lse, p) if return_probs else (out, lse)
    if dropout_p > 0 and not return_probs and batch * heads_q * seqlen_q * k.shape[2] > DROPOUT_ONE_PASS_ELEMENTS:
        chunk_rows = backward_chunk_rows(batch, heads_q, seqlen_q, k.shape[2])
        rows_of = [(q[:, :, r0 : r0 + chunk_rows], r0) for r0 in range(0, seqlen_q, chunk_rows)]
        parts = [checkpoint(_attention_rows, q_rows, r0, *args, use_reentrant=False) for q_rows, r0 in rows_of]
        return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)
    out, lse, p = _attention_rows(q, 0, *args, return_probs=True)
    return (out, lse, p) if return_probs else (out, lse)


def _attention_rows(
    q: Tensor,
    first_row: int,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    seqlen_q: int,
    scale: float,
    softcap: float,
    window: tuple[int, int],
    bottom_right: bool,
    dropout_p: float,
    dtype: torch.dtype,
    return_probs: bool = False,
    dropout_mask: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """attention_reference's math for the query rows ``first_row ..`` of a call with ``seqlen_q``
    rows (``q`` holds those rows): ``(out, lse)``, and the probabilities if ``return_probs``;
    ``dropout_mask`` covers every row of the call."""
    heads_kv = k.shape[1]
    rows = torch.arange(first_row, first_row + q.shape[2], device=q.device)
    s, _ = _masked_scores(
        _grouped(q.to(dtype), heads_kv), k.to(dtype), attn_mask, rows, seqlen_q, scale, softcap, window, bottom_right
    )
    # A row with no visible key: logsumexp's gradient there would be 0 * NaN, so such rows take the
    # log-sum-exp of zeros (no gradient flows back through masked_fill) and are set to -inf after.
    empty_rows = torch.isneginf(s).all(-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(empty_rows, 0), dim=-1).masked_fill(empty_rows.squeeze(-1), -math.inf)
    # A +inf score makes the row NaN (exp(inf - inf)), as in SDPA's math; its lse too, not +inf.
    lse = lse.masked_fill(torch.isposinf(lse), math.nan)
    # Hidden keys get 0 even in a NaN row (lse NaN): the row's NaN stays on the keys it sees.
    p = torch.exp(s - _finite_lse(lse)[..., None]).masked_fill(torch.isneginf(s), 0)
    if dropout_mask is not None:
        kept = _grouped(dropout_mask[:, :, first_row : first_row + q.shape[2]], heads_kv)
        p = p * kept.to(dtype) * (1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)
    elif dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    out = torch.matmul(p, v.to(dtype).unsqueeze(2))
    out, lse = out.flatten(1, 2), lse.flatten(1, 2)
    return (out, lse, p.flatten(1, 2)) if return_probs else (out, lse)


def backward_chunk_rows(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int) -> int:
    """Query rows per backward chunk so one (B, Hq, rows, Nk) buffer stays near the budget."""
    per_row = max(1, batch * heads_q * seqlen_k)
    return max(1, min(seqlen_q, BACKWARD_CHUNK_ELEMENTS // per_row))


def attention_backward_chunked(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    is_causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    compute_grad_mask: bool = False,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (out, lse) w.r.t. q, k, v, recomputing P from exp(S - lse) chunk by chunk,
    and, if ``compute_grad_mask``, the fp32 ``(B, Hq, Nq, Nk)`` gradient of the scores after the
    mask (what an additive mask receives before its broadcast dimensions are summed), else an
    empty fp32 ``(0,)`` tensor: attention_backward's outputs.

    Extra memory is O(chunk_rows x Nk) per head: nothing of size Nq x Nk is allocated unless a
    single chunk covers every query or the mask's gradient is asked for. GQA gradients are summed
    over each kv-head's query group.
    """
    dtype = compute_dtype_for(q.dtype)
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    scale = resolve_scale(scale, head_dim)
    window = effective_window(is_causal, window_left, window_right)
    chunk_rows = chunk_rows or backward_chunk_rows(batch, heads_q, seqlen_q, seqlen_k)

    kc, vc = k.to(dtype), v.to(dtype)
    # Out of place throughout, so torch.func (vmap, jvp) and autograd (double backward) go through.
    dq_parts, mask_parts = [], []
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for r0 in range(0, seqlen_q, chunk_rows):
        r1 = min(seqlen_q, r0 + chunk_rows)
        rows = torch.arange(r0, r1, device=q.device)
        q_i = _grouped(q[:, :, r0:r1].to(dtype), heads_kv)
        do_i = _grouped(grad_out[:, :, r0:r1].to(dtype), heads_kv)
        lse_i = _grouped(lse[:, :, r0:r1].to(dtype), heads_kv)
        s, tanh_s = _masked_scores(q_i, kc, attn_mask, rows, seqlen_q, scale, softcap, window, bottom_right)
        p = _chunk_probs(s, lse_i)
        del s
        dp = torch.matmul(do_i, vc.unsqueeze(2).transpose(-1, -2))
        # sum_j p_ij dp_ij equals dO_i . O_i, but taken from the same p it stays consistent with
        # it (exactly 0 for a single visible key); the chunk is in memory, so it costs one pass.
        delta = (p * dp).sum(-1, keepdim=True)
        if grad_lse is not None:  # d lse / d s = p
            delta = delta - _grouped(grad_lse[:, :, r0:r1].to(dtype), heads_kv)[..., None]
        # Hidden keys keep dS = 0 in a NaN row too (delta NaN), as autograd of the masked math.
        ds = torch.where(p == 0, 0, p * (dp - delta))
        del dp
        if compute_grad_mask:
            mask_parts.append(ds.flatten(1, 2).float())
        if tanh_s is not None:  # d/ds [c tanh(s / c)] = 1 - tanh^2
            ds = ds * (1 - tanh_s * tanh_s)
            del tanh_s
        dq_parts.append((torch.matmul(ds, kc.unsqueeze(2)) * scale).flatten(1, 2))
        dk = dk + torch.einsum("bhgrn,bhgrd->bhnd", ds, q_i) * scale
        dv = dv + torch.einsum("bhgrn,bhgrd->bhnd", p, do_i)
    dq = torch.cat(dq_parts, 2) if dq_parts else torch.zeros(q.shape, dtype=dtype, device=q.device)
    if not compute_grad_mask:
        grad_mask = torch.zeros(0, dtype=torch.float32, device=q.device)
    elif mask_parts:
        grad_mask = torch.cat(mask_parts, 2)
    else:
        grad_mask = torch.zeros(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.float32, device=q.device)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grad_mask


def attention_jvp_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    mask_t: Tensor | None,
    scale: float | None,
    is_causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    chunk_rows: int | None = None,
    dropout_p: float = 0.0,
    dropout_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward-mode derivative of attention's (out, lse) along the tangents (None = zero).

    With T the tangent of the scores (``scale (q_t k^T + q k_t^T)``, times ``1 - tanh^2`` under
    softcap, plus ``mask_t``): ``lse_t = sum_j P_ij T_ij`` and ``out_t = P (T - lse_t) V + P v_t``.
    P is recomputed from the saved lse a chunk of queries at a time, as in the backward. With
    ``dropout_mask`` (the kept keys, ``dropout_keep_mask``) the products take P o Z, Z the kept
    keys scaled by ``1 / (1 - dropout_p)``; lse (undropped) keeps P.
    """
    dtype = compute_dtype_for(q.dtype)
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    scale = resolve_scale(scale, head_dim)
    window = effective_window(is_causal, window_left, window_right)
    chunk_rows = chunk_rows or backward_chunk_rows(batch, heads_q, seqlen_q, seqlen_k)
    kc, vc = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    out_parts, lse_parts = [], []
    for r0 in range(0, seqlen_q, chunk_rows):
        r1 = min(seqlen_q, r0 + chunk_rows)
        rows = torch.arange(r0, r1, device=q.device)
        q_i = _grouped(q[:, :, r0:r1].to(dtype), heads_kv)
        lse_i = _grouped(lse[:, :, r0:r1].to(dtype), heads_kv)
        s, tanh_s = _masked_scores(q_i, k.to(dtype), attn_mask, rows, seqlen_q, scale, softcap, window, bottom_right)
        p = _chunk_probs(s, lse_i)
        del s
        t = torch.zeros_like(p)
        if q_t is not None:
            t = t + torch.matmul(_grouped(q_t[:, :, r0:r1].to(dtype), heads_kv), kc.transpose(-1, -2))
        if k_t is not None:
            t = t + torch.matmul(q_i, k_t.to(dtype).unsqueeze(2).transpose(-1, -2))
        t = t * scale
        if tanh_s is not None:
            t = t * (1 - tanh_s * tanh_s)
        if mask_t is not None:
            m = mask_t.expand(batch, heads_q, seqlen_q, seqlen_k)[:, :, r0:r1]
            t = t + _grouped(m.to(dtype), heads_kv)
        # Keys outside the visible set have P = 0; where their T is not finite (a -inf mask's
        # tangent, say) it must not turn 0 * T into NaN.
        t = torch.where(p > 0, t, torch.zeros_like(t))
        lse_t = (p * t).sum(-1, keepdim=True)
        if dropout_mask is not None:
            kept = _grouped(dropout_mask[:, :, r0:r1], heads_kv).to(dtype)
            p = p * kept * (1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)
        out_t = torch.matmul(p * (t - lse_t), vc)
        if v_t is not None:
            out_t = out_t + torch.matmul(p, v_t.to(dtype).unsqueeze(2))
        out_parts.append(out_t.flatten(1, 2))
        lse_parts.append(lse_t.squeeze(-1).flatten(1, 2))
    out_t = torch.cat(out_parts, 2) if out_parts else q.new_zeros(q.shape, dtype=dtype)
    lse_t = torch.cat(lse_parts, 2) if lse_parts else q.new_zeros(q.shape[:3], dtype=dtype)
    return out_t.to(q.dtype), lse_t.float()
