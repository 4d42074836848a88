"""The one exception clients see: the daemon's gRPC status and message."""

from __future__ import annotations

import grpc


class EpdError(RuntimeError):
    """A failed EPD call. `code` is the gRPC status (INVALID_ARGUMENT, ABORTED, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> EpdError:
        return cls(err.code(), err.details() or "")
