"""The serving ops against what a user would otherwise run, in one process (interleaved rounds, median).

    python benchmarks/bench_serve.py --group varlen    # ragged batch: varlen vs SDPA padded vs FlexAttention
    python benchmarks/bench_serve.py --group kvcache   # decode against a cache: contiguous, paged, SDPA
    python benchmarks/bench_serve.py --smoke           # tiny shapes, any device (checks the script runs)

varlen: sequence lengths drawn uniformly from [128, 8192] (--lengths; mean about half the maximum), packed for
flash_attn_varlen_func; SDPA runs on the right-padded batch (causal: is_causal, which is exact for the
valid rows of right-padded self-attention; not causal: a (B, 1, 1, N) key-padding mask) with each backend
forced in turn; FlexAttention runs on the packed row with a document mask (compiled). TFLOP/s count the
useful work only (each sequence's own pairs, halved by causality).

kvcache: B = 8, 32 query heads / 8 kv heads, D = 128, one new token per step appended at cache_seqlens,
caches of 1k ... 128k tokens, contiguous and paged (pages of 256 and 16 tokens); SDPA FLASH / CUDNN /
EFFICIENT (and flashmod.attention) read a contiguous cache of the same length without appending. Reported
as TFLOP/s and as a fraction of the device's copy rate, measured in the same run on as many bytes (read +
written) as the K/V bytes each step reads. Every call starts from a cold L2 and the contenders' order
rotates per round (harness.median_times, isolate): caches of 1k-4k tokens (34-134 MB) otherwise stay
partly in the 50 MB L2 from one contender to the next that reads the same cache.

    python benchmarks/bench_serve.py --group kvcache --sizes 1024,4096 --pages 16 --graphs --wall \
        --page-orders random,in-order,grouped \
        --variant "append kernel:FLASHMOD_KVCACHE_FUSED_APPEND=0"

--graphs adds each flashmod / SDPA contender captured in a CUDA graph ("[graph]": what a serving engine
replays per decode step, no host work per call); --wall the wall time per call of eager calls back to
back (where the host, not the GPU, sets the pace); --variant flashmod under FLASHMOD_* knobs too
(kvcache: its contiguous and paged calls), e.g. --group varlen --variant "fa2-style:FLASHMOD_SM90_WS=0".

Every contender's output is checked against flashmod's before it is timed. Results (JSON) go to
build/bench/serve_<group>.json (or --out-dir).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import flashmod  # noqa: E402
from flashmod.reference import effective_window, visible_keys  # noqa: E402

BACKENDS = {
    "FLASH": SDPBackend.FLASH_ATTENTION,
    "CUDNN": SDPBackend.CUDNN_ATTENTION,
    "EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
}


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> bool:
    err = (got.float() - want.float()).abs().max().item()
    if err > atol:
        print(f"  {name}: result differs from flashmod's by {err:.3e} (> {atol}); not timed")
        return False
    return True


def with_backward(fn: Callable[[], torch.Tensor], leaves: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
    """fn's forward and the gradients of its output with respect to leaves (a fixed random grad_out)."""
    grad_out = torch.randn_like(fn())

    def step() -> torch.Tensor:
        out = fn()
        torch.autograd.grad(out, leaves, grad_out)
        return out.detach()

    return step


