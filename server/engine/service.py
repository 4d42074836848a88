"""gRPC transport of the engine: decode, admit, call the Engine, encode; errors become statuses.

Every unary method of the Engine service in the registry (proto/operations.py) is served by one
wrapper: the engine's `EngineState` admits the call (UNAVAILABLE once the engine drains; counted
in flight), the handler runs, and any exception goes through the one mapping
(executor.as_epd_error) to a status. Collectives run the engine's synchronous operation on the
session's executor (`Engine.operation`, the same function the fast path runs); the other methods
have a handler in `CONTROL`. OpenSession, the session's lease, is the one streaming method.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from ...proto import counter_page, operations
from ...proto import fd_channel as fdc
from ...proto.errors import EpdError, PermissionDenied
from ...proto.v1 import epd_pb2, epd_pb2_grpc
from .. import __version__, metrics
from .core import Engine
from .decoding import check, deserializer
from .executor import CLIENT_DEADLINE, as_epd_error
from .state import Session

log = logging.getLogger("epd.engine")
Handler = Callable[[Engine, Message], Awaitable[Message]]


# -- handlers of the methods that are not collectives -------------------------------------------
async def _join_group(e: Engine, request: epd_pb2.JoinGroupRequest) -> epd_pb2.JoinGroupResponse:
    m = await e.join_group(e.session(request.session_id), request)
    region = m.comm.output_region
    return epd_pb2.JoinGroupResponse(
        group_id=m.group_id, rank=m.rank, output_region_id=region.region_id,
        output_region_ipc=getattr(region, "ipc_handle", b""),
        output_region_bytes=region.size, counter_slot=m.counter_slot,
        service_class=m.spec.service_class,
        rank_nodes=m.comm.membership.rank_nodes if len(set(m.comm.membership.rank_nodes)) > 1
        else (), hierarchical=m.comm.hierarchical, two_stage=m.comm.two_stage)


async def _leave_group(e: Engine, request: epd_pb2.LeaveGroupRequest
                       ) -> epd_pb2.LeaveGroupResponse:
    await e.leave_group(e.session(request.session_id), request.group_id)
    return epd_pb2.LeaveGroupResponse()


async def _register_region(e: Engine, request: epd_pb2.RegisterRegionRequest
                           ) -> epd_pb2.RegisterRegionResponse:
    region = await e.register_region(e.session(request.session_id), request)
    return epd_pb2.RegisterRegionResponse(region_id=region.region_id, size_bytes=region.size)


async def _unregister_region(e: Engine, request: epd_pb2.UnregisterRegionRequest
                             ) -> epd_pb2.UnregisterRegionResponse:
    # On the session's worker, in order with its operations: an ArmStreamOp running there
    # packs its tensors' addresses before it publishes the op, so a check made meanwhile on
    # the event loop found no armed user and unmapped a region the op then read.
    s = e.session(request.session_id)
    await s.executor.run(e.unregister_region, s, request.region_id)
    return epd_pb2.UnregisterRegionResponse()


async def _get_stats(e: Engine, request: epd_pb2.GetStatsRequest) -> epd_pb2.GetStatsResponse:
    # Without a session id: engine-wide counts only, no session's groups; not of a tenant
    # pool's engine, whose activity is its tenants' own (anyone in the socket group may ask;
    # gRPC gives no peer credentials to tell the pool's uids from others).
    if request.session_id:
        return e.stats(e.session(request.session_id))
    if e.slot.tenant_pool:
        raise PermissionDenied(f"engine {e.index} serves tenant pool {e.slot.tenant_pool!r}: "
                               f"its counts go to its sessions only (GetStats with a session)")
    return e.stats(None)


async def _open_fast_path(e: Engine, request: epd_pb2.OpenFastPathRequest
                          ) -> epd_pb2.OpenFastPathResponse:
    return e.open_fast_path(e.session(request.session_id), request)


async def _ping(e: Engine, request: epd_pb2.PingRequest) -> epd_pb2.PingResponse:
    return epd_pb2.PingResponse()


async def _arm_stream_op(e: Engine, request: epd_pb2.ArmStreamOpRequest
                         ) -> epd_pb2.ArmStreamOpResponse:
    return await e.arm_stream_op(e.session(request.session_id), request)


async def _disarm_stream_op(e: Engine, request: epd_pb2.DisarmStreamOpRequest
                            ) -> epd_pb2.DisarmStreamOpResponse:
    await e.disarm_stream_op(e.session(request.session_id), request.op_id)
    return epd_pb2.DisarmStreamOpResponse()


async def _release_handles(e: Engine, request: epd_pb2.ReleaseHandlesRequest
                           ) -> epd_pb2.ReleaseHandlesResponse:
    # Under the session's operation lock, like the operations that create and use handles.
    s = e.session(request.session_id)
    return await s.executor.run(_cpu_counted("ReleaseHandles", e.operation("ReleaseHandles")),
                                s, request, "grpc")


async def _rank_mask(e: Engine, request: epd_pb2.RankMaskRequest) -> epd_pb2.RankMaskResponse:
    # On the session's executor: ordered with the session's low-latency calls.
    s = e.session(request.session_id)
    return await s.executor.run(e.operation("RankMask"), s, request, "grpc")


async def _rejoin(e: Engine, request: epd_pb2.RejoinRequest) -> epd_pb2.RejoinResponse:
    # A collective of the group: on the session's executor, like its low-latency calls.
    s = e.session(request.session_id)
    return await s.executor.run(e.operation("Rejoin"), s, request, "grpc")


CONTROL: dict[str, Handler] = {
    "JoinGroup": _join_group, "LeaveGroup": _leave_group, "RegisterRegion": _register_region,
    "UnregisterRegion": _unregister_region, "GetStats": _get_stats,
    "OpenFastPath": _open_fast_path, "Ping": _ping, "ArmStreamOp": _arm_stream_op,
    "DisarmStreamOp": _disarm_stream_op, "ReleaseHandles": _release_handles,
    "RankMask": _rank_mask, "Rejoin": _rejoin}


def _collective(name: str) -> Handler:
    async def run(e: Engine, request: Message) -> Message:
        s = e.session(request.session_id)
        return await s.executor.run(_cpu_counted(name, e.operation(name)), s, request, "grpc")
    return run


def _cpu_counted(name: str, op: Callable[..., Message]) -> Callable[..., Message]:
    """`op` with its thread CPU (on the session's worker) into epd_request_cpu_seconds,
    path "grpc", as the fast path counts its own: the per-call CPU the metric's users divide
    by epd_requests_total covers both transports. (gRPC's decoding on the event loop is not
    in it.)"""
    def run(*args: Any) -> Message:
        cpu0 = time.thread_time()
        try:
            return op(*args)
        finally:
            metrics.inc(metrics.REQUEST_CPU_SECONDS, (name, "grpc"), time.thread_time() - cpu0)
    return run


def handler(name: str) -> Handler:
    """The handler of a unary registry operation (KeyError if it has none)."""
    if name in CONTROL:
        return CONTROL[name]
    if name in operations.COLLECTIVES and name in Engine.OPERATIONS:
        return _collective(name)
    raise KeyError(f"no gRPC handler for Engine operation {name!r}")


def session_token(context: grpc.aio.ServicerContext) -> bytes:
    """The session token a call carries (metadata `epd-session-token-bin`), or b""."""
    for key, value in context.invocation_metadata() or ():
        if key == fdc.TOKEN_METADATA:
            return value if isinstance(value, bytes) else value.encode()
    return b""


def _unary(engine: Engine, name: str, fn: Handler):
    """Authenticate, admit, run, map errors to a status, count every request by code."""
    request_type = operations.OPERATIONS[name].request

    async def method(request: Message, context: grpc.aio.ServicerContext) -> Message:
        code = grpc.StatusCode.OK
        try:
            check(name, request_type, request)  # bytes that did not parse: INVALID_ARGUMENT
            # Before anything else (even the drain's refusal, which aborts the named session's
            # group): a call naming a session must carry that session's token.
            sid = getattr(request, "session_id", "")
            session = engine.authenticate(sid, session_token(context)) if sid else None
            return await _admitted(engine, name, request, context, fn, session)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:  # the client's deadline passed or it cancelled: counted
            # as the status it got, not OK
            remaining = context.time_remaining()
            code = (grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0
                    else grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:  # one mapping: a bug is logged and serving goes on
            err = as_epd_error(name, exc)
            code = err.code
            await context.abort(err.code, err.message)
        finally:
            metrics.REQUESTS.labels(name, code.name).inc()

    method.__name__ = name
    return method


async def _admitted(engine: Engine, name: str, request: Message,
                    context: grpc.aio.ServicerContext, fn: Handler,
                    session: Session | None) -> Message:
    """Run a call unless the engine refuses calls (its drain: refused first, so that its
    group is aborted for its peers) or the session has too many under way (backlog.py)."""
    try:
        engine.state.enter()
    except EpdError as refused:
        await asyncio.to_thread(engine.refuse, name, request, refused)
        raise
    remaining = context.time_remaining()
    CLIENT_DEADLINE.set(None if remaining is None else time.monotonic() + remaining)
    try:
        with (engine.backlog.hold(session, name, request) if session is not None
              else contextlib.nullcontext()):
            return await fn(engine, request)
    finally:
        engine.state.leave()


class EngineService(epd_pb2_grpc.EngineServicer):
    """The Engine service: OpenSession here, every unary method from the registry."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        for op in operations.OPERATIONS.values():
            if not op.streaming:
                setattr(self, op.name, _unary(engine, op.name, handler(op.name)))

    async def OpenSession(self, request: epd_pb2.OpenSessionRequest,
                          context: grpc.aio.ServicerContext):
        e = self.engine
        try:
            check("OpenSession", epd_pb2.OpenSessionRequest, request)
            # The ticket of the client's descriptor-channel hello: the session's uid, known
            # before it opens (Engine.open_session).
            session = e.open_session(request.client_name, request.pid,
                                     request.channel_ticket)
        except Exception as exc:  # the same mapping as every other method
            err = as_epd_error("OpenSession", exc)
            metrics.REQUESTS.labels("OpenSession", err.code.name).inc()
            await context.abort(err.code, err.message)
        metrics.REQUESTS.labels("OpenSession", "OK").inc()
        try:
            on_mps = e.session_mps(session, request.mps_pipe_directory,
                                   request.mps_pipe_present)
            info = e.backend.device_info()
            yield epd_pb2.SessionEvent(opened=epd_pb2.SessionOpened(
                session_id=session.session_id, session_token=session.token,
                fd_socket_path=fdc.socket_path_for(e.socket_path),
                counter_page_bytes=counter_page.PAGE_BYTES, backend=e.backend.proto_kind,
                engine_index=e.index, device_ordinal=int(info.get("ordinal", 0)),
                version=__version__, default_timeout_seconds=e.config.timeout_seconds,
                mps_pipe_directory=e.mps_pipe_directory, client_on_engine_mps=on_mps))
            # The stream is the lease: it ends when the client closes it or its process dies.
            await session.closed.wait()
        finally:
            # Shielded: a second cancellation must not leave the session half torn down.
            await asyncio.shield(e.close_session(session, "disconnected (session stream ended)"))


def add_to_server(service: EngineService, server: grpc.aio.Server) -> None:
    """Register the Engine service with the registry's types and the decoding module's
    deserializer: bytes that do not parse reach the handler as a `decoding.Malformed` marker and
    are answered INVALID_ARGUMENT (rate-limited log), instead of failing inside grpc as with the
    generated add_EngineServicer_to_server."""
    handlers = {}
    for op in operations.OPERATIONS.values():
        make = (grpc.unary_stream_rpc_method_handler if op.streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[op.name] = make(getattr(service, op.name),
                                 request_deserializer=deserializer(op.name, op.request),
                                 response_serializer=op.response.SerializeToString)
    name = epd_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
