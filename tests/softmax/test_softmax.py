"""flashmod.softmax and flashmod.matmul_softmax against torch (issue 5).

Accuracy follows flash-attn's rule (tests/tolerance.py): our error against an fp64 reference is at
most twice the error of plain torch computed in the same low precision, plus a tiny slack.
"""

from __future__ import annotations

import math
import re
from functools import partial

import pytest
import torch
from tolerance import assert_within_rule, max_abs_err

import flashmod
from flashmod.reference import HIDING_MASK_VALUE

LOW = [torch.float32, torch.float16, torch.bfloat16]
NEG_INF = float("-inf")


def dtypes_for(device: str) -> list[torch.dtype]:
    return LOW + ([torch.float64] if device == "cpu" else [])


def compile_backend(device: str) -> str:
    """Inductor on CUDA; on CPU aot_eager, which traces the same fake and autograd registrations but
    skips inductor's C++ code generation (tens of seconds on a 2-core machine)."""
    return "inductor" if device == "cuda" else "aot_eager"


def assert_rule(ours: torch.Tensor, truth: torch.Tensor, plain: torch.Tensor, what: str) -> None:
    """tests/tolerance.py's rule with factor 2, and our dtype must be torch's."""
    assert ours.dtype == plain.dtype, what
    assert_within_rule(ours, truth, plain, 2.0, ours.dtype, what)


# ---------------------------------------------------------------------------------------- softmax


# On CUDA: warp per row (<= 1023), block per row (4097, 16384), then the long-row paths that
# test_softmax_long_row_paths checks by name.
@pytest.mark.parametrize("n", [1, 17, 255, 256, 1023, 4097, 16384, 40000, 65537, 131072, 262143, 300000])
def test_softmax_rows(device, n):
    for dtype in dtypes_for(device):
        x = (torch.randn(3, n, device=device) * 4).to(dtype)
        ours = flashmod.softmax(x, -1)
        assert_rule(ours, torch.softmax(x.double(), -1), torch.softmax(x, -1), f"{dtype} n={n}")


@pytest.mark.parametrize("shape", [(5, 19, 33), (2, 3, 4, 17), (40, 1)])
def test_softmax_every_dim(device, shape):
    for dtype in dtypes_for(device):
        x = (torch.randn(shape, device=device) * 3).to(dtype)
        for dim in range(-len(shape), len(shape)):
            ours = flashmod.softmax(x, dim)
            assert_rule(ours, torch.softmax(x.double(), dim), torch.softmax(x, dim), f"{dtype} dim={dim}")


def test_softmax_non_contiguous_and_scalar(device):
    x = torch.randn(33, 70, device=device).t()  # strided input
    torch.testing.assert_close(flashmod.softmax(x, 1), torch.softmax(x, 1))
    s = torch.randn((), device=device)
    assert flashmod.softmax(s, 0).item() == 1.0 and flashmod.softmax(s, -1).shape == ()


STREAM_THREADS = 544  # csrc/softmax/cuda/softmax_stream_sm90.cuh: 16 consumer warps + the producer warp
STREAM_MAX_SEGMENT = 128 * 1024  # bytes of a row per block on the stream path
STREAM_MAX_CLUSTER = 16


def long_path(n: int, dtype: torch.dtype, capability: tuple[int, int], registers: bool = False):
    """(path, threads, blocks per row) that csrc/softmax/cuda/softmax.cu's FLASHMOD_SOFTMAX_TRACE reports
    for a row of n > 16384 elements; None where the build has no kernel of its own. On sm_90, rows
    that load in 16-byte packs and fit 16 segments of 128 KB take the stream path, whose blocks per
    row depend on occupancy (None here: assert_long_path checks the range), unless `registers`
    (FLASHMOD_SOFTMAX_STREAM=0). Cluster threads of the register path keep 64 elements of
    16-bit rows that load in packs (n % 8 == 0), 32 otherwise; the fallbacks keep 32."""
    row_bytes = n * torch.empty((), dtype=dtype).element_size()
    if capability == (9, 0):
        if not registers and row_bytes % 16 == 0 and row_bytes <= STREAM_MAX_CLUSTER * STREAM_MAX_SEGMENT:
            return ("stream", STREAM_THREADS, None)
        per_thread = 64 if dtype != torch.float32 and n % 8 == 0 else 32
        if n <= 8 * 256 * per_thread:
            return ("cluster", 256, math.ceil(n / (256 * per_thread)))
        if n <= 16 * 512 * per_thread:
            return ("cluster", 512, math.ceil(n / (512 * per_thread)))  # 16: the non-portable cluster size
    elif capability[0] != 8:
        return None
    elif n <= 1024 * 32:
        return ("block", 1024, 1)
    return ("two-kernel", 256, math.ceil(n / (256 * 32)))


def assert_long_path(trace: str, n: int, dtype: torch.dtype, registers: bool = False) -> None:
    expected = long_path(n, dtype, torch.cuda.get_device_capability(), registers)
    if expected is None:
        return
    path, threads, blocks = expected
    if blocks is not None:
        assert f"n={n} path={path} threads={threads} blocks_per_row={blocks}" in trace, (dtype, trace)
        return
    found = re.search(rf"n={n} path={path} threads={threads} blocks_per_row=(\d+)", trace)
    assert found, (dtype, trace)
    row_bytes = n * torch.empty((), dtype=dtype).element_size()
    assert math.ceil(row_bytes / STREAM_MAX_SEGMENT) <= int(found[1]) <= STREAM_MAX_CLUSTER, (dtype, trace)


