"""``FlashAttention``: the attention core of a transformer block as an ``nn.Module``."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from .functional import attention_bhsd


class FlashAttention(nn.Module):
    """Scaled dot-product attention over already-projected q, k, v (no weights of its own).

    Args:
        causal: apply a causal mask. Its alignment follows ``layout``'s convention: top-left for
            ``"bhsd"`` (SDPA), bottom-right for ``"bshd"`` (flash-attn; right for KV-cache decode).
        softmax_scale: default ``1 / sqrt(head_dim)``.
        dropout: attention dropout, applied only in training mode (reference fallback).
        window_size: ``(left, right)`` sliding window, -1 = unbounded.
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
        self.dropout = dropout
        self.window_size = tuple(window_size)
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
        if self.layout == "bshd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
                raise ValueError(
                    "FlashAttention: key_padding_mask must be a bool (batch, seqlen_k) tensor, "
                    f"got {key_padding_mask.dtype} of shape {list(key_padding_mask.shape)}"
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
            self.window_size,
            self.softcap,
        )
        return out.transpose(1, 2) if self.layout == "bshd" else out

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, softmax_scale={self.softmax_scale}, dropout={self.dropout}, "
            f"window_size={self.window_size}, softcap={self.softcap}, layout={self.layout!r}"
        )
