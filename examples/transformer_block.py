"""A hand-written pre-norm transformer decoder block with ``flashmod.FlashAttention`` as its attention core.

    python examples/transformer_block.py [--device cuda|cpu]

Shows the module's contract in a real block: (batch, seq, heads, head_dim) inputs ("bshd", flash-attn's
layout), GQA without repeating K/V, causal masking aligned bottom-right so the same module serves the prompt
(prefill) and one-token decoding against a KV cache, a key padding mask, and a training step. The block is
checked against the same block computed with ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import flashmod


def default_device() -> str:
    """CUDA when there is a GPU and flashmod was built with its CUDA kernel, else CPU."""
    has_cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("flashmod::attention", "CUDA")
    return "cuda" if torch.cuda.is_available() and has_cuda_kernel else "cpu"


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: x + Attn(LN(x)), then x + MLP(LN(x)). GQA with ``heads // kv_heads`` groups."""

    def __init__(self, dim: int, heads: int, kv_heads: int, window: int = -1, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        # The attention core: no weights. causal + "bshd" = bottom-right alignment, right for KV-cache decoding.
        self.attn = flashmod.FlashAttention(causal=True, dropout=dropout, window_size=(window, -1), layout="bshd")

    def forward(
        self, x: Tensor, cache: tuple[Tensor, Tensor] | None = None, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x: (B, S, dim); cache: (k, v) of earlier tokens, each (B, S_past, kv_heads, head_dim);
        key_padding_mask: (B, S_past + S) bool, True = real token. Returns (output, updated cache)."""
        batch, seqlen, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(batch, seqlen, self.heads, self.head_dim)
        k, v = self.kv(h).view(batch, seqlen, 2, self.kv_heads, self.head_dim).unbind(2)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
        a = self.attn(q, k, v, key_padding_mask=key_padding_mask)  # (B, S, heads, head_dim)
        x = x + self.out(a.flatten(2))
        x = x + self.mlp(self.norm2(x))
        return x, (k, v)


def sdpa_block(block: DecoderBlock, x: Tensor, cache=None, key_padding_mask=None) -> Tensor:
    """The same block with torch's SDPA (explicit bottom-right causal mask, K/V repeated for GQA)."""
    batch, seqlen, _ = x.shape
    h = block.norm1(x)
    q = block.q(h).view(batch, seqlen, block.heads, block.head_dim).transpose(1, 2)
    k, v = block.kv(h).view(batch, seqlen, 2, block.kv_heads, block.head_dim).unbind(2)
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
    groups = block.heads // block.kv_heads
    k, v = (t.transpose(1, 2).repeat_interleave(groups, dim=1) for t in (k, v))
    seqlen_k = k.shape[2]
    mask = torch.ones(seqlen, seqlen_k, dtype=torch.bool, device=x.device).tril(seqlen_k - seqlen)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = x + block.out(a.transpose(1, 2).flatten(2))
    return x + block.mlp(block.norm2(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=default_device())
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    block = DecoderBlock(dim=128, heads=8, kv_heads=2).to(device)
    print(block)

    # Prefill a right-padded batch, then decode 4 tokens one at a time against the cache.
    x = torch.randn(2, 16, 128, device=device)
    padding = torch.ones(2, 16, dtype=torch.bool, device=device)
    padding[1, 12:] = False  # second sequence has 12 real tokens
    with torch.no_grad():
        y, cache = block(x, key_padding_mask=padding)
        ref = sdpa_block(block, x, key_padding_mask=padding)
        print(f"prefill   max |flashmod - sdpa| = {(y - ref)[padding].abs().max().item():.2e}")
        for step in range(4):
            t = torch.randn(2, 1, 128, device=device)
            padding = torch.cat([padding, torch.ones(2, 1, dtype=torch.bool, device=device)], dim=1)
            y, new_cache = block(t, cache=cache, key_padding_mask=padding)
            ref = sdpa_block(block, t, cache=cache, key_padding_mask=padding)
            cache = new_cache
            print(
                f"decode {step} max |flashmod - sdpa| = {(y - ref).abs().max().item():.2e}  (cache {cache[0].shape[1]})"
            )

    # A training step: gradients flow through flashmod's backward.
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
    x = torch.randn(4, 32, 128, device=device)
    target = torch.randn_like(x)
    for step in range(3):
        optimizer.zero_grad()
        loss = F.mse_loss(block(x)[0], target)
        loss.backward()
        optimizer.step()
        print(f"train step {step}: loss {loss.item():.4f}")
    block.zero_grad()
    F.mse_loss(block(x)[0], target).backward()
    ours = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    F.mse_loss(sdpa_block(block, x), target).backward()
    diff = max((a - p.grad).abs().max().item() for a, p in zip(ours, block.parameters()))
    print(f"gradients max |flashmod - sdpa| = {diff:.2e}")


if __name__ == "__main__":
    main()