def mark_special_rows(x: torch.Tensor, all_inf: int, some_inf: int, nan: int) -> None:
    n = x.shape[-1]
    x[all_inf] = NEG_INF  # all -inf: zeros
    x[some_inf, ::3] = NEG_INF  # partly -inf: exact zeros there
    x[nan, n - 1] = float("nan")  # NaN in the last block of the row: the whole row NaN


def check_special_rows(y: torch.Tensor, all_inf: int, some_inf: int, nan: int) -> None:
    assert (y[all_inf] == 0).all()
    assert (y[some_inf, ::3] == 0).all()
    assert torch.isnan(y[nan]).all()


@pytest.mark.cuda
# On H100, rows in 16-byte packs up to 2 MB take the stream path: 20000, 65536, 262144, 524288 (fp32:
# exactly 16 x 128 KB) and 600000 in 16 bits. With FLASHMOD_SOFTMAX_STREAM=0, and for the rest,
# per dtype (fp32 / aligned 16-bit): 20000 and 65536 take clusters of 256-thread blocks, 262144
# clusters of 512 (16 / 8 blocks), 524288 the largest cluster for 16-bit, two kernels for fp32,
# 600000 two kernels. Odd n loads one element at a time (32 per thread, every dtype): 65537
# 5 x 512, 262143 the largest cluster, 300001 two kernels.
@pytest.mark.parametrize("registers", [False, True], ids=["stream", "registers"])
@pytest.mark.parametrize("n", [20000, 65536, 65537, 262143, 262144, 300001, 524288, 600000])
def test_softmax_long_row_paths(n, registers, monkeypatch, capfd):
    monkeypatch.setenv("FLASHMOD_SOFTMAX_TRACE", "1")
    if registers:
        monkeypatch.setenv("FLASHMOD_SOFTMAX_STREAM", "0")
    capfd.readouterr()
    rows = 6
    for dtype in LOW:
        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
        mark_special_rows(x, 0, 1, 2)
        y = flashmod.softmax(x, -1)
        assert_long_path(capfd.readouterr().err, n, dtype, registers)
        check_special_rows(y, 0, 1, 2)
        assert not torch.isnan(y[3:]).any()
        keep = [1] + list(range(3, rows))
        xk = x[keep]
        assert_within_rule(y[keep], torch.softmax(xk.double(), -1), torch.softmax(xk, -1), 2, dtype, f"{dtype} n={n}")


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="sm_90 stream path"
)
# Every cluster size the stream path may pick, on rows with a partial last chunk (fp32 20000: 4 full
# chunks of 16 KB + 14464 B on one block) and more rows than clusters, so each cluster loops over
# rows and both parities of the exchange buffers and every ring slot get reused. Poisoned output:
# an element the kernel does not write stays NaN.
@pytest.mark.parametrize("cluster", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("n", [20000, 16392 * 3])
def test_softmax_stream_cluster_sizes(n, cluster, monkeypatch, capfd):
    monkeypatch.setenv("FLASHMOD_SOFTMAX_TRACE", "1")
    monkeypatch.setenv("FLASHMOD_SOFTMAX_STREAM_CLUSTER", str(cluster))
    capfd.readouterr()
    rows = 3 * torch.cuda.get_device_properties(0).multi_processor_count + 7
    for dtype in LOW:
        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
        mark_special_rows(x, rows - 3, rows - 2, rows - 1)
        poison = torch.full_like(x, float("nan"))
        del poison  # the caching allocator hands this NaN-filled block to the output
        y = flashmod.softmax(x, -1)
        trace = capfd.readouterr().err
        if cluster < math.ceil(n * x.element_size() / STREAM_MAX_SEGMENT):
            # Segments would exceed 128 KB: the knob is refused and the register path runs.
            assert "path=stream" not in trace and f"n={n} path=" in trace, trace
        else:
            assert f"n={n} path=stream threads={STREAM_THREADS} blocks_per_row={cluster}" in trace, trace
        check_special_rows(y, rows - 3, rows - 2, rows - 1)
        assert not torch.isnan(y[: rows - 3]).any()
        xk = x[: rows - 3]
        plain = torch.softmax(xk, -1)
        assert_within_rule(y[: rows - 3], torch.softmax(xk.double(), -1), plain, 2, dtype, f"{dtype} c={cluster}")


@pytest.mark.cuda
def test_softmax_cluster_rows_past_grid(monkeypatch, capfd):
    """More rows than the grid's 65535: clusters 0-4 take rows 65535-65539 as their second row
    (the other parity of the shared-memory buffers), with the special rows among them."""
    monkeypatch.setenv("FLASHMOD_SOFTMAX_TRACE", "1")
    capfd.readouterr()
    rows, n = 65540, 16392  # the shortest rows on the cluster path (2 x 256 x 64 for 16-bit)
    check = [0, 1, 2, 65534, 65536, 65538, 65539]  # the NaN row's neighbours stay finite
    for dtype in LOW:
        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
        mark_special_rows(x, 65535, 65536, 65537)
        y = flashmod.softmax(x, -1)
        assert_long_path(capfd.readouterr().err, n, dtype)
        check_special_rows(y, 65535, 65536, 65537)
        xk = x[check]
        assert_within_rule(y[check], torch.softmax(xk.double(), -1), torch.softmax(xk, -1), 2, dtype, str(dtype))
        del x, y


def test_softmax_neg_inf_rows_and_nan(device):
    for dtype in LOW:
        for n in (5, 300, 5000):
            x = torch.randn(4, n, device=device).to(dtype)
            x[0] = NEG_INF  # all -inf: zeros (torch gives NaN)
            x[1, ::2] = NEG_INF  # partly -inf: exact zeros there, the rest normalized
            x[2, n // 2] = float("nan")  # NaN makes its row NaN, and only its row
            y = flashmod.softmax(x, -1)
            assert (y[0] == 0).all()
            assert (y[1, ::2] == 0).all()
            torch.testing.assert_close(y[1], torch.softmax(x[1], -1))
            assert torch.isnan(y[2]).all()
            torch.testing.assert_close(y[3], torch.softmax(x[3], -1))
            # the same along a non-last dimension
            yt = flashmod.softmax(x.t().contiguous(), 0)
            assert (yt[:, 0] == 0).all() and torch.isnan(yt[:, 2]).all()
            torch.testing.assert_close(yt[:, 3], torch.softmax(x[3], -1))


def test_fp64_nan_anywhere_makes_the_row_nan():
    """The fp64 row (softmax and matmul_softmax): a NaN first, after -infs only, or alone spreads to
    the whole row as torch's does, never drops out (a NaN row of matmul_softmax's a is not a row of
    zeros, which would read as a masked row)."""
    inf, nan = float("inf"), float("nan")
    for row in ([nan], [nan, 0.0, 1.0], [-inf, nan, 1.0], [-inf, -inf, nan], [0.5, nan, -inf]):
        y = flashmod.softmax(torch.tensor(row, dtype=torch.float64), 0)
        assert torch.isnan(y).all(), f"{row} -> {y}"
    a = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    a[0, 0, 1, 0] = nan
    y = flashmod.matmul_softmax(a, torch.randn(1, 1, 4, 8, dtype=torch.float64))
    assert torch.isnan(y[0, 0, 1]).all() and not torch.isnan(y[0, 0, [0, 2]]).any()


def test_softmax_empty(device):
    for shape, dim in (((0, 7), -1), ((7, 0), -1), ((3, 0, 5), 1), ((0,), 0)):
        x = torch.randn(shape, device=device)
        y = flashmod.softmax(x, dim)
        assert y.shape == x.shape and y.dtype == x.dtype


def test_softmax_gradcheck():
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    for dim in (0, 1, -1):
        assert torch.autograd.gradcheck(flashmod.softmax, (x, dim))
    y = torch.tensor([[NEG_INF] * 3, [1.0, NEG_INF, 2.0]], dtype=torch.float64, requires_grad=True)
    flashmod.softmax(y, -1).sum().backward()
    assert torch.isfinite(y.grad).all() and (y.grad[0] == 0).all()


def test_softmax_grad_matches_torch(device):
    x = torch.randn(6, 300, device=device, requires_grad=True)
    g = torch.randn(6, 300, device=device)
    (ours,) = torch.autograd.grad(flashmod.softmax(x, -1), x, g)
    (ref,) = torch.autograd.grad(torch.softmax(x, -1), x, g)
    torch.testing.assert_close(ours, ref)


def test_low_precision_grads_within_rule(device):
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(8, 700, device=device) * 3).to(dtype)
        g = torch.randn(8, 700, device=device).to(dtype)
        grads = []
        for fn, t in ((flashmod.softmax, x), (torch.softmax, x), (torch.softmax, x.double())):
            t = t.detach().requires_grad_()
            (grad,) = torch.autograd.grad(fn(t, -1), t, g.to(t.dtype))
            grads.append(grad)
        assert_rule(grads[0], grads[2], grads[1], f"softmax grad {dtype}")
        a = torch.randn(1, 4, 50, 64, device=device, dtype=dtype)
        b = torch.randn(1, 2, 90, 64, device=device, dtype=dtype)
        gp = torch.randn(1, 4, 50, 90, device=device, dtype=dtype)
        results = []
        for fn, dt in (
            (flashmod.matmul_softmax, dtype),
            (matmul_softmax_ref, dtype),
            (matmul_softmax_ref, torch.float64),
        ):
            ta, tb = a.to(dt).requires_grad_(), b.to(dt).requires_grad_()
            results.append(torch.autograd.grad(fn(ta, tb, is_causal=True), (ta, tb), gp.to(dt)))
        for i, name in enumerate("ab"):
            assert_rule(results[0][i], results[2][i], results[1][i], f"matmul_softmax grad {name} {dtype}")


def test_softmax_opcheck_and_compile(device):
    x = torch.randn(4, 37, 9, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.flashmod.softmax.default, (x, 1))
    torch.library.opcheck(torch.ops.flashmod.softmax.default, (x, -1))
    compiled = torch.compile(lambda t: flashmod.softmax(t * 2, 1) + 1, fullgraph=True, backend=compile_backend(device))
    torch.testing.assert_close(compiled(x), torch.softmax(x * 2, 1) + 1)


def test_softmax_bad_inputs(device):
    x = torch.randn(3, 4, device=device)
    flashmod.softmax(x, -2)  # positive control: the same tensor with a valid dim works
    with pytest.raises(RuntimeError, match=r"flashmod.softmax: dim must be in \[-2, 1\] for a 2-D tensor, got 2"):
        flashmod.softmax(x, 2)
    with pytest.raises(RuntimeError, match="flashmod.softmax: x must be float32, float16, bfloat16 or float64, got"):
        flashmod.softmax(torch.ones(3, 4, dtype=torch.int32, device=device), -1)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="float64 is supported on CPU only"):
            flashmod.softmax(x.double(), -1)


