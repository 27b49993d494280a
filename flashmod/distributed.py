"""Context-parallel (ring) attention on ``torch.distributed``.

Each rank holds a slice of the sequence. K/V slices travel around the ring of ranks with
point-to-point sends overlapped with the local attention, and the partial results are merged exactly
through their log-sum-exps (:func:`flashmod.merge_attention`). The backward runs the ring again, in
the other direction: K/V travel with their gradient sums, and every rank adds its queries' share with
the single-device backward kernel (``flashmod::attention_backward`` against the merged output and
lse, which makes each share exact without renormalizing).

Placement: non-causal attention takes contiguous slices. Causal attention splits the sequence into
``2 * world_size`` chunks and gives rank ``r`` chunks ``r`` and ``2 * world_size - 1 - r`` (zigzag),
so every rank does the same amount of causal work; each ring step is then one dense attention call
(the first chunk's queries see the visiting first chunk, or the second chunk's queries see both
visiting chunks), and step 0 is plain causal attention on the local slice.
:func:`shard_sequence` and :func:`unshard_sequence` place a sequence and gather it back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .merge_ops import merge_attention
from .ops import attention_op


def _chunk_lengths(total: int, chunks: int) -> list[int]:
    """Lengths of ``torch.tensor_split(x, chunks)``: the first ``total % chunks`` get one more."""
    return [total // chunks + (1 if i < total % chunks else 0) for i in range(chunks)]


def _rank_chunks(rank: int, world_size: int, causal: bool) -> list[int]:
    return [rank, 2 * world_size - 1 - rank] if causal else [rank]


def shard_sequence(x: Tensor, dim: int, rank: int, world_size: int, causal: bool = False) -> Tensor:
    """The slice of ``x`` along ``dim`` that rank ``rank`` holds in :func:`ring_attention`.

    Non-causal: the ``rank``-th of ``world_size`` contiguous pieces (``torch.tensor_split``'s sizes).
    Causal: pieces ``rank`` and ``2 * world_size - 1 - rank`` of ``2 * world_size``, concatenated.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_sequence: rank must be in [0, world_size={world_size}), got {rank}")
    pieces = torch.tensor_split(x, 2 * world_size if causal else world_size, dim=dim)
    return torch.cat([pieces[c] for c in _rank_chunks(rank, world_size, causal)], dim=dim)


def unshard_sequence(parts: list[Tensor], dim: int, causal: bool = False) -> Tensor:
    """Inverse of :func:`shard_sequence`: ``parts[r]`` is rank ``r``'s slice; returns the sequence."""
    world_size = len(parts)
    if not causal:
        return torch.cat(parts, dim=dim)
    total = sum(p.shape[dim] for p in parts)
    lengths = _chunk_lengths(total, 2 * world_size)
    ordered: list[Tensor | None] = [None] * (2 * world_size)
    for rank, part in enumerate(parts):
        first, second = _rank_chunks(rank, world_size, True)
        ordered[first], ordered[second] = torch.split(part, [lengths[first], lengths[second]], dim=dim)
    return torch.cat(ordered, dim=dim)


class _Ring:
    """Who sends to whom, and the slice lengths every rank holds: from the whole sequence's length
    when the caller gives it, else from one all_gather of ints (a host synchronization)."""

    def __init__(
        self,
        group,
        local_len: int,
        device: torch.device,
        causal: bool,
        window: tuple[int, int] = (-1, -1),
        seqlen: int | None = None,
        agreement: dict[str, float] | None = None,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Point-to-point ops name peers by their global rank.
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.next = ranks[(self.rank + 1) % self.world_size]
        self.prev = ranks[(self.rank - 1) % self.world_size]
        if seqlen is None:
            # The slice lengths, and with them what every rank must pass alike (shapes, dtype,
            # options): a mismatch would otherwise surface as a transport error on one rank and a
            # reset connection or a hang on the others, or not at all (B and H swapped).
            # float64 holds the ints exactly (all below 2^53) and the float options as they are.
            fields = agreement or {}
            mine = torch.tensor([local_len, *fields.values()], dtype=torch.float64, device=device)
            gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(gathered, mine, group=group)
            rows = [t.tolist() for t in gathered]
            self.local_lens = [int(row[0]) for row in rows]
            for i, name in enumerate(fields, start=1):
                if any(row[i] != rows[0][i] for row in rows):
                    raise ValueError(
                        f"ring_attention: every rank must pass the same {name}, got "
                        f"{[_shown(name, row[i]) for row in rows]} on ranks 0..{self.world_size - 1}"
                    )
        else:
            chunk = _chunk_lengths(seqlen, 2 * self.world_size if causal else self.world_size)
            self.local_lens = [
                sum(chunk[c] for c in _rank_chunks(r, self.world_size, causal)) for r in range(self.world_size)
            ]
            if self.local_lens[self.rank] != local_len:
                raise ValueError(
                    f"ring_attention: seqlen={seqlen} places {self.local_lens[self.rank]} tokens on rank "
                    f"{self.rank} of {self.world_size} (shard_sequence(..., causal={causal})), but its "
                    f"q, k and v hold {local_len}"
                )
        self.causal = causal
        # The band of visible keys around each query's global position (-1: unbounded side).
        self.window_left, self.window_right = window[0], (0 if causal else window[1])
        # Per rank: its chunks as (global start, length, offset in the rank's slice).
        self.chunks: list[list[tuple[int, int, int]]] = []
        if causal:
            chunk = _chunk_lengths(sum(self.local_lens), 2 * self.world_size)
            starts = [sum(chunk[:c]) for c in range(2 * self.world_size)]
            self.first_len = [chunk[r] for r in range(self.world_size)]
            expected = [chunk[r] + chunk[2 * self.world_size - 1 - r] for r in range(self.world_size)]
            if expected != self.local_lens:
                raise ValueError(
                    "ring_attention(causal=True): the ranks' sequence slices must be placed by "
                    f"shard_sequence(..., causal=True) (lengths {expected}), got lengths {self.local_lens}"
                )
            for r in range(self.world_size):
                second = 2 * self.world_size - 1 - r
                self.chunks.append([(starts[r], chunk[r], 0), (starts[second], chunk[second], chunk[r])])
        else:
            for r in range(self.world_size):
                self.chunks.append([(sum(self.local_lens[:r]), self.local_lens[r], 0)])

    def source(self, step: int) -> int:
        """The rank whose K/V slice this rank holds at ``step``."""
        return (self.rank - step) % self.world_size

    def exchange(self, send: list[Tensor], recv_like_rank: int, backward: bool = False) -> tuple[list, list[Tensor]]:
        """Starts sending ``send`` to the next rank and receiving the previous rank's tensors (the other
        way round when ``backward``), shaped as rank ``recv_like_rank``'s slice along dim 2 and typed
        as ``send``. Returns the requests and the receive buffers."""
        buffers = []
        for t in send:
            shape = list(t.shape)
            shape[2] = self.local_lens[recv_like_rank]
            buffers.append(torch.empty(shape, dtype=t.dtype, device=t.device))
        to, source = (self.prev, self.next) if backward else (self.next, self.prev)
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, b, source, self.group) for b in buffers]
        return dist.batch_isend_irecv(ops), buffers

    @property
    def banded(self) -> bool:
        """Whether steps are planned chunk pair by chunk pair (sliding windows), not one dense call."""
        return not (self.window_left < 0 and self.window_right < 0 or self.causal and self.window_left < 0)

    def step_calls(self, step: int) -> list[tuple[slice, slice, bool, int, int]]:
        """This step's attention calls: (query rows, key rows of the visiting slice, causal, window_left,
        window_right), each a top-left aligned call of the single-device op."""
        if not self.banded:
            plan = self._dense_plan(step)
            return [] if plan is None else [(*plan, -1, -1)]
        return self._banded_calls(step, self.chunks[self.rank])

    def own_step_in_two(self) -> tuple[list, list]:
        """Step 0's calls (the rank's own K/V) split by query rows into a first part and the rest, each
        a list like :meth:`step_calls`'s. The backward runs the first part while the first visiting K/V
        arrive and the rest last, while the sums of its own dK/dV come home. Causal: the first chunk's
        causal square (a quarter of the step), then the second chunk's rows, which see every key up to
        their own (a right window bound of the first chunk's length, top-left)."""
        if self.world_size == 1:
            return self.step_calls(0), []
        if self.banded:
            start, length, offset = self.chunks[self.rank][0]
            half = length // 2
            first = [(start, half, offset)]
            rest = [(start + half, length - half, offset + half), *self.chunks[self.rank][1:]]
            return self._banded_calls(0, first), self._banded_calls(0, rest)
        rows = self.local_lens[self.rank]
        if self.causal:
            h = self.first_len[self.rank]
            first, rest = [(slice(0, h), slice(0, h), True, -1, -1)], [(slice(h, None), slice(None), False, -1, h)]
        else:
            h = rows // 2
            first, rest = [(slice(0, h), slice(None), False, -1, -1)], [(slice(h, None), slice(None), False, -1, -1)]
        # A rank with fewer than two rows has nothing to split off.
        return [c for c in first if 0 < h], [c for c in rest if h < rows]

    def _dense_plan(self, step: int) -> tuple[slice, slice, bool] | None:
        """Full or causal attention: one call per step (zigzag placement makes every step after the
        first one dense call), or None when none of this rank's queries sees the visiting keys."""
        src = self.source(step)
        if step == 0:
            return slice(None), slice(None), self.causal
        if not self.causal:
            return slice(None), slice(None), False
        if src < self.rank:  # both local query chunks lie after the visiting first chunk only
            return slice(None), slice(0, self.first_len[src]), False
        # src > rank: only the local second chunk lies after the visiting slice, and after all of it
        return slice(self.first_len[self.rank], None), slice(None), False

    def _banded_calls(
        self, step: int, query_chunks: list[tuple[int, int, int]]
    ) -> list[tuple[slice, slice, bool, int, int]]:
        """Sliding windows: one call per (query chunk, visiting key chunk) pair whose band meets, for
        ``query_chunks`` of this rank's (global start, length, offset in its slice).
        Query i (global a + i) sees key j (global b + j) iff j - i lies in [d - wl, d + wr], d = a - b.
        The op's band is centred on j - i = 0, so keys left of a band that starts above 0 and queries
        above a band that ends below 0 are sliced off (they see nothing), which re-centres it."""
        calls = []
        wl, wr = self.window_left, self.window_right
        for a, lq, q_off in query_chunks:
            for b, lk, k_off in self.chunks[self.source(step)]:
                d = a - b
                low = d - wl if wl >= 0 else None
                high = d + wr if wr >= 0 else None
                key_skip = max(0, low) if low is not None else 0
                query_skip = max(0, -high) if high is not None else 0
                if key_skip >= lk or query_skip >= lq:
                    continue
                d += query_skip - key_skip
                call_wl = wl - d if wl >= 0 else -1  # d - wl <= 0 after the slicing
                call_wr = d + wr if wr >= 0 else -1  # d + wr >= 0 after the slicing
                rows = slice(q_off + query_skip, q_off + lq)
                keys = slice(k_off + key_skip, k_off + lk)
                calls.append((rows, keys, False, call_wl, call_wr))
        return calls


