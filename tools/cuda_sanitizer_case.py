"""Small shapes covering every CUDA attention kernel path once, for compute-sanitizer.

tests/attention/test_cuda.py::test_compute_sanitizer runs it; by hand, from the repository root:

    compute-sanitizer --tool memcheck --kernel-name kns=attention_fwd --error-exitcode 1 \\
        python tools/cuda_sanitizer_case.py
    compute-sanitizer --tool racecheck --kernel-name kns=attention_fwd --error-exitcode 1 \\
        python tools/cuda_sanitizer_case.py

(kns=attention_bwd for the backward's kernels.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a source tree
from flashmod.ops import attention_op  # noqa: E402

# The decode kernel's variants, forced through the knobs of csrc/attention/cuda/attention_cuda.cpp
# (tests/attention/test_cuda.py's DECODE_MODES covers more).
DECODE_MODES = {
    "heuristic": {},
    "packed_5splits": {"FLASHMOD_DECODE_SPLITS": "5"},
    "unpacked_3splits": {"FLASHMOD_DECODE_PACK": "0", "FLASHMOD_DECODE_SPLITS": "3"},
    "combine_kernel": {"FLASHMOD_DECODE_SPLITS": "5", "FLASHMOD_DECODE_FUSED_COMBINE": "0"},
}


def main() -> None:
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # (200, 600, 128 / 192 / 256): the sm_90 warp-specialized kernel's buffer ring wraps around
        # (at D = 192 / 256 with 64-key blocks and O stored from registers; D = 192's PV in 64-column
        # chunks). D = 160: widened to 192 on Hopper (zero columns past the head dim).
        shapes = [(17, 113, 64), (130, 77, 128), (5, 33, 256), (70, 70, 40), (200, 600, 128), (200, 600, 256)]
        shapes += [(200, 600, 192), (17, 113, 160)]
        for nq, nk, d in shapes:
            q, k, v = (torch.randn(1, 2, n, d, device="cuda", dtype=dtype) for n in (nq, nk, nk))
            mask = torch.rand(nq, nk, device="cuda") > 0.3
            attention_op(q, k, v)
            attention_op(q, k, v, is_causal=True, bottom_right=False)
            attention_op(q, k, v, mask, softcap=5.0, window_left=20, window_right=3)
            attention_op(q, k, v, mask, is_causal=True)  # bool mask alone: the wgmma kernel's bit path
            # A causal staircase as an additive mask: hidden, clear and mixed tiles (mask_tiles.h).
            stairs = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(nk - nq)
            additive = torch.zeros(nq, nk, device="cuda", dtype=dtype).masked_fill(~stairs, float("-inf"))
            attention_op(q, k, v, additive)
            attention_op(q, k, v, stairs & mask)
        if dtype != torch.float32:  # the persistent sm_90 kernel: more tiles than SMs, some empty
            q, k = (torch.randn(1, 150, n, 64, device="cuda", dtype=dtype) for n in (200, 150))
            attention_op(q, k, k, is_causal=True)
            attention_op(q, k, k)
            # Causal past 1024 query rows at D = 64: three consumers under the dynamic scheduler.
            q = torch.randn(1, 24, 1100, 64, device="cuda", dtype=dtype)
            attention_op(q, q, q, is_causal=True)
            attention_op(q, q, q, softcap=5.0)  # soft-capped scores on the same kernel
            # An additive mask on the same kernel's mask rows (kBias): a dense bias at D = 64 (three
            # consumers) and 128, rows of 600 keys (16-byte aligned), five key blocks.
            for d in (64, 128):
                q, k = (torch.randn(1, 3, n, d, device="cuda", dtype=dtype) for n in (200, 600))
                attention_op(q, k, k, torch.randn(200, 600, device="cuda", dtype=dtype))
        if dtype != torch.float32:  # decode kernel: GQA packing + split-KV and its combine
            q, k = (
                torch.randn(1, 8, 3, 59, device="cuda", dtype=dtype),
                torch.randn(1, 2, 700, 59, device="cuda", dtype=dtype),
            )
            for knobs in DECODE_MODES.values():
                # This process is the sanitizer's child and ends here: setting its environment is harmless.
                for name in ("FLASHMOD_DECODE_PACK", "FLASHMOD_DECODE_SPLITS", "FLASHMOD_DECODE_FUSED_COMBINE"):
                    os.environ.pop(name, None)
                os.environ.update(knobs)
                attention_op(q, k, k, is_causal=True)
                attention_op(q, k, k, torch.rand(3, 700, device="cuda") > 0.5, softcap=3.0)
    for name in ("FLASHMOD_DECODE_PACK", "FLASHMOD_DECODE_SPLITS", "FLASHMOD_DECODE_FUSED_COMBINE"):
        os.environ.pop(name, None)
    serving_ops()
    backward_ops()
    torch.cuda.synchronize()
    print("sanitizer case done", flush=True)
    # Every kernel has finished, so the sanitizer has seen all it will report. Skip the interpreter's
    # teardown: under the sanitizer and a loaded host it sometimes ended in "terminate called
    # without an active exception" (SIGABRT) after 0 errors (3 of 12 runs in sessions 39-40), a
    # shutdown race outside flashmod's kernels that failed the test without any finding.
    os._exit(0)


def backward_ops() -> None:
    """The fp16/bf16 backward's kernels (the row statistics, dK/dV and dQ; general variants with a
    soft cap and a mask, and with dropout, whose forward runs here too) and, on Hopper, the dK/dV
    kernel that takes dQ itself (FLASHMOD_BWD_FUSED_DQ=2, head dims 64 and 128; with dropout at
    128) with the conversion of its sums; D = 256 and fp32: odd lengths, causal, GQA."""
    for fused in ("0", "2"):
        os.environ["FLASHMOD_BWD_FUSED_DQ"] = fused
        shapes = ((130, 77, 128, 2, 2), (200, 600, 128, 4, 2), (17, 113, 64, 2, 1), (200, 600, 64, 4, 2))
        for nq, nk, d, hq, hkv in shapes:
            grad = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
            q = torch.randn(1, hq, nq, d, **grad)
            k, v = (torch.randn(1, hkv, nk, d, **grad) for _ in range(2))
            for opts in ({}, {"is_causal": True}):
                out, lse = attention_op(q, k, v, **opts)
                torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
            # The dropout variants (forward, dK/dV, dQ; general and plain scores), and the fused
            # dQ variant's plain one.
            rng = torch.randint(0, 1 << 62, (2,), device="cuda")
            mask = torch.rand(nq, nk, device="cuda") > 0.3
            for m in (mask, None) if fused == "0" else (None,):
                out, _ = torch.ops.flashmod.attention_dropout(q, k, v, m, None, True, True, -1, -1, 0.0, 0.3, rng)
                torch.autograd.grad(out.float().sum(), (q, k, v))
            if fused == "0":
                out, _ = attention_op(q, k, v, mask, softcap=5.0)
                torch.autograd.grad(out.float().sum(), (q, k, v))
    os.environ.pop("FLASHMOD_BWD_FUSED_DQ")
    # D = 256 (on Hopper the kernel whose warpgroups split the head dim; with a soft cap the pair
    # kernel, whose two warpgroups run different code between the same barriers), D = 192 and 160
    # (the pair kernel at 192; its tile copy by 64-column block) and fp32 (the 3xTF32 kernels): odd
    # lengths, causal and not, GQA.
    bf16, fp32 = torch.bfloat16, torch.float32
    for dtype, d in ((bf16, 256), (bf16, 192), (bf16, 160), (fp32, 40), (fp32, 128)):
        grad = {"device": "cuda", "dtype": dtype, "requires_grad": True}
        q = torch.randn(1, 4, 130, d, **grad)
        k, v = (torch.randn(1, 2, 77, d, **grad) for _ in range(2))
        for opts in ({}, {"is_causal": True}, {"is_causal": True, "softcap": 5.0}):
            out, lse = attention_op(q, k, v, **opts)
            torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
        if d == 256:  # an additive mask that stages (rows of 200 keys): the pair tile's staged variant
            k2, v2 = (torch.randn(1, 2, 200, d, **grad) for _ in range(2))
            stairs = torch.ones(130, 200, dtype=torch.bool, device="cuda").tril(70)
            bias = torch.randn(130, 200, device="cuda", dtype=dtype).masked_fill(~stairs, float("-inf"))
            out, _ = attention_op(q, k2, v2, bias)
            torch.autograd.grad(out.float().sum(), (q, k2, v2))
        if d == 192:  # the general (mask tensor) and dropout variants' column-block tile copy
            mask = torch.rand(130, 77, device="cuda") > 0.3
            out, _ = attention_op(q, k, v, mask, softcap=5.0)
            torch.autograd.grad(out.float().sum(), (q, k, v))
            rng = torch.randint(0, 1 << 62, (2,), device="cuda")
            out, _ = torch.ops.flashmod.attention_dropout(q, k, v, None, None, True, True, -1, -1, 0.0, 0.3, rng)
            torch.autograd.grad(out.float().sum(), (q, k, v))


def serving_ops() -> None:
    """The per-sequence kernel variants: varlen (empty and odd sequences; with dropout, forward and
    backward), contiguous and paged caches
    (pages of 16 rows per row lookup, 64 per block lookup) with the append inside the decode kernel
    (1 new row, and 70 across key blocks with 3 splits) and with the append kernel, and 16-token
    pages over 2k tokens (the copy engine's path on Hopper)."""
    import flashmod

    for dtype in (torch.bfloat16, torch.float16):
        lengths = [17, 0, 130, 1]
        cu = torch.tensor([0, 17, 17, 147, 148], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(sum(lengths), h, 64, device="cuda", dtype=dtype) for h in (4, 2, 2))
        flashmod.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, causal=True)
        flashmod.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, window_size=(9, 2), softcap=5.0)
        # Dropout on packed rows: the warp-specialized forward's variant (causal), the mma.sync one (soft
        # cap), and both backwards' per-sequence dropout variants (plain and general scores); under
        # FLASHMOD_BWD_FUSED_DQ=2 the Hopper backward's fused dQ variant for packed rows (plain scores,
        # with and without dropout) and the conversion of its sums.
        for fused in ("0", "2"):
            os.environ["FLASHMOD_BWD_FUSED_DQ"] = fused
            for d in (64, 128, 192):
                grad = {"device": "cuda", "dtype": dtype, "requires_grad": True}
                qg, kg, vg = (torch.randn(sum(lengths), h, d, **grad) for h in (4, 2, 2))
                for opts in ({"causal": True}, {"softcap": 5.0}):
                    out = flashmod.flash_attn_varlen_func(qg, kg, vg, cu, cu, 130, 130, dropout_p=0.3, **opts)
                    torch.autograd.grad(out.float().sum(), (qg, kg, vg))
                out = flashmod.flash_attn_varlen_func(qg, kg, vg, cu, cu, 130, 130)
                torch.autograd.grad(out.float().sum(), (qg, kg, vg))
        os.environ.pop("FLASHMOD_BWD_FUSED_DQ")
        for page in (16, 64):
            pages = 256 // page
            k_pool, v_pool = (torch.randn(3 * pages, page, 2, 128, device="cuda", dtype=dtype) for _ in range(2))
            table = torch.randperm(3 * pages, device="cuda").to(torch.int32).reshape(3, pages)
            qd = torch.randn(3, 1, 8, 128, device="cuda", dtype=dtype)
            kn, vn = (torch.randn(3, 1, 2, 128, device="cuda", dtype=dtype) for _ in range(2))
            seqlens = torch.tensor([0, 100, 255], dtype=torch.int32, device="cuda")
            flashmod.flash_attn_with_kvcache(qd, k_pool, v_pool, kn, vn, seqlens, block_table=table, causal=True)
            k_cache, v_cache = (t.reshape(3, 256, 2, 128) for t in (k_pool.clone(), v_pool.clone()))
            flashmod.flash_attn_with_kvcache(qd, k_cache, v_cache, kn, vn, seqlens, causal=True)
            kn70, vn70 = (torch.randn(3, 70, 2, 128, device="cuda", dtype=dtype) for _ in range(2))
            seqlens70 = torch.tensor([0, 100, 186], dtype=torch.int32, device="cuda")
            for knobs in ({"FLASHMOD_DECODE_SPLITS": "3"}, {"FLASHMOD_KVCACHE_FUSED_APPEND": "0"}):
                os.environ.update(knobs)
                flashmod.flash_attn_with_kvcache(qd, k_pool, v_pool, kn70, vn70, seqlens70, block_table=table)
                for name in knobs:
                    os.environ.pop(name)
        # 16-token pages through the copy engine (Hopper): splits of >= 16 key blocks take it.
        k_pool, v_pool = (torch.randn(2 * 128, 16, 2, 128, device="cuda", dtype=dtype) for _ in range(2))
        table = torch.randperm(2 * 128, device="cuda").to(torch.int32).reshape(2, 128)
        qd = torch.randn(2, 1, 8, 128, device="cuda", dtype=dtype)
        kn, vn = (torch.randn(2, 1, 2, 128, device="cuda", dtype=dtype) for _ in range(2))
        os.environ["FLASHMOD_DECODE_SPLITS"] = "2"
        seqlens = torch.tensor([1500, 2047], dtype=torch.int32, device="cuda")
        flashmod.flash_attn_with_kvcache(qd, k_pool, v_pool, kn, vn, seqlens, block_table=table)
        os.environ.pop("FLASHMOD_DECODE_SPLITS")


if __name__ == "__main__":
    main()
