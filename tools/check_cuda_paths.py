"""Quick side-by-side check of flashmod's CUDA kernels on one GPU (a debugging aid, not a test).

    python tools/check_cuda_paths.py

For a grid of shapes it runs the default kernel (wgmma on sm_90) and the portable mma.sync one
(FLASHMOD_DISABLE_SM90=1) and prints each one's max error against an fp64 reference next to the
error of plain attention in the same dtype; where an output is far off it also prints which
query rows and head-dim columns are wrong, which points at a fragment-layout or descriptor bug.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashmod.ops import attention_op  # noqa: E402
from flashmod.reference import attention_reference  # noqa: E402


def run(q, k, v, portable, **opts):
    if portable:
        os.environ["FLASHMOD_DISABLE_SM90"] = "1"
    try:
        return attention_op(q, k, v, None, **opts)
    finally:
        os.environ.pop("FLASHMOD_DISABLE_SM90", None)


def main() -> int:
    torch.manual_seed(0)
    bad = 0
    shapes = [
        (1, 1, 64, 64, 64, {}),
        (1, 1, 128, 128, 128, {}),
        (2, 4, 203, 113, 64, {}),
        (2, 4, 1023, 1023, 128, {"is_causal": True}),
        (2, 4, 1024, 4096, 128, {}),
        (1, 2, 17, 300, 59, {"softcap": 5.0}),
        (2, 4, 777, 1023, 111, {"window_left": 100, "window_right": 30}),
        (2, 2, 203, 1023, 256, {"is_causal": True}),
        (1, 2, 300, 77, 250, {"softcap": 5.0}),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for b, h, nq, nk, d, opts in shapes:
            q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, h, nk, d, device="cuda", dtype=dtype)
            v = torch.randn(b, h, nk, d, device="cuda", dtype=dtype)
            ref, ref_lse = attention_reference(q, k, v, None, compute_dtype=torch.float64, **opts)
            plain, _ = attention_reference(q, k, v, None, compute_dtype=dtype, **opts)
            plain_err = (plain.double() - ref).abs().max().item()
            line = f"{str(dtype)[6:]:8s} b{b} h{h} nq{nq} nk{nk} d{d} {opts}: plain {plain_err:.2e}"
            for portable in (False, True):
                out, lse = run(q, k, v, portable, **opts)
                torch.cuda.synchronize()
                diff = (out.double() - ref).abs()
                err = diff.max().item()
                fin = torch.isfinite(ref_lse)
                lse_err = (lse.double() - ref_lse)[fin].abs().max().item() if fin.any() else 0.0
                line += f" | {'mma ' if portable else 'default'} {err:.2e} lse {lse_err:.2e}"
                if not err <= 2 * plain_err + 1e-3:
                    bad += 1
                    rows = (diff.amax(dim=(0, 1, 3)) > 2 * plain_err + 1e-3).nonzero().flatten()
                    cols = (diff.amax(dim=(0, 1, 2)) > 2 * plain_err + 1e-3).nonzero().flatten()
                    line += f" BAD rows {rows[:12].tolist()}.. ({len(rows)}) cols {cols[:12].tolist()}.. ({len(cols)})"
            print(line, flush=True)
    print("all within 2x plain" if bad == 0 else f"{bad} bad results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
