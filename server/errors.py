"""Errors that carry a gRPC status: every layer raises these, the transport maps them."""

from __future__ import annotations

import grpc


class EpdError(Exception):
    """An error with the gRPC status code a client should see."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(EpdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(EpdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(EpdError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(EpdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(EpdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(EpdError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(EpdError):
    code = grpc.StatusCode.ABORTED


class PermissionDenied(EpdError):
    code = grpc.StatusCode.PERMISSION_DENIED
