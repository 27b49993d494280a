"""torch.compile(fullgraph=True) over the public entry points, forward and backward, against eager.
(HF models under compile and torch.export: test_hf.py; a patched nn.TransformerEncoder: test_patch.py.)"""

from __future__ import annotations

import pytest
import torch

import flashmod


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_forward_and_backward_fullgraph(device, dynamic):
    torch._dynamo.reset()

    def step(q, k, v, mask):
        a = flashmod.attention(q, k, v, attn_mask=mask, is_causal=True)
        b = flashmod.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softcap=5.0)
        return a.square().sum() + b.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for nq, nk in ((9, 11), (17, 23)):  # a second shape exercises the dynamic graph
        q, k, v = (torch.randn(2, h, n, 16, device=device, requires_grad=True) for h, n in ((4, nq), (2, nk), (2, nk)))
        mask = torch.rand(2, 1, nq, nk, device=device) > 0.2
        loss = compiled(q, k, v, mask)
        grads = torch.autograd.grad(loss, (q, k, v))
        ref_loss = step(q, k, v, mask)
        ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
        torch.testing.assert_close(loss, ref_loss)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b)


def test_compile_module(device):
    torch._dynamo.reset()
    module = flashmod.FlashAttention(causal=True, window_size=(5, 0))
    q = torch.randn(2, 13, 4, 32, device=device, requires_grad=True)
    compiled = torch.compile(module, fullgraph=True)
    out = compiled(q, q, q)
    torch.testing.assert_close(out, module(q, q, q))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
