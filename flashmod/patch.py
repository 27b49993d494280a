"""Put flashmod inside existing models: :func:`patch`, :func:`unpatch`, :func:`patched`.

``flashmod.patch(model)`` works on any ``nn.Module`` tree:

* every HuggingFace ``PreTrainedModel`` in it is switched to ``attn_implementation="fmod_attention"``
  (``flashmod.HF_ATTN_IMPLEMENTATION``) with ``set_attn_implementation``;
* every ``torch.nn.MultiheadAttention`` (e.g. inside ``nn.TransformerEncoder``/``Decoder``) is replaced by a
  :class:`FlashMultiheadAttention` that shares its parameters (same objects: an optimizer built before the
  patch keeps working, and training done while patched is kept by :func:`unpatch`) and has its semantics.

PyTorch's fused fast paths of ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` (eval mode, no grad)
read ``self_attn``'s weights and call torch's own kernels, bypassing ``self_attn.forward``. The swapped module
opts out of them, and patching turns off the encoder's nested-tensor path (``use_nested_tensor``), so the
flashmod kernel is what actually runs. One visible difference: torch's nested-tensor path returns 0 at padded
positions, the regular path (and so a patched model) returns whatever the layers compute there.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from .hf import HF_ATTN_IMPLEMENTATION, register
from .modules import FlashMultiheadAttention

__all__ = ["patch", "patched", "unpatch"]


@dataclass
class _PatchState:
    """What :func:`patch` changed, so :func:`unpatch` can put it back."""

    hf_models: list[tuple[nn.Module, Any]] = field(default_factory=list)  # (model, previous attn_implementation)
    mha: list[tuple[nn.Module, str, nn.MultiheadAttention]] = field(default_factory=list)  # (parent, name, original)
    nested: list[tuple[nn.Module, bool]] = field(default_factory=list)  # (TransformerEncoder, use_nested_tensor)


_STATE_ATTR = "_flashmod_patch_state"


def _is_plain_mha(module: nn.Module) -> bool:
    # Subclasses that override forward have their own semantics: leave them alone. So are modules with
    # parametrized weights (weight norm, spectral norm, ...): the weight is computed from the parameter
    # on every access, which a swapped module holding one computed copy would freeze.
    return (
        isinstance(module, nn.MultiheadAttention)
        and type(module).forward is nn.MultiheadAttention.forward
        and not parametrize.is_parametrized(module)
    )


def _hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers PreTrainedModels in ``model`` (set_attn_implementation covers their submodels)."""
    # A model holding PreTrainedModels means transformers was imported: never import it (seconds) just to look.
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return []
    pretrained_class = modeling_utils.PreTrainedModel
    found: list[nn.Module] = []
    skip: set[str] = set()
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, pretrained_class):
            found.append(module)
            skip.add(name)
            if name == "":
                break
    return found


def patch(model: nn.Module, *, hf: bool = True, multihead_attention: bool = True) -> nn.Module:
    """Make ``model`` run its attention on flashmod, in place. Undo with :func:`unpatch`.

    Args:
        model: any ``nn.Module``: a transformers model, a module containing some, an ``nn.TransformerEncoder``...
        hf: switch transformers ``PreTrainedModel``s to ``attn_implementation=flashmod.HF_ATTN_IMPLEMENTATION``.
        multihead_attention: replace ``nn.MultiheadAttention`` modules by :class:`FlashMultiheadAttention`.

    Returns:
        ``model`` (the same object) -- except when ``model`` itself is an ``nn.MultiheadAttention``, which cannot
        be replaced in place: then the new :class:`FlashMultiheadAttention` is returned.

    Raises:
        RuntimeError: if ``model`` is already patched, or a transformers model refuses the implementation.
    """
    if multihead_attention and _is_plain_mha(model):
        return FlashMultiheadAttention.from_torch(model)
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("flashmod.patch: this model is already patched (call flashmod.unpatch first)")
    state = _PatchState()
    try:
        if hf:
            hf_models = _hf_models(model)
            if hf_models:
                register()
            for hf_model in hf_models:
                previous = hf_model.get_attn_implementation() if hasattr(hf_model, "get_attn_implementation") else None
                if previous is None:
                    previous = hf_model.config._attn_implementation
                hf_model.set_attn_implementation(HF_ATTN_IMPLEMENTATION)
                state.hf_models.append((hf_model, previous))
                if hf_model.config._attn_implementation != HF_ATTN_IMPLEMENTATION:
                    raise RuntimeError(
                        f"flashmod.patch: {type(hf_model).__name__} did not accept "
                        f"attn_implementation={HF_ATTN_IMPLEMENTATION!r} (it does not use transformers' "
                        "AttentionInterface); it keeps its own attention"
                    )
        if multihead_attention:
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if _is_plain_mha(child):
                        setattr(parent, name, FlashMultiheadAttention.from_torch(child))
                        state.mha.append((parent, name, child))
                if isinstance(parent, nn.TransformerEncoder) and getattr(parent, "use_nested_tensor", False):
                    state.nested.append((parent, parent.use_nested_tensor))
                    parent.use_nested_tensor = False
    except BaseException:
        _undo(state)
        raise
    if not state.hf_models and not state.mha:
        warnings.warn("flashmod.patch: found no transformers model and no nn.MultiheadAttention to patch", stacklevel=2)
    object.__setattr__(model, _STATE_ATTR, state)
    return model


def _undo(state: _PatchState) -> None:
    for encoder, flag in reversed(state.nested):
        encoder.use_nested_tensor = flag
    for parent, name, original in reversed(state.mha):
        current = getattr(parent, name)
        if isinstance(current, FlashMultiheadAttention):
            current._give_back(original)
        setattr(parent, name, original)
    for hf_model, previous in reversed(state.hf_models):
        hf_model.set_attn_implementation(previous)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: previous attention implementations and the original ``nn.MultiheadAttention`` modules
    (which share their parameters with the replacements, so training done while patched is kept).

    Raises:
        RuntimeError: if ``model`` was not patched by :func:`patch`.
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("flashmod.unpatch: this model was not patched by flashmod.patch")
    _undo(state)
    object.__delattr__(model, _STATE_ATTR)
    return model


@contextlib.contextmanager
def patched(model: nn.Module, **kwargs: bool) -> Iterator[nn.Module]:
    """``with flashmod.patched(model) as m: ...``: :func:`patch` on entry, :func:`unpatch` on exit.

    Yields what :func:`patch` returns (``model`` itself, unless it is an ``nn.MultiheadAttention``).
    """
    result = patch(model, **kwargs)
    try:
        yield result
    finally:
        if result is model:
            unpatch(model)
