"""The thin layer over the C++ operator: loading it, its fake (meta) implementation, autograd.

``torch.ops.flashmod.attention`` is declared in ``csrc/flashmod.cpp``. Here it gets:

* ``register_fake``: shapes/dtypes for torch.compile, with the same checks as the C++ host code
  (``csrc/attention/attention_host.cpp``) written as ``torch._check`` so they fire while tracing too;
* ``flashmod::attention_backward`` (fused kernels in C++): its fake implementation, and the
  reference math as its CUDA kernel in builds without the fused CUDA backward;
* Autograd kernels (:class:`AttentionFunction`; the reference math for attention_backward's own
  derivative) and batching rules, so the op works under autograd, ``torch.func`` and vmap.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd import forward_ad

from . import _C  # noqa: F401  (loading the library registers the operators)
from .checks import (
    check_4d,
    check_float_dtype,
    check_fp64_on_cpu,
    check_head_groups,
    check_mask,
    check_options,
    check_same_device,
    check_same_dtype,
    check_tensor_types,
    unbounded_if_huge,
)
from .reference import attention_backward_chunked, attention_jvp_chunked, attention_reference, dropout_keep_mask

CUDA_MAX_HEAD_DIM = 256

ATTENTION_MASK_DIMS = "(batch, q_heads, seqlen_q, seqlen_k)"


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    window_left: int,
    window_right: int,
    softcap: float,
    op: str = "flashmod.attention",
) -> None:
    """Mirror of csrc/attention/attention_host.cpp's checks (same order, same messages); ``op``
    prefixes every message (the backward shares the forward's checks)."""
    p = f"{op}: "
    check_4d(op, "batch, heads, seqlen, head_dim", q=q, k=k, v=v)
    check_float_dtype(op, "q", q)
    check_same_dtype(op, "k", k, "q", q)
    check_same_dtype(op, "v", v, "q", q)
    check_same_device(op, "k", k, "q", q)
    check_same_device(op, "v", v, "q", q)
    torch._check(
        k.shape[0] == q.shape[0] and v.shape[0] == q.shape[0],
        lambda: f"{p}k and v must have q's batch size {q.shape[0]}, got k {k.shape[0]} and v {v.shape[0]}",
    )
    torch._check(q.shape[3] > 0, lambda: f"{p}q's head_dim (last dimension) must be positive, got {q.shape[3]}")
    torch._check(
        k.shape[3] == q.shape[3] and v.shape[3] == q.shape[3],
        lambda: f"{p}k and v must have q's head_dim {q.shape[3]}, got k {k.shape[3]} and v {v.shape[3]}",
    )
    torch._check(v.shape[1] == k.shape[1], lambda: f"{p}v must have k's number of heads {k.shape[1]}, got {v.shape[1]}")
    torch._check(v.shape[2] == k.shape[2], lambda: f"{p}v must have k's sequence length {k.shape[2]}, got {v.shape[2]}")
    check_head_groups(op, "q", q, "k", k, "k/v")
    check_mask(op, attn_mask, q, "q", (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), ATTENTION_MASK_DIMS)
    check_options(op, scale, window_left, window_right, softcap)
    if q.device.type == "cuda":
        check_fp64_on_cpu(op, "q", q)
        torch._check(
            q.shape[3] <= CUDA_MAX_HEAD_DIM,
            lambda: f"{p}q's head_dim must be <= {CUDA_MAX_HEAD_DIM} on CUDA, got {q.shape[3]}",
        )


@torch.library.register_fake("flashmod::attention")
def _attention_fake(
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
) -> tuple[Tensor, Tensor]:
    _check_inputs(q, k, v, attn_mask, scale, window_left, window_right, softcap)
    out = torch.empty_like(q if q.stride(-1) == 1 else q.contiguous())
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)
    return out, lse


