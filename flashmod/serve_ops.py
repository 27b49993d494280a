"""The serving ops: variable-length (packed) batches and decoding against a KV cache.

``torch.ops.flashmod.attention_varlen`` / ``attention_varlen_backward`` / ``attention_kvcache`` are
declared in ``csrc/flashmod.cpp`` and prepared by ``csrc/attention/serve_host.cpp``. Here they get
their fake implementations (the C++ checks mirrored as ``torch._check``, same order and messages),
autograd for ``attention_varlen``, fp32's padded CUDA path, and the flash-attn-compatible
functions :func:`flash_attn_varlen_func` and :func:`flash_attn_with_kvcache`.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .checks import (
    check_deterministic_backward,
    check_dropout,
    check_flash_attn_extras,
    check_float_dtype,
    check_fp64_on_cpu,
    check_options,
    check_same_device,
    check_same_dtype,
    check_tensor_types,
    check_window,
    unbounded_past,
    unpack_stacked,
)
from .ops import CUDA_MAX_HEAD_DIM, _check_dropout_args, attention_op, below_autograd, has_tangent, no_grad_needed

_VARLEN = "flashmod.attention_varlen"
_KVCACHE = "flashmod.attention_kvcache"


def _check_index(p: str, name: str, t: Tensor, rank: int, want: int | None, want_text: str, q: Tensor) -> None:
    torch._check(t.dtype == torch.int32, lambda: f"{p}{name} must be int32, got {t.dtype}")
    torch._check(
        t.dim() == rank,
        lambda: f"{p}{name} must be a {rank}-D tensor, got a {t.dim()}-D tensor of shape {list(t.shape)}",
    )
    torch._check(
        want is None or t.shape[0] == want,
        lambda: f"{p}{name} must have {want_text} = {want} entries in dim 0, got {t.shape[0]}",
    )
    torch._check(t.device == q.device, lambda: f"{p}{name} must be on q's device {q.device}, got {t.device}")


def _check_cuda(op: str, q: Tensor) -> None:
    """The CUDA kernels of the serving ops: fp16/bf16 (flash-attn's dtypes), head_dim <= 256."""
    if q.device.type != "cuda":
        return
    check_fp64_on_cpu(op, "q", q)
    torch._check(
        q.dtype in (torch.float16, torch.bfloat16),
        lambda: f"{op}: q must be float16 or bfloat16 on CUDA, got {q.dtype}",
    )
    torch._check(
        q.shape[-1] <= CUDA_MAX_HEAD_DIM,
        lambda: f"{op}: q's head_dim must be <= {CUDA_MAX_HEAD_DIM} on CUDA, got {q.shape[-1]}",
    )


def _check_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None,
    window_left: int,
    window_right: int,
    softcap: float,
) -> None:
    """Mirror of serve_host.cpp's prepare_attention_varlen checks, after serve_cuda.cpp's CUDA-only
    ones (values of cu_seqlens are checked by the CPU kernel only: reading them on CUDA would
    synchronize)."""
    _check_cuda(_VARLEN, q)
    p = f"{_VARLEN}: "
    for name, t in (("q", q), ("k", k), ("v", v)):
        torch._check(
            t.dim() == 3,
            lambda n=name, t=t: (
                f"{p}{n} must be a 3-D tensor (total_tokens, heads, head_dim), got a {t.dim()}-D tensor "
                f"of shape {list(t.shape)}"
            ),
        )
    check_float_dtype(_VARLEN, "q", q)
    check_same_dtype(_VARLEN, "k", k, "q", q)
    check_same_dtype(_VARLEN, "v", v, "q", q)
    check_same_device(_VARLEN, "k", k, "q", q)
    check_same_device(_VARLEN, "v", v, "q", q)
    torch._check(q.shape[2] > 0, lambda: f"{p}q's head_dim must be positive, got {q.shape[2]}")
    torch._check(
        k.shape[2] == q.shape[2] and v.shape[2] == q.shape[2],
        lambda: f"{p}k and v must have q's head_dim {q.shape[2]}, got k {k.shape[2]} and v {v.shape[2]}",
    )
    torch._check(
        v.shape[0] == k.shape[0] and v.shape[1] == k.shape[1],
        lambda: f"{p}v must have k's (total_k, heads) = ({k.shape[0]}, {k.shape[1]}), got ({v.shape[0]}, {v.shape[1]})",
    )
    torch._check(
        k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
        lambda: (
            f"{p}q's heads must be a multiple of k's heads (GQA/MQA), "
            f"got q heads {q.shape[1]} and k/v heads {k.shape[1]}"
        ),
    )
    _check_index(p, "cu_seqlens_q", cu_seqlens_q, 1, None, "", q)
    torch._check(cu_seqlens_q.numel() >= 1, lambda: f"{p}cu_seqlens_q must have batch + 1 >= 1 entries, got 0")
    _check_index(p, "cu_seqlens_k", cu_seqlens_k, 1, cu_seqlens_q.numel(), "cu_seqlens_q's length (batch + 1)", q)
    torch._check(max_seqlen_q >= 0, lambda: f"{p}max_seqlen_q must be >= 0, got {max_seqlen_q}")
    torch._check(max_seqlen_k >= 0, lambda: f"{p}max_seqlen_k must be >= 0, got {max_seqlen_k}")
    check_options(_VARLEN, scale, window_left, window_right, softcap)


