"""CPU backend: the collectives of server/reference.py between engine processes, through
shared memory.

It mirrors the GPU design: every group has one communication file (the analogue of the symmetric
heap) with a slot per rank, arrival words (the analogue of NVSHMEM signals) and an abort word.
A collective is pull-based:

    1. wait until every rank has finished reading the previous collective (so slots are free),
    2. copy this rank's inputs into its slot and raise its arrival word,
    3. wait for every rank's arrival (deadline + abort word),
    4. notify: compute the receive counts from the sources' routing and publish them into the
       session's counter page; then compute the layout and copy the rows in,
    5. raise the "done reading" word.

The barrier that frees the slots (step 1) is paid by the next collective, off this one's path.
It is a real implementation used for CI and laptops; it is never used to claim GPU results.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...proto import counter_page, dtypes
from ...proto.errors import Aborted, DeadlineExceeded, InvalidArgument
from ...proto.v1 import epd_pb2
from ..reference import quantize_fp8  # the one FP8 quantisation (server/reference.py)
from .base import (
    Array,
    Backend,
    CombineArgs,
    CombineOutputs,
    CounterPage,
    DispatchArgs,
    DispatchOutputs,
    GroupPlanner,
    GroupSpec,
    LayoutOutputs,
    LowLatencyCombineArgs,
    LowLatencyCombineOutputs,
    LowLatencyDispatchArgs,
    LowLatencyDispatchOutputs,
    Membership,
    RankComm,
    Region,
    check_combine_routing,
)

PAGE = 4096
_HEADER_BYTES = 4 * PAGE
_ABORT_FLAG, _ABORT_LEN = 0, 1  # int64 words in the header
_ABORT_TEXT = 64  # byte offset of the abort reason (utf-8)
_ABORT_TEXT_MAX = 1024
_ARRIVALS = 2048  # byte offset of the int64 arrival words, one per rank
MAX_RANKS = 128


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of one rank's slot in the communication file."""

    x: int
    x_scales: int
    topk_idx: int
    topk_weights: int
    y: int
    y_weights: int
    ll_y: int
    meta: int
    size: int

    @classmethod
    def for_spec(cls, spec: GroupSpec) -> SlotLayout:
        t, h, k = spec.max_tokens_per_rank, spec.hidden, spec.num_topk
        n = spec.max_recv_tokens
        item = spec.x_numpy_dtype.itemsize
        off = 0
        fields = {}
        for name, nbytes in (("meta", 64),
                             ("x", t * h * item),
                             ("x_scales", t * max(h // dtypes.FP8_BLOCK, 1) * 4),
                             ("topk_idx", t * k * 8),
                             ("topk_weights", t * k * 4),
                             ("y", n * h * item),
                             ("y_weights", n * k * 4),
                             # low-latency combine: the valid rows of every local expert,
                             # compacted; at most one row per (token, distinct expert) pair
                             ("ll_y", ll_max_rows(spec) * h * item)):
            fields[name] = off
            off = _align(off + nbytes, PAGE)
        return cls(size=off, **fields)


def ll_max_rows(spec: GroupSpec) -> int:
    """Most rows one rank receives in low-latency dispatch: every token of every rank, once per
    distinct local expert it picks."""
    return spec.max_recv_tokens * min(spec.num_topk, spec.num_local_experts)


def comm_file_bytes(spec: GroupSpec) -> int:
    return _HEADER_BYTES + spec.num_ranks * SlotLayout.for_spec(spec).size


def check_spec(spec: GroupSpec) -> None:
    """The CPU backend's limits on a group (InvalidArgument names the one exceeded)."""
    if spec.num_ranks > MAX_RANKS:
        raise InvalidArgument(f"num_ranks={spec.num_ranks} exceeds the cpu backend's limit of "
                              f"{MAX_RANKS} ranks per group (MAX_RANKS)")


def create_comm_file(path: str, spec: GroupSpec) -> None:
    """Called by the supervisor when a group forms: a sparse file, zero-filled."""
    check_spec(spec)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        os.ftruncate(fd, comm_file_bytes(spec))
    finally:
        os.close(fd)


def _header_words(mm: mmap.mmap | memoryview) -> np.ndarray:
    return np.frombuffer(mm, dtype=np.int64, count=_HEADER_BYTES // 8)


ABORTED, TIMED_OUT = 1, 2  # values of the abort flag


def write_abort(header: np.ndarray, reason: str, kind: int = ABORTED) -> None:
    """First writer wins: a group keeps the reason it first failed for."""
    if header[_ABORT_FLAG]:
        return
    raw = reason.encode()[:_ABORT_TEXT_MAX]
    header.view(np.uint8)[_ABORT_TEXT:_ABORT_TEXT + len(raw)] = np.frombuffer(raw, np.uint8)
    header[_ABORT_LEN] = len(raw)
    header[_ABORT_FLAG] = kind


def read_abort(header: np.ndarray) -> str | None:
    if not header[_ABORT_FLAG]:
        return None
    n = int(header[_ABORT_LEN])
    return bytes(header.view(np.uint8)[_ABORT_TEXT:_ABORT_TEXT + n]).decode(errors="replace")


def abort_kind(header: np.ndarray) -> int:
    return int(header[_ABORT_FLAG])


def abort_comm_file(path: str, reason: str) -> None:
    """Abort a group from outside any rank (the supervisor, when an engine died)."""
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), _HEADER_BYTES) as mm:
            header = _header_words(mm)
            write_abort(header, reason)
            del header
    except (FileNotFoundError, ValueError):
        pass


class ShmRegion(Region):
    """A file mapped into this process: a client's region, or an engine-owned output region."""

    def __init__(self, region_id: str, path: str, size: int, *, create: bool = False) -> None:
        super().__init__(region_id, size)
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o660)
        try:
            if create:
                os.ftruncate(fd, size)
            actual = os.fstat(fd).st_size
            if actual < size:
                raise InvalidArgument(f"region file {path} has {actual} bytes, "
                                      f"fewer than the {size} declared")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._base = np.frombuffer(self._mm, dtype=np.uint8)
        self._owned = create

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype,
             strides: tuple[int, ...]) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=offset,
                          strides=tuple(s * dtype.itemsize for s in strides))

    def offset_of(self, array: np.ndarray) -> int:
        return array.__array_interface__["data"][0] - self._base.ctypes.data

    def close(self) -> None:
        self._base = None  # type: ignore[assignment]
        # A view may still be alive (a response being serialised): the mapping then goes with
        # the last reference instead.
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._owned:
            Path(self.path).unlink(missing_ok=True)