def _check_like(p: str, name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    torch._check(
        t.shape == ref.shape, lambda: f"{p}{name} must have {ref_name}'s shape {list(ref.shape)}, got {list(t.shape)}"
    )
    torch._check(t.dtype == ref.dtype, lambda: f"{p}{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    torch._check(
        t.device == ref.device, lambda: f"{p}{name} must be on {ref_name}'s device {ref.device}, got {t.device}"
    )


def _check_row_stat(p: str, name: str, t: Tensor, q: Tensor, fp32_only: bool) -> None:
    want = [q.shape[0], q.shape[1], q.shape[2]]
    torch._check(
        list(t.shape) == want,
        lambda: f"{p}{name} must have shape (batch, q_heads, seqlen_q) = {want}, got {list(t.shape)}",
    )
    if fp32_only:
        torch._check(t.dtype == torch.float32, lambda: f"{p}{name} must be float32, got {t.dtype}")
    else:
        torch._check(t.dtype.is_floating_point, lambda: f"{p}{name} must be a floating dtype, got {t.dtype}")
    torch._check(t.device == q.device, lambda: f"{p}{name} must be on q's device {q.device}, got {t.device}")


@torch.library.register_fake("flashmod::attention_backward")
def _attention_backward_fake(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    bottom_right: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    compute_grad_mask: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mirror of csrc/attention/attention_host.cpp's prepare_attention_backward: the forward's
    checks, then out, lse, grad_out and grad_lse; gradients in the fixed-up inputs' layouts."""
    op = "flashmod.attention_backward"
    _check_inputs(q, k, v, attn_mask, scale, window_left, window_right, softcap, op=op)
    p = f"{op}: "
    _check_like(p, "out", out, "q", q)
    _check_row_stat(p, "lse", lse, q, fp32_only=True)
    _check_like(p, "grad_out", grad_out, "out", out)
    if grad_lse is not None:
        _check_row_stat(p, "grad_lse", grad_lse, q, fp32_only=False)
    if compute_grad_mask:
        torch._check(
            attn_mask is not None and attn_mask.dtype != torch.bool,
            lambda: (
                f"{p}compute_grad_mask needs an additive float attn_mask, got "
                f"{'no attn_mask' if attn_mask is None else 'a bool attn_mask'}"
            ),
        )
    grads = tuple(torch.empty_like(t if t.stride(-1) == 1 else t.contiguous()) for t in (q, k, v))
    mask_shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if compute_grad_mask else (0,)
    return (*grads, q.new_empty(mask_shape, dtype=torch.float32))


@torch.library.impl("flashmod::attention_backward_reference", "CompositeExplicitAutograd")
def _attention_backward_reference(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    bottom_right: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    compute_grad_mask: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``flashmod::attention_backward_reference``: the chunked reference math with
    attention_backward's checks; tests use it as the oracle."""
    _attention_backward_fake(
        grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale,
        is_causal, bottom_right, window_left, window_right, softcap, compute_grad_mask,
    )  # fmt: skip
    *grads, grad_mask = attention_backward_chunked(
        grad_out, grad_lse, q, k, v, lse, attn_mask, scale,
        is_causal, bottom_right, window_left, window_right, softcap, compute_grad_mask,
    )  # fmt: skip
    # Each gradient in its input's memory layout, as the fake implementation promises.
    layouts = (torch.empty_like(t if t.stride(-1) == 1 else t.contiguous()) for t in (q, k, v))
    return (*(out.copy_(g) for out, g in zip(layouts, grads)), grad_mask)


torch.library.register_fake("flashmod::attention_backward_reference")(_attention_backward_fake)


@torch.library.impl("flashmod::attention_dropout_reference", "CompositeImplicitAutograd")
def _attention_dropout_reference(
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
) -> tuple[Tensor, Tensor]:
    """``flashmod::attention_dropout_reference``: attention's checks, then the reference math with
    dropout; out in q's dtype, lse in fp32."""
    check_attention_call(q, k, v, attn_mask, scale, window_left, window_right, softcap)
    out, lse = attention_reference(
        q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap, dropout_p
    )
    return out.to(q.dtype), lse.float()


def _call_keep_mask(q: Tensor, k: Tensor, dropout_p: float, rng_state: Tensor) -> Tensor:
    """The keep mask (reference.dropout_keep_mask) of a dropout call on q, k."""
    return dropout_keep_mask(rng_state, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dropout_p)


def _check_dropout_args(op: str, q: Tensor, dropout_p: float, rng_state: Tensor) -> None:
    """Mirror of the C++ dropout checks after the shared ones: CUDA's dtype rule
    (csrc/attention/cuda/host_alignment.h: set_cuda_dropout; the sm_80 kernels carry dropout in
    fp16/bf16), then set_dropout (csrc/attention/attention_host.cpp; every device)."""
    p = f"{op}: "
    if q.device.type == "cuda":
        torch._check(
            q.dtype in (torch.float16, torch.bfloat16),
            lambda: f"{p}fused dropout takes float16 or bfloat16 q, got {q.dtype}",
        )
    torch._check(0.0 <= dropout_p <= 1.0, lambda: f"{p}dropout_p must be a probability in [0, 1], got {dropout_p}")
    torch._check(
        rng_state.dtype == torch.int64
        and rng_state.shape == (2,)
        and rng_state.is_contiguous()
        and rng_state.device == q.device,
        lambda: (
            f"{p}rng_state must be a contiguous (2,) int64 tensor on {q.device}, got {rng_state.dtype} "
            f"of shape {list(rng_state.shape)} on {rng_state.device}"
        ),
    )


@torch.library.register_fake("flashmod::attention_dropout")
def _attention_dropout_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    is_causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    rng_state: Tensor,
) -> tuple[Tensor, Tensor]:
    out, lse = _attention_fake(q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap)
    _check_dropout_args("flashmod.attention", q, dropout_p, rng_state)
    return out, lse


@torch.library.register_fake("flashmod::attention_dropout_backward")
def _attention_dropout_backward_fake(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    is_causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    rng_state: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    options = (scale, is_causal, bottom_right, window_left, window_right, softcap)
    *grads, _ = _attention_backward_fake(grad_out, grad_lse, q, k, v, out, lse, attn_mask, *options)
    _check_dropout_args("flashmod.attention_backward", q, dropout_p, rng_state)
    return tuple(grads)


def _attention_dropout_by_reference(*args: Any) -> tuple[Tensor, Tensor]:
    """``flashmod::attention_dropout``'s CUDA kernel in builds without one: the reference math with
    the kernels' keep mask (reference.dropout_keep_mask), so the same rng_state drops the same keys.
    It holds (B, Hq, Nq, Nk) tensors."""
    out, _ = _attention_dropout_fake(*args)
    *call, dropout_p, rng_state = args
    q, k = call[0], call[1]
    keep = _call_keep_mask(q, k, dropout_p, rng_state)
    o, lse = attention_reference(*call, dropout_p, dropout_mask=keep)
    return out.copy_(o), lse.float()


def _attention_dropout_backward_by_reference(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    *options_dropout_rng: Any,
) -> tuple[Tensor, Tensor, Tensor]:
    """``flashmod::attention_dropout_backward`` without its CUDA kernels: autograd through the
    reference with the forward's keep mask."""
    grads = _attention_dropout_backward_fake(grad_out, grad_lse, q, k, v, out, lse, attn_mask, *options_dropout_rng)
    *options, dropout_p, rng_state = options_dropout_rng
    keep = _call_keep_mask(q, k, dropout_p, rng_state)

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return attention_reference(q, k, v, attn_mask, *options, dropout_p, dropout_mask=keep)

    # torch.func: this kernel runs below autograd, where torch.autograd.grad would see no graph.
    (o, lse_ref), vjp_fn = torch.func.vjp(forward, q, k, v)
    computed = vjp_fn((grad_out.to(o.dtype), torch.zeros_like(lse_ref) if grad_lse is None else grad_lse.to(o.dtype)))
    return tuple(g.copy_(c) for g, c in zip(grads, computed))


def _attention_dropout_backward_setup_context(ctx, inputs, output) -> None:
    grad_out, grad_lse, q, k, v, _, _, attn_mask, *options, dropout_p, rng_state = inputs
    ctx.save_for_backward(grad_out, grad_lse, q, k, v, attn_mask, rng_state)
    ctx.options = (*options, dropout_p)


def _attention_dropout_double_backward(ctx, *cotangents: Tensor) -> tuple[Tensor | None, ...]:
    """attention_dropout_backward's own derivative (double backward): autograd twice through the
    reference with the forward's keep mask, in (B, Hq, Nq, Nk) memory, only when asked for."""
    grad_out, grad_lse, q, k, v, attn_mask, rng_state = ctx.saved_tensors
    if ctx.needs_input_grad[7]:
        raise NotImplementedError("flashmod.attention_dropout: attn_mask gets no gradient here")
    *options, dropout_p = ctx.options
    keep = _call_keep_mask(q, k, dropout_p, rng_state)
    with torch.enable_grad():
        primals = [t.detach().requires_grad_() for t in (grad_out, q, k, v)]
        g_lse = None if grad_lse is None else grad_lse.detach().requires_grad_()
        g_out, q_, k_, v_ = primals
        o, lse = attention_reference(q_, k_, v_, attn_mask, *options, dropout_p, dropout_mask=keep)
        lse_cotangent = torch.zeros_like(lse) if g_lse is None else g_lse.to(lse.dtype)
        first = torch.autograd.grad((o, lse), (q_, k_, v_), (g_out.to(o.dtype), lse_cotangent), create_graph=True)
        inputs = primals + ([g_lse] if g_lse is not None else [])
        second = torch.autograd.grad(
            first,
            inputs,
            [c.to(f.dtype) if c is not None else torch.zeros_like(f) for c, f in zip(cotangents, first)],
            allow_unused=True,
        )
    g_grad_out, g_q, g_k, g_v = (g if g is None else g.to(t.dtype) for g, t in zip(second[:4], primals))
    g_grad_lse = second[4] if g_lse is not None else None
    return g_grad_out, g_grad_lse, g_q, g_k, g_v, *([None] * 11)


torch.library.register_autograd(
    "flashmod::attention_dropout_backward",
    _attention_dropout_double_backward,
    setup_context=_attention_dropout_backward_setup_context,
)
HAS_CUDA_DROPOUT_KERNELS = torch._C._dispatch_has_kernel_for_dispatch_key("flashmod::attention_dropout", "CUDA")
"""Whether this build's C++ library carries the fused dropout kernels (CUDA builds)."""
if not HAS_CUDA_DROPOUT_KERNELS:
    torch.library.impl("flashmod::attention_dropout", "CUDA")(_attention_dropout_by_reference)
    torch.library.impl("flashmod::attention_dropout_backward", "CUDA")(_attention_dropout_backward_by_reference)


def _attention_backward_without_cuda_kernel(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """flashmod::attention_backward's CUDA kernel in builds whose C++ library has none (built
    without CUDA): the reference math, with a warning."""
    _warn_reference_backward_once()
    return _attention_backward_reference(*args)


@functools.cache
def _warn_reference_backward_once() -> None:
    warnings.warn(
        "flashmod.attention_backward: this build of flashmod has no fused CUDA backward kernel "
        "(flashmod._C was built without it), so CUDA gradients run the chunked reference in "
        "flashmod/reference.py: slower and with more memory",
        stacklevel=3,
    )


if not torch._C._dispatch_has_kernel_for_dispatch_key("flashmod::attention_backward", "CUDA"):
    torch.library.impl("flashmod::attention_backward", "CUDA")(_attention_backward_without_cuda_kernel)


ATTENTION_DEFAULTS = (None, None, False, True, -1, -1, 0.0)
"""The defaults of attention's arguments after q, k, v (attn_mask .. softcap), in schema order."""

ATTENTION_BACKWARD_DEFAULTS = (*ATTENTION_DEFAULTS, False)
"""attention_backward's defaults after grad_out .. lse: attention's, then compute_grad_mask."""


def with_defaults(args: tuple, required: int, defaults: tuple) -> tuple:
    """``args`` completed with the schema's trailing defaults: the dispatcher drops trailing
    arguments equal to their default before it calls a Python kernel."""
    missing = required + len(defaults) - len(args)
    return args if missing <= 0 else (*args, *defaults[len(defaults) - missing :])


def has_tangent(*tensors: Tensor | None) -> bool:
    """True when forward-mode AD (``torch.autograd.forward_ad`` or ``torch.func.jvp``) carries a
    tangent on one of ``tensors``."""
    if forward_ad._current_level < 0:
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def differentiating(*tensors: Tensor | None) -> bool:
    """True when reverse-mode (a tensor requires grad, grad mode on) or forward-mode AD needs the
    derivative of a call on ``tensors``; inside ``torch.func.grad`` the inputs require grad."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    return has_tangent(*tensors)


class AttentionFunction(torch.autograd.Function):
    """``flashmod::attention`` with its derivatives: reverse mode through the fused backward op
    (whose own derivative, for double backward, is the reference math), forward mode through
    :func:`flashmod.reference.attention_jvp_chunked`, vmap through the ops' batching rules. It is
    the op's Autograd kernel and what the eager wrappers call (it composes with ``torch.func``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap):
        args = (q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap)
        return forward_below_autograd(torch.ops.flashmod.attention, *args)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, attn_mask, *options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.save_for_forward(q, k, v, out, lse, attn_mask)
        ctx.options = tuple(options)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        if grad_out is None:  # only lse was used
            grad_out = torch.zeros_like(out)
        want_mask = ctx.needs_input_grad[3]  # an additive mask that requires grad (a learned bias)
        dq, dk, dv, d_mask = torch.ops.flashmod.attention_backward(
            grad_out, grad_lse, q, k, v, out, lse, attn_mask, *ctx.options, want_mask
        )
        d_mask = d_mask.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if want_mask else None
        return dq, dk, dv, d_mask, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, q_t, k_t, v_t, mask_t, *_):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        return attention_jvp_chunked(q, k, v, lse, attn_mask, q_t, k_t, v_t, mask_t, *ctx.options)


class AttentionBackwardFunction(torch.autograd.Function):
    """``flashmod::attention_backward`` made differentiable in reverse mode (double backward): the
    fused op computes the gradients; their own derivatives come from the chunked reference math
    (:func:`flashmod.reference.attention_backward_chunked`, plain torch), only when asked for.
    Forward mode (forward-over-reverse) runs that math itself (``_attention_backward_autograd``).
    The result does not depend on ``out`` and ``lse`` beyond the probabilities they encode, so those
    get no gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, *options):
        args = (grad_out, grad_lse, q, k, v, out, lse, attn_mask, *options)
        return forward_below_autograd(torch.ops.flashmod.attention_backward, *args)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        grad_out, grad_lse, q, k, v, out, lse, attn_mask, *options = inputs
        ctx.save_for_backward(grad_out, grad_lse, q, k, v, lse, attn_mask)
        ctx.save_for_forward(grad_out, grad_lse, q, k, v, lse, attn_mask)
        ctx.options = tuple(options)

    @staticmethod
    def _primals(ctx) -> tuple[tuple[Tensor, ...], Callable]:
        grad_out, grad_lse, q, k, v, lse, attn_mask = ctx.saved_tensors
        float_mask = attn_mask is not None and attn_mask.dtype != torch.bool
        primals = (grad_out, q, k, v) + ((grad_lse,) if grad_lse is not None else ())
        primals += (attn_mask,) if float_mask else ()

        def gradients(grad_out, q, k, v, *rest):
            g_lse = rest[0] if grad_lse is not None else None
            mask = rest[-1] if float_mask else attn_mask
            return attention_backward_chunked(grad_out, g_lse, q, k, v, lse, mask, *ctx.options)

        return primals, gradients

    @staticmethod
    def backward(ctx, *cotangents):
        grad_out, grad_lse, _, _, _, _, attn_mask = ctx.saved_tensors
        primals, gradients = AttentionBackwardFunction._primals(ctx)
        outputs, vjp_fn = torch.func.vjp(gradients, *primals)
        cotangents = tuple(c if c is not None else torch.zeros_like(o) for c, o in zip(cotangents, outputs))
        grads = vjp_fn(cotangents)
        g_grad_out, g_q, g_k, g_v = grads[:4]
        g_grad_lse = grads[4] if grad_lse is not None else None
        g_mask = grads[-1] if len(grads) > 4 + (grad_lse is not None) else None
        return g_grad_out, g_grad_lse, g_q, g_k, g_v, None, None, g_mask, *([None] * len(ctx.options))


def apply_here(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply`` at the current autograd level. In an Autograd kernel the dispatcher has
    already unwrapped torch.func's tensors to this level; ``Function.apply`` would hand the call
    to torch.func again, which has no kernel left at this dispatch key. (torch.func's own grad rule
    for autograd.Function applies its per-level function the same way.)"""
    if not torch._C._are_functorch_transforms_active():
        return super(torch.autograd.Function, function).apply(*args)
    with enable_single_level_autograd_function():
        return super(torch.autograd.Function, function).apply(*args)


def _attention_autograd(*args: Any) -> tuple[Tensor, Tensor]:
    args = with_defaults(args, 3, ATTENTION_DEFAULTS)
    if differentiating(*args[:4]):
        return apply_here(AttentionFunction, *args)
    return below_autograd(torch.ops.flashmod.attention, *args)


def _attention_backward_autograd(*args: Any) -> tuple[Tensor, ...]:
    args = with_defaults(args, 7, ATTENTION_BACKWARD_DEFAULTS)
    grad_out, grad_lse, q, k, v, _, lse, attn_mask, *options = args
    if has_tangent(grad_out, grad_lse, q, k, v, attn_mask):  # forward mode: plain torch carries it
        return attention_backward_chunked(grad_out, grad_lse, q, k, v, lse, attn_mask, *options)
    if differentiating(grad_out, grad_lse, q, k, v, attn_mask):
        return apply_here(AttentionBackwardFunction, *args)
    return below_autograd(torch.ops.flashmod.attention_backward, *args)


torch.library.impl("flashmod::attention", "Autograd")(_attention_autograd)
torch.library.impl("flashmod::attention_backward", "Autograd")(_attention_backward_autograd)


class AttentionDropoutFunction(torch.autograd.Function):
    """``flashmod::attention_dropout`` with its derivatives: reverse mode through the fused
    attention_dropout_backward op (which regenerates the forward's keep mask from rng_state; its own
    derivative runs the reference), forward mode through :func:`attention_jvp_chunked` with the same
    keep mask."""

    @staticmethod
    def forward(q, k, v, attn_mask, *options_dropout_rng):
        return forward_below_autograd(torch.ops.flashmod.attention_dropout, q, k, v, attn_mask, *options_dropout_rng)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, attn_mask, *options, dropout_p, rng_state = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng_state)
        ctx.save_for_forward(q, k, v, lse, attn_mask, rng_state)
        ctx.options = (*options, dropout_p)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        q, k, v, out, lse, attn_mask, rng_state = ctx.saved_tensors
        if ctx.needs_input_grad[3]:
            raise NotImplementedError(
                "flashmod.attention_dropout: attn_mask gets no gradient here; flashmod.attention sends a "
                "mask that requires grad with dropout to the reference (attention_dropout_reference)"
            )
        if grad_out is None:  # only lse was used
            grad_out = torch.zeros_like(out)
        dq, dk, dv = torch.ops.flashmod.attention_dropout_backward(
            grad_out, grad_lse, q, k, v, out, lse, attn_mask, *ctx.options, rng_state
        )
        return dq, dk, dv, *([None] * 9)

    @staticmethod
    def jvp(ctx, q_t, k_t, v_t, mask_t, *_):
        q, k, v, lse, attn_mask, rng_state = ctx.saved_tensors
        *options, dropout_p = ctx.options
        keep = _call_keep_mask(q, k, dropout_p, rng_state)
        return attention_jvp_chunked(
            q, k, v, lse, attn_mask, q_t, k_t, v_t, mask_t, *options, dropout_p=dropout_p, dropout_mask=keep
        )


def _attention_dropout_autograd(*args: Any) -> tuple[Tensor, Tensor]:
    if differentiating(*args[:4]):
        return apply_here(AttentionDropoutFunction, *args)
    return below_autograd(torch.ops.flashmod.attention_dropout, *args)


torch.library.impl("flashmod::attention_dropout", "Autograd")(_attention_dropout_autograd)


def _vmap_front(t: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """``t`` with its vmapped dimension first (expanded there when ``t`` is not batched)."""
    if t is None:
        return None
    return t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)


def vmap_into_batch(t: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """A (B, ...) argument under vmap as (V * B, ...): the vmapped dimension folded into the batch."""
    t = _vmap_front(t, dim, size)
    return None if t is None else t.flatten(0, 1)


def vmap_mask_into_batch(mask: Tensor | None, dim: int | None, size: int, batch: int) -> Tensor | None:
    """A mask broadcastable to (B, H, Nq, Nk) under vmap, made broadcastable to (V * B, H, Nq, Nk)."""
    if mask is None or (dim is None and (mask.dim() < 4 or mask.shape[0] == 1)):
        return mask  # broadcasts over the folded batch as it is
    m = _vmap_front(mask, dim, size)
    m = m.reshape(size, *([1] * (5 - m.dim())), *m.shape[1:])
    return m.expand(size, batch, *m.shape[2:]).flatten(0, 1)


def vmap_out_of_batch(t: Tensor, size: int) -> Tensor:
    return t.unflatten(0, (size, t.shape[0] // size if size else 0))


@torch.library.register_vmap("flashmod::attention")
def _attention_vmap(info, in_dims, q, k, v, attn_mask=None, *options):
    """Batching rule: vmapped dimensions fold into the batch dimension, so one kernel call serves
    every vmapped problem."""
    size, batch = info.batch_size, _batch_of(q, in_dims[0])
    q, k, v = (vmap_into_batch(t, d, size) for t, d in zip((q, k, v), in_dims))
    attn_mask = vmap_mask_into_batch(attn_mask, in_dims[3] if len(in_dims) > 3 else None, size, batch)
    out, lse = torch.ops.flashmod.attention(q, k, v, attn_mask, *options)
    return (vmap_out_of_batch(out, size), vmap_out_of_batch(lse, size)), (0, 0)


@torch.library.register_vmap("flashmod::attention_backward")
def _attention_backward_vmap(info, in_dims, grad_out, grad_lse, q, k, v, out, lse, attn_mask=None, *options):
    size, batch = info.batch_size, _batch_of(q, in_dims[2])
    tensors = (grad_out, grad_lse, q, k, v, out, lse)
    folded = [vmap_into_batch(t, d, size) for t, d in zip(tensors, in_dims)]
    attn_mask = vmap_mask_into_batch(attn_mask, in_dims[7] if len(in_dims) > 7 else None, size, batch)
    *grads, grad_mask = torch.ops.flashmod.attention_backward(*folded, attn_mask, *options)
    if grad_mask.dim() == 1:  # not computed: the empty (0,) tensor, not batched
        return (*(vmap_out_of_batch(g, size) for g in grads), grad_mask), (0, 0, 0, None)
    return tuple(vmap_out_of_batch(g, size) for g in (*grads, grad_mask)), (0, 0, 0, 0)


def _batch_of(t: Tensor, dim: int | None) -> int:
    """The per-sample batch size of a vmapped argument (its dimension 0 inside the vmapped function)."""
    return _vmap_front(t, dim, 1).shape[1]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for ``device_type`` (None when autocast is off there)."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_cast(t: Tensor | None, dtype: torch.dtype, device_type: str) -> Tensor | None:
    """``t`` in ``dtype`` when autocast would cast it (floating, not fp64, on that device)."""
    if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype) if t.device.type == device_type else t


def autocast_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An additive mask next to ``dtype`` inputs: kept in fp32 or ``dtype`` (both accepted), else fp32."""
    if mask is None or not mask.is_floating_point() or mask.dtype in (dtype, torch.float32, torch.float64):
        return mask
    return mask.float()


def autocast_attention_args(args: tuple) -> tuple:
    """SDPA's autocast rule for attention's arguments (q, k, v, attn_mask, ...): q, k and v in the
    autocast dtype of q's device (so mixed-dtype inputs meet too), the output then in that dtype."""
    q, k, v, attn_mask, *rest = args
    dtype = autocast_dtype(q.device.type)
    if dtype is None:
        return args
    device_type = q.device.type
    q, k, v = (autocast_cast(t, dtype, device_type) for t in (q, k, v))
    return (q, k, v, autocast_mask(attn_mask, q.dtype if q.dtype != torch.float64 else dtype), *rest)


def register_autocast(qualname: str, cast_args: Callable[[tuple], tuple]) -> None:
    """An Autocast kernel for ``flashmod::<qualname>`` on CPU and CUDA that casts with ``cast_args``
    and redispatches below autocast (what torch.library.register_autocast does, with the autocast
    dtype read when called instead of fixed, as for SDPA)."""
    op = getattr(torch.ops.flashmod, qualname).default
    for device_type in ("cpu", "cuda"):
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def kernel(*args: Any, key: torch._C.DispatchKey = key) -> Any:
            args = cast_args(args)  # before the guard: autocast reads as off inside it
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
                return op(*args)

        op.py_impl(key)(kernel)  # what torch.compile's Python dispatcher runs
        _LIB.impl(qualname, lambda _keyset, *args, k=kernel: k(*args), key_name, with_keyset=True)


_LIB = torch.library.Library("flashmod", "IMPL")
register_autocast("attention", lambda args: autocast_attention_args(with_defaults(args, 3, ATTENTION_DEFAULTS)))


def attention_op(
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
) -> tuple[Tensor, Tensor]:
    """``torch.ops.flashmod.attention`` with keyword defaults; returns ``(out, lse)``.

    Unlike the operator, it also takes a value head dim other than q's and k's (as SDPA does)."""
    check_tensor_types("flashmod.attention", ("attn_mask",), q=q, k=k, v=v, attn_mask=attn_mask)
    window_left, window_right = unbounded_if_huge(window_left), unbounded_if_huge(window_right)
    if isinstance(scale, Tensor):
        q, scale = _tensor_scale(q, scale)
    if _value_head_dim_differs(q, k, v):
        return _attention_other_value_dim(
            q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap
        )
    args = (q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap)
    if autocast_dtype(q.device.type) is not None:  # cast outside the graph's Function, as the op's Autocast kernel does
        args = autocast_attention_args(args)
        q, k, v, attn_mask = args[:4]
    if no_grad_needed(q, k, v, attn_mask):
        return below_autograd(torch.ops.flashmod.attention, *args)
    if not torch.compiler.is_compiling():
        return apply_function(AttentionFunction, *args)
    return torch.ops.flashmod.attention(*args)


def check_attention_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
    window_left: int,
    window_right: int,
    softcap: float,
) -> None:
    """The checks ``attention_op`` gets from the op, for the op that bypasses it (dropout runs the
    reference, ``flashmod::attention_dropout_reference``): the same errors for the same bad inputs.
    Its schema takes tensors and a float scale (attention_bhsd read a tensor one first). A value head
    dim other than q's passes, as in ``attention_op``."""
    if _value_head_dim_differs(q, k, v):
        v = v.new_empty(()).expand(*v.shape[:3], q.shape[3])  # v's dtype, device and extents, q's head dim
    _check_inputs(q, k, v, attn_mask, scale, window_left, window_right, softcap)


def _tensor_scale(q: Tensor, scale: Tensor, op: str = "flashmod.attention") -> tuple[Tensor, float]:
    """A 0-d tensor ``scale``: read as a float in eager code (and checked finite); folded into q
    (``q * scale``, the same scores) while torch.compile traces, where reading it would stop the
    graph, or when it requires grad or carries a forward-mode tangent, so that it gets its
    derivative."""
    if scale.dim() != 0 or not scale.is_floating_point():
        raise TypeError(f"{op}: scale must be a float or a 0-d float tensor, got {scale!r}")
    if torch.compiler.is_compiling():
        return q * scale.to(device=q.device, dtype=q.dtype), 1.0
    value = float(scale.detach())
    if not math.isfinite(value):  # the op's check, which a scale folded into q would not reach
        raise RuntimeError(f"{op}: scale must be finite, got {value}")
    if scale.requires_grad or has_tangent(scale):
        return q * scale.to(device=q.device, dtype=q.dtype), 1.0
    return q, value


def _value_head_dim_differs(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """q and k share a head dim and v has another (anything else is the op's to judge)."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape  # unrolled, not a generator: this runs on every call
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return False
    return ks[3] == qs[3] and vs[3] != qs[3] and min(qs[3], vs[3]) > 0


def _attention_other_value_dim(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: Any, *options: Any):
    """Attention with v's head dim Dv != Dqk (e.g. 192 / 128 in latent-attention models): the
    smaller side is zero-padded to the larger, which changes no dot product (the default scale stays
    1 / sqrt(Dqk)) and adds zero columns to the output; the output is sliced back to Dv, and autograd
    slices the gradients back through the pads. Every kernel (CPU and CUDA) serves it, at the cost
    of the padded copies."""
    d_qk, d_v = q.shape[3], v.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(d_qk)
    if d_qk < d_v:
        q, k = (torch.nn.functional.pad(t, (0, d_v - d_qk)) for t in (q, k))
    else:
        v = torch.nn.functional.pad(v, (0, d_qk - d_v))
    out, lse = attention_op(q, k, v, attn_mask, scale, *options)
    return out[..., :d_v].contiguous(), lse


def apply_function(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` for the eager wrappers, with every argument given. Outside
    torch.func it skips ``Function.apply``'s signature binding (``inspect.signature`` on each call,
    tens of microseconds of host time that a training step pays once per layer)."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


def forward_below_autograd(op: Callable, *args: Any) -> Any:
    """``below_autograd`` for an autograd.Function's forward. Under torch.func the call continues
    to the next lower transform level, whose own autograd must see grad mode on again (the Function
    turned it off for this level), as torch.func's generated per-level functions do."""
    if not torch._C._are_functorch_transforms_active():
        return below_autograd(op, *args)
    with torch.enable_grad(), torch.autograd.forward_ad._set_fwd_grad_enabled(True):
        return below_autograd(op, *args)


def below_autograd(op: Callable, *args: Any) -> Any:
    """``op(*args)`` dispatched below the autograd key (the guard torch's own autograd kernels use),
    so the op's registered Python autograd kernel does not run."""
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def no_grad_needed(*inputs: Tensor | None) -> bool:
    """True in eager mode when no input needs a gradient: the caller then skips the autograd layer,
    whose Python kernel would only redispatch below itself. That saves ~6 us
    of host time per call (CPU machine, tiny tensors: attention 29.7 -> 23.2 us, SDPA 22.3 us),
    which a decoding step pays once per layer. Under ``torch.compile`` the ordinary path is traced."""
    if torch.compiler.is_compiling():
        return False
    return not differentiating(*inputs)
