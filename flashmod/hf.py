"""HuggingFace transformers (v5) integration: flashmod as an ``attn_implementation``.

After ``import flashmod``, any transformers model that uses the ``AttentionInterface`` runs its attention on
flashmod's kernel with::

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fmod_attention")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fmod_attention")
    model.set_attn_implementation("fmod_attention")
    flashmod.patch(model)  # the same, plus nn.MultiheadAttention swapping (see flashmod.patch)

The name is exported as ``flashmod.HF_ATTN_IMPLEMENTATION``. It deliberately does not contain "flash":
transformers treats every implementation whose name contains "flash" as a FlashAttention kernel to load
(``is_flash_attention_requested``) and one containing "sdpa" as torch SDPA with its dispatch checks.

Two registrations are made, both needed:

* ``AttentionInterface.register(NAME, hf_attention_forward)``: the attention itself;
* ``AttentionMaskInterface.register(NAME, sdpa_mask)``: the mask builder. Without it transformers builds no
  mask at all for an unknown name (causal masking included). SDPA's builder gives a 4-D bool mask
  (True = attend) or ``None`` when the pattern is a plain causal (or full) one that ``is_causal`` expresses.

Registration is lazy: ``import flashmod`` never imports transformers (which takes seconds). If transformers'
modules are already loaded they are registered at once, otherwise an import hook registers them the moment
``transformers.modeling_utils`` / ``transformers.masking_utils`` are first imported. :func:`register` does it
explicitly.

Semantics of :func:`hf_attention_forward` (they follow transformers' own ``sdpa`` integration, so the same
masks give the same results):

* inputs ``(B, H, S, D)``; returns ``((B, S, H, D) output, attention weights or None)``;
* GQA through flashmod's kernel (kv head ``h // num_key_value_groups``), never ``repeat_kv``;
* with a mask, the mask is the whole truth (it already holds causality, padding and sliding windows);
* without a mask, a causal layer (``module.is_causal`` or the ``is_causal`` kwarg) is causal: top-left
  aligned when several queries are given (transformers drops the mask only when the cache was empty, e.g.
  a StaticCache prefill whose key length is the cache size) and unrestricted for one query (decoding: the
  query is the newest token). ``sliding_window`` then becomes a window with the same alignment, as
  transformers' mask functions define it: ``q - k < sliding_window`` (left ``sliding_window - 1``) for causal
  layers, ``|q - k| <= sliding_window`` for bidirectional ones. (transformers drops the mask only when the
  window cannot bind, so this matters for direct calls only);
* ``softcap`` (Gemma 2/3) is applied to the scores before the mask; ``scaling`` defaults to ``1/sqrt(D)``;
* ``dropout > 0`` (transformers passes it in training only) runs :func:`flashmod.attention`'s dropout
  (fused into the kernels); packed sequences (below) then run each sequence through the dense op on its own
  rows, as :func:`flashmod.flash_attn_varlen_func` takes no dropout;
* ``output_attentions=True`` also returns the probabilities, computed by :func:`attention_weights` (also
  for models such as GPT-2 that do not forward the flag but record what the attention returns); with
  dropout in training they are the probabilities before dropout;
* rows with no visible key (the padding queries of left-padded batches) have output 0 and zero gradients;
* attention sinks (``s_aux``, gpt-oss) scale each row's output by ``sigmoid(lse - sink)`` (the kernel's
  log-sum-exp; the same as the sink joining the softmax), also in packed sequences and the returned weights;
* packed sequences (training without padding: transformers' ``cu_seq_lens_q/k`` + ``max_length_q/k`` kwargs, or
  one row whose ``position_ids`` restart at 0 with transformers' block-diagonal mask) run
  :func:`flashmod.flash_attn_varlen_func`: each sequence attends to itself only, causal per sequence, and the
  blocks between sequences are never computed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from .functional import attention_bhsd, attention_weights
from .reference import HIDING_MASK_VALUE
from .serve_ops import flash_attn_varlen_func

HF_ATTN_IMPLEMENTATION = "fmod_attention"
"""The ``attn_implementation`` name under which flashmod is registered in transformers."""

__all__ = ["HF_ATTN_IMPLEMENTATION", "hf_attention_forward", "is_registered", "register"]


def _mask_for(query: Tensor, attention_mask: Tensor | None, seqlen_k: int) -> Tensor | None:
    """transformers' 4-D mask in a form the op accepts: bool stays bool, additive goes to q's dtype (or fp32)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(
            f"flashmod ({HF_ATTN_IMPLEMENTATION}): attention_mask must be a torch.Tensor or None, got "
            f"{type(attention_mask).__name__} (a flex_attention BlockMask? use attn_implementation='flex_attention')"
        )
    mask = attention_mask
    if mask.shape[-1] != seqlen_k:  # eager implementations slice a longer mask the same way
        mask = mask[..., :seqlen_k]
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():  # 0/1 integer masks: 1 = attend
        return mask.bool()
    half = query.dtype in (torch.float16, torch.bfloat16)
    if mask.dtype != query.dtype and not (half and mask.dtype == torch.float32):
        mask = mask.to(query.dtype)
    return mask


