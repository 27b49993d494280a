"""merge_attention: the exact merge of partial attention results, its fake implementation,
autograd and front door.

``torch.ops.flashmod.merge_attention(outs, lses) -> (out, lse)`` is declared in
``csrc/flashmod.cpp``. Partial results computed over disjoint key sets (each normalized over its own
keys, with its log-sum-exp) combine into the result over all keys:

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i

A partial with ``lse_i = -inf`` saw no visible key and contributes nothing; a row where every
partial is empty stays ``(0, -inf)``. fp16/bf16 partials are merged in fp32. This is what makes
context-parallel (ring) attention exact: see :mod:`flashmod.distributed`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _C  # noqa: F401  (loading the library registers the operators)
from .ops import has_tangent

_OP = "flashmod.merge_attention: "
_MERGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_merge(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> None:
    """Mirror of csrc/merge/merge_host.cpp's checks (same order, same messages)."""
    torch._check(len(outs) > 0, lambda: f"{_OP}outs must hold at least one partial output")
    torch._check(
        len(outs) == len(lses),
        lambda: f"{_OP}outs and lses must have the same length, got {len(outs)} outs and {len(lses)} lses",
    )
    first = outs[0]
    torch._check(
        first.dtype in _MERGE_DTYPES,
        lambda: f"{_OP}outs must be float32, float16, bfloat16 or float64, got {first.dtype}",
    )
    torch._check(first.dim() >= 1, lambda: f"{_OP}outs[0] must have a head_dim (last) dimension, got a 0-D tensor")
    torch._check(
        not (first.dtype == torch.float64 and first.device.type == "cuda"),
        lambda: f"{_OP}outs' dtype float64 is supported on CPU only, got it on {first.device}",
    )
    for i, (o, lse) in enumerate(zip(outs, lses)):
        _check_partial(i, o, lse, first)


def _check_partial(i: int, o: Tensor, lse: Tensor, first: Tensor) -> None:
    row_shape = list(first.shape[:-1])
    torch._check(
        o.dtype == first.dtype, lambda: f"{_OP}outs[{i}] must have outs[0]'s dtype {first.dtype}, got {o.dtype}"
    )
    torch._check(
        o.device == first.device,
        lambda: f"{_OP}outs[{i}] must be on outs[0]'s device {first.device}, got {o.device}",
    )
    torch._check(
        list(o.shape) == list(first.shape),
        lambda: f"{_OP}outs[{i}] must have outs[0]'s shape {list(first.shape)}, got {list(o.shape)}",
    )
    torch._check(lse.dtype == torch.float32, lambda: f"{_OP}lses[{i}] must be float32, got {lse.dtype}")
    torch._check(
        lse.device == first.device,
        lambda: f"{_OP}lses[{i}] must be on outs[0]'s device {first.device}, got {lse.device}",
    )
    torch._check(
        list(lse.shape) == row_shape,
        lambda: f"{_OP}lses[{i}] must have outs[0]'s shape without head_dim {row_shape}, got {list(lse.shape)}",
    )


