"""gRPC transport of the engine: decode, call the Engine, encode; errors become statuses."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from ...proto import counter_page
from ...proto.errors import EpdError
from ...proto.v1 import epd_pb2, epd_pb2_grpc
from .. import __version__, metrics
from .core import Engine

log = logging.getLogger("epd.engine")


def _unary(method):
    """Map EpdError to its status, count every request by code, never leak a traceback."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        code = grpc.StatusCode.OK
        try:
            return await method(self, request, context)
        except EpdError as e:
            code = e.code
            await context.abort(e.code, e.message)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # a bug, not a client error: keep serving, say what happened
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{name}: {type(e).__name__}: {e}")
        finally:
            metrics.REQUESTS.labels(name, code.name).inc()

    return wrapper


class EngineService(epd_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def OpenSession(self, request, context):
        e = self.engine
        try:
            session = e.open_session(request.client_name, request.pid)
        except EpdError as err:
            metrics.REQUESTS.labels("OpenSession", err.code.name).inc()
            await context.abort(err.code, err.message)
        metrics.REQUESTS.labels("OpenSession", "OK").inc()
        info = e.backend.device_info()
        try:
            yield epd_pb2.SessionEvent(opened=epd_pb2.SessionOpened(
                session_id=session.session_id, counter_page_path=session.counter_path,
                counter_page_bytes=counter_page.PAGE_BYTES,
                backend=epd_pb2.CUDA if e.backend.name == "cuda" else epd_pb2.CPU,
                engine_index=e.index, device_ordinal=int(info.get("ordinal", 0)),
                version=__version__, default_timeout_seconds=e.config.timeout_seconds))
            # The stream is the lease: it ends when the client closes it or its process dies.
            await session.closed.wait()
        finally:
            # Shielded: a second cancellation must not leave the session half torn down.
            await asyncio.shield(e.close_session(session, "disconnected (session stream ended)"))

    @_unary
    async def JoinGroup(self, request, context):
        s = self.engine.session(request.session_id)
        m = await self.engine.join_group(s, request)
        region = m.comm.output_region
        return epd_pb2.JoinGroupResponse(
            group_id=m.group_id, rank=m.rank, output_region_id=region.region_id,
            output_region_path=getattr(region, "path", ""),
            output_region_ipc=getattr(region, "ipc_handle", b""),
            output_region_bytes=region.size, counter_slot=m.counter_slot)

    @_unary
    async def LeaveGroup(self, request, context):
        s = self.engine.session(request.session_id)
        await self.engine.leave_group(s, request.group_id)
        return epd_pb2.LeaveGroupResponse()

    @_unary
    async def RegisterRegion(self, request, context):
        s = self.engine.session(request.session_id)
        region = await self.engine.register_region(s, request)
        return epd_pb2.RegisterRegionResponse(region_id=region.region_id,
                                              size_bytes=region.size)

    @_unary
    async def UnregisterRegion(self, request, context):
        s = self.engine.session(request.session_id)
        self.engine.unregister_region(s, request.region_id)
        return epd_pb2.UnregisterRegionResponse()

    @_unary
    async def GetDispatchLayout(self, request, context):
        s = self.engine.session(request.session_id)
        return await self.engine.get_dispatch_layout(s, request)

    @_unary
    async def Dispatch(self, request, context):
        s = self.engine.session(request.session_id)
        return await self.engine.dispatch(s, request)

    @_unary
    async def Combine(self, request, context):
        s = self.engine.session(request.session_id)
        return await self.engine.combine(s, request)

    @_unary
    async def LowLatencyDispatch(self, request, context):
        s = self.engine.session(request.session_id)
        return await self.engine.low_latency_dispatch(s, request)

    @_unary
    async def LowLatencyCombine(self, request, context):
        s = self.engine.session(request.session_id)
        return await self.engine.low_latency_combine(s, request)

    @_unary
    async def GetStats(self, request, context):
        s = self.engine.session(request.session_id) if request.session_id else None
        return self.engine.stats(s)

    @_unary
    async def OpenFastPath(self, request, context):
        s = self.engine.session(request.session_id)
        return self.engine.open_fast_path(s, request)

    @_unary
    async def Ping(self, request, context):
        return epd_pb2.PingResponse()

    @_unary
    async def ArmStreamOp(self, request, context):
        s = self.engine.session(request.session_id)
        return await self.engine.arm_stream_op(s, request)

    @_unary
    async def DisarmStreamOp(self, request, context):
        s = self.engine.session(request.session_id)
        await self.engine.disarm_stream_op(s, request.op_id)
        return epd_pb2.DisarmStreamOpResponse()
