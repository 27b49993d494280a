"""The ``nn.Module`` front doors.

* :class:`FlashAttention`: the attention core of a transformer block (no weights of its own);
* :class:`FlashMultiheadAttention`: a drop-in ``torch.nn.MultiheadAttention`` running on flashmod
  (what :func:`flashmod.patch` swaps in).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_tensor_types, unbounded_past
from .functional import attention_bhsd, attention_weights, check_bshd, check_dropout, check_window
from .reference import attention_reference

__all__ = ["FlashAttention", "FlashMultiheadAttention"]


class FlashAttention(nn.Module):
    """Scaled dot-product attention over already-projected q, k, v (no weights of its own).

    Args:
        causal: apply a causal mask. Its alignment follows ``layout``'s convention: top-left for
            ``"bhsd"`` (SDPA), bottom-right for ``"bshd"`` (flash-attn; right for KV-cache decode).
        softmax_scale: default ``1 / sqrt(head_dim)``.
        dropout: attention dropout, applied only in training mode (as :func:`flashmod.attention`'s).
        window_size: ``(left, right)`` sliding window, -1 = unbounded; with ``"bshd"`` a side that
            reaches over all keys is unbounded too (flash-attn's rule, as ``flash_attn_func``).
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)``.
        layout: ``"bshd"`` for ``(batch, seq, heads, head_dim)`` inputs and output (flash-attn's),
            ``"bhsd"`` for ``(batch, heads, seq, head_dim)`` (SDPA's).

    Forward:
        ``forward(q, k, v, attn_mask=None, key_padding_mask=None)`` with q ``(B, Nq, Hq, D)`` and
        k, v ``(B, Nk, Hkv, D)`` (or the ``bhsd`` transposes); ``Hq % Hkv == 0`` (GQA/MQA).
        ``attn_mask``: bool (True = attend) or additive, broadcastable to ``(B, Hq, Nq, Nk)``.
        ``key_padding_mask``: bool ``(B, Nk)``, True = a real token (attend), False = padding.
        Returns the output in q's layout and dtype; rows with no visible key are 0.
    """

    def __init__(
        self,
        causal: bool = False,
        softmax_scale: float | None = None,
        dropout: float = 0.0,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        layout: Literal["bshd", "bhsd"] = "bshd",
    ) -> None:
        super().__init__()
        if layout not in ("bshd", "bhsd"):
            raise ValueError(f"FlashAttention: layout must be 'bshd' or 'bhsd', got {layout!r}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.dropout = check_dropout("FlashAttention", "dropout", dropout)
        self.window_size = check_window("FlashAttention", window_size)
        self.softcap = softcap
        self.layout = layout

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        op = "FlashAttention"
        check_tensor_types(
            op, ("attn_mask", "key_padding_mask"), q=q, k=k, v=v, attn_mask=attn_mask, key_padding_mask=key_padding_mask
        )
        if self.layout == "bshd":
            check_bshd(op, q, k, v)  # before the transpose: errors in the caller's layout
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if key_padding_mask is not None:
            want = [q.shape[0], k.shape[2]] if q.dim() == 4 and k.dim() == 4 else None
            if want is not None and (key_padding_mask.dtype != torch.bool or list(key_padding_mask.shape) != want):
                raise ValueError(
                    f"{op}: key_padding_mask must be a bool (batch, seqlen_k) = {want} tensor (True = a real "
                    f"token), got {key_padding_mask.dtype} of shape {list(key_padding_mask.shape)}"
                )
            padding = key_padding_mask[:, None, None, :]
            if attn_mask is None:
                attn_mask = padding
            elif attn_mask.dtype == torch.bool:
                attn_mask = attn_mask & padding
            else:
                attn_mask = attn_mask.masked_fill(~padding, float("-inf"))
        out, _ = attention_bhsd(
            q,
            k,
            v,
            attn_mask,
            self.dropout if self.training else 0.0,
            self.softmax_scale,
            self.causal,
            self.layout == "bshd",
            # bshd is flash-attn's convention, its window rule included (as flash_attn_func).
            unbounded_past(self.window_size, k.shape[2]) if self.layout == "bshd" else self.window_size,
            self.softcap,
        )
        return out.transpose(1, 2) if self.layout == "bshd" else out

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, softmax_scale={self.softmax_scale}, dropout={self.dropout}, "
            f"window_size={self.window_size}, softcap={self.softcap}, layout={self.layout!r}"
        )


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
          then applies causality itself and skips the mask (not with ``add_bias_kv`` / ``add_zero_attn``,
          whose appended key the padded mask shows to every query);
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
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                # An integer mask would otherwise be added to the scores (1 = pad would add +1).
                raise TypeError(
                    f"FlashMultiheadAttention: {name} must be bool (True = masked out) or floating point "
                    f"(added to the scores), as in nn.MultiheadAttention; got {m.dtype}"
                )
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
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "FlashMultiheadAttention: query, key and value must all be batched (3-D) or all unbatched (2-D), "
                f"got {query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
            )
        for name, t, want in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != want:
                raise ValueError(
                    f"FlashMultiheadAttention: {name} must have {want} features (embed_dim / kdim / vdim), "
                    f"got {t.shape[-1]}"
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
        if key_padding_mask is not None and key_padding_mask.shape[-1] != key.shape[1]:
            raise ValueError(
                f"FlashMultiheadAttention: key_padding_mask must be (batch, S) with S = {key.shape[1]} keys, "
                f"got {list(key_padding_mask.shape)}"
            )
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

        # is_causal promises attn_mask is the causal mask: the kernel applies it (and skips work) instead,
        # unless a key was appended (add_bias_kv, add_zero_attn): the padded mask shows it to every query,
        # which the kernel's diagonal would hide from all but the last.
        is_causal = is_causal and self.bias_k is None and not self.add_zero_attn
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
                weights = attention_weights(q, k, v, mask, None, is_causal, False, (-1, -1), 0.0)

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
