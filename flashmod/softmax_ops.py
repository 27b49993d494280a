"""softmax and fused matmul+softmax: the operators' fake implementations, autograd and front doors.

``torch.ops.flashmod.softmax`` and ``torch.ops.flashmod.matmul_softmax`` are declared in
``csrc/flashmod.cpp``; the checks in ``csrc/softmax/softmax_host.cpp`` are mirrored here with
``torch._check`` (same order, same messages) so they also fire while torch.compile traces.
Derivatives (reverse, forward, double backward) are plain torch math in autograd.Functions that
are the ops' Autograd kernels; batching rules fold vmapped dimensions into the ops' own.
"""

from __future__ import annotations

import math

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
    check_tensor_types,
)
from .ops import (
    _tensor_scale,
    apply_function,
    autocast_cast,
    autocast_dtype,
    autocast_mask,
    below_autograd,
    differentiating,
    forward_below_autograd,
    no_grad_needed,
    register_autocast,
    vmap_into_batch,
    vmap_mask_into_batch,
    vmap_out_of_batch,
    with_defaults,
)


def _check_softmax(x: Tensor, dim: int) -> None:
    """Mirror of prepare_softmax in csrc/softmax/softmax_host.cpp."""
    op = "flashmod.softmax"
    check_float_dtype(op, "x", x)
    check_fp64_on_cpu(op, "x", x)
    ndim = max(x.dim(), 1)
    torch._check(
        -ndim <= dim < ndim,
        lambda: f"{op}: dim must be in [{-ndim}, {ndim - 1}] for a {x.dim()}-D tensor, got {dim}",
    )


def _check_matmul_softmax(a: Tensor, b: Tensor, scale: float | None, attn_mask: Tensor | None) -> None:
    """Mirror of prepare_matmul_softmax in csrc/softmax/softmax_host.cpp."""
    op = "flashmod.matmul_softmax"
    check_4d(op, "batch, heads, seqlen, depth", a=a, b=b)
    check_float_dtype(op, "a", a)
    check_same_dtype(op, "b", b, "a", a)
    check_same_device(op, "b", b, "a", a)
    check_fp64_on_cpu(op, "a", a)
    torch._check(b.shape[0] == a.shape[0], lambda: f"{op}: b must have a's batch size {a.shape[0]}, got {b.shape[0]}")
    torch._check(a.shape[3] > 0, lambda: f"{op}: a's depth (last dimension) must be positive, got {a.shape[3]}")
    torch._check(
        b.shape[3] == a.shape[3],
        lambda: f"{op}: b must have a's depth (last dimension) {a.shape[3]}, got {b.shape[3]}",
    )
    check_head_groups(op, "a", a, "b", b, "b")
    check_scale(op, scale)
    check_mask(op, attn_mask, a, "a", (a.shape[0], a.shape[1], a.shape[2], b.shape[2]), "(batch, a_heads, M, N)")


@torch.library.register_fake("flashmod::softmax")
def _softmax_fake(x: Tensor, dim: int) -> Tensor:
    _check_softmax(x, dim)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.register_fake("flashmod::matmul_softmax")
def _matmul_softmax_fake(
    a: Tensor, b: Tensor, scale: float | None = None, is_causal: bool = False, attn_mask: Tensor | None = None
) -> Tensor:
    _check_matmul_softmax(a, b, scale, attn_mask)
    return a.new_empty((a.shape[0], a.shape[1], a.shape[2], b.shape[2]))


def _product_dtype(a: Tensor) -> torch.dtype:
    """The dtype of matmul_softmax's derivative products: a's, except fp16 on the CPU and bf16 on CPUs
    below AVX-512, where torch's GEMM in that dtype is a scalar loop (a (8, 512, 128) x (8, 128, 512)
    product: 211 ms fp16, 193 ms bf16 held to AVX2, 2.7 ms fp32; session 42): fp32 there, rounded back."""
    if a.device.type != "cpu":
        return a.dtype
    if a.dtype == torch.float16 or (a.dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() != "AVX512"):
        return torch.float32
    return a.dtype


def _softmax_grad(grad: Tensor, y: Tensor, dim: int) -> Tensor:
    """y * (g - sum(g * y, dim)): aten's softmax backward, which does this in one pass and in fp32
    for fp16/bf16 (one rounding at the end). An all -inf row has y = 0 and gets a zero gradient."""
    return torch.ops.aten._softmax_backward_data(grad.contiguous(), y, dim, y.dtype)


