"""How a client reaches its engine: the `Transport` interface and its two implementations.
gRPC (`GrpcTransport`) carries every operation; the same-host fast path (`FastPathTransport`)
carries the data-plane operations the registry marks for the ring (`proto/operations.py`)
through the session's shared-memory ring, with the same messages, and hands everything else
(and any message too large for a slot) to gRPC. Both raise the one `EpdError` (`proto/errors.py`)
for a failed call."""

from __future__ import annotations

import abc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import grpc
from google.protobuf.message import Message

from ..proto import fd_channel as fdc
from ..proto import operations, spin
from ..proto import ring as R
from ..proto.errors import EpdError, ResourceExhausted, Unavailable, from_status_value
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
# (and the lease: see FastPathTransport.lease_lost)


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
    def __init__(self, fut: grpc.Future) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> Message:
        try:
            return self._fut.result(timeout=timeout)
        except grpc.RpcError as e:
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
        try:
            return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise EpdError.from_rpc(e) from None

    def call_async(self, method: str, request: Message, timeout: float) -> _Future:
        return _Future(getattr(self.stub, method).future(request, timeout=timeout,
                                                         metadata=self.metadata))

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
        raise self.error


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
        words, _, _ = self.t.ring.slot(self.slot)
        return self._done or int(words[R.S_STATE]) == R.DONE

    def result(self, timeout: float | None = None) -> Message:
        with self._taking:
            if not self._done:
                self._value = self.t._finish(self)
                self._done = True
        if isinstance(self._value, EpdError):
            raise self._value
        assert self._value is not None
        return self._value

    def abandon(self) -> None:
        """Its answer may be taken by the ring when it needs the slot (its holder stopped
        waiting for it; a later result() still returns it)."""
        if not self._done:
            self.t._orphans[self.slot] = (self.seq, weakref.ref(self))

    def __del__(self) -> None:
        # Dropped before its answer was taken (an exception in the caller, an abandoned async
        # call): its slot goes back to the ring once answered, or the ring would stall there.
        if not self._done:
            self.t._orphans[self.slot] = (self.seq, None)


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
        self.inner = inner
        self.ring = ring if isinstance(ring, R.Ring) else R.Ring.from_fd(ring, slots, slot_bytes)
        self.spin = spin.SpinWindow(spin_seconds, reply_spin_max_seconds)
        self._lock = threading.Lock()
        self._next = 1
        # slot -> (sequence, the call or None) of a call dropped or abandoned unanswered
        # (_RingCall.__del__ / abandon, any thread: a dict store, no lock); the slot is freed
        # once the engine answered it (_reclaim)
        self._orphans: dict[int, tuple[int, Callable[[], _RingCall | None] | None]] = {}
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
            seq = self._next
            slot = (seq - 1) % self.ring.slots
            words, payload, _ = self.ring.slot(slot)
            while int(words[R.S_STATE]) != R.FREE and not self._reclaim(slot, words):
                # Every slot holds a call in flight: wait for the oldest to be consumed.
                if self.lost is not None:
                    raise self._lost_error()
                if time.monotonic() > deadline:
                    raise ResourceExhausted(
                        f"fast-path ring full ({self.ring.slots} calls in flight)")
                time.sleep(RING_FULL_POLL_SECONDS)
            self._next += 1
            payload[:len(data)] = data
            words[R.S_METHOD] = op.ring_id
            words[R.S_LENGTH] = len(data)
            words[R.S_STATUS] = 0
            R.set_seq(words, seq)
            words[R.S_STATE] = R.SUBMITTED
            self.ring.header[R.DOORBELL] += 1
            if self.ring.header[R.ENGINE_WAITING]:
                R.futex_wake(self.ring.doorbell_addr)
        return _RingCall(self, op, slot, seq, deadline)

    def _reclaim(self, slot: int, words: np.ndarray) -> bool:
        """(Under self._lock.) Free `slot` if it holds the answer of a call dropped or
        abandoned unanswered; an abandoned call keeps its answer for a later result()."""
        orphan = self._orphans.get(slot)
        if orphan is None or int(words[R.S_STATE]) != R.DONE or R.seq_of(words) != orphan[0]:
            return False
        call = orphan[1]() if orphan[1] is not None else None
        if call is None:
            R.set_seq(words, 0)
            words[R.S_STATE] = R.FREE
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
        words, _, state_addr = self.ring.slot(call.slot)
        header = self.ring.header
        ring_id = call.op.ring_id
        spin_until = call.submitted + self.spin.window(ring_id)
        while words[R.S_STATE] != R.DONE:
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
        status = int(words[R.S_STATUS])
        n = int(words[R.S_LENGTH])
        data = bytes(payload[:n])
        R.set_seq(words, 0)
        words[R.S_STATE] = R.FREE
        if status:
            return from_status_value(status, data.decode(errors="replace"))
        return call.op.response.FromString(data)

    def _use_ring(self, method: str, data: bytes) -> bool:
        op = operations.OPERATIONS.get(method)
        return (self.broken is None and op is not None and op.ring_id is not None
                and len(data) <= self.ring.capacity)

    def call(self, method: str, request: Message, timeout: float) -> Message:
        if self.lost is not None:
            raise self._lost_error()
        data = request.SerializeToString()
        if not self._use_ring(method, data):
            return self.inner.call(method, request, timeout)
        return self._submit(method, data, timeout).result()

    def call_async(self, method: str, request: Message, timeout: float) -> PendingCall:
        if self.lost is not None:
            return _Failed(self._lost_error())
        data = request.SerializeToString()
        if not self._use_ring(method, data):
            return self.inner.call_async(method, request, timeout)
        return self._submit(method, data, timeout)

    def open_stream(self, request: epd_pb2.OpenSessionRequest) -> SessionStream:
        return self.inner.open_stream(request)

    def close(self) -> None:
        self.ring.close(unlink=False)
        self.inner.close()