def _check_varlen_dropout(op: str, q: Tensor, dropout_p: float, rng_state: Tensor | None) -> None:
    """Mirror of serve_host.cpp's set_varlen_dropout: nothing at dropout_p = 0, else rng_state is
    required and checked as attention_dropout's."""
    torch._check(0.0 <= dropout_p <= 1.0, lambda: f"{op}: dropout_p must be a probability in [0, 1], got {dropout_p}")
    if dropout_p == 0.0:
        return
    torch._check(
        rng_state is not None,
        lambda: f"{op}: dropout_p = {dropout_p} > 0 needs rng_state (a contiguous (2,) int64 tensor), got None",
    )
    _check_dropout_args(op, q, dropout_p, rng_state)


@torch.library.register_fake("flashmod::attention_varlen")
def _attention_varlen_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None = None,
    is_causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right, softcap
    )
    _check_varlen_dropout(_VARLEN, q, dropout_p, rng_state)
    out = torch.empty_like(q if q.stride(-1) == 1 else q.contiguous())
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.register_fake("flashmod::attention_varlen_backward")
def _attention_varlen_backward_fake(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None = None,
    is_causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left, window_right, softcap
    )
    _check_varlen_dropout("flashmod.attention_varlen_backward", q, dropout_p, rng_state)
    p = "flashmod.attention_varlen_backward: "
    torch._check(
        out.shape == q.shape and grad_out.shape == q.shape,
        lambda: (
            f"{p}out and grad_out must have q's shape {list(q.shape)}, got out {list(out.shape)} "
            f"and grad_out {list(grad_out.shape)}"
        ),
    )
    want = [q.shape[1], q.shape[0]]
    torch._check(
        list(lse.shape) == want and lse.dtype == torch.float32,
        lambda: f"{p}lse must be float32 of shape (heads, total_q) = {want}, got {lse.dtype} {list(lse.shape)}",
    )
    torch._check(
        grad_lse is None or grad_lse.shape == lse.shape,
        lambda: f"{p}grad_lse must have lse's shape {list(lse.shape)}, got {list(grad_lse.shape)}",
    )
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _left_pad_index(cu: Tensor, total: int, max_len: int) -> tuple[Tensor, Tensor]:
    """(sequence, padded position) of each packed row when every sequence is right-aligned in
    ``max_len`` rows: device-side index math, no host sync."""
    tok = torch.arange(total, device=cu.device)
    ends = cu[1:].long()
    seq = torch.searchsorted(ends, tok, right=True)
    lens = ends - cu[:-1].long()
    return seq, max_len - lens[seq] + (tok - cu[:-1].long()[seq])


def _pad_to(t: Tensor, seq: Tensor, pos: Tensor, batch: int, n: int) -> Tensor:
    """Packed rows ``(total, H, D)`` into a zero ``(batch, H, n, D)`` view at ``(seq, pos)``."""
    padded = t.new_zeros((batch, n, *t.shape[1:]))
    padded[seq, pos] = t
    return padded.transpose(1, 2)


