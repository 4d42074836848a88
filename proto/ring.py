"""The same-host fast path: a request ring in shared memory, shared by the client (producer) and
the engine (consumer) of one session.

The messages are the gRPC protocol's own (serialised protobuf), so the fast path carries exactly
the same operations, validation and errors; only the hop differs. Wake-ups use futexes on words
of the shared file: both sides spin for a bounded time first, then sleep in FUTEX_WAIT with a
timeout, so an idle engine costs no CPU and a busy one answers in microseconds.

The ring is a memfd the engine creates and seals (it can neither shrink nor grow, so no side can
make the other's mapping fault), fetched by the session's client as "ring" over the engine's
descriptor channel (proto/fd_channel.py): only that client holds it.

Layout (little-endian):
    header (4096 bytes)
        u32 doorbell         bumped by the client after each submission (the engine's futex)
        u32 engine_waiting   1 while the engine sleeps on the doorbell
        u32 closed           1 once either side gave up the ring
    slot i at HEADER + i * slot_bytes
        u64 seq              submission number of the request in the slot (1, 2, ...)
        u32 state            FREE, SUBMITTED, DONE (the client's futex while it waits)
        u32 method           ring id of the operation (operations.RING_METHODS)
        u32 length           bytes of the request, then of the response
        i32 status           gRPC status code of the response (0 = OK)
        u64 deadline         when the client stops waiting: CLOCK_MONOTONIC ns (one clock on
                             one host); 0 from an older client (none). A request still queued
                             then is answered DEADLINE_EXCEEDED and not run.
        payload              request, replaced by the response (or an error message)
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import time

import numpy as np

from . import fd_channel as fdc
from . import operations

HEADER = 4096
SLOT_HEADER = 64
FREE, SUBMITTED, DONE = 0, 1, 2
# Word indices (u32) in the header and in a slot header.
DOORBELL, ENGINE_WAITING, CLOSED = 0, 1, 2
S_SEQ_LO, S_SEQ_HI, S_STATE, S_METHOD, S_LENGTH, S_STATUS = 0, 1, 2, 3, 4, 5
S_DEADLINE_LO, S_DEADLINE_HI = 6, 7

# Limits of a ring (the engine checks a client's request against them) and the default slot size.
MAX_SLOTS = 1024
MIN_SLOT_BYTES, MAX_SLOT_BYTES = 4096, 1 << 20
DEFAULT_SLOT_BYTES = 16384

# Operation ids carried in a slot: operations.RING_METHODS (the registry) is the table; these two
# names remain as views of it for older importers. Use operations.BY_RING_ID / Operation.ring_id.
METHODS = operations.RING_METHODS
METHOD_ID = {name: i for i, name in enumerate(METHODS)}

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the u32 at `addr` equals `expected`, at most `timeout` seconds (spurious
    wake-ups are fine: callers re-check)."""
    if _SYS_FUTEX is None:
        time.sleep(min(timeout, 200e-6))
        return
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(expected),
                  ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    if _SYS_FUTEX is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 1 << 30, None, None, 0)


def ring_bytes(slots: int, slot_bytes: int) -> int:
    return HEADER + slots * slot_bytes