class ShmCounterPage(CounterPage):
    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, counter_page.PAGE_BYTES)
            self._mm = mmap.mmap(fd, counter_page.PAGE_BYTES)
        finally:
            os.close(fd)

    def slot(self, index: int) -> np.ndarray:
        return counter_page.slot_words(self._mm, index)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._mm.close()
        Path(self.path).unlink(missing_ok=True)


@dataclass
class _Handle:
    """What combine and cached dispatch need (kept by the engine under a handle id)."""

    sequence: int
    is_token_in_rank: np.ndarray  # [T, R] this rank's tokens
    num_tokens: int
    rank_prefix: np.ndarray  # [R, R] int64: rows source s sends to destination d
    recv_src_rank: np.ndarray  # [N] as receiver
    recv_src_idx: np.ndarray  # [N]
    num_recv_tokens: int
    num_worst_tokens: int


@dataclass
class _LowLatencyHandle:
    """What low-latency combine needs, as source and as destination of one LL dispatch."""

    sequence: int  # the dispatch collective's number (the same on every rank)
    num_tokens: int
    num_max: int
    topk_idx: np.ndarray  # [T, K] this rank's routing as dispatched
    dest: np.ndarray  # [T, K] destination rank of each pair, -1 for none
    row: np.ndarray  # [T, K] row of the pair in the destination's compacted combine input
    recv_count: np.ndarray  # [L] rows this rank received per local expert


