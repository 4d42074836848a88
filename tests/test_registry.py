"""The operation registry (proto/operations.py) is the one table of the server's transports:
every Engine RPC has a handler, every ring operation is served by the ring, ring errors use the
registry's status values, and the old ring names are views of the registry."""

from __future__ import annotations

import errno
import inspect

import grpc
import pytest

from epd.proto import operations
from epd.proto import ring as R
from epd.proto.errors import EpdError, InvalidArgument
from epd.server.engine import core, executor, fast_path, service


def test_every_engine_rpc_has_a_handler() -> None:
    unary = [op.name for op in operations.OPERATIONS.values() if not op.streaming]
    for name in unary:
        assert inspect.iscoroutinefunction(service.handler(name)), name
    streaming = {op.name for op in operations.OPERATIONS.values() if op.streaming}
    assert streaming == {"OpenSession"}
    assert inspect.isasyncgenfunction(service.EngineService.OpenSession)
    # A control handler for a name the registry does not know would be dead code.
    assert set(service.CONTROL) <= set(operations.OPERATIONS)
    with pytest.raises(KeyError):
        service.handler("NoSuchOperation")


def test_the_service_binds_every_unary_rpc() -> None:
    class FakeEngine:
        OPERATIONS = core.Engine.OPERATIONS

    svc = service.EngineService(FakeEngine())  # type: ignore[arg-type]
    for op in operations.OPERATIONS.values():
        bound = getattr(svc, op.name)
        if not op.streaming:
            assert bound.__name__ == op.name and "bound method" not in repr(bound), op.name


def test_every_ring_operation_is_served_by_the_ring() -> None:
    for rid, op in operations.BY_RING_ID.items():
        assert op.ring_id == rid
        attr = core.Engine.OPERATIONS.get(op.name)
        assert attr is not None, f"ring operation {op.name} has no engine operation"
        fn = getattr(core.Engine, attr)
        assert list(inspect.signature(fn).parameters) == ["self", "session", "req", "path"], \
            op.name
    # Collectives run the same function over gRPC.
    assert set(core.Engine.OPERATIONS) >= operations.COLLECTIVES
    assert set(core.Engine.OPERATIONS) <= set(operations.OPERATIONS)


def test_ring_names_are_views_of_the_registry() -> None:
    assert R.METHODS == operations.RING_METHODS
    assert {n: i for i, n in enumerate(R.METHODS)} == R.METHOD_ID
    assert all(operations.OPERATIONS[n].ring_id == i for n, i in R.METHOD_ID.items())
    src = inspect.getsource(fast_path)
    assert "_REQUESTS" not in src and "R.METHODS" not in src


def test_one_error_mapping() -> None:
    e = InvalidArgument("bad")
    assert executor.as_epd_error("X", e) is e
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", "/dev/shm/x/y.counters")
    err = executor.as_epd_error("OpenSession", gone)
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert err.message == ("OpenSession: No such file or directory (FileNotFoundError): "
                           "/dev/shm/x/y.counters")
    denied = PermissionError(errno.EACCES, "Permission denied", "/dev/shm/z")
    assert executor.as_epd_error("Dispatch", denied).code == grpc.StatusCode.INTERNAL
    bug = executor.as_epd_error("Combine", KeyError("k"))
    assert isinstance(bug, EpdError) and bug.code == grpc.StatusCode.INTERNAL
    assert bug.message == "Combine: KeyError: 'k'"
