"""Host time per call on tiny tensors, where launching is all the work (decode steps, small layers).

    python tools/host_overhead.py [--device cuda]

Each contender runs back to back many times with one synchronize at the end
(benchmarks/harness.py, host_seconds_per_call). Prints
flashmod's ops next to torch's, with and without an input that needs a gradient (flashmod skips its
Python autograd layer when none does: flashmod/ops.py, no_grad_needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from harness import host_seconds_per_call  # noqa: E402

import flashmod  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda if present)",
    )
    device = parser.parse_args().device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 32, 1, 128, device=device, dtype=dtype)  # one decode step of one layer
    k = torch.randn(1, 8, 256, 128, device=device, dtype=dtype)
    x = torch.randn(8, 64, device=device, dtype=dtype)
    qg = q.clone().requires_grad_()
    cases = {
        "torch.softmax": lambda: torch.softmax(x, -1),
        "flashmod.softmax": lambda: flashmod.softmax(x, -1),
        "flashmod.softmax (raw op)": lambda: torch.ops.flashmod.softmax(x, -1),
        "SDPA (GQA decode)": lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True),
        "flashmod.attention_op (GQA decode)": lambda: flashmod.attention_op(q, k, k),
        "flashmod.attention_op, q needs grad": lambda: flashmod.attention_op(qg, k, k),
        "torch.ops.flashmod.attention (raw op)": lambda: torch.ops.flashmod.attention(q, k, k),
    }
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"host time per call, {name}, torch {torch.__version__}")
    for label, fn in cases.items():
        print(f"  {label:40} {host_seconds_per_call(fn, device) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