def varlen_case(
    lengths: list[int],
    h: int,
    d: int,
    causal: bool,
    dtype,
    dev: str,
    reps: int,
    backward: bool = False,
    variants: dict[str, str] | None = None,
    dropout: float = 0.0,
    window: tuple[int, int] = (-1, -1),
) -> dict:
    """Every contender on one ragged batch, checked without dropout against flashmod's output, then
    timed with ``dropout`` (FlexAttention has none: left out when it is > 0). A ``window`` (flash-attn's
    (left, right), -1 unbounded) leaves SDPA out: it would need an explicit N x N mask per sequence."""
    total, longest, b = sum(lengths), max(lengths), len(lengths)
    q, k, v = (torch.randn(total, h, d, dtype=dtype, device=dev, requires_grad=backward) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    left, right = effective_window(causal, *window)  # causal is a band too, for the pair count and Flex
    windowed = window != (-1, -1)  # SDPA takes causality (is_causal), not a window
    pairs = sum(band_pairs(n, left, right) for n in lengths)
    # forward + backward counts 3.5x the forward's FLOPs, as bench_attention.py does.
    flops = 4 * pairs * h * d * (3.5 if backward else 1)

    def ours(p=dropout):
        return flashmod.flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, dropout_p=p, causal=causal, window_size=window
        )

    ref = ours(0.0).detach()
    # Right-padded (B, H, N, D) copies and the index of every packed row in them.
    seq = torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(lengths, device=dev))
    pos = torch.arange(total, device=dev) - cu[:-1].long()[seq]

    def pad(t):
        p = t.detach().new_zeros(b, longest, h, d)
        p[seq, pos] = t.detach()
        return p.transpose(1, 2).requires_grad_(backward)  # leaves: the padding copy is not timed

    qp, kp, vp = pad(q), pad(k), pad(v)
    key_ok = torch.zeros(b, longest, dtype=torch.bool, device=dev)
    key_ok[seq, pos] = True
    mask = None if causal else key_ok[:, None, None, :]
    fns = {"flashmod": ours}
    for label in variants or {}:
        fns[f"flashmod {label}"] = ours  # its knobs wrap the whole step, backward included (below)
    if windowed:
        print("  SDPA: left out (a window needs an explicit N x N mask)")
    for name, backend in BACKENDS.items():
        if windowed or dev != "cuda" or (name == "FLASH" and mask is not None):
            continue

        def sdpa(backend=backend, p=dropout):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=causal, dropout_p=p)

        try:
            got = sdpa(p=0.0).detach().transpose(1, 2)[seq, pos]
            sdpa()  # the backend takes dropout too
        except RuntimeError as err:
            print(f"  SDPA {name}: {str(err).splitlines()[0][:100]}")
            continue
        if check(f"SDPA {name}", got, ref, 2e-2):
            fns[f"SDPA {name}"] = sdpa
    if dev == "cpu" and not windowed:

        def sdpa_cpu(p=dropout):
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=causal, dropout_p=p)

        if check("SDPA", sdpa_cpu(0.0).detach().transpose(1, 2)[seq, pos], ref, 2e-2):
            fns["SDPA"] = sdpa_cpu
    flex_leaves = None
    try:
        if dropout > 0:
            raise NotImplementedError("no dropout")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = seq

        def document(b_, h_, qi, ki):
            keep = doc[qi] == doc[ki]
            if left >= 0:
                keep = keep & (qi - ki <= left)
            if right >= 0:
                keep = keep & (ki - qi <= right)
            return keep

        block_mask = create_block_mask(document, None, None, total, total, device=dev)
        flex = torch.compile(flex_attention)
        qf, kf, vf = flex_leaves = tuple(t.detach().transpose(0, 1)[None].requires_grad_(backward) for t in (q, k, v))

        def flex_doc():
            return flex(qf, kf, vf, block_mask=block_mask)

        if check("FlexAttention", flex_doc().detach()[0].transpose(0, 1), ref, 2e-2):
            fns["FlexAttention"] = flex_doc
    except Exception as err:  # noqa: BLE001 (reported, not hidden: the row says why flex is missing)
        print(f"  FlexAttention: {type(err).__name__}: {str(err).splitlines()[0][:100]}")
    if backward:

        def leaves(name: str) -> tuple[torch.Tensor, ...]:
            if name.startswith("flashmod"):  # its knob variants too
                return q, k, v
            return flex_leaves if name == "FlexAttention" else (qp, kp, vp)

        fns = {name: with_backward(fn, leaves(name)) for name, fn in fns.items()}
    for label, settings in (variants or {}).items():
        fns[f"flashmod {label}"] = harness.with_env(settings, fns[f"flashmod {label}"])
    times = harness.median_times(fns, dev, warmup=3, reps=reps)
    return {name: {"status": "ok", "ms": t * 1e3, "tflops": flops / t / 1e12} for name, t in times.items()}


