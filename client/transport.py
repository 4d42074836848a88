"""How a client reaches its engine. gRPC is the contract; a same-host shared-memory fast path
(a later transport) implements the same `Transport` calls with the same messages and errors."""

from __future__ import annotations

import abc
import threading
import time
from typing import Any

import grpc

from ..proto import ring as R
from ..proto.errors import EpdError
from ..proto.v1 import epd_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                   ("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.enable_retries", 0)]


class Transport(abc.ABC):
    name: str

    @abc.abstractmethod
    def call(self, method: str, request: Any, timeout: float) -> Any:
        """Unary call; raises EpdError."""

    @abc.abstractmethod
    def call_async(self, method: str, request: Any, timeout: float) -> Any:
        """Start a unary call; the returned object has .result() (raising EpdError)."""

    @abc.abstractmethod
    def open_stream(self, request: Any) -> Any:
        """The session stream (an iterator of SessionEvent with .cancel())."""

    @abc.abstractmethod
    def close(self) -> None: ...


class _Future:
    def __init__(self, fut: grpc.Future) -> None:
        self._fut = fut

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: float | None = None) -> Any:
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

    def call(self, method: str, request: Any, timeout: float) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise EpdError.from_rpc(e) from None

    def call_async(self, method: str, request: Any, timeout: float) -> _Future:
        return _Future(getattr(self.stub, method).future(request, timeout=timeout))

    def open_stream(self, request: Any) -> Any:
        return self.stub.OpenSession(request)

    def close(self) -> None:
        self.channel.close()


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _response_types() -> dict[str, Any]:
    from ..proto.v1 import epd_pb2
    return {"Ping": epd_pb2.PingResponse,
            "GetDispatchLayout": epd_pb2.GetDispatchLayoutResponse,
            "Dispatch": epd_pb2.DispatchResponse, "Combine": epd_pb2.CombineResponse,
            "GetStats": epd_pb2.GetStatsResponse,
            "LowLatencyDispatch": epd_pb2.LowLatencyDispatchResponse,
            "LowLatencyCombine": epd_pb2.LowLatencyCombineResponse}


class _RingCall:
    """One submitted fast-path request; `result()` waits for its answer."""

    def __init__(self, transport: FastPathTransport, method: str, slot: int, seq: int,
                 deadline: float) -> None:
        self.t, self.method, self.slot, self.seq, self.deadline = (transport, method, slot,
                                                                   seq, deadline)
        self._value: Any = None
        self._done = False

    def done(self) -> bool:
        words, _, _ = self.t.ring.slot(self.slot)
        return self._done or int(words[R.S_STATE]) == R.DONE

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._value = self.t._finish(self)
            self._done = True
        if isinstance(self._value, EpdError):
            raise self._value
        return self._value


class FastPathTransport(Transport):
    """Data-plane calls through the session's shared-memory ring; everything else (and any call
    whose message does not fit a slot) through gRPC. Same messages, same errors."""

    name = "fastpath"

    def __init__(self, inner: GrpcTransport, ring_path: str, slots: int, slot_bytes: int,
                 spin_seconds: float) -> None:
        self.inner = inner
        self.ring = R.Ring(ring_path, slots, slot_bytes, create=False)
        self.spin = spin_seconds
        self._lock = threading.Lock()
        self._next = 1
        self._responses = _response_types()
        self.broken: str | None = None

    def _submit(self, method: str, data: bytes, timeout: float) -> _RingCall:
        deadline = time.monotonic() + timeout
        with self._lock:
            seq = self._next
            slot = (seq - 1) % self.ring.slots
            words, payload, _ = self.ring.slot(slot)
            while int(words[R.S_STATE]) != R.FREE:
                # Every slot holds a call in flight: wait for the oldest to be consumed.
                if time.monotonic() > deadline:
                    raise EpdError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"fast-path ring full ({self.ring.slots} calls in flight)")
                time.sleep(20e-6)
            self._next += 1
            payload[:len(data)] = data
            words[R.S_METHOD] = R.METHOD_ID[method]
            words[R.S_LENGTH] = len(data)
            words[R.S_STATUS] = 0
            R.set_seq(words, seq)
            words[R.S_STATE] = R.SUBMITTED
            self.ring.header[R.DOORBELL] += 1
            if self.ring.header[R.ENGINE_WAITING]:
                R.futex_wake(self.ring.doorbell_addr)
        return _RingCall(self, method, slot, seq, deadline)

    def _finish(self, call: _RingCall) -> Any:
        words, payload, state_addr = self.ring.slot(call.slot)
        header = self.ring.header
        spin_until = time.perf_counter() + self.spin
        while words[R.S_STATE] != R.DONE:
            if header[R.CLOSED]:
                self.broken = "the engine closed the fast path"
                return EpdError(grpc.StatusCode.UNAVAILABLE, self.broken)
            if time.perf_counter() < spin_until:
                continue
            left = call.deadline - time.monotonic()
            if left <= 0:
                # The engine still owns the slot: stop using the ring, keep the session.
                self.broken = f"{call.method} did not complete on the fast path in time"
                return EpdError(grpc.StatusCode.DEADLINE_EXCEEDED, self.broken)
            R.futex_wait(state_addr, R.SUBMITTED, min(left, 0.05))
        status = int(words[R.S_STATUS])
        n = int(words[R.S_LENGTH])
        data = bytes(payload[:n])
        R.set_seq(words, 0)
        words[R.S_STATE] = R.FREE
        if status:
            return EpdError(_CODES.get(status, grpc.StatusCode.UNKNOWN), data.decode())
        return self._responses[call.method].FromString(data)

    def _use_ring(self, method: str, data: bytes) -> bool:
        return (self.broken is None and method in R.METHOD_ID
                and len(data) <= self.ring.capacity)

    def call(self, method: str, request: Any, timeout: float) -> Any:
        data = request.SerializeToString()
        if not self._use_ring(method, data):
            return self.inner.call(method, request, timeout)
        return self._submit(method, data, timeout).result()

    def call_async(self, method: str, request: Any, timeout: float) -> Any:
        data = request.SerializeToString()
        if not self._use_ring(method, data):
            return self.inner.call_async(method, request, timeout)
        return self._submit(method, data, timeout)

    def open_stream(self, request: Any) -> Any:
        return self.inner.open_stream(request)

    def close(self) -> None:
        self.ring.close(unlink=False)
        self.inner.close()
