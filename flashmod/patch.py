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
import math
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .functional import attention_bhsd
from .hf import HF_ATTN_IMPLEMENTATION, _attention_weights, register
from .reference import attention_reference

__all__ = ["FlashMultiheadAttention", "patch", "patched", "unpatch"]

_MHA_PARAMETERS = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
)


class FlashMultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` running on flashmod: same constructor, parameters, state_dict and forward.

    Build one like ``nn.MultiheadAttention(embed_dim, num_heads, ...)`` or from an existing module with
    :meth:`from_torch` (which shares, not copies, the parameters).

    Forward (torch's contract):
        ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
        average_attn_weights=True, is_causal=False) -> (output, weights or None)``

        * query ``(B, L, E)`` if ``batch_first`` else ``(L, B, E)``, or unbatched ``(L, E)``; key/value alike
          with ``S`` keys and ``kdim``/``vdim`` features;
        * ``key_padding_mask`` ``(B, S)``: bool **True = padding (ignored)**, or additive float;
        * ``attn_mask`` ``(L, S)`` or ``(B * num_heads, L, S)``: bool **True = not allowed**, or additive float;
        * ``is_causal``: hint that ``attn_mask`` is the causal mask (required with it, as in torch); the kernel
          then applies causality itself and skips the mask;
        * ``need_weights``: also return the attention probabilities, averaged over heads if
          ``average_attn_weights`` (``(B, L, S)``, else ``(B, num_heads, L, S)``);
        * ``dropout`` on the probabilities in training mode.

        Differences: queries with no visible key give 0 (torch gives NaN); nested-tensor inputs are not
        supported.
    """

    # nn.TransformerEncoder(Layer) read this to decide whether to take their fused fast paths, which would run
    # torch's kernels on our weights and bypass forward(). False is the documented way to make them skip it;
    # this module keeps the real layout in `_packed_in_proj`.
    _qkv_same_embed_dim = False

    in_proj_weight: nn.Parameter | None
    q_proj_weight: nn.Parameter | None
    k_proj_weight: nn.Parameter | None
    v_proj_weight: nn.Parameter | None
    in_proj_bias: nn.Parameter | None
    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # torch's constructor does the validation and the parameter initialization; we adopt the result.
        source = nn.MultiheadAttention(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype
        )
        self._adopt(source)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> FlashMultiheadAttention:
        """A module sharing ``mha``'s parameters (the same ``nn.Parameter`` objects) and settings."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"FlashMultiheadAttention.from_torch expects nn.MultiheadAttention, got {type(mha)}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._adopt(mha)
        module.train(mha.training)
        return module

    def _adopt(self, mha: nn.MultiheadAttention) -> None:
        self.embed_dim = mha.embed_dim
        self.kdim = mha.kdim
        self.vdim = mha.vdim
        self.num_heads = mha.num_heads
        self.head_dim = mha.head_dim
        self.dropout = mha.dropout
        self.batch_first = mha.batch_first
        self.add_zero_attn = mha.add_zero_attn
        self._packed_in_proj = mha._qkv_same_embed_dim
        for name in _MHA_PARAMETERS:
            param = getattr(mha, name)
            if param is None:
                self.register_parameter(name, None)
            else:
                setattr(self, name, param)
        self.out_proj = mha.out_proj

    def _give_back(self, mha: nn.MultiheadAttention) -> None:
        """Point ``mha`` at this module's parameters (in case ``.to()`` etc. replaced them while patched)."""
        for name in _MHA_PARAMETERS:
            param = getattr(self, name)
            if param is not None:
                setattr(mha, name, param)
        mha.out_proj = self.out_proj
        mha.train(self.training)

    def _projections(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.split(e)
        if self._packed_in_proj:
            if query is key and key is value:  # self-attention: one GEMM for q, k and v
                return F.linear(query, self.in_proj_weight, self.in_proj_bias).split(e, dim=-1)
            w_q, w_k, w_v = self.in_proj_weight.split(e)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _combined_mask(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        batch: int,
        seqlen_q: int,
        dtype: torch.dtype,
    ) -> Tensor | None:
        """torch's masks (True = masked out) as one flashmod mask (True = attend, or additive), (B, H|1, L, S)."""
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                attn_mask = attn_mask[None, None]
            elif attn_mask.dim() == 3:
                if attn_mask.shape[0] != batch * self.num_heads:
                    raise ValueError(
                        f"FlashMultiheadAttention: 3-D attn_mask must be (batch * num_heads, L, S) = "
                        f"({batch * self.num_heads}, ...), got {list(attn_mask.shape)}"
                    )
                attn_mask = attn_mask.view(batch, self.num_heads, *attn_mask.shape[1:])
            else:
                raise ValueError(f"FlashMultiheadAttention: attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
            masks.append(attn_mask)
        if key_padding_mask is not None:
            if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch:
                raise ValueError(
                    f"FlashMultiheadAttention: key_padding_mask must be (batch, S) with batch {batch}, "
                    f"got {list(key_padding_mask.shape)}"
                )
            masks.append(key_padding_mask[:, None, None, :])
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            allowed = ~masks[0]
            for m in masks[1:]:
                allowed = allowed & ~m
            return allowed
        # At least one additive mask: add them all up, bools as -inf (torch's _canonical_mask does the same).
        mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        total = None
        for m in masks:
            m = torch.zeros_like(m, dtype=mask_dtype).masked_fill(m, -math.inf) if m.dtype == torch.bool else m
            m = m.to(mask_dtype)
            total = m if total is None else total + m
        return total

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """See the class docstring (identical to ``nn.MultiheadAttention.forward``)."""
        if query.is_nested or key.is_nested or value.is_nested:
            raise NotImplementedError("FlashMultiheadAttention: nested-tensor inputs are not supported")
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "FlashMultiheadAttention: need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)"
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif query.dim() != 3:
            raise ValueError(f"FlashMultiheadAttention: query must be 2-D or 3-D, got shape {list(query.shape)}")
        elif not self.batch_first:
            # (L, B, E) -> (B, L, E); keep q/k/v identity so self-attention still takes the fused projection.
            same_kv = key is value
            same_qk = query is key
            query = query.transpose(0, 1)
            key = query if same_qk else key.transpose(0, 1)
            value = key if same_kv else value.transpose(0, 1)

        batch, seqlen_q, _ = query.shape
        q, k, v = self._projections(query, key, value)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(batch, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(batch, 1, -1)], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        # (B, N, E) -> (B, H, N, D) as a view: the op takes strided heads without a copy.
        q, k, v = (x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) for x in (q, k, v))
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch, self.num_heads, 1, self.head_dim)], dim=2)
            v = torch.cat([v, v.new_zeros(batch, self.num_heads, 1, self.head_dim)], dim=2)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None

        # is_causal promises attn_mask is the causal mask: the kernel applies it (and skips work) instead.
        mask = self._combined_mask(None if is_causal else attn_mask, key_padding_mask, batch, seqlen_q, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights and dropout > 0.0:
            # The returned weights must be the dropped-out probabilities the output was computed with.
            out, _, weights = attention_reference(
                q, k, v, mask, None, is_causal, False, -1, -1, 0.0, dropout, None, True
            )
            out, weights = out.to(q.dtype), weights.to(q.dtype)
        else:
            out, _ = attention_bhsd(q, k, v, mask, dropout, None, is_causal, False, (-1, -1), 0.0)
            if need_weights:
                weights = _attention_weights(q, k, v, mask, None, is_causal, False, (-1, -1), 0.0)

        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}, kdim={self.kdim}, vdim={self.vdim}, "
            f"add_bias_kv={self.bias_k is not None}, add_zero_attn={self.add_zero_attn}"
        )


# ----------------------------------------------------------------------------------------------------------
# patch / unpatch
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _PatchState:
    """What :func:`patch` changed, so :func:`unpatch` can put it back."""

    hf_models: list[tuple[nn.Module, Any]] = field(default_factory=list)  # (model, previous attn_implementation)
    mha: list[tuple[nn.Module, str, nn.MultiheadAttention]] = field(default_factory=list)  # (parent, name, original)
    nested: list[tuple[nn.Module, bool]] = field(default_factory=list)  # (TransformerEncoder, use_nested_tensor)


_STATE_ATTR = "_flashmod_patch_state"


def _is_plain_mha(module: nn.Module) -> bool:
    # Subclasses that override forward have their own semantics: leave them alone.
    return isinstance(module, nn.MultiheadAttention) and type(module).forward is nn.MultiheadAttention.forward


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
