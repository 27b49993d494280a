"""The thin layer over the C++ operator: loading it, its fake (meta) implementation, autograd.

``torch.ops.flashmod.attention`` is declared in ``csrc/flashmod.cpp``. Here it gets:

* ``register_fake``: shapes/dtypes for torch.compile, with the same checks as the C++ host code
  (``csrc/attention/attention_host.cpp``) written as ``torch._check`` so they fire while tracing too;
* ``flashmod::attention_backward`` (fused kernels in C++): its fake implementation, and the
  reference math as its CUDA kernel in builds without the fused CUDA backward;
* ``register_autograd``: makes the forward op itself differentiable.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import _C  # noqa: F401  (loading the library registers the operators)
from .checks import (
    check_4d,
    check_float_dtype,
    check_fp64_on_cpu,
    check_head_groups,
    check_mask,
    check_same_device,
    check_same_dtype,
    check_scale,
)
from .reference import attention_backward_chunked

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
    check_scale(op, scale)
    torch._check(window_left >= -1, lambda: f"{p}window_left must be >= -1 (-1 = unbounded), got {window_left}")
    torch._check(window_right >= -1, lambda: f"{p}window_right must be >= -1 (-1 = unbounded), got {window_right}")
    torch._check(
        softcap >= 0.0 and softcap != float("inf"),
        lambda: f"{p}softcap must be a finite number >= 0 (0 = off), got {softcap}",
    )
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
) -> tuple[Tensor, Tensor, Tensor]:
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
    return tuple(torch.empty_like(t if t.stride(-1) == 1 else t.contiguous()) for t in (q, k, v))


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
) -> tuple[Tensor, Tensor, Tensor]:
    """``flashmod::attention_backward_reference``: the chunked reference math with
    attention_backward's checks. CUDA's attention_backward runs it for float32 (no fused kernel
    yet, with a warning); tests use it as the oracle."""
    _attention_backward_fake(
        grad_out, grad_lse, q, k, v, out, lse, attn_mask, scale,
        is_causal, bottom_right, window_left, window_right, softcap,
    )  # fmt: skip
    return attention_backward_chunked(
        grad_out, grad_lse, q, k, v, lse, attn_mask, scale,
        is_causal, bottom_right, window_left, window_right, softcap,
    )  # fmt: skip


torch.library.register_fake("flashmod::attention_backward_reference")(_attention_backward_fake)


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


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap = inputs
    if attn_mask is not None and attn_mask.requires_grad:
        raise NotImplementedError(
            "flashmod.attention: gradients with respect to attn_mask are not supported; "
            "pass attn_mask.detach() (got a mask with requires_grad=True)"
        )
    ctx.save_for_backward(q, k, v, output[0], output[1], attn_mask)
    ctx.options = (scale, is_causal, bottom_right, window_left, window_right, softcap)


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flashmod.attention_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("flashmod::attention", _backward, setup_context=_setup_context)


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
    """``torch.ops.flashmod.attention`` with keyword defaults; returns ``(out, lse)``."""
    args = (q, k, v, attn_mask, scale, is_causal, bottom_right, window_left, window_right, softcap)
    if no_grad_needed(q, k, v, attn_mask):
        return below_autograd(torch.ops.flashmod.attention, *args)
    if eager_autograd():
        return _EagerAttention.apply(*args)
    return torch.ops.flashmod.attention(*args)


def eager_autograd() -> bool:
    """True outside ``torch.compile`` and functorch transforms: there the wrappers may run the
    backward through a plain ``autograd.Function`` with the op's own ``_setup_context`` and
    ``_backward``. torch's ``register_autograd`` path spends ~100 us of host time per call in
    ``torch._library.utils.fill_defaults`` (it rebuilds ``schema.arguments`` on each access), which a
    training step pays once per layer; compiled code and direct ``torch.ops`` calls keep that path."""
    return not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()


class _EagerAttention(torch.autograd.Function):
    """``flashmod::attention`` with the gradients ``register_autograd`` gives it (same
    ``_setup_context`` and ``_backward``), for eager calls through :func:`attention_op`."""

    @staticmethod
    def forward(ctx, *inputs):
        output = below_autograd(torch.ops.flashmod.attention, *inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        return _backward(ctx, grad_out, grad_lse)


def below_autograd(op: Callable, *args: Any) -> Any:
    """``op(*args)`` dispatched below the autograd key (the guard torch's own autograd kernels use),
    so the op's registered Python autograd kernel does not run."""
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def no_grad_needed(*inputs: Tensor | None) -> bool:
    """True in eager mode when no input needs a gradient: the caller then skips the autograd layer,
    whose Python kernel (``register_autograd``) would only redispatch below itself. That saves ~6 us
    of host time per call (CPU machine, tiny tensors: attention 29.7 -> 23.2 us, SDPA 22.3 us),
    which a decoding step pays once per layer. Under ``torch.compile`` the ordinary path is traced."""
    if torch.compiler.is_compiling():
        return False
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs)