def _rows(t: Tensor, rows: slice) -> Tensor:
    return t[:, :, rows]


# Dense forward steps on Hopper get a right window bound past every key: it hides nothing, and it
# makes the forward's persistent kernel claim tiles as its CTAs free up rather than deal them
# round-robin (the other GPUs' forward kernels take one CTA per tile and would only pay the
# window's checks). A step runs beside the next step's exchange, whose NCCL kernels hold some SMs
# for a while; a round-robin CTA that starts late on such an SM delays the whole call by as much
# (4 H100s, N = 128k causal, the forward: 36.9 -> 32.0 ms; benchmarks/results/design/merge-and-ring.md).
# False only for bench_ring.py's A/B.
_BOUND_DENSE_STEPS = True


def _ring_forward(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, scale, softcap: float) -> tuple[Tensor, Tensor]:
    """The ring's forward: each step's attention calls on the visiting K/V, merged through the lse,
    with the next step's K/V in flight meanwhile. Returns this rank's rows of (out, lse)."""
    out = lse = None  # nothing merged yet
    bound_dense = _BOUND_DENSE_STEPS and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
    k_cur, v_cur = k, v
    for step in range(ring.world_size):
        kv_in_flight = None
        if step < ring.world_size - 1:
            kv_in_flight = ring.exchange([k_cur, v_cur], ring.source(step + 1))
        for rows, keys, step_causal, wl, wr in ring.step_calls(step):
            if bound_dense and not step_causal and wl < 0 and wr < 0:
                wr = _rows(k_cur, keys).shape[2]  # top-left: query 0 already sees every key
            o_part, lse_part = attention_op(
                _rows(q, rows), _rows(k_cur, keys), _rows(v_cur, keys), None, scale, step_causal, False,
                wl, wr, softcap,
            )  # fmt: skip
            if out is None and rows == slice(None):
                out, lse = o_part, lse_part  # the first share of every row needs no merge pass
                continue
            if out is None:
                out, lse = _nothing_seen(q)
            merged_o, merged_lse = merge_attention([_rows(out, rows), o_part], [lse[:, :, rows], lse_part])
            out[:, :, rows] = merged_o
            lse[:, :, rows] = merged_lse
        if kv_in_flight is not None:
            k_cur, v_cur = _arrived(kv_in_flight)
    if out is None:  # no key was visible to any local query
        out, lse = _nothing_seen(q)
    return out, lse