def _packed_rows(out: Tensor, lse: Tensor, seq: Tensor, pos: Tensor, overlong: Tensor) -> tuple[Tensor, Tensor]:
    """A padded batch's out ``(B, n, H, D)`` and lse ``(B, H, n)`` back as packed rows ``(total, H, D)``
    and ``(H, total)`` from each row's ``(seq, pos)``; rows of an overlong sequence are NaN."""
    out = out[seq, pos].masked_fill(overlong[:, None, None], float("nan"))
    lse = lse.transpose(1, 2)[seq, pos].masked_fill(overlong[:, None], float("nan"))
    return out, lse.t()


def varlen_forward_padded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None = None,
    is_causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    warn: bool = True,
) -> tuple[Tensor, Tensor]:
    """``attention_varlen``'s result through the dense attention op on a padded batch (each sequence
    right-aligned in ``max_seqlen`` rows, so the dense op's bottom-right diagonal is every sequence's
    own; a key-padding mask hides the padding keys), differentiable through the dense op's autograd.
    Serves fp32 on CUDA, which has no per-sequence kernel (a warning says so), and forward-mode AD; exact,
    no host sync, the padding costs compute and memory. A sequence longer than its ``max_seqlen`` (which
    the caller promised it is not, and which only a host sync could check) gets NaN rows, not the rows of
    its neighbours."""
    if warn:
        _warn_fp32_varlen_once()
    B = cu_seqlens_q.numel() - 1
    sq, pq = _left_pad_index(cu_seqlens_q, q.shape[0], max_seqlen_q)
    sk, pk = _left_pad_index(cu_seqlens_k, k.shape[0], max_seqlen_k)
    overlong = (cu_seqlens_q.diff() > max_seqlen_q) | (cu_seqlens_k.diff() > max_seqlen_k)
    pq, pk = pq.clamp(min=0), pk.clamp(min=0)
    key_ok = torch.zeros((B, max_seqlen_k), dtype=torch.bool, device=q.device)
    key_ok[sk, pk] = True
    out, lse = attention_op(
        _pad_to(q, sq, pq, B, max_seqlen_q), _pad_to(k, sk, pk, B, max_seqlen_k), _pad_to(v, sk, pk, B, max_seqlen_k),
        key_ok[:, None, None, :], scale, is_causal, True, window_left, window_right, softcap,
    )  # fmt: skip
    return _packed_rows(out.transpose(1, 2), lse, sq, pq, overlong[sq])


def _varlen_paged(
    op: str,
    block_table: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None,
    is_causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """flash_attn_varlen_func with a block table: the KV-cache op (which reads the pages) on q padded
    to ``max_seqlen_q`` rows a sequence, each sequence right-aligned so that the op's bottom-right
    diagonal is its own, and cache lengths from ``cu_seqlens_k`` (device-side, no host sync). A
    sequence longer than ``max_seqlen_q`` gets NaN rows, as in :func:`varlen_forward_padded`."""
    check_tensor_types(op, block_table=block_table)
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{op}: with block_table, {name} must be a page pool (num_blocks, page_size, heads_k, head_dim), "
                f"got a {t.dim()}-D tensor of shape {list(t.shape)}"
            )
    named = (("q", q), ("k", k), ("v", v))
    wants_grad = [n for n, t in named if (t.requires_grad and torch.is_grad_enabled()) or has_tangent(t)]
    if wants_grad:
        raise RuntimeError(
            f"{op}: with block_table the call is forward only (as flash-attn's paged varlen), got "
            f"{', '.join(wants_grad)} requiring grad; call it under torch.no_grad()"
        )
    B = cu_seqlens_q.numel() - 1
    seq, pos = _left_pad_index(cu_seqlens_q, q.shape[0], max_seqlen_q)
    overlong = (cu_seqlens_q.diff() > max_seqlen_q)[seq]
    pos = pos.clamp(min=0)  # an overlong sequence's first rows (its output is NaN)
    padded_q = q.new_zeros((B, max_seqlen_q, *q.shape[1:]))
    padded_q[seq, pos] = q
    out, lse = torch.ops.flashmod.attention_kvcache(
        padded_q, k, v, None, None, cu_seqlens_k.diff().to(torch.int32), None, block_table,
        scale, is_causal, window_left, window_right, softcap,
    )  # fmt: skip
    return _packed_rows(out, lse, seq, pos, overlong)


