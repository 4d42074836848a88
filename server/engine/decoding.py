"""Request decoding for both transports: a message that does not parse is the client's error
(INVALID_ARGUMENT), never INTERNAL or UNKNOWN, and its log line is rate-limited so that garbage
sent at ring speed cannot flood the log (at most one line per method per LOG_INTERVAL seconds,
with the count of the lines suppressed since).

gRPC: the Engine service is registered with this module's deserializer (service.add_to_server),
which returns a `Malformed` marker instead of raising inside grpc (where a deserialization error
became a bare status with no message); the servicer's wrapper answers the marker. The ring
decodes with `decode()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from google.protobuf.message import Message

from ...proto.errors import InvalidArgument
from ..rate_limited_log import RateLimitedLog

log = logging.getLogger("epd.engine")


CLIENT_ERRORS = RateLimitedLog(log)  # one line per method a second


class Malformed:
    """What the gRPC deserializer hands the servicer for bytes that are not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _invalid(method: str, kind: type[Message], error: str, transport: str) -> InvalidArgument:
    text = f"{method}: malformed {kind.__name__} ({error})"
    CLIENT_ERRORS.warning(f"{transport}:{method}", f"{text} on {transport}")
    return InvalidArgument(text)


def decode(method: str, kind: type[Message], data: bytes, transport: str) -> Message:
    """Parse a request; InvalidArgument (logged, rate-limited) when it does not parse."""
    try:
        return kind.FromString(data)
    except Exception as e:  # DecodeError, and anything else the parser raises on garbage
        raise _invalid(method, kind, str(e) or type(e).__name__, transport) from None


def deserializer(method: str, kind: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return kind.FromString(data)
        except Exception as e:
            return Malformed(str(e) or type(e).__name__)
    return parse


def check(method: str, kind: type[Message], request: object, transport: str = "grpc") -> None:
    """Raise InvalidArgument if the gRPC deserializer could not parse the request."""
    if isinstance(request, Malformed):
        raise _invalid(method, kind, request.error, transport)
