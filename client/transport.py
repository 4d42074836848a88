"""How a client reaches its engine: the `Transport` interface and its two implementations.
gRPC (`GrpcTransport`) carries every operation; the same-host fast path (`FastPathTransport`)
carries the data-plane operations the registry marks for the ring (`proto/operations.py`)
through the session's shared-memory ring, with the same messages, and hands everything else
(and any message too large for a slot) to gRPC. Both raise the one `EpdError` (`proto/errors.py`)
for a failed call."""

from __future__ import annotations

import abc
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from ..proto import fd_channel as fdc
from ..proto import host_order, operations, spin
from ..proto import ring as R
from ..proto.errors import (
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    Internal,
    ResourceExhausted,
    Unavailable,
    from_status_value,
)
from ..proto.v1 import epd_pb2, epd_pb2_grpc
from . import host_cpu

if TYPE_CHECKING:
    import numpy as np

MAX_MESSAGE_BYTES = 64 << 20  # gRPC messages, both directions
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0)]
RING_FULL_POLL_SECONDS = 20e-6  # a full ring: how often to look for a freed slot
FUTEX_WAIT_SECONDS = 0.05  # a waiting call wakes at least this often to check the ring
GRPC_WAIT_MARGIN_SECONDS = 5.0  # a gRPC future's wait past its call's own deadline
# (and the lease: see FastPathTransport.lease_lost)
# The most a client spins for an answer, whatever the engine's OpenFastPathResponse says (its
# defaults: 50 µs, and 1 ms for answers predicted to come that quickly); never past a call's
# deadline either.
MAX_SPIN_SECONDS = 0.01
CLOSED_MESSAGE = "the session is closed"

log = logging.getLogger("epd.client")


def fast_path_spins(spin_seconds: float, reply_spin_max_seconds: float
                    ) -> tuple[float, float, str]:
    """The engine's spin windows as the client uses them: each within [0, MAX_SPIN_SECONDS]
    (NaN: 0); and what was clamped ("" when nothing was), for a warning."""
    out, notes = [], []
    for name, v in (("spin_seconds", spin_seconds),
                    ("reply_spin_max_seconds", reply_spin_max_seconds)):
        v = float(v)
        c = 0.0 if math.isnan(v) else min(max(v, 0.0), MAX_SPIN_SECONDS)
        if c != v:
            notes.append(f"{name}={v!r} taken as {c}")
        out.append(c)
    return out[0], out[1], "; ".join(notes)


def check_fast_path_ring(slots: int, slot_bytes: int) -> None:
    """ValueError unless the engine's ring has a shape this client can use (the limits the
    engine itself checks a request against, proto/ring.py)."""
    if not (1 <= slots <= R.MAX_SLOTS and R.MIN_SLOT_BYTES <= slot_bytes <= R.MAX_SLOT_BYTES):
        raise ValueError(f"the engine offered a fast-path ring of {slots} slots of {slot_bytes} "
                         f"bytes (slots must lie in [1, {R.MAX_SLOTS}], slot_bytes in "
                         f"[{R.MIN_SLOT_BYTES}, {R.MAX_SLOT_BYTES}])")


class PendingCall(Protocol):
    """A unary call in flight."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Message:
        """The response; raises EpdError."""
        ...


class SessionStream(Protocol):
    """The session's lease stream: SessionEvents until it ends; `cancel()` ends it."""

    def __iter__(self) -> Iterator[epd_pb2.SessionEvent]: ...

    def cancel(self) -> bool: ...


class Transport(abc.ABC):
    name: str

    @abc.abstractmethod
    def call(self, method: str, request: Message, timeout: float) -> Message:
        """Unary call of the Engine operation `method`; raises EpdError."""

    @abc.abstractmethod
    def call_async(self, method: str, request: Message, timeout: float) -> PendingCall:
        """Start a unary call."""

    @abc.abstractmethod
    def open_stream(self, request: epd_pb2.OpenSessionRequest) -> SessionStream:
        """The session stream."""

    @abc.abstractmethod
    def close(self) -> None: ...


