"""Input checks shared by the ops' fake implementations, written as ``torch._check`` so they also
fire while torch.compile traces. Each mirrors a check of the C++ host code (``csrc/*/..._host.cpp``,
``csrc/common/mask_check.cpp``) with the same message: the error names the argument, what was
expected and what came."""

from __future__ import annotations

import math
import numbers
import operator
import os

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""The dtypes every flashmod op accepts (float64 on CPU only)."""


def check_tensor_types(op: str, optional: tuple[str, ...] = (), **tensors: object) -> None:
    """Each argument is a strided torch.Tensor (those named in ``optional`` may be None): anything
    else (None, a numpy array, a list) is a TypeError naming the argument and what came, and a
    NestedTensor a NotImplementedError that names the alternative."""
    for name, t in tensors.items():
        if t is None and name in optional:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{op}: {name} must be a torch.Tensor{' or None' if name in optional else ''}, "
                f"got {type(t).__module__}.{type(t).__qualname__}"
            )
        if t.is_nested:
            raise NotImplementedError(
                f"{op}: {name} is a NestedTensor, which flashmod does not take; use padded tensors "
                "with a mask (attn_mask, or key_padding_mask in the modules) for sequences of different lengths"
            )


def check_4d(op: str, dims: str, **tensors: Tensor) -> None:
    """Each tensor is 4-D; ``dims`` names the four dimensions, e.g. ``"batch, heads, seqlen, depth"``."""
    for name, t in tensors.items():
        torch._check(
            t.dim() == 4,
            lambda n=name, t=t: (
                f"{op}: {n} must be a 4-D tensor ({dims}), got a {t.dim()}-D tensor of shape {list(t.shape)}"
            ),
        )


def check_float_dtype(op: str, name: str, t: Tensor) -> None:
    torch._check(
        t.dtype in FLOAT_DTYPES,
        lambda: f"{op}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}",
    )


def check_same_dtype(op: str, name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    torch._check(t.dtype == ref.dtype, lambda: f"{op}: {name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")


def check_same_device(op: str, name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    torch._check(
        t.device == ref.device, lambda: f"{op}: {name} must be on {ref_name}'s device {ref.device}, got {t.device}"
    )


def check_fp64_on_cpu(op: str, name: str, t: Tensor) -> None:
    torch._check(
        not (t.dtype == torch.float64 and t.device.type == "cuda"),
        lambda: f"{op}: {name}'s dtype float64 is supported on CPU only, got it on {t.device}",
    )


def check_head_groups(op: str, q_name: str, q: Tensor, kv_name: str, kv: Tensor, kv_label: str) -> None:
    """GQA/MQA: ``q``'s heads are a whole multiple of ``kv``'s; ``kv_label`` names the key side in the
    message (``"k/v"`` when k and v share the head count). No query heads at all is an empty problem."""
    torch._check(
        (kv.shape[1] > 0 and q.shape[1] % kv.shape[1] == 0) or q.shape[1] == 0,
        lambda: (
            f"{op}: {q_name}'s heads must be a multiple of {kv_name}'s heads (GQA/MQA), "
            f"got {q_name} heads {q.shape[1]} and {kv_label} heads {kv.shape[1]}"
        ),
    )


def check_scale(op: str, scale: float | None) -> None:
    torch._check(scale is None or math.isfinite(scale), lambda: f"{op}: scale must be finite, got {scale}")


def check_options(op: str, scale: float | None, window_left: int, window_right: int, softcap: float) -> None:
    """The options every attention op shares, in the order of csrc/attention/attention_host.cpp's
    check_attention_options."""
    p = f"{op}: "
    torch._check(window_left >= -1, lambda: f"{p}window_left must be >= -1 (-1 = unbounded), got {window_left}")
    torch._check(window_right >= -1, lambda: f"{p}window_right must be >= -1 (-1 = unbounded), got {window_right}")
    torch._check(
        softcap >= 0.0 and softcap != float("inf"),
        lambda: f"{p}softcap must be a finite number >= 0 (0 = off), got {softcap}",
    )
    check_scale(op, scale)


def check_mask(op: str, attn_mask: Tensor | None, ref: Tensor, ref_name: str, target: tuple, target_names: str) -> None:
    """The ``attn_mask`` rules every op with a mask shares: ``ref``'s device, bool or ``ref``'s dtype
    (or float32 for half-precision ``ref``), broadcastable to ``target``."""
    if attn_mask is None:
        return
    torch._check(
        attn_mask.device == ref.device,
        lambda: f"{op}: attn_mask must be on {ref_name}'s device {ref.device}, got {attn_mask.device}",
    )
    half = ref.dtype in (torch.float16, torch.bfloat16)
    torch._check(
        attn_mask.dtype in (torch.bool, ref.dtype) or (half and attn_mask.dtype == torch.float32),
        lambda: (
            f"{op}: attn_mask must be bool or {ref_name}'s dtype {ref.dtype}"
            f"{' (or float32)' if half else ''}, got {attn_mask.dtype}"
        ),
    )
    ok = 1 <= attn_mask.dim() <= len(target) and all(
        attn_mask.shape[-i] in (1, target[-i]) for i in range(1, attn_mask.dim() + 1)
    )
    torch._check(
        ok,
        lambda: (
            f"{op}: attn_mask must be broadcastable to {target_names} = {list(target)}, "
            f"got shape {list(attn_mask.shape)}"
        ),
    )


def check_window(op: str, window_size: object) -> tuple[int, int]:
    """``window_size`` as a pair of ints ``(left, right)``; anything else (an int, None, floats)
    raises a TypeError naming the argument and what came."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common call, without the ABC checks below
        left, right = window_size
        if type(left) is int and type(right) is int:
            return unbounded_if_huge(left), unbounded_if_huge(right)
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    ok = ok and all(isinstance(w, (numbers.Integral, torch.SymInt)) and not isinstance(w, bool) for w in window_size)
    if not ok:
        raise TypeError(f"{op}: window_size must be a pair of ints (left, right), -1 = unbounded, got {window_size!r}")
    return unbounded_if_huge(operator.index(window_size[0])), unbounded_if_huge(operator.index(window_size[1]))


