"""Public attention functions in the two conventions users know.

* :func:`attention` — SDPA's ``(B, H, S, D)`` layout and arguments; ``is_causal`` is top-left
  aligned, as in ``torch.nn.functional.scaled_dot_product_attention``.
* :func:`flash_attn_func` — flash-attn's ``(B, S, H, D)`` layout and arguments; ``causal`` and
  ``window_size`` are bottom-right aligned, as in flash-attn (what KV-cache decoding needs).

  :func:`flash_attn_qkvpacked_func` and :func:`flash_attn_kvpacked_func` take flash-attn's packed
  forms of the same.

Both reach ``torch.ops.flashmod.attention`` (differentiable through ``register_autograd``). GQA/MQA
is automatic: q-head ``h`` uses kv-head ``h // (Hq // Hkv)``; K/V are never repeated in memory.
Dropout runs ``torch.ops.flashmod.attention_dropout`` (fused kernels on the CPU and on CUDA
fp16/bf16), else the reference (:func:`fused_dropout_applies` says which).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import (
    check_deterministic_backward,
    check_dropout,
    check_flash_attn_extras,
    check_tensor_types,
    check_window,
    unbounded_past,
    unpack_stacked,
)
from .ops import HAS_CUDA_DROPOUT_KERNELS, _tensor_scale, attention_op, autocast_attention_args
from .reference import attention_reference
from .softmax_ops import matmul_softmax


def attention_bhsd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    scale: float | None,
    is_causal: bool,
    bottom_right: bool,
    window: tuple[int, int],
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """The one path every public entry point takes: the op, or the reference when dropping out."""
    dropout_p = check_dropout("flashmod", "dropout", dropout_p)
    if attn_mask is not None and attn_mask.dtype == torch.float32 and q.dtype == torch.float64:
        # SDPA takes a float32 mask with any query dtype; the op takes float64 queries' masks in
        # float64 (exact) and float32 ones for fp16/bf16 queries as they are.
        attn_mask = attn_mask.to(torch.float64)
    if dropout_p > 0.0:
        # As attention_op: the named type errors first (the op's schema would give its own), then
        # a tensor scale read, or folded into q (the schema takes a float).
        check_tensor_types("flashmod.attention", ("attn_mask",), q=q, k=k, v=v, attn_mask=attn_mask)
        q, k, v, attn_mask = autocast_attention_args((q, k, v, attn_mask))
        if isinstance(scale, Tensor):
            q, scale = _tensor_scale(q, scale)
        wl, wr = window
        if fused_dropout_applies(q, v, attn_mask):
            # Fresh random words per call from torch's generator (seeded by torch.manual_seed,
            # traced by torch.compile); the backward reuses them.
            rng_state = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=q.device)
            return torch.ops.flashmod.attention_dropout(
                q, k, v, attn_mask, scale, is_causal, bottom_right, wl, wr, softcap, dropout_p, rng_state
            )
        return torch.ops.flashmod.attention_dropout_reference(
            q, k, v, attn_mask, scale, is_causal, bottom_right, wl, wr, softcap, dropout_p
        )
    return attention_op(q, k, v, attn_mask, scale, is_causal, bottom_right, window[0], window[1], softcap)


def fused_dropout_applies(q: Tensor, v: Tensor, attn_mask: Tensor | None) -> bool:
    """Whether a dropout call runs the fused kernels (flashmod::attention_dropout): the CPU's (every
    dtype) and CUDA's (fp16/bf16, in builds that carry them), with v's head dim q's and no mask that
    wants a gradient. The rest runs the reference (flashmod::attention_dropout_reference), which the
    op's checks also guard."""
    if v.shape[-1] != q.shape[-1] or (attn_mask is not None and attn_mask.requires_grad):
        return False
    if q.device.type == "cpu":
        return True
    return HAS_CUDA_DROPOUT_KERNELS and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)