# ---------------------------------------------------------------------------------- matmul_softmax


def matmul_softmax_ref(a, b, scale=None, is_causal=False, attn_mask=None, dtype=None, merge_group=False):
    """softmax(scale * a @ b^T + mask) in `dtype` (default a's), fully masked rows as zeros.
    merge_group: a GQA group's heads multiplied as one (G * M)-row matrix against their shared b,
    instead of b repeated per head (the same product, another GEMM shape)."""
    dtype = dtype or a.dtype
    a, b = a.to(dtype), b.to(dtype)
    scale = 1 / math.sqrt(a.shape[-1]) if scale is None else scale
    if merge_group:
        batch, heads_a, m, k = a.shape
        merged = a.reshape(batch, b.shape[1], -1, k) @ b.transpose(-1, -2)
        s = scale * merged.reshape(batch, heads_a, m, -1)
    else:
        s = scale * (a @ b.repeat_interleave(a.shape[1] // b.shape[1], dim=1).transpose(-1, -2))
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, NEG_INF)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, NEG_INF) if attn_mask.dtype == torch.bool else s + attn_mask.to(dtype)
    return torch.softmax(s, -1).nan_to_num(0.0)


def check_matmul_softmax(a, b, what, **kw):
    """The rule against plain torch in a's dtype, whose error is that of the worse of the two ways it
    multiplies a GQA group: b repeated per head, or the group's rows merged against b once (what the
    ops do, through the same bmm / cuBLAS call). Their GEMMs round differently (the library picks a
    blocking by shape: at (9, 20, 264) fp32 on the CPU the merged logits were 5x less accurate, and 1
    seed in 150 failed the rule against the per-head form alone), and either is plain torch."""
    ours = flashmod.matmul_softmax(a, b, **kw)
    assert ours.is_contiguous()
    truth = matmul_softmax_ref(a, b, dtype=torch.float64, **kw)
    plains = [matmul_softmax_ref(a, b, merge_group=merge, **kw) for merge in (False, True)]
    assert_rule(ours, truth, max(plains, key=lambda plain: max_abs_err(plain, truth)), what)
    return ours


