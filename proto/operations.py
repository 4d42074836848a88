"""The registry of the Engine service's operations: name, request and response types, whether a
session's fast-path ring may carry it (and under which id), and whether it is a collective.

One table for every transport: the gRPC servicer, the fast-path ring server and the client all
look operations up here, so adding an operation is one line (plus its handler on the engine,
which a test checks exists). The request/response types come from the service descriptor of
`v1/epd.proto`, the contract, not from a second list.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import message, message_factory

from .v1 import epd_pb2

# Ring ids, append only: an id never changes meaning (a client and an engine of different
# versions agree on these). Ping is the empty operation that measures the transport.
RING_METHODS = ("Ping", "GetDispatchLayout", "Dispatch", "Combine", "GetStats",
                "LowLatencyDispatch", "LowLatencyCombine", "ReleaseHandles")

# The data-plane collectives: they run under the session's operation lock on its executor.
COLLECTIVES = frozenset({"GetDispatchLayout", "Dispatch", "Combine", "LowLatencyDispatch",
                         "LowLatencyCombine"})

# Operations that change nothing: a client may send one again (the fast path's answer that
# did not fit its slot is asked for over gRPC).
READ_ONLY = frozenset({"Ping", "GetStats"})


@dataclass(frozen=True)
class Operation:
    name: str                                # the gRPC method name
    request: type[message.Message]
    response: type[message.Message]
    ring_id: int | None                      # id in a fast-path ring slot; None: gRPC only
    streaming: bool                          # a server stream (OpenSession, the lease)
    collective: bool


def _build() -> dict[str, Operation]:
    service = epd_pb2.DESCRIPTOR.services_by_name["Engine"]
    ops = {}
    for m in service.methods:
        ops[m.name] = Operation(
            name=m.name,
            request=message_factory.GetMessageClass(m.input_type),
            response=message_factory.GetMessageClass(m.output_type),
            ring_id=RING_METHODS.index(m.name) if m.name in RING_METHODS else None,
            streaming=m.server_streaming, collective=m.name in COLLECTIVES)
    missing = set(RING_METHODS) - set(ops)
    if missing:  # pragma: no cover - the table and the proto disagree: a programming error
        raise RuntimeError(f"ring methods {sorted(missing)} are not Engine RPCs")
    return ops


OPERATIONS: dict[str, Operation] = _build()
BY_RING_ID: dict[int, Operation] = {op.ring_id: op for op in OPERATIONS.values()
                                    if op.ring_id is not None}


def get(name: str) -> Operation:
    return OPERATIONS[name]