def _ring_backward(
    ring: _Ring, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, scale, softcap: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The ring's backward: dQ of this rank's rows (fp32), dK/dV of its K/V slice (k's and v's dtype).

    The forward saw the slices of ranks r, r - 1, ..., r + 1 in turn; the backward visits them the
    other way round, r + 1 first and its own last, with K/V and the dK/dV sums travelling to rank
    r - 1. So each slice's sums end their trip at its owner, added to its own share of the last
    kernels, and no transfer is left after them. Every exchange runs beside kernels:
    - the own slice's first part of rows (:meth:`_Ring.own_step_in_two`) while rank r + 1's K/V
      arrive;
    - each visiting slice while the next one's K/V arrive, and while the sums so far of its own
      dK/dV arrive from rank r + 1 (added after its kernels, then sent on);
    - the rest of the own slice's rows while its sums come home.
    The sums leave a visiting slice's first visit as the one bf16 part they are (dense steps, one
    call), and in fp32 once they add several parts.
    """
    dq = torch.zeros_like(q, dtype=torch.float32)

    def backward_calls(calls, k_cur: Tensor, v_cur: Tensor) -> list[tuple[slice, Tensor, Tensor]]:
        parts = []
        for rows, keys, step_causal, wl, wr in calls:
            dq_part, dk_part, dv_part, _ = torch.ops.flashmod.attention_backward(
                _rows(grad_out, rows), None, _rows(q, rows), _rows(k_cur, keys), _rows(v_cur, keys),
                _rows(out, rows), lse[:, :, rows], None, scale, step_causal, False, wl, wr, softcap,
            )  # fmt: skip
            dq[:, :, rows] += dq_part
            parts.append((keys, dk_part, dv_part))
        return parts

    def add_parts(sums: list[Tensor], parts) -> list[Tensor]:
        for keys, dk_part, dv_part in parts:
            sums[0][:, :, keys] += dk_part
            sums[1][:, :, keys] += dv_part
        return sums

    last = ring.world_size - 1
    own_first, own_rest = ring.own_step_in_two()
    kv_in_flight = ring.exchange([k, v], ring.source(last), backward=True) if last > 0 else None
    own_parts = backward_calls(own_first, k, v)
    sums_in_flight = None
    for step in range(last, 0, -1):
        k_cur, v_cur = _arrived(kv_in_flight)
        kv_in_flight = ring.exchange([k_cur, v_cur], ring.source(step - 1), backward=True) if step > 1 else None
        parts = backward_calls(ring.step_calls(step), k_cur, v_cur)
        if sums_in_flight is None:
            sum_dtype = torch.float32 if ring.banded else None  # a dense step's one part, exactly
            sums = [torch.zeros_like(k_cur, dtype=sum_dtype), torch.zeros_like(v_cur, dtype=sum_dtype)]
        else:
            sums = [t.float() for t in _arrived(sums_in_flight)]
        sums_in_flight = ring.exchange(add_parts(sums, parts), ring.source(step - 1), backward=True)
    own_parts += backward_calls(own_rest, k, v)
    if sums_in_flight is None:
        sums = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
    else:
        sums = [t.float() for t in _arrived(sums_in_flight)]
    dk, dv = add_parts(sums, own_parts)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _shown(name: str, value: float):
    """A gathered agreement field as the caller passed it."""
    if name == "dtype":
        return str(_DTYPES[int(value)]) if 0 <= value < len(_DTYPES) else value
    return value if name in ("scale", "softcap") else int(value)


def _agreement(q: Tensor, k: Tensor, causal: bool, scale: float | None, softcap: float, window) -> dict[str, float]:
    """What every rank of one ring call must share, gathered with the slice lengths."""
    return {
        "batch": q.shape[0], "q heads": q.shape[1], "k/v heads": k.shape[1], "head_dim": q.shape[3],
        "dtype": _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, "causal": int(causal),
        "window_size left": window[0], "window_size right": window[1],
        "scale": -1.0 if scale is None else float(scale), "softcap": float(softcap),
    }  # fmt: skip


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, softcap, window, ring_type=_Ring, seqlen=None):
        # ring_type: benchmarks/bench_ring.py swaps in a ring without exchanges to time the compute.
        ring = ring_type(
            group, q.shape[2], q.device, causal, window, seqlen, _agreement(q, k, causal, scale, softcap, window)
        )
        out, lse = _ring_forward(ring, q, k, v, scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.softcap = ring, scale, softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if torch.is_grad_enabled():  # create_graph=True: a graph of the gradients is asked for
            raise RuntimeError(
                "ring_attention: double backward (create_graph=True) is not supported: the exchanges "
                "between ranks are in no autograd graph, so the gradients' own derivatives would be wrong"
            )
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, q, k, v, out, lse, grad_out.contiguous(), ctx.scale, ctx.softcap)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def _nothing_seen(q: Tensor) -> tuple[Tensor, Tensor]:
    """The output and lse of rows that have seen no key yet: 0 and -inf."""
    return torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)


def _arrived(in_flight: tuple[list, list[Tensor]]) -> list[Tensor]:
    """Waits for an exchange's requests (on a GPU: orders the current stream after them) and returns
    its receive buffers."""
    requests, buffers = in_flight
    for request in requests:
        request.wait()
    return buffers


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    seqlen: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence split across the ranks of ``group`` (SDPA layout ``(B, H, S, D)``).

    Every rank passes its own slice ``q``, ``k``, ``v`` (placed by :func:`shard_sequence` with the same
    ``causal``) and gets its queries' rows of the full attention, as single-device
    ``flashmod.attention`` over the whole sequence would give them. GQA (fewer k/v heads) and softcap
    and sliding windows work as in the single-device op; causal is top-left aligned over the full
    sequence (SDPA's ``is_causal``). Differentiable with respect to q, k and v (first order: double
    backward is an error). The slices may differ in length: without ``seqlen`` each call first gathers
    them (one ``all_gather`` and a host synchronization, which stops the host from queueing work ahead
    of the GPU), and with them checks that every rank passed the same batch, heads, head dim, dtype
    and options; with ``seqlen``, they follow from the placement and nothing waits (nor is checked).
    Strided k/v (e.g. views of ``(B, S, H, D)`` tensors) are made contiguous for the exchanges. The
    partial results merge through their fp32 lse, so fp64 inputs get about fp32 accuracy (~1e-7).

    Args:
        q: ``(B, Hq, S_local, D)``; k, v: ``(B, Hkv, S_local, D)``, this rank's slices.
        group: the process group forming the ring (default: the world).
        causal: causal attention over the full sequence (slices placed in zigzag order).
        scale: score scale (default ``1/sqrt(D)``).
        softcap: ``softcap * tanh(score / softcap)`` when > 0.
        return_lse: also return the float32 log-sum-exp ``(B, Hq, S_local)``.
        window_size: ``(left, right)`` sliding window over global positions: query ``i`` sees keys
            ``i - left <= j <= i + right`` (``-1``: unbounded side; causal sets ``right = 0``).
        seqlen: the whole sequence's length, the same on every rank, with the slices placed by
            :func:`shard_sequence` (checked against this rank's slice). Skips the per-call gather of
            the slice lengths.
    """
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        raise ValueError(f"ring_attention: window_size must be a pair of ints >= -1 (left, right), got {window_size!r}")
    if seqlen is not None and (not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1):
        raise ValueError(f"ring_attention: seqlen must be a positive int (the whole sequence's length), got {seqlen!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed must be initialized (dist.init_process_group)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"ring_attention: {name} must be 4-D (batch, heads, seqlen, head_dim), got shape {list(t.shape)}"
            )
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(
            "ring_attention: q, k and v must hold the same sequence slice, got lengths "
            f"q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}"
        )
    if k.shape[3] != q.shape[3] or v.shape[3] != q.shape[3]:
        raise ValueError(
            f"ring_attention: q, k and v must share one head_dim, got q {q.shape[3]}, k {k.shape[3]}, v {v.shape[3]}"
        )
    if isinstance(scale, Tensor):
        if scale.requires_grad:
            raise TypeError("ring_attention: scale must be a float; a tensor scale that requires grad gets none here")
        scale = float(scale)
    # The K/V slices travel as flat buffers, received as contiguous (B, H, S, D): a strided view
    # (a (B, S, H, D) transpose, a chunk of a fused qkv) is sent in its storage order, which gloo
    # refuses and NCCL would deliver scrambled.
    k, v = k.contiguous(), v.contiguous()
    out, lse = _RingAttention.apply(q, k, v, group, causal, scale, softcap, tuple(window_size), _Ring, seqlen)
    return (out, lse) if return_lse else out


def ring_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    group: dist.ProcessGroup | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    seqlen: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`ring_attention` in flash-attn's layout: q ``(B, S_local, Hq, D)``, k/v ``(B, S_local, Hkv, D)``;
    shard along dim 1. Returns ``(B, S_local, Hq, D)`` (and the lse ``(B, Hq, S_local)``)."""
    result = ring_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group, causal, softmax_scale, softcap, True,
        window_size, seqlen,
    )  # fmt: skip
    out, lse = result
    return (out.transpose(1, 2), lse) if return_lse else out.transpose(1, 2)