# On CUDA, fp16/bf16 with depth a multiple of 8 up to 256 take the fused tensor-core kernel, one
# instantiation per depth bucket (<= 32, 64, 128, 256: 8, 16, 40, 64, 96, 128, 200, 256 here); depth
# 4, 12, 30 and 264 take the cuBLAS + in-place fallback. fp32 takes the fused 3xTF32 kernel at depth
# a multiple of 4 up to 128 (buckets 32, 64, 128: 4, 8, 12, 16, 40, 64, 96, 128), the fallback at
# 30, 200, 256, 264; at depth > 64 it is the single-pass kernel (16 rows by 256 columns) while N
# fits in shared memory (test_matmul_softmax_fp32_single_pass forces both). The 16-bit tiles are
# 128 (64 at depth > 128) rows by 64 (32) columns, fp32's two-pass 64 rows by 64 (32 at depth > 32):
# M and N straddle them, and N % 8 == 0 takes the 16-byte stores (fp32: N % 4), other N the element
# stores. Causal runs cover M > N and M < N.
@pytest.mark.parametrize(
    "mnk",
    [
        (1, 1, 8),
        (17, 33, 16),
        (64, 257, 64),
        (130, 75, 40),
        (70, 128, 64),
        (129, 136, 96),
        (5, 1100, 128),
        (66, 65, 200),
        (31, 96, 256),
        (23, 41, 12),
        (19, 36, 4),
        (13, 50, 30),
        (9, 20, 264),
    ],
)
def test_matmul_softmax_shapes(device, mnk):
    m, n, k = mnk
    for dtype in dtypes_for(device):
        a = torch.randn(2, 4, m, k, device=device, dtype=dtype)
        b = torch.randn(2, 2, n, k, device=device, dtype=dtype)  # GQA: 2 a-heads per b-head
        check_matmul_softmax(a, b, f"{dtype} {mnk}")
        check_matmul_softmax(a, b, f"{dtype} {mnk} causal scale", is_causal=True, scale=0.3)


def test_matmul_softmax_masks(device):
    m, n, k = 37, 70, 32
    for dtype in dtypes_for(device):
        a = torch.randn(2, 3, m, k, device=device, dtype=dtype)
        b = torch.randn(2, 3, n, k, device=device, dtype=dtype)
        bool_mask = torch.rand(m, n, device=device) > 0.4
        bool_mask[5] = False  # a fully masked row: zeros
        out = check_matmul_softmax(a, b, f"{dtype} bool", attn_mask=bool_mask)
        assert (out[:, :, 5] == 0).all()
        per_batch = torch.rand(2, 1, 1, n, device=device) > 0.5
        check_matmul_softmax(a, b, f"{dtype} bool (B,1,1,N) causal", attn_mask=per_batch, is_causal=True)
        additive = torch.randn(3, m, n, device=device, dtype=dtype)
        check_matmul_softmax(a, b, f"{dtype} additive", attn_mask=additive)
        if dtype in (torch.float16, torch.bfloat16):
            check_matmul_softmax(a, b, f"{dtype} fp32 additive", attn_mask=additive.float())