class _Future:
    def __init__(self, fut: grpc.Future, method: str, timeout: float) -> None:
        self._fut, self._method = fut, method
        self._deadline = time.monotonic() + timeout + GRPC_WAIT_MARGIN_SECONDS
        self._expired: EpdError | None = None  # the wait ran out and the call was cancelled

    def done(self) -> bool:
        return self._expired is not None or self._fut.done()

    def result(self, timeout: float | None = None) -> Message:
        # Never past the call's own deadline and a margin: gRPC's deadline fires first, unless
        # an exception raised inside grpc's code (a signal handler's KeyboardInterrupt in an
        # earlier call of this thread) left its channel lock held, and then nothing else
        # would end the wait (a fuzzer's run hung there).
        if self._expired is not None:  # (a cancelled future raises grpc's own error)
            raise self._expired.copy()
        left = min(max(self._deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)
        try:
            return self._outcome(left if timeout is None else min(timeout, left))
        except grpc.FutureTimeoutError:
            if timeout is not None and timeout < left:
                raise
        if not self._fut.cancel():  # (it ended as the wait did: that outcome stands)
            return self._outcome(0.0)
        self._expired = DeadlineExceeded(f"{self._method}: gRPC did not end the call within "
                                         f"its deadline (+{GRPC_WAIT_MARGIN_SECONDS:g} s)")
        raise self._expired.copy()

    def _outcome(self, timeout: float) -> Message:
        try:
            return self._fut.result(timeout=timeout)
        except grpc.RpcError as e:
            # grpc raises its future itself, so its traceback would gather every raise's
            # frames, a caller's that went on to make a new PendingDispatch too (a cycle that
            # kept it alive and refused the next dispatch_async)
            e.__traceback__ = None
            raise EpdError.from_rpc(e) from None


class GrpcTransport(Transport):
    name = "grpc"

    def __init__(self, target: str) -> None:
        if target.startswith("/"):
            target = f"unix://{target}"
        self.target = target
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = epd_pb2_grpc.EngineStub(self.channel)
        self.metadata: tuple[tuple[str, bytes], ...] = ()  # the session token, once opened

    def set_token(self, token: bytes) -> None:
        """Every later call carries the session's token (gRPC metadata)."""
        self.metadata = ((fdc.TOKEN_METADATA, token),)

    def call(self, method: str, request: Message, timeout: float) -> Message:
        return self.call_async(method, request, timeout).result()  # (its wait is bounded)

    def call_async(self, method: str, request: Message, timeout: float) -> _Future:
        return _Future(getattr(self.stub, method).future(request, timeout=timeout,
                                                         metadata=self.metadata),
                       method, timeout)

    def open_stream(self, request: epd_pb2.OpenSessionRequest) -> SessionStream:
        return self.stub.OpenSession(request)

    def close(self) -> None:
        self.channel.close()


class _Failed:
    """A call that failed before it started."""

    def __init__(self, error: EpdError) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Message:
        raise self.error.copy()


class _RingCall:
    """One submitted fast-path request; `result()` waits for its answer."""

    def __init__(self, transport: FastPathTransport, op: operations.Operation, slot: int,
                 seq: int, deadline: float) -> None:
        self.t, self.op, self.slot, self.seq, self.deadline = (transport, op, slot, seq,
                                                               deadline)
        self.submitted = time.perf_counter()
        self._value: Message | EpdError | None = None
        self._done = False
        self._taking = threading.Lock()  # result() and the ring's reclaim never both take it

    def done(self) -> bool:
        """Whether result() returns (or raises) at once: answered, or the transport closed."""
        if self._done or self.t.closed:
            return True
        words, _, _ = self.t.ring.slot(self.slot)
        # (a call exists only once published: a free slot, or another call's, means its
        # answer was taken, by the ring into this call or by a read an exception cut short,
        # which result() reports)
        if R.seq_of(words) != self.seq or int(words[R.S_STATE]) == R.FREE:
            return True
        return int(words[R.S_STATE]) == R.DONE or self._done

    def result(self, timeout: float | None = None) -> Message:
        with self._taking:
            if not self._done:
                try:
                    self._value = self.t._finish(self)
                except Exception as e:  # (a bug here: fail this call once, never spin again)
                    self._value = Internal(f"{self.op.name}: the fast-path answer could not "
                                           f"be read: {type(e).__name__}: {e}")
                self._done = True
        if isinstance(self._value, EpdError):
            raise self._value.copy()  # (a copy: each raise's frames stay out of the stored one)
        assert self._value is not None
        return self._value

    def __del__(self) -> None:
        # Dropped before its answer was taken (an exception in the caller, an abandoned async
        # call): its slot goes back to the ring once answered, or the ring would stall there.
        # (An __init__ cut short set nothing: its submission registered the slot itself.)
        if not getattr(self, "_done", True):
            # (only while the slot's entry is still this call's: a newer call may own it now)
            orphans = self.t._orphans
            held = orphans.get(self.slot)
            if held is not None and held[0] == self.seq:
                orphans[self.slot] = (self.seq, None)


class FastPathTransport(Transport):
    """Data-plane calls through the session's shared-memory ring; everything else (and any call
    whose message does not fit a slot) through gRPC. Same messages, same errors."""

    name = "fastpath"

    def __init__(self, inner: GrpcTransport, ring: R.Ring | int, slots: int, slot_bytes: int,
                 spin_seconds: float, reply_spin_max_seconds: float = 0.0) -> None:
        """`ring`: the ring's memfd as fetched over the descriptor channel (mapped here, the
        descriptor closed), or a mapped Ring. The wait for an answer spins `spin_seconds`, or
        up to `reply_spin_max_seconds` where the recent answers of the same operation came
        within that (the caller's thread is blocked on the call anyway; a futex sleep adds a
        wake-up to every answer that takes longer than the base spin)."""
        try:
            check_fast_path_ring(slots, slot_bytes)
        except ValueError:
            if not isinstance(ring, R.Ring):
                os.close(ring)
            raise
        base, longest, clamped = fast_path_spins(spin_seconds, reply_spin_max_seconds)
        if clamped:
            log.warning("fast path: the engine's spin windows were clamped (%s)", clamped)
        self.inner = inner
        self.ring = ring if isinstance(ring, R.Ring) else R.Ring.from_fd(ring, slots, slot_bytes)
        self.spin = spin.SpinWindow(base, longest)
        self._lock = threading.Lock()
        self._next = 1
        # slot -> (sequence, the call or None) of the call submitted there: its weak reference
        # (set at submission), or None once it was dropped unanswered (_RingCall.__del__, any
        # thread: a dict store, no lock). A slot the ring needs again is freed once the engine
        # answered it (_reclaim): the answer of a live call moves into that call, which
        # result() then returns; that of a dropped call is thrown away.
        self._orphans: dict[int, tuple[int, Callable[[], _RingCall | None] | None]] = {}
        self.closed = False  # close() ran: no call may touch the ring any more
        self.broken: str | None = None
        # Set once the session's lease ended (the engine died or the session closed): every ring
        # call then fails with UNAVAILABLE, waiting ones within one wait slice.
        self.lost: str | None = None

    def lease_lost(self, message: str) -> None:
        """The session's stream ended: fail every call waiting on the ring now (wake each
        slot's futex; a waiter also re-checks `lost` at least every FUTEX_WAIT_SECONDS) and
        every later one at once, with UNAVAILABLE and `message` ("the engine went away: ...").
        Called by the session's lease thread."""
        if self.lost is None:
            self.lost = message
        for i in range(self.ring.slots):
            try:
                _, _, state_addr = self.ring.slot(i)
            except IndexError:  # the ring was closed meanwhile: nobody waits on it
                return
            R.futex_wake(state_addr)

    def _lost_error(self) -> EpdError:
        return Unavailable(self.lost or "the engine went away")

    def _submit(self, method: str, data: bytes, timeout: float) -> _RingCall:
        op = operations.get(method)
        assert op.ring_id is not None, f"{method} does not travel on the ring"
        deadline = time.monotonic() + timeout
        with self._lock:
            if self.closed:
                raise FailedPrecondition(CLOSED_MESSAGE)
            seq = self._next
            slot = (seq - 1) % self.ring.slots
            words, payload, _ = self.ring.slot(slot)
            while int(words[R.S_STATE]) != R.FREE and not self._reclaim(slot, words):
                # Every slot holds a call the engine has not answered yet (or whose answer
                # result() is taking now): wait for the oldest to be consumed.
                if self.lost is not None:
                    raise self._lost_error()
                if self.closed:
                    raise FailedPrecondition(CLOSED_MESSAGE)
                if time.monotonic() > deadline:
                    raise ResourceExhausted(
                        f"fast-path ring full ({self.ring.slots} calls in flight)")
                time.sleep(RING_FULL_POLL_SECONDS)
            # An exception can land between any two steps (a KeyboardInterrupt from a signal
            # handler): the slot is reclaimable as a dropped call's from its publication on,
            # and a sequence is taken only once published (the engine serves them in order:
            # one taken and never published would stall every later call).
            self._orphans[slot] = (seq, None)
            try:
                payload[:len(data)] = data
                words[R.S_METHOD] = op.ring_id
                words[R.S_LENGTH] = len(data)
                words[R.S_STATUS] = 0
                R.set_deadline(words, deadline)  # (the engine does not start it later)
                R.set_seq(words, seq)
                host_order.publish()  # (the request before its state)
                words[R.S_STATE] = R.SUBMITTED
                self._next = seq + 1
            finally:  # (published: the engine may have answered it already)
                if int(words[R.S_STATE]) != R.FREE and R.seq_of(words) == seq:
                    self._next = seq + 1
                    self._ring_doorbell()
                else:  # (not published: the slot stays free, the sequence untaken)
                    self._orphans.pop(slot, None)
            call = _RingCall(self, op, slot, seq, deadline)
            self._orphans[slot] = (seq, weakref.ref(call))
        return call

    def _ring_doorbell(self) -> None:
        self.ring.header[R.DOORBELL] += 1
        host_order.full()  # (our stores before the engine's waiting word is read)
        if self.ring.header[R.ENGINE_WAITING]:
            R.futex_wake(self.ring.doorbell_addr)

    def _reclaim(self, slot: int, words: np.ndarray) -> bool:
        """(Under self._lock.) Free `slot` if it holds an answer nobody is taking now: that of
        a dropped call is thrown away, that of a live one (an async call not read yet, e.g. a
        PendingDispatch) moves into the call for its later result(). So a call whose answer
        sits unread never blocks the call that comes round to its slot."""
        orphan = self._orphans.get(slot)
        if orphan is None or int(words[R.S_STATE]) != R.DONE or R.seq_of(words) != orphan[0]:
            return False
        call = orphan[1]() if orphan[1] is not None else None
        if call is None or call._done:  # (done: it failed already, e.g. its deadline passed)
            words[R.S_STATE] = R.FREE  # (free before its sequence is cleared: an exception
            R.set_seq(words, 0)  # between the two leaves a free slot, not an unmatched answer)
        elif call._taking.acquire(blocking=False):  # (else its result() is taking it now)
            try:
                if not call._done:
                    call._value, call._done = self._take(call), True
            finally:
                call._taking.release()
        del self._orphans[slot]
        return int(words[R.S_STATE]) == R.FREE

    def _finish(self, call: _RingCall) -> Message | EpdError:
        with host_cpu.waiting():
            waited = self._wait(call)
        return waited if waited is not None else self._take(call)

    def _wait(self, call: _RingCall) -> EpdError | None:
        """Until the engine answered (None), or why it never will."""
        if self.closed:
            return FailedPrecondition(CLOSED_MESSAGE)
        words, _, state_addr = self.ring.slot(call.slot)
        if R.seq_of(words) != call.seq or int(words[R.S_STATE]) == R.FREE:  # (its answer was
            # taken by a read an exception cut short: the slot is free, or another call's
            # now; never read that one's answer)
            return Internal(f"{call.op.name}: its fast-path answer was lost (a read of it was "
                            f"interrupted); the call itself ran")
        header = self.ring.header
        ring_id = call.op.ring_id
        # Spin for the operation's window, never past the call's own deadline.
        spin_until = min(call.submitted + self.spin.window(ring_id),
                         time.perf_counter() + (call.deadline - time.monotonic()))
        while words[R.S_STATE] != R.DONE:
            if self.closed:
                return FailedPrecondition(CLOSED_MESSAGE)
            if header[R.CLOSED]:
                self.broken = "the engine closed the fast path"
                return Unavailable(self.broken)
            if self.lost is not None:
                # The engine will never answer: the slot stays SUBMITTED, the ring unused.
                return self._lost_error()
            if time.perf_counter() < spin_until:
                spin.relax()  # without the GIL (the caller's other threads), no timer
                continue
            left = call.deadline - time.monotonic()
            if left <= 0:
                # The engine still owns the slot: stop using the ring, keep the session.
                self.broken = f"{call.op.name} did not complete on the fast path in time"
                return EpdError(grpc.StatusCode.DEADLINE_EXCEEDED, self.broken)
            R.futex_wait(state_addr, R.SUBMITTED, min(left, FUTEX_WAIT_SECONDS))
        self.spin.seen(ring_id, time.perf_counter() - call.submitted)
        return None

    def _take(self, call: _RingCall) -> Message | EpdError:
        """The answer in the call's slot, which goes back to the ring."""
        words, payload, _ = self.ring.slot(call.slot)
        host_order.consume()  # (the DONE seen before the answer is read)
        status = int(words[R.S_STATUS])
        n = int(words[R.S_LENGTH])
        data = bytes(payload[:n])
        words[R.S_STATE] = R.FREE  # (then its sequence: as in _reclaim)
        R.set_seq(words, 0)
        if status:
            return from_status_value(status, data.decode(errors="replace"))
        if n > self.ring.capacity:
            return Internal(f"{call.op.name}: the engine's answer could not be decoded (it "
                            f"claims {n} bytes; a slot holds {self.ring.capacity})")
        try:
            return call.op.response.FromString(data)
        except DecodeError as e:
            return Internal(f"{call.op.name}: the engine's answer could not be decoded "
                            f"({n} bytes: {e})")

    def _use_ring(self, method: str, data: bytes) -> bool:
        op = operations.OPERATIONS.get(method)
        return (self.broken is None and op is not None and op.ring_id is not None
                and len(data) <= self.ring.capacity)

    def call(self, method: str, request: Message, timeout: float) -> Message:
        if self.closed:
            raise FailedPrecondition(CLOSED_MESSAGE)
        if self.lost is not None:
            raise self._lost_error()
        data = request.SerializeToString()
        if not self._use_ring(method, data):
            return self.inner.call(method, request, timeout)
        start = time.monotonic()
        try:
            return self._submit(method, data, timeout).result()
        except ResourceExhausted as e:  # (a large GetStats: many groups, long abort reasons)
            if method in operations.READ_ONLY and R.is_oversize(e.message):
                left = timeout - (time.monotonic() - start)  # (the caller's wait, not twice it)
                if left <= 0:
                    raise DeadlineExceeded(f"{method}: its answer did not fit the ring slot "
                                           f"and no time was left to ask over gRPC") from None
                return self.inner.call(method, request, left)
            raise

    def call_async(self, method: str, request: Message, timeout: float) -> PendingCall:
        if self.closed:
            return _Failed(FailedPrecondition(CLOSED_MESSAGE))
        if self.lost is not None:
            return _Failed(self._lost_error())
        data = request.SerializeToString()
        if not self._use_ring(method, data):
            return self.inner.call_async(method, request, timeout)
        return self._submit(method, data, timeout)

    def open_stream(self, request: epd_pb2.OpenSessionRequest) -> SessionStream:
        return self.inner.open_stream(request)

    def close(self) -> None:
        """Unmap the ring: a call not answered yet, and any later call, fails with
        FAILED_PRECONDITION ("the session is closed"); an answer already taken stays."""
        self.closed = True
        with self._lock:  # (no submission is writing into a slot now)
            self.ring.close(unlink=False)
        self.inner.close()
