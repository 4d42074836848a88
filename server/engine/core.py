"""The engine: sessions, their regions and group memberships, the fast path, and lifecycle.

Transport-agnostic: the gRPC servicer and the shared-memory fast path decode requests and call
these methods; the data-plane operations themselves live in `ops.DataPlane`. A session's
operations run on its worker thread (one per session, like a CUDA stream: a client's calls run
in its order and never block the event loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from ...proto import counter_page
from ...proto.errors import (
    Aborted,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from ...proto.v1 import epd_pb2, epd_pb2_grpc
from .. import metrics
from ..backends.base import (
    Backend,
    Membership,
    Region,
)
from ..config import Config
from .ops import DataPlane
from .state import (
    GroupMember,
    Session,
    engine_files_prefix,
    spec_from_proto,
    sweep_engine_files,
)

log = logging.getLogger("epd.engine")
MAX_TIMEOUT = 600.0


class Engine(DataPlane):
    def __init__(self, config: Config, index: int, backend: Backend) -> None:
        self.config = config
        self.index = index
        self.backend = backend
        self.sessions: dict[str, Session] = {}
        self.draining = False
        self._label = str(index)
        self._node_channel: grpc.aio.Channel | None = None
        self._inflight = 0
        from .stream_ops import StreamOps
        self.stream_ops = StreamOps(self)

    # -- plumbing ----------------------------------------------------------------------------
    def _node(self) -> epd_pb2_grpc.NodeStub:
        if self._node_channel is None:
            self._node_channel = grpc.aio.insecure_channel(f"unix://{self.config.node_socket}")
        return epd_pb2_grpc.NodeStub(self._node_channel)

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.closed.is_set():
            raise NotFound(f"session {session_id!r} is not open on engine {self.index}")
        return s

    def member(self, session: Session, group_id: str) -> GroupMember:
        m = session.members.get(group_id)
        if m is None:
            raise NotFound(f"group {group_id!r} is not joined by {session.describe()}")
        return m

    def _timeout(self, requested: float) -> float:
        if requested < 0:
            raise InvalidArgument(f"timeout_seconds must be >= 0, got {requested}")
        return min(requested or self.config.timeout_seconds, MAX_TIMEOUT)

    async def _run(self, session: Session, fn, *args):
        loop = asyncio.get_running_loop()
        self._inflight += 1

        def locked():
            with session.op_lock:
                return fn(*args)
        try:
            return await loop.run_in_executor(session.worker, locked)
        finally:
            self._inflight -= 1

    def _refresh_gauges(self) -> None:
        metrics.SESSIONS.labels(self._label).set(len(self.sessions))
        metrics.GROUPS.labels(self._label).set(sum(len(s.members) for s in self.sessions.values()))
        metrics.REGIONS.labels(self._label).set(sum(len(s.regions) for s in self.sessions.values()))
        metrics.REGION_BYTES.labels(self._label).set(
            sum(r.size for s in self.sessions.values() for r in s.regions.values()))

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self, client_name: str, pid: int) -> Session:
        if self.draining:
            raise Unavailable(f"engine {self.index} is draining; no new sessions")
        if len(self.sessions) >= self.config.max_sessions:
            raise ResourceExhausted(f"engine {self.index} has {len(self.sessions)} sessions, "
                                    f"the maximum (--max-sessions)")
        sid = secrets.token_hex(8)
        path = os.path.join(self.config.shm_dir, f"{engine_files_prefix(self.index)}{sid}.counters")
        page = self.backend.open_counter_page(path)
        s = Session(sid, client_name[:64], pid, page, path,
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"epd-s{sid[:6]}",
                                       initializer=self.backend.thread_init))
        self.sessions[sid] = s
        self._refresh_gauges()
        log.info("opened %s", s.describe())
        return s

    async def close_session(self, session: Session, reason: str) -> None:
        """Tear a session down exactly once: abort its groups, drain its worker, free all."""
        if session.teardown_done:
            return
        session.teardown_done = True
        session.closed.set()
        if session.stream_ops:  # release client streams waiting on them, before the groups
            await asyncio.to_thread(self.stream_ops.release_session, session)
        for member in list(session.members.values()):
            await self._drop_member(session, member, f"{session.describe()} {reason}")
        if session.fast_path is not None:
            await asyncio.to_thread(session.fast_path.stop)
        await asyncio.to_thread(session.worker.shutdown, wait=True)
        for region in session.regions.values():
            if not region.borrowed:
                region.close()
        session.regions.clear()
        session.counter_page.close()
        self.backend.close_events(session.events)
        self.sessions.pop(session.session_id, None)
        self._refresh_gauges()
        log.info("closed %s: %s", session.describe(), reason)

    async def _drop_member(self, session: Session, member: GroupMember, reason: str) -> None:
        text = f"rank {member.rank} of group {member.spec.name!r} went away: {reason}"
        if any(o.member is member for o in session.stream_ops.values()):
            await asyncio.to_thread(self.stream_ops.release_member, session, member)
        if member.comm.abort_reason() is None:
            metrics.ABORTS.labels("member_left").inc()
        member.comm.abort(text)  # wakes that rank's own pending waits and every peer's
        # Let a collective in flight on the worker observe the abort before we unmap.
        await asyncio.to_thread(lambda: session.worker.submit(lambda: None).result())
        member.comm.close()
        session.members.pop(member.group_id, None)
        session.free_slots.append(member.counter_slot)
        try:
            await self._node().ReleaseRank(
                epd_pb2.ReleaseRankRequest(group_id=member.group_id, rank=member.rank,
                                           reason=text), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("could not release rank %d of %s: %s", member.rank, member.group_id,
                        e.details())
        self._refresh_gauges()

    # -- groups ------------------------------------------------------------------------------
    async def join_group(self, session: Session, req: epd_pb2.JoinGroupRequest) -> GroupMember:
        spec = spec_from_proto(req.spec)
        if not 0 <= req.rank < spec.num_ranks:
            raise InvalidArgument(f"rank {req.rank} is out of range for num_ranks="
                                  f"{spec.num_ranks}")
        if any(m.spec.name == spec.name for m in session.members.values()):
            raise FailedPrecondition(f"{session.describe()} already holds a rank of group "
                                     f"{spec.name!r}")
        if not session.free_slots:
            raise ResourceExhausted(f"a session can join at most {counter_page.NUM_SLOTS} groups")
        timeout = self._timeout(req.timeout_seconds)
        try:
            resp = await self._node().Rendezvous(epd_pb2.RendezvousRequest(
                spec=req.spec, rank=req.rank, engine_index=self.index,
                session_id=session.session_id, timeout_seconds=timeout), timeout=timeout + 5)
        except grpc.aio.AioRpcError as e:
            raise EpdError(e.code(), e.details() or "rendezvous failed") from None
        membership = Membership(resp.group_id, req.rank, tuple(resp.rank_engines),
                                resp.comm_path, resp.nvshmem_uid, resp.heap_offset)
        out_path = os.path.join(self.config.shm_dir, f"{engine_files_prefix(self.index)}"
                                                     f"{session.session_id}-{resp.group_id}.out")
        try:
            comm = await self._run(session, self.backend.attach, spec, membership, out_path)
        except Exception as e:
            await self._node().ReleaseRank(epd_pb2.ReleaseRankRequest(
                group_id=resp.group_id, rank=req.rank, reason=f"attach failed: {e}"), timeout=5)
            raise
        member = GroupMember(spec, membership, comm, session.free_slots.pop(0))
        session.members[member.group_id] = member
        try:
            await self._node().Rendezvous(epd_pb2.RendezvousRequest(
                spec=req.spec, rank=req.rank, engine_index=self.index,
                session_id=session.session_id, timeout_seconds=timeout, attached=True,
                group_id=resp.group_id), timeout=timeout + 5)
        except grpc.aio.AioRpcError as e:
            await self._drop_member(session, member, f"attach barrier failed: {e.details()}")
            raise EpdError(e.code(), e.details() or "attach barrier failed") from None
        if comm.output_region.borrowed:  # outputs may come back as inputs (combine(recv_x))
            session.regions.setdefault(comm.output_region.region_id, comm.output_region)
        if session.closed.is_set():  # the client vanished while we waited for its peers
            await self._drop_member(session, member, "closed during join")
            raise Aborted("session closed during join")
        self._refresh_gauges()
        log.info("%s joined group %r (%s) as rank %d/%d", session.describe(), spec.name,
                 member.group_id, req.rank, spec.num_ranks)
        return member

    async def leave_group(self, session: Session, group_id: str) -> None:
        member = self.member(session, group_id)
        await self._drop_member(session, member, "left the group")

    # -- fast path ---------------------------------------------------------------------------
    def open_fast_path(self, session: Session,
                       req: epd_pb2.OpenFastPathRequest) -> epd_pb2.OpenFastPathResponse:
        from .fast_path import FastPathServer

        if not self.config.fast_path:
            raise FailedPrecondition("the fast path is disabled on this engine (--fast-path)")
        if session.fast_path is not None:
            raise FailedPrecondition(f"{session.describe()} already has a fast path")
        slots = req.slots or self.config.fast_path_slots
        slot_bytes = req.slot_bytes or 16384
        if not 1 <= slots <= 1024 or not 4096 <= slot_bytes <= 1 << 20:
            raise InvalidArgument("slots must lie in [1, 1024] and slot_bytes in "
                                  "[4096, 1 MiB]")
        path = os.path.join(self.config.shm_dir, f"{engine_files_prefix(self.index)}"
                                                 f"{session.session_id}.ring")
        spin = self.config.fast_path_spin_us * 1e-6
        session.fast_path = FastPathServer(self, session, path, slots, slot_bytes, spin)
        session.fast_path.start()
        log.info("%s uses the fast path (%d slots of %d bytes)", session.describe(), slots,
                 slot_bytes)
        return epd_pb2.OpenFastPathResponse(ring_path=path, slots=slots, slot_bytes=slot_bytes,
                                            spin_seconds=spin)

    # -- stream-ordered calls -----------------------------------------------------------------
    async def arm_stream_op(self, session: Session, req: epd_pb2.ArmStreamOpRequest
                            ) -> epd_pb2.ArmStreamOpResponse:
        return await self._run(session, self.stream_ops.arm, session, req)

    async def disarm_stream_op(self, session: Session, op_id: int) -> None:
        await asyncio.to_thread(self.stream_ops.disarm, session, op_id)

    def stats(self, session: Session | None) -> epd_pb2.GetStatsResponse:
        """Counters of one session's memberships (or of all sessions)."""
        groups = []
        sessions = [session] if session is not None else list(self.sessions.values())
        for s in sessions:
            for m in s.members.values():
                reason = m.comm.abort_reason()
                groups.append(epd_pb2.GroupStats(
                    group_id=m.group_id, name=m.spec.name, rank=m.rank,
                    num_ranks=m.spec.num_ranks, dispatches=m.dispatches, combines=m.combines,
                    bytes_sent=m.bytes_sent, bytes_received=m.bytes_received,
                    aborted=reason is not None, abort_reason=reason or ""))
        regions = [r for s in sessions for r in s.regions.values() if not r.borrowed]
        return epd_pb2.GetStatsResponse(engine_index=self.index, sessions=len(self.sessions),
                                        groups=groups, regions=len(regions),
                                        region_bytes=sum(r.size for r in regions))

    # -- regions -----------------------------------------------------------------------------
    async def register_region(self, session: Session,
                              req: epd_pb2.RegisterRegionRequest) -> Region:
        if len(session.regions) >= self.config.max_regions_per_session:
            raise ResourceExhausted(f"{session.describe()} has "
                                    f"{len(session.regions)} regions, the maximum")
        if req.size_bytes <= 0:
            raise InvalidArgument("size_bytes must be positive")
        which = req.WhichOneof("source")
        if which is None:
            raise InvalidArgument("a region needs shm_path or cuda_ipc_handle")
        rid = "r" + secrets.token_hex(8)
        region = await self._run(session, lambda: self.backend.open_region(
            rid, shm_path=req.shm_path, ipc_handle=req.cuda_ipc_handle, size=req.size_bytes,
            device_ordinal=req.device_ordinal))
        session.regions[rid] = region
        self._refresh_gauges()
        return region

    def unregister_region(self, session: Session, region_id: str) -> None:
        region = session.regions.get(region_id)
        if region is not None and region.borrowed:
            raise FailedPrecondition(f"region {region_id!r} belongs to the engine")
        region = session.regions.pop(region_id, None)
        if region is None:
            raise NotFound(f"region {region_id!r} is not registered by {session.describe()}")
        # The worker may be reading it: close it in worker order.
        session.worker.submit(region.close)
        self._refresh_gauges()

    # -- lifecycle ---------------------------------------------------------------------------
    async def drain(self, seconds: float) -> None:
        """Stop taking sessions, let running collectives finish (bounded), close everything."""
        self.draining = True
        deadline = time.monotonic() + seconds
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for s in list(self.sessions.values()):
            await self.close_session(s, "engine shutting down")
        settle = time.monotonic() + 2.0
        while self.sessions and time.monotonic() < settle:
            await asyncio.sleep(0.01)  # teardowns already under way (streams that just ended)
        self.stream_ops.stop()
        sweep_engine_files(self.config.shm_dir, self.index)
        if self._node_channel is not None:
            await self._node_channel.close()
        self.backend.close()

