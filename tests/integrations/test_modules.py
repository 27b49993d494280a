"""flashmod.FlashAttention, the attention-core module, in both layouts and with padding, against the
reference and SDPA. (FlashMultiheadAttention is tested against nn.MultiheadAttention in test_patch.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashmod
from flashmod.reference import attention_reference


def test_module_both_layouts_and_padding(device):
    b, n, h, d = 2, 21, 4, 32
    q, k, v = (torch.randn(b, n, h, d, device=device) for _ in range(3))
    keep = torch.ones(b, n, dtype=torch.bool, device=device)
    keep[0, -5:] = False
    module = flashmod.FlashAttention(causal=True)
    out = module(q, k, v, key_padding_mask=keep)
    ref = attention_reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), keep[:, None, None, :], is_causal=True
    )[0].transpose(1, 2)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)
    bhsd = flashmod.FlashAttention(causal=True, layout="bhsd")
    torch.testing.assert_close(
        bhsd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="layout must be 'bshd' or 'bhsd', got 'sbhd'"):
        flashmod.FlashAttention(layout="sbhd")
    with pytest.raises(ValueError, match="key_padding_mask must be a bool"):
        module(q, k, v, key_padding_mask=keep.float())