def _with_position_bias(mask: Tensor | None, bias: Tensor, query: Tensor) -> Tensor:
    """Fold an additive position bias (T5-style) into the mask, as transformers' sdpa integration does."""
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    bias = bias.to(dtype)
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, -math.inf)
    return bias + mask.to(dtype)


_collector: Any = None


def _output_collector() -> Any:
    """transformers' collector of ``output_*`` tensors (what ``capture_outputs`` fills from module outputs).

    Looked up until found: its module loads with the first model that captures outputs (GPT-2 does, BERT
    does not), so a miss only means no such model ran yet; caching the miss hid GPT-2's weights after a
    BERT call in the same process.
    """
    global _collector
    if _collector is None:
        for name in ("transformers.utils.output_capturing", "transformers.utils.generic"):
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "_active_collector"):
                _collector = module._active_collector
                break
    return _collector


def _attentions_requested(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the caller wants attention weights back.

    Llama-style models forward ``output_attentions`` in the kwargs, others (GPT-2) drop it and only record the
    weights the attention returns; for those the request is visible in transformers' output collector.
    """
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
        return True
    collector = _output_collector()
    if collector is None:
        return False
    if torch.compiler.is_compiling():  # ContextVar.get is not traceable; capture_outputs then uses a global
        collected = collector.global_var if getattr(collector, "compiling", False) else None
    else:
        collected = collector.get()
    return bool(collected) and ("attentions" in collected or "cross_attentions" in collected)


def _packed_sequences(
    query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor, int, int] | None:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` when the call holds packed sequences,
    else None.

    Packed means either the varlen kwargs transformers gives its flash backends (``cu_seq_lens_q/k`` and
    ``max_length_q/k``, e.g. from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or one row
    whose ``position_ids`` restart (transformers' own packed-sequence detection: no 2-D attention mask, no
    cache). For the latter, the mask transformers built must keep sequences apart: its last query must not
    see the first key (a padding or plain causal mask would, and then the mask decides, as in eager).
    Reading position_ids costs a device sync (as in transformers' flash path), so it is skipped while
    compiling; the varlen kwargs path reads nothing.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)
    position_ids = kwargs.get("position_ids")
    n = query.shape[2]
    if (
        position_ids is None
        or torch.compiler.is_compiling()
        or query.shape[0] != 1
        or key.shape[2] != n
        or n < 2
        or position_ids.numel() != n
    ):
        return None
    positions = position_ids.reshape(-1)
    starts = (positions == positions.min()).nonzero().view(-1)
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None
    if mask is not None:
        corner = mask[..., -1, 0]
        sees_first_key = corner.any() if corner.dtype == torch.bool else (corner > HIDING_MASK_VALUE).any()
        if bool(sees_first_key):
            return None
    cu = torch.cat([starts.to(torch.int32), torch.tensor([n], dtype=torch.int32, device=starts.device)])
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


def hf_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers ``AttentionInterface`` function running flashmod's kernel.

    Args:
        module: the calling attention layer; ``is_causal`` and ``config.output_attentions`` are read from it.
        query: ``(B, Hq, Nq, D)``; key, value: ``(B, Hkv, Nk, D)`` (``Hq`` a multiple of ``Hkv``: GQA/MQA).
        attention_mask: transformers' 4-D mask (bool True = attend, or additive float) broadcastable to
            ``(B, Hq, Nq, Nk)``, or None (see the module docstring for what None means).
        dropout: attention dropout probability (transformers passes 0 outside training).
        scaling: score scale, default ``1 / sqrt(D)``.
        sliding_window: window size counting the token itself (used only when ``attention_mask`` is None: a
            given mask already contains the window).
        softcap: logit soft-capping (``softcap * tanh(score / softcap)``) before the mask; None or 0 = off.
        is_causal: overrides ``module.is_causal`` when given.
        **kwargs: ``output_attentions`` (return the weights), ``position_bias`` (additive bias folded into the
            mask), ``s_aux`` (attention sinks, gpt-oss: one logit per query head that joins each row's softmax);
            other transformers kwargs (``position_ids``, ``use_cache``, ...) are ignored.

    Returns:
        ``(output (B, Nq, Hq, D) contiguous, weights (B, Hq, Nq, Nk) or None)``.

    Raises:
        NotImplementedError: for paged (continuous-batching) caches.
    """
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.shape != (query.shape[1],)):
        raise ValueError(
            f"flashmod ({HF_ATTN_IMPLEMENTATION}): s_aux (attention sinks) must be a tensor of one logit per "
            f"query head, ({query.shape[1]},), got {sinks.shape if isinstance(sinks, Tensor) else type(sinks).__name__}"
        )
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise NotImplementedError(
            f"flashmod ({HF_ATTN_IMPLEMENTATION}): paged caches (continuous batching) are not supported; "
            "use attn_implementation='sdpa' or 'eager' for generate_batch / continuous batching"
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"flashmod ({HF_ATTN_IMPLEMENTATION}): expected 4-D (batch, heads, seqlen, head_dim) query/key/value, "
            f"got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
        )
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = _mask_for(query, attention_mask, seqlen_k)

    if mask is None:
        # transformers' mask builder returned None: the pattern is plain causal (cache empty, so top-left
        # alignment is right even when the keys are a longer static cache) or, for one query, everything.
        causal = bool(is_causal) and seqlen_q > 1
        bottom_right = seqlen_q == 1
        window = _window(sliding_window, bool(is_causal))
    else:
        # The mask already encodes causality, padding and any sliding window (what transformers' sdpa does).
        causal, bottom_right, window = False, True, (-1, -1)

    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        mask = _with_position_bias(mask, position_bias, query)

    cap = float(softcap) if softcap else 0.0
    packed = None
    if position_bias is None and not _attentions_requested(module, kwargs):
        packed = _packed_sequences(query, key, mask, kwargs)
    if packed is not None:
        # Packed sequences: each attends to itself only (block-diagonal, causal and windowed per sequence when
        # the layer is), without the (N x N) mask.
        window = _window(sliding_window, bool(is_causal))
        if not dropout or not (query.device.type == "cuda" and query.dtype == torch.float32):
            # Without computing the blocks off the diagonal.
            hq, hkv, d = query.shape[1], key.shape[1], query.shape[3]
            out, lse = flash_attn_varlen_func(
                query.transpose(1, 2).reshape(-1, hq, d), key.transpose(1, 2).reshape(-1, hkv, d),
                value.transpose(1, 2).reshape(-1, hkv, d), *packed, dropout_p=float(dropout),
                softmax_scale=scaling, causal=bool(is_causal), window_size=window, softcap=cap, return_lse=True,
            )  # fmt: skip
            if sinks is not None:
                out = (out.float() * _sink_factor(lse, sinks, 0).t().unsqueeze(-1)).to(out.dtype)
            return out.reshape(query.shape[0], -1, hq, d), None
        # Dropout on float32 CUDA tensors, which flash_attn_varlen_func takes only without it: each sequence
        # runs the dense op on its own rows.
        out, lse = _each_packed_sequence(
            query, key, value, packed, float(dropout), scaling, bool(is_causal), window, cap
        )
    else:
        out, lse = attention_bhsd(query, key, value, mask, float(dropout), scaling, causal, bottom_right, window, cap)
    factor = None
    if sinks is not None:
        factor = _sink_factor(lse, sinks, 1).unsqueeze(-1)
        out = (out.float() * factor).to(out.dtype)

    weights = None
    if _attentions_requested(module, kwargs):
        weights = attention_weights(query, key, value, mask, scaling, causal, bottom_right, window, cap)
        if factor is not None:
            weights = (weights.float() * factor).to(weights.dtype)
    # The op's output keeps q's memory layout, which for transformers' transposed projections is already
    # (B, S, H, D): this transpose + contiguous is then free.
    return out.transpose(1, 2).contiguous(), weights