@torch.library.register_fake("flashmod::merge_attention")
def _merge_attention_fake(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    _check_merge(outs, lses)
    return (
        torch.empty_like(outs[0], memory_format=torch.contiguous_format),
        torch.empty_like(lses[0], memory_format=torch.contiguous_format),
    )


def _merge_setup_context(ctx, inputs, output) -> None:
    outs, lses = inputs
    ctx.parts = len(outs)
    ctx.save_for_backward(*outs, *lses, *output)


def _merge_weights(lses: Sequence[Tensor], acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The parts' weights as the kernels form them, exp(lse_i - top) / total with top the largest
    finite lse (exp(lse_i - lse) would sum to more than 1 where |lse| dwarfs the log of the sum), and
    total and top; empty parts (lse -inf) weigh 0, and a row of only empty parts has total 0."""
    stacked = torch.stack([lse.to(acc) for lse in lses])
    top = stacked.amax(0)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    scaled = torch.exp(stacked - top)
    total = scaled.sum(0)
    return scaled / torch.where(total == 0, torch.ones_like(total), total), total, top


def _merge_backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    # With w_i = exp(lse_i - lse) (merged lse): d out / d out_i = w_i, d lse / d lse_i = w_i and
    # d out / d lse_i = w_i (out_i - out), so
    #   grad out_i = w_i grad_out,   grad lse_i = w_i (<grad_out, out_i - out> + grad_lse).
    saved = ctx.saved_tensors
    outs, lses, (out, _) = saved[: ctx.parts], saved[ctx.parts : 2 * ctx.parts], saved[2 * ctx.parts :]
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    weights, _, _ = _merge_weights(lses, acc)
    grads_out, grads_lse = [], []
    for o_i, lse_i, w in zip(outs, lses, weights):  # a part with lse -inf has weight exp(-inf) = 0
        g_lse = torch.zeros_like(w) if grad_lse is None else w * grad_lse.to(acc)
        if grad_out is None:
            grads_out.append(None)
        else:
            g = grad_out.to(acc)
            grads_out.append((w[..., None] * g).to(o_i.dtype))
            g_lse = g_lse + w * (g * (o_i.to(acc) - out.to(acc))).sum(-1)
        grads_lse.append(g_lse.to(lse_i.dtype))
    return grads_out, grads_lse


torch.library.register_autograd("flashmod::merge_attention", _merge_backward, setup_context=_merge_setup_context)


def merge_attention(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge partial attention results over disjoint key sets into the exact result.

    Args:
        outs: partial outputs, all of one shape ``(..., head_dim)`` and dtype (fp32, fp16, bf16; fp64
            on CPU), e.g. ``flashmod.attention_op`` outputs over different key ranges.
        lses: their log-sum-exps, float32 of shape ``(...)``: ``outs``' shape without the head dim,
            as ``flashmod.attention_op`` returns it. The serving functions return theirs in flash-attn's
            layouts (``flash_attn_with_kvcache``: ``(B, Hq, Sq)`` for an ``(B, Sq, Hq, D)`` output;
            ``flash_attn_varlen_func``: ``(Hq, total)``): transpose those to match first.

    Returns:
        ``(out, lse)``: the attention output over the union of the key sets (contiguous, the dtype of
        ``outs``) and its float32 log-sum-exp. Differentiable with respect to ``outs`` and ``lses``, in
        reverse and forward mode.
    """
    # An empty list has no tensor to dispatch on: the one check the C++ kernels cannot make.
    torch._check(len(outs) > 0, lambda: f"{_OP}outs must hold at least one partial output")
    for name, items in (("outs", outs), ("lses", lses)):
        for i, t in enumerate(items):
            if not isinstance(t, Tensor):
                raise TypeError(f"{_OP}{name}[{i}] must be a tensor, got {type(t).__name__}")
    if has_tangent(*outs, *lses) or _under_functorch(*outs, *lses):
        # The op's autograd is reverse mode only and would drop a tangent (a silent zero), and the op
        # has no functorch rules (torch.func.grad, vmap): plain torch math has all of them.
        _check_merge(outs, lses)
        return _merge_math(outs, lses)
    return torch.ops.flashmod.merge_attention(list(outs), list(lses))


def _under_functorch(*tensors: Tensor) -> bool:
    """An input wrapped by a torch.func transform (grad, vmap, jacrev)."""
    if torch.compiler.is_compiling():
        return False
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _merge_math(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The merge in differentiable torch ops, with the kernels' weights exp(lse_i - max) / sum (empty
    parts weigh 0; a row of only empty parts is (0, -inf)): forward-mode AD's path."""
    acc = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    weights, total, top = _merge_weights(lses, acc)
    out = sum(w[..., None] * o.to(acc) for w, o in zip(weights, outs))
    lse = torch.where(total == 0, torch.full_like(total, -math.inf), torch.log(total) + top)
    return out.to(outs[0].dtype).contiguous(), lse.float()
