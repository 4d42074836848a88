"""How a client reaches its engine. gRPC is the contract; a same-host shared-memory fast path
(a later transport) implements the same `Transport` calls with the same messages and errors."""

from __future__ import annotations

import abc
from typing import Any

import grpc

from epd.client.errors import EpdError
from epd.proto.v1 import epd_pb2_grpc

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