class SoftmaxFunction(torch.autograd.Function):
    """``flashmod::softmax`` with its derivatives (reverse, forward, vmap); the op's Autograd kernel."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, dim: int) -> Tensor:
        return forward_below_autograd(torch.ops.flashmod.softmax, x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (y,) = ctx.saved_tensors
        return _softmax_grad(grad, y, ctx.dim), None

    @staticmethod
    def jvp(ctx, x_t: Tensor, _):
        (y,) = ctx.saved_tensors
        return _softmax_jvp(y, x_t, ctx.dim)


def _softmax_jvp(y: Tensor, x_t: Tensor, dim: int) -> Tensor:
    """y * (x_t - sum(y * x_t)); positions with y = 0 (-inf logits) take no tangent, even a non-finite one."""
    x_t = torch.where(y != 0, x_t, torch.zeros_like(x_t))
    return y * (x_t - (y * x_t).sum(dim, keepdim=True))


class MatmulSoftmaxFunction(torch.autograd.Function):
    """``flashmod::matmul_softmax`` with its derivatives (reverse, forward, vmap); the op's Autograd kernel."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, scale, is_causal, attn_mask):
        return forward_below_autograd(torch.ops.flashmod.matmul_softmax, a, b, scale, is_causal, attn_mask)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        a, b, scale, _, attn_mask = inputs
        ctx.mask_shape = None if attn_mask is None else (attn_mask.shape, attn_mask.dtype)
        ctx.save_for_backward(a, b, output)
        ctx.save_for_forward(a, b, output)
        ctx.scale = 1.0 / math.sqrt(a.shape[-1]) if scale is None else scale

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b, p = ctx.saved_tensors
        batch, heads_a, rows, depth = a.shape
        heads_b, cols = b.shape[1], b.shape[2]
        group = heads_a // heads_b
        ds = _softmax_grad(grad, p, -1)  # masked entries have P = 0 and so dS = 0 there
        grad_mask = None
        if ctx.needs_input_grad[4]:  # an additive mask that requires grad: dS summed to its shape
            shape, dtype = ctx.mask_shape
            grad_mask = ds.sum_to_size(shape).to(dtype)
        ds = ds.reshape(batch, heads_b, group * rows, cols)  # GQA: a's head groups share b's head
        a_g = a.reshape(batch, heads_b, group * rows, depth)
        work = _product_dtype(a)
        ds_w, b_w, a_w = (ctx.scale * ds).to(work), b.to(work), a_g.to(work)
        grad_a = (ds_w @ b_w).to(a.dtype).reshape(a.shape) if ctx.needs_input_grad[0] else None
        grad_b = (ds_w.transpose(-1, -2) @ a_w).to(b.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None, grad_mask

    @staticmethod
    def jvp(ctx, a_t, b_t, _scale, _causal, mask_t):
        a, b, p = ctx.saved_tensors
        batch, heads_a, rows, depth = a.shape
        heads_b = b.shape[1]
        # The products in _product_dtype, each rounded once; the sum, the scale and the softmax's
        # tangent in fp32 (at least), rounded to p's dtype at the end. Rounding each step in bf16, as
        # plain torch does, failed the 2x rule for 3 of 1000 seeds (CPU, session 42); now none.
        work = _product_dtype(a)
        acc = torch.promote_types(p.dtype, torch.float32)
        t = torch.zeros_like(p, dtype=acc).unflatten(1, (heads_b, heads_a // heads_b))
        if a_t is not None:
            t = t + (a_t.to(work).unflatten(1, (heads_b, -1)) @ b.to(work).unsqueeze(2).transpose(-1, -2)).to(acc)
        if b_t is not None:
            t = t + (a.to(work).unflatten(1, (heads_b, -1)) @ b_t.to(work).unsqueeze(2).transpose(-1, -2)).to(acc)
        t = (ctx.scale * t).flatten(1, 2)
        if mask_t is not None:
            t = t + mask_t
        return _softmax_jvp(p.to(acc), t, -1).to(p.dtype)


def _softmax_autograd(*args):
    x, dim = args
    if differentiating(x):
        return apply_function(SoftmaxFunction, x, dim)
    return below_autograd(torch.ops.flashmod.softmax, x, dim)


def _matmul_softmax_autograd(*args):
    args = with_defaults(args, 2, (None, False, None))
    if differentiating(args[0], args[1], args[4]):
        return apply_function(MatmulSoftmaxFunction, *args)
    return below_autograd(torch.ops.flashmod.matmul_softmax, *args)


torch.library.impl("flashmod::softmax", "Autograd")(_softmax_autograd)
torch.library.impl("flashmod::matmul_softmax", "Autograd")(_matmul_softmax_autograd)


def _autocast_matmul_softmax_args(args: tuple) -> tuple:
    """Autocast's rule for matmul_softmax (a matmul, like SDPA's): a and b in the autocast dtype."""
    a, b, scale, is_causal, attn_mask = with_defaults(args, 2, (None, False, None))
    dtype = autocast_dtype(a.device.type)
    if dtype is None:
        return (a, b, scale, is_causal, attn_mask)
    a, b = (autocast_cast(t, dtype, a.device.type) for t in (a, b))
    return (a, b, scale, is_causal, autocast_mask(attn_mask, a.dtype if a.dtype != torch.float64 else dtype))


register_autocast("matmul_softmax", _autocast_matmul_softmax_args)


@torch.library.register_vmap("flashmod::softmax")
def _softmax_vmap(info, in_dims, x, dim):
    x = x.movedim(in_dims[0], 0)
    if x.dim() == 1:  # a 0-d x per sample: softmax of one element
        return torch.ops.flashmod.softmax(x.unsqueeze(-1), -1).squeeze(-1), 0
    return torch.ops.flashmod.softmax(x, dim + 1 if dim >= 0 else dim), 0


@torch.library.register_vmap("flashmod::matmul_softmax")
def _matmul_softmax_vmap(info, in_dims, a, b, scale=None, is_causal=False, attn_mask=None):
    size = info.batch_size
    batch = vmap_into_batch(a, in_dims[0], size).shape[0] // max(size, 1)
    a, b = vmap_into_batch(a, in_dims[0], size), vmap_into_batch(b, in_dims[1], size)
    attn_mask = vmap_mask_into_batch(attn_mask, in_dims[4] if len(in_dims) > 4 else None, size, batch)
    return vmap_out_of_batch(torch.ops.flashmod.matmul_softmax(a, b, scale, is_causal, attn_mask), size), 0


def softmax(x: Tensor, dim: int) -> Tensor:
    """``torch.softmax(x, dim)`` computed with the online normalizer (one read pass finds max and sum).

    Accepts float32/float16/bfloat16 (and float64 on CPU), any shape, any ``dim``; returns a
    contiguous tensor of ``x``'s shape and dtype. Unlike ``torch.softmax``, a row whose elements are
    all ``-inf`` gives all zeros instead of NaN; a NaN in a row makes that whole row NaN.
    Differentiable.
    """
    check_tensor_types("flashmod.softmax", x=x)
    if no_grad_needed(x):
        return below_autograd(torch.ops.flashmod.softmax, x, dim)
    if not torch.compiler.is_compiling():
        return apply_function(SoftmaxFunction, x, dim)
    return torch.ops.flashmod.softmax(x, dim)


def matmul_softmax(
    a: Tensor,
    b: Tensor,
    scale: float | None = None,
    is_causal: bool = False,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Attention probabilities ``softmax(scale * a @ b^T + mask, -1)``, fused, in ``a``'s dtype.

    Args:
        a: queries ``(B, Ha, M, K)``.
        b: keys ``(B, Hb, N, K)`` with ``Ha % Hb == 0`` (GQA: a-head ``h`` uses b-head ``h // (Ha // Hb)``).
        scale: multiplies the logits; ``None`` means ``1 / sqrt(K)`` as in attention. A 0-d tensor
            works too and gets its gradient when it requires one.
        is_causal: top-left causal mask (row ``i`` sees columns ``0..i``), like SDPA's ``is_causal``.
        attn_mask: bool (True = keep) or additive float mask broadcastable to ``(B, Ha, M, N)``;
            for float16/bfloat16 inputs an additive mask may also be float32. Additive entries at or
            below -32768 (``flashmod.reference.HIDING_MASK_VALUE``) hide their key as ``-inf`` does.

    Returns:
        ``(B, Ha, M, N)`` contiguous probabilities; rows with no visible column are all zeros.
        The output is the only ``(B, Ha, M, N)`` buffer allocated. Differentiable in ``a``, ``b`` and an
        additive ``attn_mask`` (its gradient summed over its broadcast dimensions).
    """
    check_tensor_types("flashmod.matmul_softmax", ("attn_mask",), a=a, b=b, attn_mask=attn_mask)
    if isinstance(scale, Tensor):  # as attention's: folded into a where it needs a derivative
        a, scale = _tensor_scale(a, scale, "flashmod.matmul_softmax")
    args = (a, b, scale, is_causal, attn_mask)
    if autocast_dtype(a.device.type) is not None:
        args = _autocast_matmul_softmax_args(args)
        a, b, attn_mask = args[0], args[1], args[4]
    if no_grad_needed(a, b, attn_mask):
        return below_autograd(torch.ops.flashmod.matmul_softmax, *args)
    if not torch.compiler.is_compiling():
        return apply_function(MatmulSoftmaxFunction, *args)
    return torch.ops.flashmod.matmul_softmax(*args)
