"""The CPU backend's communication file: one sealed memfd per group (the analogue of the GPU's
symmetric heap), made by the supervisor and mapped by every engine of the group. Its header
holds the abort word and reason, the ranks' arrival words and the rank mask; then one slot per
rank (SlotLayout): the call header the ranks compare (cpu_calls.py), the rank's inputs and the
rows it receives. Only the layout and the words outside any collective live here; the
collectives are cpu.py's."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ...proto import dtypes, host_order
from ...proto import fd_channel as fdc
from ...proto.errors import InvalidArgument
from .base import GroupSpec, RankComm

PAGE = 4096
HEADER_BYTES = 4 * PAGE
_ABORT_FLAG, _ABORT_LEN = 0, 1  # int64 words in the header
ABORT_TEXT = 64  # byte offset of the abort reason (utf-8)
ABORT_TEXT_MAX = 1024
ARRIVALS = 2048  # byte offset of the int64 arrival words, one per rank
MAX_RANKS = 128
# Rank masking (shrink groups): one byte per rank, RankComm.MASK_IN / MASK_MASKED / MASK_GONE.
MASK = 4096

# The call header: what a rank publishes in its slot when it arrives at a collective, compared
# by every rank after the arrival barrier (docs/DESIGN_NOTES.md "Collectives agree or fail
# together"). int64 words at byte CALL of the slot's meta area, the reason text after them.
CALL = 64  # byte offset in the slot's meta area (words 0-7 before it: per-call metadata)
(H_SEQ, H_KIND, H_REF, H_FLAGS, H_WORST, H_ALIGN, H_NUM_MAX, H_STATUS,
 H_REASON_LEN, H_TOKENS) = range(10)
CALL_WORDS = 16
REASON = CALL + 8 * CALL_WORDS  # byte offset of the reason text of a rejected call
REASON_MAX = 1024
# Shrink groups: the mask as this rank saw it when it arrived (one byte per rank): the ranks a
# collective leaves out are those some participant saw masked, and those that never arrived.
MASK_SEEN = REASON + REASON_MAX
META_BYTES = MASK_SEEN + MAX_RANKS  # < PAGE: the slot layout is unchanged
# H_KIND: layout is not a collective on this backend (each rank's routing alone decides it).
DISPATCH, CACHED_DISPATCH, COMBINE, LL_DISPATCH, LL_COMBINE, REJOIN = 1, 2, 3, 4, 5, 6
KIND_NAMES = {DISPATCH: "dispatch", CACHED_DISPATCH: "cached dispatch", COMBINE: "combine",
              LL_DISPATCH: "low-latency dispatch", LL_COMBINE: "low-latency combine",
              REJOIN: "rejoin"}
# H_FLAGS bits: FP8 payload (+ scales); combine with topk_weights; dispatch without top-k;
# FP8 scales are int32 words (packed UE8M0) rather than float32; from bit SCALE_COLS_SHIFT up,
# the number of scale columns (DeepEP takes any width: [T, 1], packed [T, H/512], [T, H/128])
F_FP8, F_WEIGHTS, F_NO_TOPK, F_INT32_SCALES = 1, 2, 4, 8
SCALE_COLS_SHIFT = 8
ARRIVED, REJECTED = 1, 2  # H_STATUS


def align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of one rank's slot in the communication file."""

    x: int
    x_scales: int
    topk_idx: int
    topk_weights: int
    in_rank: int
    per_expert: int
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
        for name, nbytes in (("meta", META_BYTES),
                             ("x", t * h * item),
                             ("x_scales", t * max(h // dtypes.FP8_BLOCK, 1) * 4),
                             ("topk_idx", t * k * 8),
                             ("topk_weights", t * k * 4),
                             # dispatch without top-k: is_token_in_rank and the
                             # tokens per expert of the source
                             ("in_rank", t * spec.num_ranks),
                             ("per_expert", spec.num_experts * 4),
                             ("y", n * h * item),
                             ("y_weights", n * k * 4),
                             # low-latency combine: the valid rows of every local expert,
                             # compacted; at most one row per (token, distinct expert) pair
                             ("ll_y", ll_max_rows(spec) * h * item)):
            fields[name] = off
            off = align(off + nbytes, PAGE)
        return cls(size=off, **fields)


def ll_max_rows(spec: GroupSpec) -> int:
    """Most rows one rank receives in low-latency dispatch: every token of every rank, once per
    distinct local expert it picks."""
    return spec.max_recv_tokens * min(spec.num_topk, spec.num_local_experts)


def comm_file_bytes(spec: GroupSpec) -> int:
    return HEADER_BYTES + spec.num_ranks * SlotLayout.for_spec(spec).size


def check_spec(spec: GroupSpec) -> None:
    """The CPU backend's limits on a group (InvalidArgument names the one exceeded)."""
    if spec.num_ranks > MAX_RANKS:
        raise InvalidArgument(f"num_ranks={spec.num_ranks} exceeds the cpu backend's limit of "
                              f"{MAX_RANKS} ranks per group (MAX_RANKS)")


def create_comm_file(group_id: str, spec: GroupSpec) -> int:
    """Called by the supervisor when a group forms: a memfd, zero-filled, sealed against
    shrinking and growing (no process can truncate it under the engines that map it); returns
    its descriptor, which the supervisor keeps while the group lives."""
    check_spec(spec)
    return fdc.create_memfd(f"epd-{group_id}.comm", comm_file_bytes(spec), fdc.ENGINE_SEALS)


def open_comm_file(path: str, size: int) -> mmap.mmap:
    """An engine maps a group's communication memfd through the supervisor's descriptor
    (/proc/<supervisor pid>/fd/<n>: only processes of the daemon's uid may open it); refuses
    one that is not sealed at its size."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fdc.check_sealed(fd, size, fdc.F_SEAL_SHRINK | fdc.F_SEAL_GROW, "group comm file")
        return fdc.map_fd(fd, size)
    finally:
        os.close(fd)


def header_words(mm: mmap.mmap | memoryview) -> np.ndarray:
    return np.frombuffer(mm, dtype=np.int64, count=HEADER_BYTES // 8)


ABORTED, TIMED_OUT = 1, 2  # values of the abort flag


def write_abort(header: np.ndarray, reason: str, kind: int = ABORTED) -> None:
    """First writer wins: a group keeps the reason it first failed for."""
    if header[_ABORT_FLAG]:
        return
    raw = reason.encode()[:ABORT_TEXT_MAX]
    header.view(np.uint8)[ABORT_TEXT:ABORT_TEXT + len(raw)] = np.frombuffer(raw, np.uint8)
    header[_ABORT_LEN] = len(raw)
    host_order.publish()  # (the reason before its flag)
    header[_ABORT_FLAG] = kind


def read_abort(header: np.ndarray) -> str | None:
    if not header[_ABORT_FLAG]:
        return None
    host_order.consume()
    n = int(header[_ABORT_LEN])
    return bytes(header.view(np.uint8)[ABORT_TEXT:ABORT_TEXT + n]).decode(errors="replace")


def abort_kind(header: np.ndarray) -> int:
    return int(header[_ABORT_FLAG])


def abort_comm_file(path: str, reason: str) -> None:
    """Abort a group from outside any rank (the supervisor, when an engine died)."""
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), HEADER_BYTES) as mm:
            header = header_words(mm)
            write_abort(header, reason)
            del header
    except (FileNotFoundError, ValueError):
        pass


def mark_gone_in_comm_file(path: str, rank: int) -> None:
    """Mask a rank for good from outside any rank (the supervisor, when it went away)."""
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), HEADER_BYTES) as mm, \
                mask_locked(f.fileno(), rank):
            mm[MASK + rank] = RankComm.MASK_GONE
    except (FileNotFoundError, ValueError, IndexError):
        pass


@contextlib.contextmanager
def mask_locked(fd: int, rank: int) -> Iterator[None]:
    """Hold a record lock on one rank's mask byte of a comm file (`fd`: the file opened by the
    caller). The supervisor marks a rank gone while an engine's RankMask may be changing the
    same byte from a state it read just before: under the lock the engine sees GONE and keeps
    it (set_mask), rather than writing IN over it (peers would then wait for a rank that
    went away, until the deadline aborted the group)."""
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, MASK + rank)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, MASK + rank)