def band_pairs(n: int, left: int, right: int) -> int:
    """(query, key) pairs of one self-attention sequence of n tokens under a (left, right) band
    (-1: unbounded), the useful work the TFLOP/s count."""
    seen = visible_keys(torch.arange(n), n, n, left, right, bottom_right=True)
    return n * n if seen is None else int(seen.sum())


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """fn captured in a CUDA graph (after a warm-up call on a side stream), replayed per call: what a
    serving engine launches for a decode step, without the per-call host work."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


PAGE_ORDERS = ("random", "in-order", "grouped")


def page_order(order: str, count: int, page_bytes: int, dev: str) -> torch.Tensor:
    """Pool slots for ``count`` pages in sequence order: a random permutation, the identity, or the
    identity shuffled within each 2 MB of pool (``grouped``)."""
    if order == "random":
        return torch.randperm(count, device=dev)
    ident = torch.arange(count, device=dev)
    if order == "in-order":
        return ident
    group = max(1, (2 << 20) // page_bytes)
    keys = (ident // group) * count + torch.randperm(count, device=dev)  # group first, random inside
    return ident[torch.argsort(keys)]


def page_pools(
    caches: tuple[torch.Tensor, ...], table: torch.Tensor, page: int, head_major: bool = False
) -> tuple[torch.Tensor, ...]:
    """Each (B, S, Hkv, D) cache's pages placed in a pool at ``table``'s slots, the pool seen as
    (pages, page, Hkv, D); ``head_major``: each page's memory is (Hkv, page, D) behind that view."""
    bsz, n = table.shape
    _, _, hkv, d = caches[0].shape
    pools = []
    for cache in caches:
        if head_major:
            pool = cache.new_empty(bsz * n, hkv, page, d).transpose(1, 2)
        else:
            pool = cache.new_empty(bsz * n, page, hkv, d)
        pool[table.long()] = cache.reshape(bsz, n, page, hkv, d)
        pools.append(pool)
    return tuple(pools)


