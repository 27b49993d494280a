"""fp32 attention accuracy, kernel by kernel (a debugging aid, not a test).

    python tools/check_fp32.py

For a few shapes: the 3xTF32 tensor-core kernel (default for head dims <= 128 and > 32 query
rows) and the CUDA-core kernel (FLASHMOD_FP32_FFMA=1), each against an fp64 reference, beside plain
fp32 attention: max |error| and relative (Frobenius) error of the output, max |error| of lse.
The contract: relative error <= 1e-5, and within tests/tolerance.py's rule (2x plain + slack).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashmod.ops import attention_op  # noqa: E402
from flashmod.reference import attention_reference  # noqa: E402


def errors(out, lse, ref, ref_lse):
    finite = torch.isfinite(ref_lse)
    return (
        (out.double() - ref).abs().max().item(),
        ((out.double() - ref).norm() / ref.norm()).item(),
        (lse.double() - ref_lse)[finite].abs().max().item(),
    )


def main() -> None:
    torch.manual_seed(0)
    print(f"{'shape':44} {'kernel':6} {'max|dO|':>9} {'rel O':>9} {'max|dlse|':>9}")
    for b, h, nq, nk, d, opts in [
        (2, 4, 1023, 1023, 64, {}),
        (2, 4, 1023, 1023, 128, {}),
        (2, 4, 129, 300, 64, {}),
        (1, 4, 4096, 4096, 128, {"is_causal": True}),
    ]:
        q, k, v = (torch.randn(b, h, n, d, device="cuda") for n in (nq, nk, nk))
        ref, ref_lse = attention_reference(q, k, v, compute_dtype=torch.float64, **opts)
        plain, plain_lse = attention_reference(q, k, v, compute_dtype=torch.float32, **opts)
        name = f"{b}x{h} nq={nq} nk={nk} d={d} {opts}"
        rows = {"plain": (plain, plain_lse.float())}
        for kernel, ffma in (("tc", "0"), ("ffma", "1")):
            os.environ["FLASHMOD_FP32_FFMA"] = ffma
            rows[kernel] = attention_op(q, k, v, None, **opts)
        os.environ.pop("FLASHMOD_FP32_FFMA")
        for kernel, (out, lse) in rows.items():
            print(f"{name:44} {kernel:6} " + " ".join(f"{e:9.2e}" for e in errors(out, lse, ref, ref_lse)))


if __name__ == "__main__":
    main()