def test_matmul_softmax_tensor_scale_gets_its_gradient(device):
    """A 0-d tensor scale that requires grad gets d/dscale (it was read as a float, its gradient
    None), eager and compiled; a tensor of another shape is a clear error."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    a, b = torch.randn(1, 2, 17, 40, device=device, dtype=dtype), torch.randn(1, 2, 23, 40, device=device, dtype=dtype)
    weights = torch.randn(1, 2, 17, 23, device=device, dtype=dtype)
    for fn in (flashmod.matmul_softmax, torch.compile(flashmod.matmul_softmax, fullgraph=True, backend="aot_eager")):
        scale = torch.tensor(0.4, device=device, dtype=dtype, requires_grad=True)
        (g,) = torch.autograd.grad((fn(a, b, scale) * weights).sum(), scale)
        s_ref = scale.detach().double().requires_grad_()
        want = torch.softmax(s_ref * a.double() @ b.double().transpose(-1, -2), -1)
        (g_ref,) = torch.autograd.grad((want * weights.double()).sum(), s_ref)
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="flashmod.matmul_softmax: scale must be a float or a 0-d float tensor"):
        flashmod.matmul_softmax(a, b, torch.ones(2))


def test_matmul_softmax_hiding_mask_values_act_as_minus_inf(device):
    """Additive entries at or below HIDING_MASK_VALUE (HF's finfo.min, -1e9) hide their key as
    -inf does: a row of them is zeros (finfo.min once overflowed to -inf on CUDA, or summed into
    NaN), bit for bit the -inf mask's result."""
    m, n, k = 37, 70, 32
    for dtype in dtypes_for(device):
        a = torch.randn(2, 3, m, k, device=device, dtype=dtype)
        b = torch.randn(2, 3, n, k, device=device, dtype=dtype)
        mask_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        bias = torch.randn(m, n, device=device, dtype=mask_dtype)
        hidden = torch.rand(m, n, device=device) < 0.3
        hidden[4] = True
        with_inf = flashmod.matmul_softmax(a, b, attn_mask=bias.masked_fill(hidden, float("-inf")))
        assert (with_inf[:, :, 4] == 0).all()
        for value in (HIDING_MASK_VALUE, -1e9, torch.finfo(mask_dtype).min):
            out = flashmod.matmul_softmax(a, b, attn_mask=bias.masked_fill(hidden, value))
            assert torch.equal(out, with_inf), f"{dtype} {value}"


@pytest.mark.parametrize("mnk", [(150, 200, 64), (70, 131, 128), (40, 72, 256)])
def test_matmul_softmax_masks_fused_tiles(device, mnk):
    """Masks over several row blocks and column tiles of the fused kernel: broadcast strides (0 on
    batch, heads, rows or columns), a transposed mask (column stride M), with and without causal,
    bool rows fully masked and additive rows of -inf (both give zeros), MQA (one b head)."""
    m, n, k = mnk
    for dtype in dtypes_for(device):
        a = torch.randn(2, 3, m, k, device=device, dtype=dtype)
        b = torch.randn(2, 1, n, k, device=device, dtype=dtype)
        bool_mask = torch.rand(2, 1, m, n, device=device) > 0.3
        bool_mask[:, :, 3] = False
        for causal in (False, True):
            out = check_matmul_softmax(
                a, b, f"{dtype} {mnk} bool causal={causal}", attn_mask=bool_mask, is_causal=causal
            )
            assert (out[:, :, 3] == 0).all()
        transposed = torch.rand(n, m, device=device).t() > 0.5  # (M, N) view with strides (1, M)
        check_matmul_softmax(a, b, f"{dtype} {mnk} transposed bool", attn_mask=transposed, is_causal=True)
        per_column = torch.rand(1, 1, 1, n, device=device) > 0.5
        check_matmul_softmax(a, b, f"{dtype} {mnk} (1,1,1,N) bool", attn_mask=per_column)
        per_row = torch.rand(m, 1, device=device) > 0.2  # broadcast along the columns: stride 0
        check_matmul_softmax(a, b, f"{dtype} {mnk} (M,1) bool", attn_mask=per_row)
        additive = torch.randn(3, m, n, device=device, dtype=dtype) * 2
        additive[:, 7] = NEG_INF
        out = check_matmul_softmax(a, b, f"{dtype} {mnk} additive", attn_mask=additive, is_causal=True)
        assert (out[:, :, 7] == 0).all()
        if dtype in (torch.float16, torch.bfloat16):
            f32 = additive.float()[None]  # (1, H, M, N)
            check_matmul_softmax(a, b, f"{dtype} {mnk} fp32 additive", attn_mask=f32, scale=0.05)


@pytest.mark.cuda
@pytest.mark.parametrize(("mode", "warp_rows"), [("0", "1"), ("0", "0"), ("2", "1")])
def test_matmul_softmax_both_cuda_paths(mode, warp_rows, monkeypatch):
    """Both sides of the default rule (softmax_cuda.cpp: fused_preferred) on every shape, whichever
    the rule picks on this GPU: FLASHMOD_MMSM_FUSED=0 (cuBLAS and the in-place normalize, its
    unmasked and masked kernels) and 2 (the fused kernels wherever they run). Rows of 131 and 520
    columns take the normalize's warp-per-row kernel (fp32 up to 512 columns, 16-bit up to 1024;
    FLASHMOD_MMSM_WARP_ROWS=0 the block-per-row one), 1100 and 4099 its 128- and 512-thread
    cached kernels; depth 96 and 128 in fp32 the single-pass kernel under 2; depth 200 the 16-bit
    256-bucket."""
    monkeypatch.setenv("FLASHMOD_MMSM_FUSED", mode)
    monkeypatch.setenv("FLASHMOD_MMSM_WARP_ROWS", warp_rows)
    for m, n, k in ((37, 1100, 128), (19, 4099, 64), (70, 131, 96), (9, 520, 200)):
        for dtype in LOW:
            a = torch.randn(2, 4, m, k, device="cuda", dtype=dtype)
            b = torch.randn(2, 2, n, k, device="cuda", dtype=dtype)  # GQA: 2 a-heads per b-head
            what = f"FUSED={mode} {dtype} {(m, n, k)}"
            check_matmul_softmax(a, b, what)
            check_matmul_softmax(a, b, f"{what} causal scale", is_causal=True, scale=0.3)
            keep = torch.rand(m, n, device="cuda") > 0.3
            keep[1] = False
            out = check_matmul_softmax(a, b, f"{what} bool", attn_mask=keep)
            assert (out[:, :, 1] == 0).all(), what
    # 21 rows: the warp-per-row kernel's last block has three warps past the last row.
    for dtype in LOW:
        a, b = (torch.randn(1, 3, n, 40, device="cuda", dtype=dtype) for n in (7, 131))
        check_matmul_softmax(a, b, f"FUSED={mode} {dtype} 21 rows", is_causal=True)


@pytest.mark.cuda
@pytest.mark.parametrize("max_n", [None, "0", "512"])
def test_matmul_softmax_fp32_single_pass(max_n, monkeypatch):
    """fp32 at depth 65..128 takes the single-pass kernel (16-row CTAs, the rows' logits parked in
    shared memory) while N fits the device's shared memory, the two-pass kernel past that.
    FLASHMOD_MMSM_SINGLE_PASS_MAX_N moves the limit: unset (the device's), 0 (always two-pass) and
    512 (N = 600 and 1100 fall back, the rest single-pass). Odd M and N straddle the 16-row CTAs and
    256-column tiles, N % 4 != 0 takes the element stores, depth 68 zero-fills most of the last
    depth chunks; causal with M > N and M < N, GQA, bool / additive masks with fully masked rows."""
    monkeypatch.setenv("FLASHMOD_MMSM_FUSED", "2")  # the rule sends Hopper's non-causal calls to cuBLAS
    if max_n is None:
        monkeypatch.delenv("FLASHMOD_MMSM_SINGLE_PASS_MAX_N", raising=False)
    else:
        monkeypatch.setenv("FLASHMOD_MMSM_SINGLE_PASS_MAX_N", max_n)
    device = "cuda"
    for m, n, k in ((33, 257, 128), (16, 600, 96), (70, 131, 68), (300, 1100, 128), (5, 2048, 128)):
        a = torch.randn(2, 4, m, k, device=device)
        b = torch.randn(2, 2, n, k, device=device)  # GQA: 2 a-heads per b-head
        what = f"max_n={max_n} {(m, n, k)}"
        check_matmul_softmax(a, b, what)
        check_matmul_softmax(a, b, f"{what} causal", is_causal=True, scale=0.3)
        bool_mask = torch.rand(2, 1, m, n, device=device) > 0.3
        bool_mask[:, :, 3] = False
        for causal in (False, True):
            out = check_matmul_softmax(a, b, f"{what} bool causal={causal}", attn_mask=bool_mask, is_causal=causal)
            assert (out[:, :, 3] == 0).all()
        additive = torch.randn(4, m, n, device=device) * 2
        additive[:, 1] = NEG_INF
        out = check_matmul_softmax(a, b, f"{what} additive", attn_mask=additive)
        assert (out[:, :, 1] == 0).all()


@pytest.mark.parametrize("k", [12, 64, 264])
def test_matmul_softmax_fp16_raw_logits_past_fp16_range(device, k):
    """fp16 inputs whose raw logits a @ b^T (~1e5) pass fp16's 65504 while the scaled ones (~24) do
    not: every path must stay finite and accurate (the CPU's fp32 logits; on CUDA the fused kernel
    at depth 64, and the cuBLAS fallback at 12 and 264, which writes the logits scaled). Before, the
    CPU and the fallback rounded the raw logits to fp16 first: inf, then a row of NaN. Plain torch
    overflows the same way, so its yardstick here is plain torch with the scale inside the product
    (as SDPA's math backend scales q and k), rounded to fp16 once."""
    offset = math.sqrt(1e5 / k)  # rows of offset + noise: every raw logit ~1e5
    a = (offset + torch.randn(1, 4, 37, k, device=device)).half()
    b = (offset + torch.randn(1, 2, 203, k, device=device)).half()  # GQA: 2 a-heads per b-head
    scale = 1 / 4096
    assert torch.isinf(a[0, 0] @ b[0, 0].T).all(), "the setup must overflow raw fp16 logits"
    for causal in (False, True):
        ours = flashmod.matmul_softmax(a, b, scale=scale, is_causal=causal)
        truth = matmul_softmax_ref(a, b, dtype=torch.float64, scale=scale, is_causal=causal)
        logits = (scale * (a.float() @ b.float().repeat_interleave(2, dim=1).transpose(-1, -2))).half()
        if causal:
            logits = logits.masked_fill(~torch.ones(37, 203, dtype=torch.bool, device=device).tril(), NEG_INF)
        plain = torch.softmax(logits, -1)
        assert torch.isfinite(ours).all(), f"k={k} causal={causal}: non-finite output"
        assert_rule(ours, truth, plain, f"fp16 k={k} causal={causal} raw logits past 65504")


@pytest.mark.parametrize("n", [1100, 2100, 9000])
def test_matmul_softmax_fallback_rows(device, n):
    """The fallback's normalize kernels on CUDA: rows cached in registers (16-byte packs when N is a
    multiple of the pack, single elements otherwise, 128 or 512 threads) and, past their capacity,
    the two-read loop. Depths 18 and 10 are no multiple of 4, so every dtype falls back."""
    for dtype in LOW:
        for k, causal in ((18, False), (10, True)):
            if dtype != torch.float32 and k == 18:
                continue
            a = torch.randn(1, 2, 6, k, device=device, dtype=dtype)
            b = torch.randn(1, 2, n, k, device=device, dtype=dtype)
            for nn in (n, n - 1):
                mask = torch.rand(6, nn, device=device) > 0.5
                mask[2] = False
                out = check_matmul_softmax(a, b[:, :, :nn], f"{dtype} n={nn} k={k}", is_causal=causal, attn_mask=mask)
                assert (out[:, :, 2] == 0).all()


def test_matmul_softmax_non_contiguous_and_empty(device):
    a = torch.randn(2, 9, 3, 16, device=device).transpose(1, 2)  # (B, H, M, K) view of (B, M, H, K)
    b = torch.randn(2, 16, 3, 11, device=device).permute(0, 2, 3, 1)  # last dim strided
    check_matmul_softmax(a, b, "strided")
    for dtype in LOW:  # the fused kernel with row stride 144 != depth 16
        a16 = torch.randn(2, 70, 9, 16, device=device, dtype=dtype).transpose(1, 2)
        b16 = torch.randn(2, 3, 50, 24, device=device, dtype=dtype)[..., 8:]  # 16-byte aligned view
        check_matmul_softmax(a16, b16, f"{dtype} strided", is_causal=True)
    # fp32 rows of 18 elements: row starts not 16-byte aligned, so the cuBLAS fallback at depth 16
    b18 = torch.randn(2, 3, 50, 18, device=device)[..., 2:]
    check_matmul_softmax(torch.randn(2, 3, 40, 16, device=device), b18, "f32 misaligned")
    for m, n in ((0, 5), (5, 0)):
        out = flashmod.matmul_softmax(torch.randn(1, 2, m, 8, device=device), torch.randn(1, 2, n, 8, device=device))
        assert out.shape == (1, 2, m, n)


def test_matmul_softmax_gradcheck():
    f64 = {"dtype": torch.float64, "requires_grad": True}
    a, b = torch.randn(1, 4, 5, 3, **f64), torch.randn(1, 2, 6, 3, **f64)
    mask = torch.rand(5, 6) > 0.3
    mask[2] = False
    for kw in (
        {},
        {"is_causal": True, "scale": 0.7},
        {"attn_mask": mask},
        {"attn_mask": torch.randn(4, 5, 6, dtype=torch.float64)},
    ):
        assert torch.autograd.gradcheck(partial(flashmod.matmul_softmax, **kw), (a, b))


def test_matmul_softmax_grad_matches_torch(device):
    a = torch.randn(2, 4, 20, 16, device=device, requires_grad=True)
    b = torch.randn(2, 4, 30, 16, device=device, requires_grad=True)
    g = torch.randn(2, 4, 20, 30, device=device)
    ours = torch.autograd.grad(flashmod.matmul_softmax(a, b, is_causal=True), (a, b), g)
    ref = torch.autograd.grad(matmul_softmax_ref(a, b, is_causal=True), (a, b), g)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_matmul_softmax_low_precision_gradients_and_tangents(device, dtype):
    """fp16 / bf16 gradients (factor 3) and forward-mode tangents (factor 2) by the rule against fp64,
    plain torch's autograd in the same dtype as the yardstick; GQA, causal, odd sizes. On the CPU their
    products run in fp32 where torch's GEMM in the dtype is a scalar loop (softmax_ops._product_dtype)."""
    a = torch.randn(2, 4, 37, 40, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(2, 2, 203, 40, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 4, 37, 203, device=device, dtype=dtype)
    ours = torch.autograd.grad(flashmod.matmul_softmax(a, b, is_causal=True, scale=0.3), (a, b), g)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    truth = torch.autograd.grad(matmul_softmax_ref(a64, b64, is_causal=True, scale=0.3), (a64, b64), g.double())
    plain = torch.autograd.grad(matmul_softmax_ref(a, b, is_causal=True, scale=0.3), (a, b), g)
    for name, o, t, pl in zip(("grad a", "grad b"), ours, truth, plain):
        assert o.dtype == dtype, name
        assert_within_rule(o, t, pl, 3, dtype, f"{dtype} {name}")
    a_t, b_t = torch.randn_like(a), torch.randn_like(b)
    with torch.no_grad():
        _, ours_t = torch.func.jvp(lambda x, y: flashmod.matmul_softmax(x, y, is_causal=True), (a, b), (a_t, b_t))

        def plain_fn(x, y):
            return matmul_softmax_ref(x, y, is_causal=True)

        _, truth_t = torch.func.jvp(plain_fn, (a.double(), b.double()), (a_t.double(), b_t.double()))
        _, plain_t = torch.func.jvp(plain_fn, (a, b), (a_t, b_t))
    assert_within_rule(ours_t, truth_t, plain_t, 2, dtype, f"{dtype} tangent")


def test_matmul_softmax_opcheck_and_compile(device):
    a = torch.randn(1, 4, 6, 8, device=device, requires_grad=True)
    b = torch.randn(1, 2, 7, 8, device=device, requires_grad=True)
    mask = torch.rand(6, 7, device=device) > 0.2
    op = torch.ops.flashmod.matmul_softmax.default
    torch.library.opcheck(op, (a, b), {"is_causal": True})
    torch.library.opcheck(op, (a, b), {"scale": 0.5, "attn_mask": mask})
    compiled = torch.compile(
        lambda x, y: flashmod.matmul_softmax(x + 1, y, attn_mask=mask), fullgraph=True, backend=compile_backend(device)
    )
    torch.testing.assert_close(compiled(a, b), matmul_softmax_ref(a + 1, b, attn_mask=mask))


def test_matmul_softmax_bad_inputs(device):
    a = torch.randn(1, 4, 6, 8, device=device)
    b = torch.randn(1, 2, 7, 8, device=device)
    flashmod.matmul_softmax(a, b, attn_mask=torch.ones(6, 7, dtype=torch.bool, device=device))  # positive control
    op = "flashmod.matmul_softmax: "
    cases = [
        ((a[0], b), {}, op + r"a must be a 4-D tensor \(batch, heads, seqlen, depth\), got a 3-D tensor"),
        ((a, b.half()), {}, op + "b must have a's dtype torch.float32, got torch.float16"),
        ((a, b[..., :5]), {}, op + r"b must have a's depth \(last dimension\) 8, got 5"),
        ((a, torch.randn(1, 3, 7, 8, device=device)), {}, op + "a's heads must be a multiple of b's heads"),
        (
            (a, b),
            {"attn_mask": torch.ones(6, 5, dtype=torch.bool, device=device)},
            op + r"attn_mask must be broadcastable to \(batch, a_heads, M, N\) = \[1, 4, 6, 7\], got shape \[6, 5\]",
        ),
        (
            (a, b),
            {"attn_mask": torch.ones(6, 7, dtype=torch.int32, device=device)},
            op + "attn_mask must be bool or a's dtype torch.float32, got torch.int32",
        ),
        ((a, b), {"scale": float("inf")}, op + "scale must be finite, got inf"),
    ]
    for args, kw, message in cases:
        with pytest.raises(RuntimeError, match=message):
            flashmod.matmul_softmax(*args, **kw)
    learned = torch.randn(6, 7, device=device, requires_grad=True)
    assert flashmod.matmul_softmax(a, b, attn_mask=learned).grad_fn is not None  # a mask gradient, not an error


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("knob", "value", "message"),
    [
        ("FLASHMOD_SOFTMAX_TRACE", "yes", "FLASHMOD_SOFTMAX_TRACE must be 0 or 1, got 'yes'"),
        ("FLASHMOD_SOFTMAX_STREAM", "off", "FLASHMOD_SOFTMAX_STREAM must be 0 or 1, got 'off'"),
        ("FLASHMOD_SOFTMAX_STREAM_CLUSTER", "4x", "FLASHMOD_SOFTMAX_STREAM_CLUSTER must be a whole number, got '4x'"),
        ("FLASHMOD_MMSM_SINGLE_PASS_MAX_N", "1e3", "FLASHMOD_MMSM_SINGLE_PASS_MAX_N must be a whole number, got '1e3'"),
        ("FLASHMOD_MMSM_FUSED", "3", "FLASHMOD_MMSM_FUSED must be 0, 1 or 2, got 3"),
        ("FLASHMOD_MMSM_WARP_ROWS", "on", "FLASHMOD_MMSM_WARP_ROWS must be 0 or 1, got 'on'"),
    ],
)
def test_softmax_knobs_reject_malformed_values(knob, value, message, monkeypatch):
    """The softmax knobs go through csrc/common/knobs.h like the others: a malformed value raises an
    error naming the knob (it used to be read as presence, or as atoi's prefix), and 0 turns TRACE off."""
    monkeypatch.setenv(knob, value)
    x = torch.randn(4, 100, device="cuda")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        if knob.startswith("FLASHMOD_MMSM"):
            flashmod.matmul_softmax(x[None, None], x[None, None])
        else:
            flashmod.softmax(x, -1)


@pytest.mark.cuda
def test_softmax_trace_zero_is_off(monkeypatch, capfd):
    monkeypatch.setenv("FLASHMOD_SOFTMAX_TRACE", "0")
    capfd.readouterr()
    x = torch.randn(2, 600000, device="cuda")
    y = flashmod.softmax(x, -1)
    torch.testing.assert_close(y, torch.softmax(x, -1))
    assert "flashmod softmax:" not in capfd.readouterr().err