class _OutputArena:
    """Fixed sub-buffers of the membership's output region (valid until the next call of the
    same kind on this membership). Each is sized for its widest dtype and viewed per call, so
    an FP8 dispatch and a bf16 dispatch share recv_x."""

    def __init__(self, region: ShmRegion, spec: GroupSpec) -> None:
        self._mm = region._mm
        self.offsets: dict[str, int] = {}
        off = 0
        for name, nbytes in self.sizes(spec):
            self.offsets[name] = off
            off = _align(off + nbytes)
        self.size = off

    @staticmethod
    def sizes(spec: GroupSpec) -> list[tuple[str, int]]:
        r, t, h, k, e = (spec.num_ranks, spec.max_tokens_per_rank, spec.hidden, spec.num_topk,
                         spec.num_experts)
        lx = spec.num_local_experts
        n = spec.max_recv_tokens
        item = spec.x_numpy_dtype.itemsize
        return [("recv_x", n * h * item), ("recv_x_scales", n * max(h // dtypes.FP8_BLOCK, 1) * 4),
                ("recv_topk_idx", n * k * 8), ("recv_topk_weights", n * k * 4),
                ("recv_src_idx", n * 4), ("rank_prefix_matrix", r * r * 4),
                ("num_tokens_per_rank", r * 4), ("num_tokens_per_expert", e * 4),
                ("is_token_in_rank", t * r), ("combined_x", t * h * item),
                ("combined_topk_weights", t * k * 4),
                # low-latency mode: [L, R * max_tokens_per_rank] rows per buffer
                ("ll_recv_x", lx * n * h * item),
                ("ll_recv_x_scales", lx * n * max(h // dtypes.FP8_BLOCK, 1) * 4),
                ("ll_recv_count", lx * 4), ("ll_recv_src_rank", lx * n * 4),
                ("ll_recv_src_idx", lx * n * 4), ("ll_combined_x", t * h * item)]

    @classmethod
    def bytes_for(cls, spec: GroupSpec) -> int:
        return sum(_align(n) for _, n in cls.sizes(spec))

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.ndarray(shape, dtype=np.dtype(dtype), buffer=self._mm,
                          offset=self.offsets[name])


def layout_of(topk_idx: np.ndarray, spec: GroupSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) of one rank's routing."""
    t = topk_idx.shape[0]
    r, e, lx = spec.num_ranks, spec.num_experts, spec.num_local_experts
    valid = topk_idx >= 0
    per_expert = np.bincount(topk_idx[valid], minlength=e).astype(np.int32)
    in_rank = np.zeros((t, r), dtype=np.bool_)
    rows, cols = np.nonzero(valid)
    in_rank[rows, topk_idx[rows, cols] // lx] = True
    return in_rank.sum(axis=0, dtype=np.int32), per_expert, in_rank


class CpuRankComm(RankComm):
    backend_name = "cpu"

    def __init__(self, spec: GroupSpec, membership: Membership, output_path: str) -> None:
        self.spec = spec
        self.membership = membership
        self.rank = membership.rank
        size = comm_file_bytes(spec)
        with open(comm_path(membership.plan), "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), size)
        self._header = _header_words(self._mm)
        self._arrivals = self._header[_ARRIVALS // 8:_ARRIVALS // 8 + spec.num_ranks]
        self._slot = SlotLayout.for_spec(spec)
        self.output_region = ShmRegion(f"out-{membership.group_id}-{self.rank}", output_path,
                                       _OutputArena.bytes_for(spec), create=True)
        self._out = _OutputArena(self.output_region, spec)
        self._sequence = 0  # collectives this rank has started

    # -- shared-memory plumbing ------------------------------------------------------------
    def _slot_array(self, rank: int, field: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        off = _HEADER_BYTES + rank * self._slot.size + getattr(self._slot, field)
        return np.ndarray(shape, dtype=np.dtype(dtype), buffer=self._mm, offset=off)

    def _meta(self, rank: int) -> np.ndarray:
        return self._slot_array(rank, "meta", (8,), np.int64)

    def _wait_all(self, target: int, what: str, deadline: float) -> None:
        spins = 0
        while True:
            if int(self._arrivals.min()) >= target:
                return
            reason = read_abort(self._header)
            if reason is not None:
                # A missing rank is a deadline for every waiter, whoever noticed it first.
                if abort_kind(self._header) == TIMED_OUT:
                    raise DeadlineExceeded(f"group {self.spec.name!r}: {reason}")
                raise Aborted(f"group {self.spec.name!r} aborted: {reason}")
            spins += 1
            if spins > 200:
                if time.monotonic() > deadline:
                    missing = [int(r) for r in np.nonzero(self._arrivals < target)[0]]
                    reason = (f"rank(s) {missing} did not arrive at {what} "
                              f"(collective #{(target + 1) // 2}) before the deadline")
                    write_abort(self._header, reason, TIMED_OUT)
                    raise DeadlineExceeded(f"group {self.spec.name!r}: {reason}")
                time.sleep(20e-6 if spins < 5000 else 200e-6)

    def _begin(self, deadline: float, what: str) -> int:
        """Steps 1-3 of the protocol around the caller's slot writes; returns the sequence."""
        seq = self._sequence + 1
        self._wait_all(2 * seq - 2, f"{what} (previous collective's readers)", deadline)
        return seq

    def _arrive(self, seq: int, phase: int) -> None:
        self._arrivals[self.rank] = 2 * seq - 2 + phase

    # -- collectives -------------------------------------------------------------------------
    def layout(self, topk_idx: np.ndarray) -> LayoutOutputs:
        per_rank, per_expert, in_rank = layout_of(topk_idx, self.spec)
        t = topk_idx.shape[0]
        out = self._out
        r, e = self.spec.num_ranks, self.spec.num_experts
        res = LayoutOutputs(out.get("num_tokens_per_rank", (r,), np.int32),
                            out.get("num_tokens_per_expert", (e,), np.int32),
                            out.get("is_token_in_rank", (t, r), np.bool_))
        res.num_tokens_per_rank[:] = per_rank
        res.num_tokens_per_expert[:] = per_expert
        res.is_token_in_rank[:] = in_rank
        return res

    def dispatch(self, args: DispatchArgs, counter_slot: np.ndarray, sequence: int,
                 deadline: float) -> DispatchOutputs:
        spec, me = self.spec, self.rank
        r, lx, h = spec.num_ranks, spec.num_local_experts, spec.hidden
        cached: _Handle | None = args.cached
        t = args.x.shape[0]
        has_scales = args.x_scales is not None
        seq = self._begin(deadline, "dispatch")
        # Inputs into this rank's slot (the "send buffer").
        meta = self._meta(me)
        meta[0], meta[1] = t, int(has_scales)
        xdt = args.x.dtype  # the group's dtype, or FP8 (carried as bytes)
        self._slot_array(me, "x", (t, h), xdt)[:] = args.x
        if has_scales:
            sc = args.x_scales
            self._slot_array(me, "x_scales", sc.shape, np.float32)[:] = sc
        k = spec.num_topk
        if cached is None:
            self._slot_array(me, "topk_idx", (t, k), np.int64)[:] = args.topk_idx
            self._slot_array(me, "topk_weights", (t, k), np.float32)[:] = args.topk_weights
        self._sequence = seq
        self._arrive(seq, 1)
        self._wait_all(2 * seq - 1, "dispatch", deadline)

        # Notify: who sends what to whom, from every source's routing.
        if cached is None:
            src_rows: list[np.ndarray] = []
            rank_prefix = np.zeros((r, r), dtype=np.int64)
            per_expert = np.zeros(lx, dtype=np.int64)
            for s in range(r):
                ts = int(self._meta(s)[0])
                idx = self._slot_array(s, "topk_idx", (ts, k), np.int64)
                valid = idx >= 0
                dest = np.where(valid, idx // lx, -1)
                for d in range(r):
                    rank_prefix[s, d] = np.count_nonzero((dest == d).any(axis=1))
                mine = dest == me
                src_rows.append(np.nonzero(mine.any(axis=1))[0])
                per_expert += np.bincount(idx[mine] - me * lx, minlength=lx)[:lx]
            num_recv = int(rank_prefix[:, me].sum())
            align = max(args.expert_alignment, 1)
            aligned = [int(-(-c // align) * align) for c in per_expert]
            counter_page.publish(counter_slot, sequence, num_recv, aligned)
            recv_src_rank = np.concatenate(
                [np.full(len(rows), s, np.int32) for s, rows in enumerate(src_rows)]
            ) if r else np.zeros(0, np.int32)
            recv_src_idx = np.concatenate(src_rows).astype(np.int32)
            _, _, in_rank = layout_of(args.topk_idx, spec)
        else:
            rank_prefix = cached.rank_prefix
            num_recv = cached.num_recv_tokens
            aligned = []
            counter_page.publish(counter_slot, sequence, num_recv, aligned)
            recv_src_rank, recv_src_idx = cached.recv_src_rank, cached.recv_src_idx
            in_rank = cached.is_token_in_rank

        rows_out = num_recv
        if args.num_worst_tokens:
            if num_recv > args.num_worst_tokens:
                self._arrive(seq, 2)
                raise InvalidArgument(f"received {num_recv} tokens, more than num_worst_tokens="
                                      f"{args.num_worst_tokens}")
            rows_out = args.num_worst_tokens

        # Data: pull the rows, block by block in source order.
        out = self._out
        k = spec.num_topk
        recv_x = out.get("recv_x", (rows_out, h), xdt)
        recv_scales = out.get("recv_x_scales", (rows_out, args.x_scales.shape[1]), np.float32) \
            if has_scales else None
        recv_idx = out.get("recv_topk_idx", (rows_out, k), np.int64) if cached is None else None
        recv_w = out.get("recv_topk_weights", (rows_out, k), np.float32) \
            if cached is None else None
        bytes_received = 0
        pos = 0
        for s in range(r):
            sel = recv_src_idx[recv_src_rank == s]
            n = len(sel)
            if n == 0:
                continue
            ts = int(self._meta(s)[0])
            xs = self._slot_array(s, "x", (ts, h), xdt)
            np.take(xs, sel, axis=0, out=recv_x[pos:pos + n])
            bytes_received += n * h * xdt.itemsize
            if recv_scales is not None:
                ss = self._slot_array(s, "x_scales", (ts, recv_scales.shape[1]), np.float32)
                recv_scales[pos:pos + n] = ss[sel]
            if recv_idx is not None:
                idx = self._slot_array(s, "topk_idx", (ts, k), np.int64)[sel]
                w = self._slot_array(s, "topk_weights", (ts, k), np.float32)[sel]
                local = (idx >= 0) & (idx // lx == me)
                recv_idx[pos:pos + n] = np.where(local, idx - me * lx, -1)
                recv_w[pos:pos + n] = np.where(local, w, np.float32(0))
            pos += n
        self._arrive(seq, 2)

        if rows_out > num_recv:  # worst-token padding
            recv_x[num_recv:] = 0
            if recv_scales is not None:
                recv_scales[num_recv:] = 0
            if recv_idx is not None:
                recv_idx[num_recv:] = -1
                recv_w[num_recv:] = 0
        src_idx_out = out.get("recv_src_idx", (rows_out,), np.int32)
        src_idx_out[:num_recv] = recv_src_idx
        src_idx_out[num_recv:] = -1
        prefix_out = out.get("rank_prefix_matrix", (r, r), np.int32)
        prefix_out[:] = np.cumsum(rank_prefix, axis=0)
        handle = _Handle(sequence=seq, is_token_in_rank=in_rank.copy(), num_tokens=t,
                         rank_prefix=rank_prefix, recv_src_rank=recv_src_rank,
                         recv_src_idx=recv_src_idx, num_recv_tokens=num_recv,
                         num_worst_tokens=args.num_worst_tokens)
        bytes_sent = int(in_rank.sum()) * h * xdt.itemsize
        return DispatchOutputs(
            recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w, recv_src_idx=src_idx_out, rank_prefix_matrix=prefix_out,
            num_recv_tokens=num_recv, num_recv_tokens_per_expert=aligned, handle=handle,
            bytes_sent=bytes_sent, bytes_received=bytes_received)

    def combine(self, args: CombineArgs, deadline: float) -> CombineOutputs:
        spec, me = self.spec, self.rank
        r, h = spec.num_ranks, spec.hidden
        handle: _Handle = args.handle
        n = args.x.shape[0]
        has_w = args.topk_weights is not None
        seq = self._begin(deadline, "combine")
        meta = self._meta(me)
        meta[0], meta[1] = n, int(has_w)
        # Only the rows that were really received travel back; worst-token padding stays home.
        nr = handle.num_recv_tokens
        self._slot_array(me, "y", (nr, h), spec.x_numpy_dtype)[:] = args.x[:nr]
        k = 0
        if has_w:
            k = args.topk_weights.shape[1]
            meta[2] = k
            self._slot_array(me, "y_weights", (nr, k), np.float32)[:] = args.topk_weights[:nr]
        self._sequence = seq
        self._arrive(seq, 1)
        self._wait_all(2 * seq - 1, "combine", deadline)

        t = handle.num_tokens
        acc = np.zeros((t, h), dtype=np.float32)
        if args.bias_0 is not None:
            acc += args.bias_0.astype(np.float32)
        if args.bias_1 is not None:
            acc += args.bias_1.astype(np.float32)
        acc_w = np.zeros((t, k), dtype=np.float32) if has_w else None
        bytes_received = 0
        for d in range(r):
            mine = np.nonzero(handle.is_token_in_rank[:, d])[0]
            if len(mine) == 0:
                continue
            start = int(handle.rank_prefix[:me, d].sum())
            nd = int(handle.rank_prefix[:, d].sum())
            y = self._slot_array(d, "y", (nd, h), spec.x_numpy_dtype)
            acc[mine] += y[start:start + len(mine)].astype(np.float32)
            bytes_received += len(mine) * h * spec.x_numpy_dtype.itemsize
            if acc_w is not None:
                if int(self._meta(d)[1]) == 0:
                    raise InvalidArgument(f"rank {d} passed no topk_weights to combine")
                yw = self._slot_array(d, "y_weights", (nd, k), np.float32)
                acc_w[mine] += yw[start:start + len(mine)]
        self._arrive(seq, 2)
        out_x = self._out.get("combined_x", (t, h), spec.x_numpy_dtype)
        out_x[:] = acc.astype(spec.x_numpy_dtype)
        out_w = None
        if acc_w is not None:
            out_w = self._out.get("combined_topk_weights", (t, k), np.float32)
            out_w[:] = acc_w
        return CombineOutputs(out_x, out_w, bytes_sent=nr * h * spec.x_numpy_dtype.itemsize,
                              bytes_received=bytes_received)

    # -- low-latency mode -------------------------------------------------------------------
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs,
                             deadline: float) -> LowLatencyDispatchOutputs:
        spec, me = self.spec, self.rank
        r, lx, h, k, ne = (spec.num_ranks, spec.num_local_experts, spec.hidden, spec.num_topk,
                           spec.num_experts)
        t, m, fp8 = args.x.shape[0], args.num_max_dispatch_tokens_per_rank, args.use_fp8
        blocks = h // dtypes.FP8_BLOCK
        # Quantise on the source, once per token (local work, before taking part).
        if fp8:
            payload, scales = quantize_fp8(np.asarray(args.x), args.round_scale)
        else:
            payload, scales = args.x, None
        pdt = payload.dtype
        seq = self._begin(deadline, "low-latency dispatch")
        meta = self._meta(me)
        meta[0], meta[1], meta[2] = t, int(fp8), m
        self._slot_array(me, "x", (t, h), pdt)[:] = payload
        if scales is not None:
            self._slot_array(me, "x_scales", (t, blocks), np.float32)[:] = scales
        self._slot_array(me, "topk_idx", (t, k), np.int64)[:] = args.topk_idx
        self._sequence = seq
        self._arrive(seq, 1)
        self._wait_all(2 * seq - 1, "low-latency dispatch", deadline)

        metas = [(int(self._meta(s)[0]), int(self._meta(s)[1]), int(self._meta(s)[2]))
                 for s in range(r)]
        odd = [s for s, (_, f, mm) in enumerate(metas) if (f, mm) != (int(fp8), m)]
        if odd:  # every rank sees a disagreement, so every rank fails the same way
            self._arrive(seq, 2)
            raise InvalidArgument(
                f"low-latency dispatch arguments differ across ranks: rank {me} passed "
                f"num_max_dispatch_tokens_per_rank={m}, use_fp8={fp8}; rank(s) {odd} passed "
                f"{[(metas[s][2], bool(metas[s][1])) for s in odd]}")
        ts = [mt[0] for mt in metas]
        idxs = [self._slot_array(s, "topk_idx", (ts[s], k), np.int64) for s in range(r)]
        # counts[s, g]: tokens of source s routed to global expert g (distinct per token)
        counts = np.zeros((r, ne), dtype=np.int64)
        for s, idx in enumerate(idxs):
            counts[s] = np.bincount(idx[idx >= 0], minlength=ne)[:ne]

        # Receive: per local expert, rows ordered by source rank, then token.
        rows_per_expert = r * m
        out = self._out
        recv_x = out.get("ll_recv_x", (lx, rows_per_expert, h), pdt)
        recv_scales = (out.get("ll_recv_x_scales", (lx, rows_per_expert, blocks), np.float32)
                       if fp8 else None)
        src_rank = out.get("ll_recv_src_rank", (lx, rows_per_expert), np.int32)
        src_idx = out.get("ll_recv_src_idx", (lx, rows_per_expert), np.int32)
        lo = me * lx
        fill = np.zeros(lx, dtype=np.int64)
        row_bytes = h * pdt.itemsize + (blocks * 4 if fp8 else 0)
        bytes_received = 0
        for s, idx in enumerate(idxs):
            tt, kk = np.nonzero((idx >= lo) & (idx < lo + lx))  # token-major order
            if len(tt) == 0:
                continue
            e = idx[tt, kk] - lo
            order = np.argsort(e, kind="stable")  # by expert; tokens stay ascending
            tt, e = tt[order], e[order]
            per = np.bincount(e, minlength=lx)
            first = np.cumsum(per) - per
            rows = fill[e] + (np.arange(len(e)) - first[e])
            recv_x[e, rows] = self._slot_array(s, "x", (ts[s], h), pdt)[tt]
            if recv_scales is not None:
                recv_scales[e, rows] = self._slot_array(s, "x_scales", (ts[s], blocks),
                                                        np.float32)[tt]
            src_rank[e, rows] = s
            src_idx[e, rows] = tt
            fill += per
            bytes_received += len(tt) * row_bytes
        self._arrive(seq, 2)

        for e in range(lx):  # rows beyond the count: zero payload, -1 source
            c = int(fill[e])
            recv_x[e, c:] = 0
            if recv_scales is not None:
                recv_scales[e, c:] = 0
            src_rank[e, c:] = -1
            src_idx[e, c:] = -1
        recv_count = out.get("ll_recv_count", (lx,), np.int32)
        recv_count[:] = fill

        # As a source: where each of my (token, k) pairs sits in its destination's compacted
        # combine input (destination's experts in order, each expert's rows as received).
        mine = np.array(args.topk_idx, dtype=np.int64, copy=True)
        total = counts.sum(axis=0).reshape(r, lx)
        expert_off = (np.cumsum(total, axis=1) - total).reshape(ne)
        before = (np.cumsum(counts, axis=0) - counts)[me]  # rows from sources < me
        valid = mine >= 0
        tt, kk = np.nonzero(valid)
        g = mine[tt, kk]
        order = np.argsort(g, kind="stable")
        tt, kk, g = tt[order], kk[order], g[order]
        per = np.bincount(g, minlength=ne)[:ne]
        first = np.cumsum(per) - per
        row = np.full((t, k), -1, dtype=np.int64)
        row[tt, kk] = expert_off[g] + before[g] + (np.arange(len(g)) - first[g])
        dest = np.where(valid, mine // lx, -1)
        handle = _LowLatencyHandle(sequence=seq, num_tokens=t, num_max=m, topk_idx=mine,
                                   dest=dest, row=row, recv_count=fill.copy())
        return LowLatencyDispatchOutputs(
            recv_x=recv_x, recv_x_scales=recv_scales, recv_count=recv_count,
            recv_src_rank=src_rank, recv_src_idx=src_idx, num_recv_rows=int(fill.sum()),
            handle=handle, bytes_sent=len(g) * row_bytes, bytes_received=bytes_received)

    def low_latency_combine(self, args: LowLatencyCombineArgs,
                            deadline: float) -> LowLatencyCombineOutputs:
        spec, me = self.spec, self.rank
        r, lx, h = spec.num_ranks, spec.num_local_experts, spec.hidden
        handle: _LowLatencyHandle = args.handle
        dt = spec.x_numpy_dtype
        comb = np.asarray(args.topk_idx)
        t, k = comb.shape
        # Each entry names one of the token's dispatched experts, in any k position (checked
        # before taking part: a bad entry changes nothing).
        which = check_combine_routing(handle.topk_idx, comb)
        rows = np.take_along_axis(handle.row, which, axis=1)
        dests = np.take_along_axis(handle.dest, which, axis=1)

        seq = self._begin(deadline, "low-latency combine")
        meta = self._meta(me)
        meta[3] = handle.sequence
        counts = handle.recv_count
        y = self._slot_array(me, "ll_y", (int(counts.sum()), h), dt)
        pos = 0
        for e in range(lx):  # only the valid rows travel, compacted
            c = int(counts[e])
            y[pos:pos + c] = args.x[e, :c]
            pos += c
        self._sequence = seq
        self._arrive(seq, 1)
        self._wait_all(2 * seq - 1, "low-latency combine", deadline)
        odd = [s for s in range(r) if int(self._meta(s)[3]) != handle.sequence]
        if odd:
            self._arrive(seq, 2)
            raise InvalidArgument(f"low-latency combine handles differ across ranks: rank {me} "
                                  f"combines the dispatch #{handle.sequence}, rank(s) {odd} "
                                  f"another one")

        acc = np.zeros((t, h), dtype=np.float32)
        peers = [self._slot_array(d, "ll_y", (ll_max_rows(spec), h), dt) for d in range(r)]
        bytes_received = 0
        weights = np.asarray(args.topk_weights, dtype=np.float32)
        for kk in range(k):  # k order, skipping -1, accumulated in fp32 (as the reference)
            tokens = np.nonzero(comb[:, kk] >= 0)[0]
            if len(tokens) == 0:
                continue
            d_of, r_of = dests[tokens, kk], rows[tokens, kk]
            yk = np.empty((len(tokens), h), dtype=dt)
            for d in np.unique(d_of):
                sel = d_of == d
                yk[sel] = peers[int(d)][r_of[sel]]
            bytes_received += len(tokens) * h * dt.itemsize
            acc[tokens] = acc[tokens] + weights[tokens, kk][:, None] * yk.astype(np.float32)
        self._arrive(seq, 2)
        out = args.out if args.out is not None else self._out.get("ll_combined_x", (t, h), dt)
        out[...] = acc.astype(dt)
        return LowLatencyCombineOutputs(out, bytes_sent=pos * h * dt.itemsize,
                                        bytes_received=bytes_received)

    def abort(self, reason: str) -> None:
        write_abort(self._header, reason)

    def abort_reason(self) -> str | None:
        return read_abort(self._header)

    def close(self) -> None:
        self._header = self._arrivals = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._mm.close()
        self.output_region.close()


def comm_path(plan: bytes) -> str:
    """The group's communication file, from its plan."""
    return plan.decode()


class CpuPlanner(GroupPlanner):
    """A group's shared state is one communication file under the shm folder."""

    name = "cpu"
    proto_kind = epd_pb2.CPU

    def __init__(self, shm_dir: str = "/dev/shm") -> None:
        self.shm_dir = shm_dir

    def validate_spec(self, spec: GroupSpec) -> None:
        check_spec(spec)

    def plan_group(self, group_id: str, spec: GroupSpec) -> bytes:
        path = os.path.join(self.shm_dir, f"epd-{group_id}.comm")
        create_comm_file(path, spec)
        return path.encode()

    def free_group(self, plan: bytes) -> None:
        Path(comm_path(plan)).unlink(missing_ok=True)

    def abort_group(self, plan: bytes, reason: str) -> None:
        abort_comm_file(comm_path(plan), reason)


class CpuBackend(Backend):
    name = "cpu"
    proto_kind = epd_pb2.CPU
    peer_class = "shm"

    def __init__(self, engine_index: int = 0, allowed_dirs: tuple[str, ...] = ("/dev/shm",)):
        self.planner = CpuPlanner()
        self.engine_index = engine_index
        self.allowed_dirs = tuple(os.path.realpath(d) for d in allowed_dirs)

    def device_info(self) -> dict[str, Any]:
        return {"name": f"cpu-engine-{self.engine_index}", "uuid": f"CPU-{self.engine_index}",
                "ordinal": self.engine_index}

    def open_region(self, region_id: str, *, shm_path: str = "", ipc_handle: bytes = b"",
                    size: int, device_ordinal: int = 0) -> Region:
        if ipc_handle:
            raise InvalidArgument("the cpu backend takes shared-memory regions (shm_path), "
                                  "not CUDA IPC handles")
        real = os.path.realpath(shm_path)
        if not any(real.startswith(d + os.sep) for d in self.allowed_dirs):
            raise InvalidArgument(f"region path {shm_path!r} is outside the allowed folders "
                                  f"{list(self.allowed_dirs)}")
        if not os.path.isfile(real):
            raise InvalidArgument(f"region path {shm_path!r} is not a regular file")
        return ShmRegion(region_id, real, size)

    def open_counter_page(self, path: str) -> CounterPage:
        return ShmCounterPage(path)

    def attach(self, spec: GroupSpec, membership: Membership, output_path: str) -> RankComm:
        return CpuRankComm(spec, membership, output_path)


def as_array(a: Array) -> np.ndarray:
    return np.asarray(a)
