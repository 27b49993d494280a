"""Experiment: the three ways the CUDA backward can produce dQ (FLASHMOD_BWD_DQ = 0 a pass of its
own, 1 ordered in-kernel accumulation, 2 unordered atomics), against SDPA FLASH and CUDNN, fwd+bwd,
same process, interleaved rounds. Checks the three agree first (1 and 0 exactly up to rounding of
the summation order; 2 within the low-precision rule is not checked here: see the tests)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import torch  # noqa: E402
from harness import device_name, median_times, with_env  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashmod  # noqa: E402


def main() -> None:
    print(device_name("cuda"))
    shapes = [(16, 32, 1024, 64), (4, 32, 4096, 64), (16, 16, 1024, 128), (4, 16, 4096, 128), (2, 16, 8192, 128)]
    print("shape causal | TFLOP/s: pass ordered atomic FLASH CUDNN | ordered/FLASH pass/FLASH")
    for b, h, n, d in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)

            def flashmod_step():
                out = flashmod.attention(q, k, v, is_causal=causal)
                return torch.autograd.grad(out, (q, k, v), grad)

            def sdpa_step(backend):
                def step():
                    with sdpa_kernel(backend):
                        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return torch.autograd.grad(out, (q, k, v), grad)

                return step

            fns = {
                "pass": with_env("FLASHMOD_BWD_DQ=0", flashmod_step),
                "ordered": with_env("FLASHMOD_BWD_DQ=1", flashmod_step),
                "atomic": with_env("FLASHMOD_BWD_DQ=2", flashmod_step),
                "FLASH": sdpa_step(SDPBackend.FLASH_ATTENTION),
                "CUDNN": sdpa_step(SDPBackend.CUDNN_ATTENTION),
            }
            ref = fns["pass"]()
            for name in ("ordered", "atomic"):
                got = fns[name]()
                err = max((a.float() - r.float()).abs().max().item() for a, r in zip(got, ref))
                assert err < 0.05, f"{name}: max diff {err} from the dQ pass"
            t = median_times(fns, "cuda", warmup=3, reps=15)
            flops = 3.5 * 4 * b * h * n * n * d / (2 if causal else 1)
            tf = {name: flops / s / 1e12 for name, s in t.items()}
            print(
                f"b{b} h{h} n{n} d{d} {'causal' if causal else '      '} | "
                + " ".join(f"{tf[x]:6.1f}" for x in fns)
                + f" | {t['FLASH'] / t['ordered']:.2f} {t['FLASH'] / t['pass']:.2f}"
            )


if __name__ == "__main__":
    main()