class Ring:
    """One mapping of a ring (either side). The engine makes it with `create` (a sealed memfd,
    whose descriptor it keeps in `fd` for the client to fetch); the client maps the descriptor
    it fetched with `from_fd`."""

    def __init__(self, mm: mmap.mmap, slots: int, slot_bytes: int, fd: int = -1) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self.size = ring_bytes(slots, slot_bytes)
        self.fd = fd  # the engine's descriptor of the memfd (-1 on the client)
        self._mm = mm
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        self.header = np.frombuffer(self._mm, np.uint32, HEADER // 4)
        self.capacity = slot_bytes - SLOT_HEADER
        # Views made once: building them costs microseconds, a round trip's budget. They are
        # never released explicitly: a view still in use when the ring closes keeps the
        # mapping alive until it goes (close() tolerates that).
        self._slots = [self._make_slot(i) for i in range(slots)]

    def _make_slot(self, i: int) -> tuple[np.ndarray, memoryview, int]:
        off = HEADER + i * self.slot_bytes
        words = np.frombuffer(self._mm, np.uint32, SLOT_HEADER // 4, off)
        payload = memoryview(self._mm)[off + SLOT_HEADER:off + self.slot_bytes]
        return words, payload, self.base + off + 4 * S_STATE

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> Ring:
        """A new ring: a memfd sealed against shrinking and growing, mapped; keeps the fd."""
        fd = fdc.create_memfd("epd-ring", ring_bytes(slots, slot_bytes), fdc.ENGINE_SEALS)
        try:
            mm = fdc.map_fd(fd, ring_bytes(slots, slot_bytes))
        except BaseException:
            os.close(fd)
            raise
        return cls(mm, slots, slot_bytes, fd)

    @classmethod
    def from_fd(cls, fd: int, slots: int, slot_bytes: int) -> Ring:
        """Map a ring fetched from the engine; closes `fd` (the mapping keeps a duplicate of
        its own). Refuses one that is not sealed at its size (ValueError)."""
        try:
            size = ring_bytes(slots, slot_bytes)
            try:
                fdc.check_sealed(fd, size, fdc.F_SEAL_SHRINK, "the fast-path ring")
            except Exception as e:
                raise ValueError(str(e)) from None
            mm = fdc.map_fd(fd, size)
        finally:
            os.close(fd)
        return cls(mm, slots, slot_bytes)

    def slot(self, i: int) -> tuple[np.ndarray, memoryview, int]:
        """(u32 header words, payload view, address of the state word) of slot i."""
        return self._slots[i]

    @property
    def doorbell_addr(self) -> int:
        return self.base + 4 * DOORBELL

    @property
    def closed(self) -> bool:
        return self.header is None or bool(self.header[CLOSED])

    def close(self, *, unlink: bool = False) -> None:
        """Unmap (`unlink` is accepted for older callers: a memfd has no name to remove).

        Python's mmap holds its own duplicate of the descriptor until it is closed, and it can
        only be closed once no view exports its buffer: so the ring drops its own views first.
        A view still held elsewhere keeps the mapping (and that descriptor) until it goes."""
        if self.header is None:
            return
        self.header[CLOSED] = 1
        futex_wake(self.doorbell_addr)
        _release_views(self._slots)
        self._slots = []
        self.header = None
        del self._anchor
        fdc.close_mapping(self._mm)
        self.release_fd()

    def release_fd(self) -> None:
        """Close the engine's descriptor of the memfd (the mapping stays)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _release_views(slots: list[tuple[np.ndarray, memoryview, int]]) -> None:
    """Release the payload views (in a function of its own: no loop variable outlives it to
    keep a view, and so the mapping, alive)."""
    for _words, payload, _addr in slots:
        with contextlib.suppress(BufferError):  # exported further: goes with that view
            payload.release()


def seq_of(words: np.ndarray) -> int:
    return int(words[S_SEQ_LO]) | (int(words[S_SEQ_HI]) << 32)


def set_seq(words: np.ndarray, seq: int) -> None:
    words[S_SEQ_LO] = seq & 0xFFFFFFFF
    words[S_SEQ_HI] = seq >> 32


# The engine's answer to a request whose response does not fit its slot (RESOURCE_EXHAUSTED; the
# operation ran): a read-only one (operations.READ_ONLY) is asked again over gRPC by the client.
OVERSIZE = "response of {} bytes exceeds the ring slot ({})"


def is_oversize(message: str) -> bool:
    return message.startswith(OVERSIZE.split("{")[0]) and "exceeds the ring slot" in message


def set_deadline(words: np.ndarray, deadline: float) -> None:
    """The request's deadline: `deadline` on time.monotonic()'s clock (CLOCK_MONOTONIC)."""
    # (clamped as a float first: a deadline of centuries, or one whose ns overflow a float)
    ns = int(min(max(deadline * 1e9, 1.0), float((1 << 64) - 1 - 4096)))
    words[S_DEADLINE_LO] = ns & 0xFFFFFFFF
    words[S_DEADLINE_HI] = ns >> 32


def deadline_of(words: np.ndarray) -> float | None:
    """The request's deadline on time.monotonic()'s clock, None if its client set none."""
    ns = int(words[S_DEADLINE_LO]) | (int(words[S_DEADLINE_HI]) << 32)
    return ns / 1e9 if ns else None