@functools.cache
def _warn_fp32_varlen_once() -> None:
    warnings.warn(
        "flashmod.flash_attn_varlen_func: float32 on CUDA has no variable-length kernel (flash-attn "
        "has none either); it runs the dense kernels on a padded copy of the batch",
        stacklevel=3,
    )


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, *options, dropout_p, rng_state = inputs  # defaults filled in
    # The backward regenerates the forward's dropout from the same rng_state (None without dropout).
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k, rng_state)
    ctx.options = (*options, dropout_p)


def _varlen_backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flashmod.attention_varlen_backward(
        grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *ctx.options, rng_state
    )
    return (dq, dk, dv) + (None,) * 11


torch.library.register_autograd("flashmod::attention_varlen", _varlen_backward, setup_context=_varlen_setup_context)


def _check_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: Tensor | None,
    cache_batch_idx: Tensor | None,
    block_table: Tensor | None,
    scale: float | None,
    window_left: int,
    window_right: int,
    softcap: float,
) -> None:
    """Mirror of serve_host.cpp's prepare_attention_kvcache checks (values only on CPU there)."""
    _check_cuda(_KVCACHE, q)
    p = f"{_KVCACHE}: "
    paged = block_table is not None
    cache_shape = (
        "(num_blocks, page_size, heads_k, head_dim)" if paged else "(batch_cache, seqlen_cache, heads_k, head_dim)"
    )
    torch._check(
        q.dim() == 4,
        lambda: (
            f"{p}q must be a 4-D tensor (batch, seqlen_q, heads, head_dim), "
            f"got a {q.dim()}-D tensor of shape {list(q.shape)}"
        ),
    )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        torch._check(
            t.dim() == 4,
            lambda n=name, t=t: (
                f"{p}{n} must be a 4-D tensor {cache_shape}, got a {t.dim()}-D tensor of shape {list(t.shape)}"
            ),
        )
        torch._check(
            t.stride(-1) == 1,
            lambda n=name, t=t: (
                f"{p}{n} must have stride 1 in its last dimension (it is updated in place), "
                f"got strides {list(t.stride())}"
            ),
        )
    check_float_dtype(_KVCACHE, "q", q)
    check_same_dtype(_KVCACHE, "k_cache", k_cache, "q", q)
    check_same_dtype(_KVCACHE, "v_cache", v_cache, "q", q)
    check_same_device(_KVCACHE, "k_cache", k_cache, "q", q)
    check_same_device(_KVCACHE, "v_cache", v_cache, "q", q)
    B, Hq, D, Hkv = q.shape[0], q.shape[2], q.shape[3], k_cache.shape[2]
    torch._check(D > 0, lambda: f"{p}q's head_dim must be positive, got {D}")
    torch._check(
        k_cache.shape[3] == D and v_cache.shape[3] == D,
        lambda: (
            f"{p}k_cache and v_cache must have q's head_dim {D}, "
            f"got k_cache {k_cache.shape[3]} and v_cache {v_cache.shape[3]}"
        ),
    )
    torch._check(
        v_cache.shape == k_cache.shape,
        lambda: f"{p}v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}",
    )
    torch._check(
        Hkv > 0 and Hq % Hkv == 0,
        lambda: (
            f"{p}q's heads must be a multiple of k_cache's heads (GQA/MQA), got q heads {Hq} and k_cache heads {Hkv}"
        ),
    )
    torch._check(
        (k is None) == (v is None),
        lambda: f"{p}k and v must be given together, got {'k without v' if k is not None else 'v without k'}",
    )
    if k is not None:
        torch._check(cache_seqlens is not None, lambda: f"{p}appending k/v needs cache_seqlens (where to write them)")
        for name, t in (("k", k), ("v", v)):
            torch._check(
                t.dim() == 4 and t.shape[0] == B and t.shape[2] == Hkv and t.shape[3] == D,
                lambda n=name, t=t: (
                    f"{p}{n} must have shape (batch, seqlen_new, heads_k, head_dim) = ({B}, *, {Hkv}, {D}), "
                    f"got {list(t.shape)}"
                ),
            )
            check_same_dtype(_KVCACHE, name, t, "q", q)
            check_same_device(_KVCACHE, name, t, "q", q)
        torch._check(v.shape[1] == k.shape[1], lambda: f"{p}v must have k's seqlen_new {k.shape[1]}, got {v.shape[1]}")
    if paged:
        _check_index(p, "block_table", block_table, 2, B, "q's batch", q)
        torch._check(
            cache_batch_idx is None,
            lambda: (
                f"{p}cache_batch_idx cannot be combined with block_table "
                "(a block_table row already names each sequence's pages)"
            ),
        )
        torch._check(
            k_cache.shape[1] > 0, lambda: f"{p}k_cache's page_size (dim 1) must be positive, got {k_cache.shape[1]}"
        )
    else:
        torch._check(
            cache_batch_idx is not None or k_cache.shape[0] == B,
            lambda: f"{p}k_cache must have q's batch {B} rows (or pass cache_batch_idx), got {k_cache.shape[0]}",
        )
    if cache_seqlens is not None:
        _check_index(p, "cache_seqlens", cache_seqlens, 1, B, "q's batch", q)
    if cache_batch_idx is not None:
        _check_index(p, "cache_batch_idx", cache_batch_idx, 1, B, "q's batch", q)
    check_options(_KVCACHE, scale, window_left, window_right, softcap)