def _window(sliding_window: int | None, is_causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` (counting the token itself) as flashmod's ``(left, right)``: causal
    layers keep ``q - k < w``, bidirectional ones ``|q - k| <= w``; None or 0 is no window."""
    if not sliding_window:
        return (-1, -1)
    return (sliding_window - 1, -1) if is_causal else (sliding_window, sliding_window)


def _each_packed_sequence(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    packed: tuple[Tensor, Tensor, int, int],
    dropout: float,
    scaling: float | None,
    is_causal: bool,
    window: tuple[int, int],
    cap: float,
) -> tuple[Tensor, Tensor]:
    """Packed float32 CUDA sequences under attention dropout (which flash_attn_varlen_func runs in float16 /
    bfloat16 only there): ``(out (B, Hq, N, D), lse (B, Hq, N))`` with each sequence of ``packed``
    (:func:`_packed_sequences`' cu_seqlens over the B * N flattened tokens) attending to itself alone, causal
    bottom-right and windowed as in the varlen path, through the dense op on its own rows (one call each, each
    drawing its own dropout words; reading cu_seqlens costs a host sync, as the position_ids detection does)."""
    cu_q, cu_k = (c.tolist() for c in packed[:2])
    batch, hq, n, d = query.shape
    # (1, H, B * N, D): the tokens in the flattened order cu_seqlens counts.
    q, k, v = (t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[3])[None] for t in (query, key, value))
    outs, lses = [], []
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if q1 > q0:
            o, lse = attention_bhsd(
                q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], None, dropout, scaling, is_causal, True, window, cap
            )
            outs.append(o)
            lses.append(lse)
    out = torch.cat(outs, 2).reshape(hq, batch, n, d).transpose(0, 1)
    return out, torch.cat(lses, 2).reshape(hq, batch, n).transpose(0, 1)


def _sink_factor(lse: Tensor, sinks: Tensor, head_dim_of_lse: int) -> Tensor:
    """Attention sinks (gpt-oss's ``s_aux``): one logit per query head that joins every row's softmax and
    brings no value, so each probability of the row shrinks by ``sum / (sum + e^sink)``, i.e. the output by
    ``sigmoid(lse - sink)`` (0 for a row without visible keys, whose lse is -inf). Gradients reach the sinks
    and, through the lse, the scores. ``lse`` fp32 with its heads on dim ``head_dim_of_lse``."""
    shape = [1] * lse.dim()
    shape[head_dim_of_lse] = -1
    return torch.sigmoid(lse - sinks.to(torch.float32).view(shape))


# ----------------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------------

_ATTENTION_MODULE = "transformers.modeling_utils"
_MASK_MODULE = "transformers.masking_utils"
_registered: set[str] = set()
_lock = threading.Lock()


def _register_attention(modeling_utils: ModuleType) -> None:
    modeling_utils.AttentionInterface.register(HF_ATTN_IMPLEMENTATION, hf_attention_forward)
    _registered.add(_ATTENTION_MODULE)


def _register_mask(masking_utils: ModuleType) -> None:
    # sdpa's builder: 4-D bool masks, or None when is_causal (or nothing) expresses the pattern.
    masking_utils.AttentionMaskInterface.register(HF_ATTN_IMPLEMENTATION, masking_utils.sdpa_mask)
    _registered.add(_MASK_MODULE)


_CALLBACKS: dict[str, Callable[[ModuleType], None]] = {
    _ATTENTION_MODULE: _register_attention,
    _MASK_MODULE: _register_mask,
}


def register() -> bool:
    """Register flashmod with transformers now (importing it). Idempotent.

    Returns:
        True if transformers is installed (and flashmod is now registered), False otherwise.
    """
    if importlib.util.find_spec("transformers") is None:
        return False
    for name, callback in _CALLBACKS.items():
        callback(importlib.import_module(name))
    return True


def is_registered() -> bool:
    """Whether both the attention function and the mask builder are registered in transformers."""
    return _registered >= set(_CALLBACKS)


class _CallbackLoader(importlib.abc.Loader):
    """Runs the real loader, then a callback on the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._callback(module)
        except Exception as err:  # noqa: BLE001 (never break importing transformers because of us)
            warnings.warn(
                f"flashmod: could not register with transformers ({type(err).__name__}: {err}); "
                f"call flashmod.hf.register() to see the full error",
                stacklevel=2,
            )

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for linecache/inspect
        return getattr(self._loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Import hook that registers flashmod when transformers' interface modules are first imported."""

    def __init__(self) -> None:
        self._resolving: set[str] = set()

    def find_spec(self, fullname: str, path=None, target=None):
        callback = _CALLBACKS.get(fullname)
        if callback is None or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders' answer (we skip ourselves above)
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, callback)
        return spec


_hook: _RegisterOnImport | None = None


def _install() -> None:
    """Called by ``import flashmod``: register now for modules already imported, later for the others."""
    global _hook
    with _lock:
        for name, callback in _CALLBACKS.items():
            module = sys.modules.get(name)
            if module is not None:
                try:
                    callback(module)
                except Exception as err:  # noqa: BLE001 (a failed registration must not fail import flashmod)
                    warnings.warn(f"flashmod: could not register with transformers: {err}", stacklevel=3)
        if not is_registered() and _hook is None and importlib.util.find_spec("transformers") is not None:
            _hook = _RegisterOnImport()
            sys.meta_path.insert(0, _hook)