# A window side past this many keys reaches every key of any tensor; as -1 it stays clear of int64's
# end in the kernels' index arithmetic (row + offset + side) and fits the ops' int64 arguments.
HUGE_WINDOW = 1 << 62


def unbounded_if_huge(side: int) -> int:
    """``side``, or -1 (unbounded) for a side of more than ``HUGE_WINDOW`` keys."""
    return -1 if isinstance(side, int) and side > HUGE_WINDOW else side


def check_dropout(op: str, name: str, dropout_p: object) -> float:
    """A dropout probability in [0, 1] (NaN, negative, above 1 or not a number raise)."""
    if type(dropout_p) is float and 0.0 <= dropout_p <= 1.0:  # the common call, without the ABC check below
        return dropout_p
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: {name} must be a probability in [0, 1], got {dropout_p!r}")
    return float(dropout_p)


def check_flash_attn_extras(op: str, alibi_slopes: object, **flags: object) -> None:
    """flash-attn's keyword arguments that code ported from it passes: the flags (``deterministic``,
    ``return_attn_probs``, ``return_softmax_lse``, and flashmod's ``return_lse``) are bools;
    ``alibi_slopes`` has no kernel here, so anything but None raises rather than being ignored."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            # flash-attn's own signatures put alibi_slopes where flashmod's return_lse stands: a
            # positional call ported from it would otherwise return the lse and drop the slopes.
            hint = " (flash-attn passes alibi_slopes in this place; pass flashmod's arguments by keyword)"
            raise TypeError(
                f"{op}: {name} must be a bool, got {type(flag).__name__}"
                + (hint if name == "return_lse" and isinstance(flag, Tensor) else "")
            )
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"{op}: alibi_slopes is not supported (no ALiBi kernel); pass the bias as an additive "
            "attn_mask to flashmod.attention instead"
        )


def check_deterministic_backward(op: str, deterministic: bool, *tensors: Tensor) -> None:
    """flash-attn's ``deterministic=True`` asks for a bitwise reproducible backward. flashmod's is,
    except that the Hopper backward adds dQ up by atomics (long sequences or packed ones, head dims
    33-128), and so does the fp32 one, while torch's deterministic algorithms are off and
    ``FLASHMOD_BWD_FUSED_DQ`` is not 0; rather than ignore the flag there, a CUDA call that will be
    differentiated raises and names both switches."""
    if not deterministic or torch.are_deterministic_algorithms_enabled():
        return
    if os.environ.get("FLASHMOD_BWD_FUSED_DQ") == "0":
        return
    if torch.is_grad_enabled() and any(t.is_cuda and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{op}: deterministic=True needs torch.use_deterministic_algorithms(True) on CUDA "
            "(otherwise the backward may add dQ up by atomics, in no fixed order); set it, or "
            "FLASHMOD_BWD_FUSED_DQ=0, for a bitwise reproducible backward"
        )


def unpack_stacked(op: str, name: str, packed: object, parts: int, dims: str) -> tuple[Tensor, ...]:
    """flash-attn's packed inputs (``qkv``: q, k, v stacked at dim -3; ``kv``: k, v): the parts as
    views of ``packed``, no copy. ``dims`` names its dimensions for the error, e.g.
    ``"batch, seqlen, 3, heads, head_dim"``."""
    check_tensor_types(op, **{name: packed})
    assert isinstance(packed, Tensor)
    rank = len(dims.split(", "))
    if packed.dim() != rank or packed.shape[-3] != parts:
        raise RuntimeError(f"{op}: {name} must be a {rank}-D tensor ({dims}), got shape {list(packed.shape)}")
    return packed.unbind(-3)


def unbounded_past(window: tuple[int, int], seqlen_k: int) -> tuple[int, int]:
    """flash-attn's rule: a window side that reaches over all ``seqlen_k`` keys is unbounded (-1).
    With Nq > Nk the literal bound would hide keys from the first queries, which flash-attn's
    kernels never do; code ported from it expects the same answers."""
    left, right = window
    return (-1 if left >= seqlen_k else left, -1 if right >= seqlen_k else right)