@torch.library.register_fake("flashmod::attention_kvcache")
def _attention_kvcache_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    cache_seqlens: Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    block_table: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    _check_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        cache_batch_idx,
        block_table,
        scale,
        window_left,
        window_right,
        softcap,
    )
    out = torch.empty_like(q if q.stride(-1) == 1 else q.contiguous())
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    alibi_slopes: None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, None]:
    """Attention over a packed batch of variable-length sequences (flash-attn's signature).

    ``q`` is ``(total_q, Hq, D)``, ``k``/``v`` ``(total_k, Hkv, D)``; sequence ``b`` owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` (int32, ``batch + 1`` entries) and the matching
    rows of ``k``/``v``. ``max_seqlen_q``/``max_seqlen_k`` must bound every sequence (CUDA sizes its
    grid from them without reading ``cu_seqlens``). ``causal`` and ``window_size`` align each
    sequence bottom-right; sequences may be empty. Returns ``out (total_q, Hq, D)``, and with
    ``return_lse`` also ``lse (Hq, total_q)`` fp32 (flash-attn's ``return_attn_probs`` gives ``(out,
    lse, None)``; ``deterministic=True`` asks for a bitwise reproducible backward, as in
    :func:`flashmod.flash_attn_func`; ``alibi_slopes`` must be None). Differentiable in ``q``,
    ``k``, ``v``. fp32 on CUDA (no per-sequence kernel) runs the dense kernels on a padded copy of
    the batch (:func:`varlen_forward_padded`).

    ``dropout_p`` (training): fresh random words from torch's generator each call; sequence ``b``
    drops what batch row ``b`` of a dense dropout call would (its queries and keys counted from its
    first), and the backward regenerates the same choices. Fused on the CPU (every dtype) and on
    CUDA (fp16 / bf16); reverse-mode only, and not with ``block_table`` (both raise).

    ``block_table`` (int32 ``(batch, max_pages)``, keyword-only; flash-attn's paged prefill): ``k``/``v``
    are then page pools ``(num_blocks, page_size, Hkv, D)``, sequence ``b``'s keys the first
    ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` rows of its pages. It runs the KV-cache op on ``q`` padded to
    ``max_seqlen_q`` rows a sequence (each sequence's queries last, so causal and windows stay
    bottom-right), forward only, as flash-attn's.
    """
    return _flash_attn_varlen(
        "flashmod.flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, softmax_scale, causal, window_size, softcap, return_lse, alibi_slopes, deterministic,
        return_attn_probs, block_table,
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    alibi_slopes: None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, None]:
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: :func:`flash_attn_varlen_func` on ``qkv``
    of shape ``(total, 3, H, D)`` (q, k, v stacked at dim 1; views, no copy), whose queries and keys
    share ``cu_seqlens`` and ``max_seqlen``. Arguments and returns as
    :func:`flash_attn_varlen_func`'s."""
    op = "flashmod.flash_attn_varlen_qkvpacked_func"
    q, k, v = unpack_stacked(op, "qkv", qkv, 3, "total, 3, heads, head_dim")
    return _flash_attn_varlen(
        op, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, return_lse, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    alibi_slopes: None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, None]:
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: :func:`flash_attn_varlen_func` on ``q``
    ``(total_q, Hq, D)`` and ``kv`` of shape ``(total_k, 2, Hkv, D)`` (k and v stacked at dim 1;
    views, no copy). Arguments and returns as :func:`flash_attn_varlen_func`'s."""
    op = "flashmod.flash_attn_varlen_kvpacked_func"
    k, v = unpack_stacked(op, "kv", kv, 2, "total_k, 2, heads_k, head_dim")
    return _flash_attn_varlen(
        op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, return_lse, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def _flash_attn_varlen(
    op: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    return_lse: bool,
    alibi_slopes: None,
    deterministic: bool,
    return_attn_probs: bool,
    block_table: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, None]:
    """flash_attn_varlen_func's body; ``op`` names the public function in errors."""
    check_tensor_types(op, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check_flash_attn_extras(
        op, alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs, return_lse=return_lse
    )
    check_deterministic_backward(op, deterministic, q, k, v)
    dropout_p = check_dropout(op, "dropout_p", dropout_p)
    left, right = unbounded_past(check_window(op, window_size), max_seqlen_k)
    args = (
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, left, right, softcap,
    )  # fmt: skip
    if dropout_p > 0.0:
        _check_dropout_supported(op, q, k, v, block_table)
        # Fresh random words per call from torch's generator (seeded by torch.manual_seed, traced by
        # torch.compile); the backward regenerates the same dropout from them.
        rng_state = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=q.device)
        out, lse = torch.ops.flashmod.attention_varlen(*args, dropout_p, rng_state)
    elif block_table is not None:
        out, lse = _varlen_paged(op, block_table, *args)
    elif q.device.type == "cuda" and q.dtype == torch.float32:
        out, lse = varlen_forward_padded(*args)
    elif has_tangent(q, k, v):
        # Forward-mode AD: the variable-length op has a backward only (its autograd would drop the
        # tangent, a silent zero), the dense op has a jvp, so the padded batch carries it.
        out, lse = varlen_forward_padded(*args, warn=False)
    elif no_grad_needed(q, k, v):
        out, lse = below_autograd(torch.ops.flashmod.attention_varlen, *args)
    else:
        out, lse = torch.ops.flashmod.attention_varlen(*args)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def _check_dropout_supported(op: str, q: Tensor, k: Tensor, v: Tensor, block_table: Tensor | None) -> None:
    """The varlen calls that take dropout_p > 0: the op's (fp16/bf16 on CUDA, any dtype on the CPU),
    reverse-mode autograd only."""
    if block_table is not None:
        raise NotImplementedError(f"{op}: dropout_p must be 0 with block_table (paged prefill is forward only)")
    if q.device.type == "cuda" and q.dtype == torch.float32:
        raise NotImplementedError(
            f"{op}: dropout_p > 0 takes float16 or bfloat16 on CUDA (as flash-attn; float32 has no "
            "variable-length kernel there), got float32"
        )
    if has_tangent(q, k, v):
        raise NotImplementedError(f"{op}: forward-mode AD of a call with dropout_p > 0 is not supported")


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x (B, S, H, D) at positions (B, S): the first 2 * cos.shape[1] features
    rotated in fp32 (pairs (0, 1), (2, 3), ... when interleaved, else (i, i + half), GPT-NeoX's), then
    rounded to x's dtype; the rest unchanged (flash-attn's kvcache rotary)."""
    half = cos.shape[1]
    c = cos.float()[positions].unsqueeze(-2)  # (B, S, 1, half)
    s = sin.float()[positions].unsqueeze(-2)
    rot = x[..., : 2 * half].float()
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((y.to(x.dtype), x[..., 2 * half :]), dim=-1)


def _kvcache_rotary(
    op: str,
    q: Tensor,
    k: Tensor | None,
    cache_seqlens: Tensor,
    rotary_cos: Tensor,
    rotary_sin: Tensor,
    interleaved: bool,
    capacity: int,
    positions_per_query: bool,
) -> tuple[Tensor, Tensor]:
    """q and the new keys k rotated as flash-attn's flash_attn_with_kvcache rotates them: k at
    cache_seqlens[b], cache_seqlens[b] + 1, ...; q the same where positions_per_query (causal or a
    window), else every query at cache_seqlens[b]. Checked here, as flash-attn checks them."""
    check_tensor_types(op, (), rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    if not isinstance(interleaved, bool):
        raise TypeError(f"{op}: rotary_interleaved must be a bool, got {type(interleaved).__name__}")
    if k is None:
        raise ValueError(f"{op}: rotary_cos / rotary_sin rotate the new keys, so k and v must be given")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} must be on q's device {q.device}, got {t.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(
                f"{op}: {name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), got a {t.dim()}-D tensor "
                f"of shape {list(t.shape)}"
            )
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(
            f"{op}: rotary_sin must have rotary_cos's shape {list(rotary_cos.shape)}, got {list(rotary_sin.shape)}"
        )
    seqlen_ro, half = rotary_cos.shape
    head_dim = q.shape[-1]
    if not 0 < 2 * half <= head_dim:
        raise ValueError(
            f"{op}: rotary_cos's rotary_dim / 2 (its second dimension) must be in [1, head_dim / 2 = {head_dim // 2}], "
            f"got {half}"
        )
    if seqlen_ro < capacity:
        raise ValueError(
            f"{op}: rotary_cos must have a row per cache position, at least the cache's {capacity}, got {seqlen_ro}"
        )
    start = cache_seqlens.to(torch.int64).view(-1, 1)
    k_pos = start + torch.arange(k.shape[1], device=q.device)
    q_steps = torch.arange(q.shape[1], device=q.device) if positions_per_query else torch.zeros_like(q[0, :, 0, 0])
    q_pos = start + q_steps.to(torch.int64)
    return (
        _rotate(q, rotary_cos, rotary_sin, q_pos, interleaved),
        _rotate(k, rotary_cos, rotary_sin, k_pos, interleaved),
    )


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    rotary_interleaved: bool = True,
    alibi_slopes: None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of new queries against a KV cache, appending new keys/values in place (flash-attn's
    signature and layout).

    ``q`` is ``(B, Sq, Hq, D)``; ``k_cache``/``v_cache`` are ``(B_cache, S_cache, Hkv, D)``, or
    ``(num_blocks, page_size, Hkv, D)`` pages named by ``block_table`` (int32 ``(B, max_pages)``).
    ``k``/``v`` ``(B, S_new, Hkv, D)``, if given, are written into the caches at positions
    ``cache_seqlens[b] ...`` (int32 ``(B)`` or an int) before the attention, which then covers the
    first ``cache_seqlens[b] + S_new`` keys of each row (the whole cache without ``cache_seqlens``).
    ``cache_batch_idx`` (int32 ``(B)``) maps rows to cache rows. ``causal`` is bottom-right. No host
    synchronization and no value-dependent allocation: CUDA-graph capturable. Returns ``out``
    ``(B, Sq, Hq, D)``, and with ``return_lse`` (or flash-attn's name, ``return_softmax_lse``) also
    ``lse (B, Hq, Sq)`` fp32; ``alibi_slopes`` must be None. Not differentiable:
    inputs that require grad (under grad mode) are an error.

    ``rotary_cos`` / ``rotary_sin`` ``(seqlen_ro, rotary_dim / 2)`` in q's dtype, keyword-only (flash-attn's
    positional order puts them between ``v`` and ``cache_seqlens``; flashmod's follows issue #14): as
    flash-attn, the new ``k`` is rotated at positions ``cache_seqlens[b] + i`` before it is appended, and
    ``q`` at ``cache_seqlens[b] + i`` when causal or windowed, else at ``cache_seqlens[b]``; the first
    ``rotary_dim`` features, pairs ``(0, 1), (2, 3), ...`` when ``rotary_interleaved`` (the default) and
    ``(i, i + rotary_dim / 2)`` otherwise, in fp32. They need ``k``, ``v`` and ``cache_seqlens``.
    flash-attn's ``num_splits`` (a split-KV hint, an int >= 0) is taken and not followed: flashmod picks
    its own split count, which changes the result only by rounding.
    """
    op = "flashmod.flash_attn_with_kvcache"
    check_flash_attn_extras(op, alibi_slopes, return_softmax_lse=return_softmax_lse, return_lse=return_lse)
    return_lse = return_lse or return_softmax_lse
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"{op}: num_splits must be an int >= 0 (flash-attn's split-KV hint), got {num_splits!r}")
    check_tensor_types(
        op, ("k", "v", "cache_batch_idx", "block_table"), q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
        cache_batch_idx=cache_batch_idx, block_table=block_table,
    )  # fmt: skip
    # Not differentiable (as flash-attn's): refuse inputs that want gradients rather than return
    # an output whose backward would drop them.
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
    wants_grad = [n for n, t in named if t is not None and t.requires_grad and torch.is_grad_enabled()]
    wants_grad += [f"{n} (a forward-mode tangent)" for n, t in named if has_tangent(t) and n not in wants_grad]
    if wants_grad:
        raise RuntimeError(
            f"{op}: not differentiable, got {', '.join(wants_grad)} requiring grad; call it under "
            "torch.no_grad() (decoding) or train through flash_attn_func / flash_attn_varlen_func"
        )
    if k is not None:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            # An expanded cache (stride 0 over rows) gives every batch row the same slots: one row's
            # append would land in the keys another row reads (cache_batch_idx repeats are refused
            # for the same reason).
            if any(size > 1 and stride == 0 for size, stride in zip(cache.shape, cache.stride())):
                raise RuntimeError(
                    f"{op}: appending k/v writes {name} in place, so its rows must not share memory; got "
                    f"an expanded {name} (a stride of 0) of strides {list(cache.stride())}"
                )
    # As flash-attn, a window side is judged against the cache's capacity, not a row's length
    # (shapes the op rejects get any value here: its own checks name them).
    pages = block_table.shape[1] if block_table is not None and block_table.dim() == 2 else 1
    capacity = (k_cache.shape[1] if k_cache.dim() > 1 else 0) * pages
    left, right = unbounded_past(check_window(op, window_size), capacity)
    if isinstance(cache_seqlens, bool):
        raise TypeError(f"{op}: cache_seqlens must be an int or an int32 tensor, got a bool")
    # flash-attn's positional order is (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
    # cache_batch_idx, cache_leftpad, block_table, ...): say so where a ported positional call lands.
    order_hint = (
        " (flash-attn passes rotary_cos, rotary_sin, cache_seqlens in this order after v; pass flashmod's "
        "arguments after v by keyword)"
    )
    if isinstance(cache_seqlens, Tensor) and cache_seqlens.is_floating_point():
        raise TypeError(f"{op}: cache_seqlens must be an int or an int32 tensor, got {cache_seqlens.dtype}{order_hint}")
    if isinstance(block_table, Tensor) and block_table.dim() == 1:  # RuntimeError: the op's own check's class
        raise RuntimeError(
            f"{op}: block_table must be a 2-D tensor (batch, max_pages), got a 1-D tensor of shape "
            f"{list(block_table.shape)}{order_hint}"
        )
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{op}: rotary_cos and rotary_sin come together, got only one of them")
    if rotary_cos is not None:
        if cache_seqlens is None:
            raise ValueError(f"{op}: rotary_cos / rotary_sin need cache_seqlens (the new keys' positions)")
        q, k = _kvcache_rotary(
            op, q, k, cache_seqlens, rotary_cos, rotary_sin, rotary_interleaved, capacity,
            positions_per_query=causal or tuple(window_size) != (-1, -1),
        )  # fmt: skip
    out, lse = torch.ops.flashmod.attention_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
        softmax_scale, causal, left, right, softcap,
    )  # fmt: skip
    return (out, lse) if return_lse else out
