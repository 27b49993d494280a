"""CPU emulation of the fused fp32 matmul_softmax's 3xTF32 products (csrc/softmax/cuda/matmul_softmax.cu).

    python tools/check_3xtf32.py

Each fp32 operand is split as hi = tf32(x), lo = tf32(x - hi) (round to nearest, ties away, as
cvt.rna.tf32.f32); per k-step of 8 the kernel runs acc += a_lo.b_hi, acc += a_hi.b_lo,
acc += a_hi.b_hi (three m16n8k8 mma). Emulated here with each mma's 8 products summed exactly and
rounded once into the fp32 accumulator (the tensor core's internal adds may round differently).
Prints the max error against fp64 of the logits and of the softmax, for 3xTF32, plain fp32 (what
torch computes) and 1xTF32, at |a|, |b| ~ N(0, 1) and scale 1 / sqrt(K).
"""

from __future__ import annotations

import math

import torch


def tf32_rna(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> tf32 (10 mantissa bits), ties away from zero; finite inputs only."""
    return ((x.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)


def matmul_3xtf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T the way the kernel computes it."""
    ah, bh = tf32_rna(a), tf32_rna(b)
    al, bl = tf32_rna(a - ah), tf32_rna(b - bh)
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for k0 in range(0, a.shape[1], 8):
        k = slice(k0, k0 + 8)
        for x, y in ((al, bh), (ah, bl), (ah, bh)):
            acc = (acc.double() + x[:, k].double() @ y[:, k].double().T).float()
    return acc


def main() -> None:
    torch.manual_seed(0)
    for depth in (32, 64, 128, 256):
        a, b = torch.randn(256, depth), torch.randn(256, depth)
        scale = 1 / math.sqrt(depth)
        truth = (a.double() @ b.double().T) * scale
        probs = torch.softmax(truth, -1)
        variants = {
            "3xtf32": matmul_3xtf32(a, b) * scale,
            "fp32": (a @ b.T) * scale,
            "1xtf32": (tf32_rna(a).double() @ tf32_rna(b).double().T).float() * scale,
        }
        row = [f"K={depth:3d}"]
        for name, logits in variants.items():
            err = (logits.double() - truth).abs().max().item()
            perr = (torch.softmax(logits, -1).double() - probs).abs().max().item()
            row.append(f"{name}: logits {err:.2e} softmax {perr:.2e}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