def kvcache_case(
    s: int, bsz: int, hq: int, hkv: int, d: int, dtype, dev: str, reps: int, pages: list[int],
    variants: dict[str, str], graphs: bool, wall: bool, page_orders: tuple[str, ...] = ("random",),
    read_ceiling: bool = False, head_major: bool = False, without_append: bool = False,
) -> dict:  # fmt: skip
    k_cache, v_cache = (torch.randn(bsz, s, hkv, d, dtype=dtype, device=dev) for _ in range(2))
    q = torch.randn(bsz, 1, hq, d, dtype=dtype, device=dev)
    kn, vn = (torch.randn(bsz, 1, hkv, d, dtype=dtype, device=dev) for _ in range(2))
    seqlens = torch.full((bsz,), s - 1, dtype=torch.int32, device=dev)
    kv_bytes = 2 * bsz * s * hkv * d * k_cache.element_size()
    flops = 4 * bsz * hq * s * d

    def step(k_store: torch.Tensor, v_store: torch.Tensor, table: torch.Tensor | None = None):
        """The decode step (append and attention) on these caches or page pools."""
        return lambda: flashmod.flash_attn_with_kvcache(
            q, k_store, v_store, kn, vn, cache_seqlens=seqlens, block_table=table
        )

    contiguous = step(k_cache, v_cache)
    ref = contiguous()
    fns = {"flashmod": contiguous}
    for label, settings in variants.items():
        fn = harness.with_env(settings, contiguous)
        if check(label, fn(), ref, 2e-2):
            fns[label] = fn
    if without_append:
        # The same step's attention (the cache already holds the new row) without the append, with
        # the lengths on the device and without them (every slot valid, known on the host): what
        # the append and the device-side length each cost the step.
        full = torch.full_like(seqlens, s)
        for label, fn in (
            ("no append", lambda: flashmod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full)),
            ("no append, no lengths", lambda: flashmod.flash_attn_with_kvcache(q, k_cache, v_cache)),
        ):
            if check(label, fn(), ref, 2e-2):
                fns[label] = fn
    # Pages in random order (a pool after much allocation and freeing). The other orders tell what the
    # scatter costs from what the paging itself costs (the kernel's per-page work): "in-order" is the
    # contiguous cache's memory seen through a block table; "grouped" shuffles the pages only within
    # each 2 MB of the pool (the GPU's large-page size), so a sequence's pages stay in few address
    # translations while their order inside each 2 MB is random.
    for page, order in [(p, o) for p in pages for o in page_orders]:
        if s % page:
            continue
        n = s // page
        perm = page_order(order, bsz * n, page * hkv * d * k_cache.element_size(), dev)
        table = perm.to(torch.int32).reshape(bsz, n)
        paged = step(*page_pools((k_cache, v_cache), table, page), table)
        label = f"paged {page}" + ("" if order == "random" else f" {order}")
        if check(label, paged(), ref, 0.0):
            fns[label] = paged
            for variant, settings in variants.items():
                fn = harness.with_env(settings, paged)
                if check(f"{label} {variant}", fn(), ref, 2e-2):
                    fns[f"{label} {variant}"] = fn
    if head_major:
        # The same caches with each kv head's rows contiguous (SDPA's (B, Hkv, S, D) memory; pages as
        # (pages, Hkv, page, D)) behind flash-attn's view: the decode kernel's CTA (one kv head) then
        # streams whole ranges instead of a 256-byte slice of every token's 2 KB row, which tells
        # what the slices cost the memory system.
        k_hm, v_hm = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
        contiguous_hm = step(k_hm, v_hm)
        if check("flashmod head-major", contiguous_hm(), ref, 0.0):
            fns["flashmod head-major"] = contiguous_hm
        for page in [p for p in pages if s % p == 0]:
            n = s // page
            table = torch.randperm(bsz * n, device=dev).to(torch.int32).reshape(bsz, n)
            paged_hm = step(*page_pools((k_cache, v_cache), table, page, head_major=True), table)
            if check(f"paged {page} head-major", paged_hm(), ref, 0.0):
                fns[f"paged {page} head-major"] = paged_hm
        if dev == "cuda":
            kb_hm, vb_hm = k_hm.transpose(1, 2), v_hm.transpose(1, 2)

            def cudnn_hm():
                with sdpa_kernel([BACKENDS["CUDNN"]]):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), kb_hm, vb_hm, enable_gqa=True)

            try:
                if check("SDPA CUDNN head-major", cudnn_hm().transpose(1, 2), ref, 2e-2):
                    fns["SDPA CUDNN head-major"] = cudnn_hm
            except RuntimeError as err:
                print(f"  SDPA CUDNN head-major: {str(err).splitlines()[0][:100]}")
    qb, kb, vb = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)

    def dense():
        return flashmod.attention(qb, kb, vb)

    if check("flashmod.attention", dense().transpose(1, 2), ref, 2e-2):
        fns["flashmod.attention"] = dense
    for name, backend in BACKENDS.items():
        if dev != "cuda":
            continue

        def sdpa(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)

        try:
            got = sdpa().transpose(1, 2)
        except RuntimeError as err:
            print(f"  SDPA {name}: {str(err).splitlines()[0][:100]}")
            continue
        if check(f"SDPA {name}", got, ref, 2e-2):
            fns[f"SDPA {name}"] = sdpa
    if graphs and dev == "cuda":
        for name in [n for n in fns if n == "flashmod" or n.startswith(("paged", "SDPA"))]:
            try:
                fns[f"{name} [graph]"] = graphed(fns[name])
            except RuntimeError as err:
                print(f"  {name} [graph]: {str(err).splitlines()[0][:100]}")
    walls = {}
    if wall:
        # Back-to-back calls without graphs, one synchronize: the host's cost per call where it is
        # larger than the device's (a decode step of one layer, eager).
        walls = {name: harness.host_seconds_per_call(fn, dev, calls=300) for name, fn in fns.items()}
    src = torch.empty(kv_bytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)  # moves kv_bytes (read + written)
    if read_ceiling:
        # What a plain stream over as many bytes as the step reads reaches (torch's reduction
        # kernel, one launch): the ceiling a decode step's fixed costs are measured against.
        flat = torch.randn(kv_bytes // 2, dtype=torch.bfloat16, device=dev)
        fns["read (torch sum)"] = lambda: flat.sum(dtype=torch.float32)
    times = harness.median_times(fns, dev, warmup=3, reps=reps, isolate=dev == "cuda")
    copy_rate = kv_bytes / times.pop("copy")
    return {
        name: {
            "status": "ok",
            "ms": t * 1e3,
            "tflops": flops / t / 1e12,
            "of_copy": kv_bytes / t / copy_rate,
            **({"wall_us": walls[name] * 1e6} if name in walls else {}),
        }
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--group", default="all", choices=["varlen", "kvcache", "all"])
    parser.add_argument(
        "--varlen-backward", action="store_true", help="varlen: forward + backward (training) instead of the forward"
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="varlen: dropout_p of every contender (training)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks that the script runs")
    parser.add_argument("--head-dim", type=int, default=128, help="varlen: head dim (GPU shapes)")
    parser.add_argument(
        "--window", default="-1,-1", help="varlen: LEFT,RIGHT, flash-attn's window_size (-1: unbounded; SDPA left out)"
    )
    parser.add_argument("--reps", type=int, default=20, help="timed rounds (the median is reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sequence lengths")
    parser.add_argument(
        "--lengths", default="128,8192", help="varlen: LO,HI, the range each sequence's length is drawn from"
    )
    parser.add_argument("--out-dir", default=None, help="where the JSON files go (default: build/bench)")
    parser.add_argument("--sizes", default=None, help="kvcache: cache lengths, comma-separated (default 1k..128k)")
    parser.add_argument("--pages", default="256,16", help="kvcache: page sizes of the paged contenders")
    parser.add_argument("--graphs", action="store_true", help="kvcache: also each contender captured in a CUDA graph")
    parser.add_argument("--wall", action="store_true", help="kvcache: also wall time per call, back to back, eager")
    parser.add_argument(
        "--read-ceiling",
        action="store_true",
        help="kvcache: also a plain read of the step's K/V bytes (torch sum), the ceiling of a decode step",
    )
    parser.add_argument(
        "--without-append",
        action="store_true",
        help="kvcache: also the step without its append, with and without device-side lengths",
    )
    parser.add_argument(
        "--head-major",
        action="store_true",
        help="kvcache: also caches and pages with each kv head's rows contiguous (what the per-head slices cost)",
    )
    parser.add_argument(
        "--page-orders",
        default="random",
        help=f"kvcache: orders of the pages in the pool, comma-separated, of {', '.join(PAGE_ORDERS)} "
        "(in-order: the cost of paging alone; grouped: random within each 2 MB of pool)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:NAME=VALUE[,NAME=VALUE]",
        help="also flashmod under these FLASHMOD_* knobs (kvcache: the contiguous and paged calls; repeatable)",
    )
    args = parser.parse_args()
    dev, dtype = args.device, torch.bfloat16
    default_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "bench")
    out_dir = args.out_dir or default_dir
    print(f"serving ops on {harness.device_name(dev)}, bf16")
    gen = torch.Generator().manual_seed(args.seed)
    variants = dict(v.split(":", 1) for v in args.variant)
    if args.group in ("varlen", "all"):
        rows = []
        lo, hi = (int(x) for x in args.lengths.split(","))
        lo, hi, batches = (16, 256, [4]) if args.smoke else (lo, hi, [8, 16])
        h, d = (2, 64) if args.smoke else (2048 // args.head_dim, args.head_dim)
        window = tuple(int(x) for x in args.window.split(","))
        if dev == "cpu" and not args.smoke:  # the CPU's ragged batch: 8 sequences of 128-1024 tokens
            lo, hi, batches, h, d = 128, 1024, [8], 8, 64
        for b in batches:
            lengths = torch.randint(lo, hi + 1, (b,), generator=gen).tolist()
            for causal in (False, True):
                label = f"varlen B={b} H={h} D={d} N={min(lengths)}..{max(lengths)} mean {sum(lengths) // b}" + (
                    " causal" if causal else ""
                )
                label += " fwd+bwd" if args.varlen_backward else ""
                label += f" dropout {args.dropout}" if args.dropout else ""
                label += f" window {window}" if window != (-1, -1) else ""
                print(label)
                reps = 3 if args.smoke else args.reps
                res = varlen_case(
                    lengths, h, d, causal, dtype, dev, reps, args.varlen_backward, variants, args.dropout, window
                )
                rows.append({"label": label, "lengths": lengths, "causal": causal, "results": res})
        contenders = sorted({c for r in rows for c in r["results"]}, key=lambda c: c != "flashmod")
        harness.print_table(rows, contenders)
        name = "serve_varlen_fwdbwd" if args.varlen_backward else "serve_varlen"
        name += f"_dropout{args.dropout}.json" if args.dropout else ".json"
        harness.write_json(os.path.join(out_dir, name), {"device": harness.device_name(dev), "rows": rows})
    if args.group in ("kvcache", "all"):
        rows = []
        sizes = [256, 1024] if args.smoke else [1024, 4096, 16384, 65536, 131072]
        if args.sizes:
            sizes = [int(x) for x in args.sizes.split(",")]
        bsz, hq, hkv, d = (2, 4, 2, 64) if args.smoke else (8, 32, 8, 128)
        pages = [int(x) for x in args.pages.split(",") if x]
        page_orders = tuple(x for x in args.page_orders.split(",") if x)
        if unknown := set(page_orders) - set(PAGE_ORDERS):
            parser.error(f"--page-orders: expected some of {', '.join(PAGE_ORDERS)}, got {', '.join(sorted(unknown))}")
        for s in sizes:
            label = f"kvcache B={bsz} Hq={hq} Hkv={hkv} D={d} cache={s}"
            print(label)
            res = kvcache_case(
                s, bsz, hq, hkv, d, dtype, dev, 3 if args.smoke else args.reps, pages, variants,
                args.graphs, args.wall, page_orders, args.read_ceiling, args.head_major, args.without_append,
            )  # fmt: skip
            rows.append({"label": label, "cache": s, "results": res})
        contenders = sorted({c for r in rows for c in r["results"]}, key=lambda c: c != "flashmod")
        harness.print_table(rows, contenders)
        cold = "; every call from a cold L2" if dev == "cuda" else ""
        print(f"fraction of the copy rate (bytes read + written, same run{cold}):")
        for r in rows:
            print(f"  {r['label']}: " + ", ".join(f"{c} {x['of_copy']:.2f}" for c, x in r["results"].items()))
        if args.wall:
            print("wall time per call, back to back, eager (us):")
            for r in rows:
                walls = ", ".join(f"{c} {x['wall_us']:.1f}" for c, x in r["results"].items() if "wall_us" in x)
                print(f"  {r['label']}: {walls}")
        harness.write_json(
            os.path.join(out_dir, "serve_kvcache.json"), {"device": harness.device_name(dev), "rows": rows}
        )


if __name__ == "__main__":
    main()