def attention_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    is_causal: bool,
    bottom_right: bool,
    window: tuple[int, int],
    softcap: float,
) -> Tensor:
    """Attention probabilities ``(B, Hq, Nq, Nk)`` in ``query``'s dtype, for ``output_attentions``/``need_weights``.

    The one place that materializes the weights. The fused ``flashmod.matmul_softmax`` op writes them without a
    separate logits tensor; it has no soft cap or window and aligns causal top-left, so other cases take the
    reference. Rows with no visible key are all zeros (eager implementations give a uniform row there).
    """
    top_left_causal = is_causal and (not bottom_right or query.shape[2] == key.shape[2])
    if softcap == 0 and window == (-1, -1) and (top_left_causal or not is_causal):
        return matmul_softmax(query.detach(), key.detach(), scale, is_causal, attn_mask)
    _, _, probs = attention_reference(
        query.detach(), key.detach(), value.detach(), attn_mask, scale, is_causal, bottom_right,
        window[0], window[1], softcap, return_probs=True,
    )  # fmt: skip
    return probs.to(query.dtype)


def check_bshd(op: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """The shape rules of the op, checked on (batch, seqlen, heads, head_dim) tensors before they are
    transposed, so that an error shows the caller's own layout and shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise RuntimeError(
                f"{op}: {name} must be a 4-D tensor (batch, seqlen, heads, head_dim), "
                f"got a {t.dim()}-D tensor of shape {list(t.shape)}"
            )
    rules = (
        (k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0], "k and v must have q's batch size (dim 0)"),
        (k.shape[3] == q.shape[3], "k must have q's head_dim (dim 3)"),
        (v.shape[1] == k.shape[1], "v must have k's seqlen (dim 1)"),
        (v.shape[2] == k.shape[2], "v must have k's number of heads (dim 2)"),
        (
            (k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0) or q.shape[2] == 0,
            "q's heads (dim 2) must be a multiple of k's and v's heads (GQA/MQA)",
        ),
    )
    for ok, rule in rules:
        if not ok:
            raise RuntimeError(
                f"{op}: {rule}; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                "(batch, seqlen, heads, head_dim)"
            )


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = True,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for ``F.scaled_dot_product_attention`` on ``(B, H, S, D)`` tensors.

    Args:
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hkv, Nk, D)`` with ``Hq % Hkv == 0``.
            Any strides with ``stride(-1) == 1`` (e.g. transposed ``(B, S, H, D)`` views) are used
            without copying.
        attn_mask: bool (True = attend) or additive float, broadcastable to ``(B, Hq, Nq, Nk)``;
            additive entries at or below ``HIDING_MASK_VALUE`` (-32768) hide their key as ``-inf`` does.
        dropout_p: dropout on the probabilities, fused into the kernels (CPU: every dtype; CUDA:
            fp16/bf16), with the reference (``attention_dropout_reference``) for the rest
            (:func:`fused_dropout_applies`).
        is_causal: causal mask aligned top-left (query ``i`` sees keys ``j <= i``), as SDPA.
            May be combined with ``attn_mask``.
        scale: score scale, default ``1 / sqrt(D)``.
        enable_gqa: grouped-query attention (``Hq`` a multiple of ``Hkv``); on by default, unlike
            SDPA. ``False`` requires equal head counts, as SDPA does.
        window_size: ``(left, right)`` sliding window around the (top-left) diagonal, -1 = unbounded.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)`` before the mask.
        return_lse: also return the fp32 log-sum-exp ``(B, Hq, Nq)``.

    Returns:
        ``(B, Hq, Nq, D)`` output in ``query``'s dtype (and the lse if asked). Rows with no visible
        key are 0 (lse ``-inf``).
    """
    op = "flashmod.attention"
    check_tensor_types(op, ("attn_mask",), query=query, key=key, value=value, attn_mask=attn_mask)
    dropout_p = check_dropout(op, "dropout_p", dropout_p)
    window = check_window(op, window_size)
    if not enable_gqa and query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        if key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]:
            raise RuntimeError(
                f"{op}: with enable_gqa=False, key and value must have query's number of heads "
                f"{query.shape[1]} (dim 1), got key {key.shape[1]} and value {value.shape[1]}; "
                "pass enable_gqa=True for grouped-query attention"
            )
    out, lse = attention_bhsd(query, key, value, attn_mask, dropout_p, scale, is_causal, False, window, softcap)
    return (out, lse) if return_lse else out


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
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
    """flash-attn's ``flash_attn_func`` on ``(B, S, H, D)`` tensors.

    Args:
        q: ``(B, Nq, Hq, D)``; k, v: ``(B, Nk, Hkv, D)`` with ``Hq % Hkv == 0``.
        dropout_p: dropout on the probabilities (as :func:`attention`'s).
        softmax_scale: default ``1 / sqrt(D)``.
        causal: causal mask aligned bottom-right: query ``i`` sees keys ``j <= i + Nk - Nq``.
        window_size: ``(left, right)``: query ``i`` sees keys in
            ``[i + Nk - Nq - left, i + Nk - Nq + right]``; -1 = unbounded, and, as in flash-attn, so
            is a side ``>= Nk``.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)``.
        return_lse: also return the fp32 log-sum-exp, ``(B, Hq, Nq)`` as in flash-attn.
        alibi_slopes, deterministic, return_attn_probs: flash-attn's, for code ported from it.
            ``alibi_slopes`` must be None; ``deterministic=True`` asks for a bitwise reproducible
            backward, which the CUDA backward gives under ``torch.use_deterministic_algorithms(True)``
            (or ``FLASHMOD_BWD_FUSED_DQ=0``; without either, a CUDA call that is differentiated
            raises: the backward may add dQ up by atomics); ``return_attn_probs`` returns
            ``(out, lse, None)``, as flash-attn does without dropout (with dropout its third entry,
            the dropout pattern, has no counterpart here: NotImplementedError).

    Returns:
        ``(B, Nq, Hq, D)`` output in q's dtype (and the lse if asked).
    """
    return _flash_attn(
        "flashmod.flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, return_lse,
        alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv: Tensor,
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
    """flash-attn's ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` on ``qkv`` of shape
    ``(B, S, 3, H, D)`` (q, k, v stacked at dim 2, as a fused QKV projection writes them; read as
    views, no copy). Its gradient arrives as one ``(B, S, 3, H, D)`` tensor. Arguments and returns
    as :func:`flash_attn_func`'s."""
    op = "flashmod.flash_attn_qkvpacked_func"
    q, k, v = unpack_stacked(op, "qkv", qkv, 3, "batch, seqlen, 3, heads, head_dim")
    return _flash_attn(
        op, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, return_lse,
        alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
    """flash-attn's ``flash_attn_kvpacked_func``: :func:`flash_attn_func` on ``q`` ``(B, Nq, Hq, D)``
    and ``kv`` of shape ``(B, Nk, 2, Hkv, D)`` (k and v stacked at dim 2; views, no copy; GQA as
    there). Arguments and returns as :func:`flash_attn_func`'s."""
    op = "flashmod.flash_attn_kvpacked_func"
    k, v = unpack_stacked(op, "kv", kv, 2, "batch, seqlen_k, 2, heads_k, head_dim")
    return _flash_attn(
        op, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, return_lse,
        alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def _flash_attn(
    op: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    return_lse: bool,
    alibi_slopes: None,
    deterministic: bool,
    return_attn_probs: bool,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, None]:
    """flash_attn_func's body; ``op`` names the public function in errors."""
    check_tensor_types(op, q=q, k=k, v=v)
    dropout_p = check_dropout(op, "dropout_p", dropout_p)
    check_flash_attn_extras(
        op, alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs, return_lse=return_lse
    )
    check_deterministic_backward(op, deterministic, q, k, v)
    if return_attn_probs and dropout_p > 0.0:
        raise NotImplementedError(f"{op}: return_attn_probs with dropout_p > 0 (the dropout pattern) is not supported")
    left, right = check_window(op, window_size)
    check_bshd(op, q, k, v)
    window = unbounded_past((left, right), k.shape[1])
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = attention_bhsd(qt, kt, vt, None, dropout_p, softmax_scale, causal, True, window, softcap)
    out = out.transpose(1, 2)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out
