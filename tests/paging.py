"""Packed keys and values as page pools with a block table: the layout of flash_attn_varlen_func's
block_table (tests/attention/test_serve.py and tools/fuzz_serving.py build theirs here)."""

from __future__ import annotations

import torch


def packed_into_pages(
    k: torch.Tensor, v: torch.Tensor, lengths: list[int], page_size: int, spare: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed k and v (total, H, D), sequence b owning ``lengths[b]`` rows in order, as shuffled pools
    of pages (``spare`` pages of noise nobody owns; a last page's rows past its sequence are noise too)
    and a block table (int32 ``(batch, max_pages)``) holding -1 past each sequence's pages, which the
    op must never read: ``(k_pool, v_pool, block_table)``."""
    pages = [-(-n // page_size) for n in lengths]
    owned = sum(pages)
    perm = torch.randperm(owned + spare, device=k.device)[:owned].tolist()
    pools = [torch.randn(owned + spare, page_size, *t.shape[1:], dtype=t.dtype, device=t.device) for t in (k, v)]
    table = torch.full((len(lengths), max(max(pages), 1)), -1, dtype=torch.int32, device=k.device)
    start, used = 0, 0
    for b, (n, count) in enumerate(zip(lengths, pages)):
        for j in range(count):
            rows = slice(start + j * page_size, start + min(n, (j + 1) * page_size))
            for pool, t in zip(pools, (k, v)):
                pool[perm[used], : rows.stop - rows.start] = t[rows]
            table[b, j] = perm[used]
            used += 1
        start += n
    return pools[0], pools[1], table
