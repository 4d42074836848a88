"""The one error type of EPD, shared by the daemon and its clients, and the one mapping between
it and the wire: gRPC statuses on the gRPC transport, integer status words in a fast-path ring
slot.

Every layer of the daemon raises `EpdError` (or a subclass naming its code); the transports turn
it into a status; the client turns the status back into the same `EpdError`. The argument order
is the wire's, `(code, message)`, as in `grpc.ServicerContext.abort(code, details)`.
"""

from __future__ import annotations

import re

import grpc

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
# A status message travels in gRPC metadata (16 KiB at most) and in a ring slot: a message that
# echoes a huge client string is cut, so the status itself always arrives.
MAX_MESSAGE_CHARS = 2048


class EpdError(RuntimeError):
    """A failed EPD call. `code` is the gRPC status (INVALID_ARGUMENT, ABORTED, ...), `message`
    the daemon's words (also `details`, grpc's name for it)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        if code is not None:
            self.code = code
        if len(message) > MAX_MESSAGE_CHARS:
            message = (f"{message[:MAX_MESSAGE_CHARS // 2]} ... ({len(message)} characters, "
                       f"cut) ... {message[-64:]}")
        self.message = message
        super().__init__(f"{self.code.name}: {message}")

    @property
    def details(self) -> str:
        return self.message

    def copy(self) -> EpdError:
        """The same error as a new object, with no traceback (an error kept and raised again
        would otherwise gather every raise's frames, and keep them alive)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.args = self.args
        return twin

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> EpdError:
        return error(err.code(), err.details() or "")


class _Coded(EpdError):
    """Subclasses fix the code: `InvalidArgument("message")`."""

    def __init__(self, message: str = "") -> None:
        super().__init__(None, message)


class InvalidArgument(_Coded):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(_Coded):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(_Coded):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(_Coded):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class TokenCapacityExceeded(ResourceExhausted):
    """A normal-mode dispatch with more tokens on some rank than its group holds. Every rank of
    the collective fails with the same error and the same `tokens_needed` (the largest call), so
    every rank can grow its group the same way and call again (the DeepEP facade does). The
    number travels inside the message, after CAPACITY_MARK, because a status carries only a
    code and a message."""

    # Raised for an earlier worst-case dispatch whose count the caller did not wait for (its
    # outputs hold no data): growing the group cannot redo that call (client/stream_calls.py).
    earlier = False

    def __init__(self, message: str = "", tokens_needed: int | None = None) -> None:
        if tokens_needed is None:
            found = _CAPACITY_RE.search(message)
            tokens_needed = int(found.group(1)) if found else 0
        elif CAPACITY_MARK not in message:
            message = f"{message} ({CAPACITY_MARK}{tokens_needed})"
        self.tokens_needed = tokens_needed
        super().__init__(message)


CAPACITY_MARK = "max_tokens_per_rank needed: "
_CAPACITY_RE = re.compile(re.escape(CAPACITY_MARK) + r"(\d+)")


class DeadlineExceeded(_Coded):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(_Coded):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(_Coded):
    code = grpc.StatusCode.ABORTED


class PermissionDenied(_Coded):
    code = grpc.StatusCode.PERMISSION_DENIED


class Internal(_Coded):
    code = grpc.StatusCode.INTERNAL


_CLASSES: dict[grpc.StatusCode, type[_Coded]] = {
    c.code: c for c in (InvalidArgument, FailedPrecondition, NotFound, ResourceExhausted,
                        DeadlineExceeded, Unavailable, Aborted, PermissionDenied, Internal)}


def error(code: grpc.StatusCode, message: str) -> EpdError:
    """The EpdError for a status, as the subclass that names the code where there is one (so a
    client can `except Aborted`)."""
    cls = _CLASSES.get(code)
    if cls is ResourceExhausted and CAPACITY_MARK in message:
        return TokenCapacityExceeded(message)
    return cls(message) if cls is not None else EpdError(code, message)


def status_value(code: grpc.StatusCode) -> int:
    """The integer a ring slot carries for a status (0 = OK), gRPC's own numbering."""
    return code.value[0]


def from_status_value(value: int, message: str) -> EpdError:
    """The error for a ring slot's status word (never 0)."""
    return error(_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), message)
