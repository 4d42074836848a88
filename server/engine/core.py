"""The engine: sessions, their regions and group memberships, and the request path.

Transport-agnostic: the gRPC servicer (and later the shared-memory fast path) decode requests and
call these methods; everything here validates first, then runs the collective on the session's
worker thread (one per session, like a CUDA stream: a client's calls run in its order and never
block the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from epd.proto import counter_page, dtypes
from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server import metrics
from epd.server.backends.base import (
    Backend,
    CombineArgs,
    CounterPage,
    DispatchArgs,
    GroupSpec,
    LowLatencyCombineArgs,
    LowLatencyDispatchArgs,
    Membership,
    RankComm,
    Region,
)
from epd.server.config import Config
from epd.server.engine import tensors
from epd.server.errors import (
    Aborted,
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

log = logging.getLogger("epd.engine")
MAX_TIMEOUT = 600.0
INDEX_DTYPES = (epd_pb2.INT64,)
# A group's x_dtype is its combine dtype; dispatch carries it or FP8 (e4m3 + float32 scales).
GROUP_DTYPES = (epd_pb2.BFLOAT16, epd_pb2.FLOAT16, epd_pb2.FLOAT32)


def engine_files_prefix(index: int) -> str:
    """Every file an engine creates in the shm folder starts with this (counter pages, outputs)."""
    return f"epd-e{index}-"


def sweep_engine_files(shm_dir: str, index: int) -> int:
    """Remove the files of an engine that stopped (or died); returns how many."""
    n = 0
    prefix = engine_files_prefix(index)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shm_dir):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, name))
                    n += 1
    return n


def spec_from_proto(p: epd_pb2.GroupSpec) -> GroupSpec:
    """Validate a group spec; InvalidArgument names the first thing wrong."""
    if not p.name or len(p.name) > 128:
        raise InvalidArgument("group name must have 1 to 128 characters")
    checks = (("num_ranks", p.num_ranks, 1, 128), ("num_experts", p.num_experts, 1, 1 << 16),
              ("hidden", p.hidden, 1, 1 << 16), ("max_tokens_per_rank", p.max_tokens_per_rank,
                                                  1, 1 << 20),
              ("num_topk", p.num_topk, 1, 64))
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:
            raise InvalidArgument(f"{name}={value} is out of range [{lo}, {hi}]")
    if p.num_experts % p.num_ranks:
        raise InvalidArgument(f"num_experts={p.num_experts} is not a multiple of "
                              f"num_ranks={p.num_ranks}")
    if p.num_experts // p.num_ranks > counter_page.MAX_LOCAL_EXPERTS:
        raise InvalidArgument(f"{p.num_experts // p.num_ranks} local experts exceed "
                              f"{counter_page.MAX_LOCAL_EXPERTS}")
    if p.num_topk > p.num_experts:
        raise InvalidArgument(f"num_topk={p.num_topk} exceeds num_experts={p.num_experts}")
    if p.x_dtype not in GROUP_DTYPES:
        raise InvalidArgument(f"x_dtype must be one of "
                              f"{sorted(dtypes.name(d) for d in GROUP_DTYPES)} (the dtype of "
                              f"combine; dispatch may also carry FP8 with scales)")
    return GroupSpec(p.name, p.num_ranks, p.num_experts, p.hidden, p.max_tokens_per_rank,
                     p.num_topk, p.x_dtype)


NORMAL, LOW_LATENCY = "normal", "low-latency"  # HandleInfo.kind


@dataclass
class HandleInfo:
    backend_handle: Any
    num_tokens: int
    num_recv_tokens: int
    rows_out: int
    kind: str = NORMAL  # which combine takes it
    num_max: int = 0  # low-latency: num_max_dispatch_tokens_per_rank of the dispatch


@dataclass
class GroupMember:
    """One membership of a session: this engine's rank of one group."""

    spec: GroupSpec
    membership: Membership
    comm: RankComm
    counter_slot: int
    handles: OrderedDict[int, HandleInfo] = field(default_factory=OrderedDict)
    next_handle: int = 1
    dispatch_sequence: int = 0
    dispatches: int = 0
    combines: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def group_id(self) -> str:
        return self.membership.group_id

    @property
    def rank(self) -> int:
        return self.membership.rank


@dataclass
class Session:
    session_id: str
    client_name: str
    pid: int
    counter_page: CounterPage
    counter_path: str
    worker: ThreadPoolExecutor
    regions: dict[str, Region] = field(default_factory=dict)
    members: dict[str, GroupMember] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=lambda: list(range(counter_page.NUM_SLOTS)))
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    teardown_done: bool = False
    events: dict[bytes, Any] = field(default_factory=dict)  # opened client events (cuda)
    # Held while an operation runs, whichever transport brought it (gRPC via the worker, or
    # the fast-path thread): a session's operations never overlap.
    op_lock: threading.Lock = field(default_factory=threading.Lock)
    fast_path: Any = None

    def describe(self) -> str:
        return f"session {self.session_id} ({self.client_name or 'client'}, pid {self.pid})"


class Engine:
    def __init__(self, config: Config, index: int, backend: Backend) -> None:
        self.config = config
        self.index = index
        self.backend = backend
        self.sessions: dict[str, Session] = {}
        self.draining = False
        self._label = str(index)
        self._node_channel: grpc.aio.Channel | None = None
        self._inflight = 0

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
            raise EpdError(e.details() or "rendezvous failed", e.code()) from None
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
            raise EpdError(e.details() or "attach barrier failed", e.code()) from None
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
        from epd.server.engine.fast_path import FastPathServer

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

    # -- collectives -------------------------------------------------------------------------
    def _check_alive(self, member: GroupMember) -> None:
        reason = member.comm.abort_reason()
        if reason is not None:
            raise Aborted(f"group {member.spec.name!r} is aborted: {reason}")

    def _check_routing(self, spec: GroupSpec, topk_idx, topk_weights, num_tokens: int) -> None:
        if topk_idx.shape != (num_tokens, spec.num_topk):
            raise InvalidArgument(f"topk_idx has shape {list(topk_idx.shape)}, expected "
                                  f"[{num_tokens}, {spec.num_topk}]")
        if topk_weights is not None and topk_weights.shape != topk_idx.shape:
            raise InvalidArgument(f"topk_weights has shape {list(topk_weights.shape)}, expected "
                                  f"{list(topk_idx.shape)}")

    # Each data-plane operation is one synchronous function that runs on the session's worker
    # (validation included), so every transport executes the same code: gRPC awaits it through
    # `_run`, the shared-memory fast path submits it to the worker directly.
    async def get_dispatch_layout(self, session: Session,
                                  req: epd_pb2.GetDispatchLayoutRequest
                                  ) -> epd_pb2.GetDispatchLayoutResponse:
        return await self._run(session, self.layout_op, session, req, "grpc")

    async def dispatch(self, session: Session,
                       req: epd_pb2.DispatchRequest) -> epd_pb2.DispatchResponse:
        return await self._run(session, self.dispatch_op, session, req, "grpc")

    async def combine(self, session: Session,
                      req: epd_pb2.CombineRequest) -> epd_pb2.CombineResponse:
        return await self._run(session, self.combine_op, session, req, "grpc")

    def _check_values(self, session: Session, ready_event: bytes, spec: GroupSpec,
                      topk_idx) -> None:
        """Wait for the client's inputs, then check what needs reading them (before the rank
        takes part in the collective)."""
        self.backend.wait_event(session.events, ready_event)
        if topk_idx is not None and topk_idx.shape[0]:
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= spec.num_experts:
                raise InvalidArgument(f"topk_idx holds expert ids in [{lo}, {hi}]; valid ids are "
                                      f"-1 (none) and [0, {spec.num_experts})")

    def layout_op(self, session: Session, req: epd_pb2.GetDispatchLayoutRequest,
                  path: str) -> epd_pb2.GetDispatchLayoutResponse:
        member = self.member(session, req.group_id)
        spec = member.spec
        idx = tensors.resolve(req.topk_idx, session.regions, "topk_idx", ndim=2,
                              dtype=INDEX_DTYPES)
        if idx.shape[0] > spec.max_tokens_per_rank:
            raise InvalidArgument(f"{idx.shape[0]} tokens exceed the group's "
                                  f"max_tokens_per_rank={spec.max_tokens_per_rank}")
        self._check_routing(spec, idx, None, idx.shape[0])
        t0 = time.perf_counter()
        self._check_values(session, req.ready_event, spec, idx)
        out = member.comm.layout(idx)
        metrics.LAYOUT_SECONDS.labels(spec.name, path, self.backend.name).observe(
            time.perf_counter() - t0)
        per_expert = self.backend.to_host(out.num_tokens_per_expert)
        if per_expert.size and per_expert.mean() > 0:
            metrics.LOAD_IMBALANCE.labels(spec.name).set(float(per_expert.max() /
                                                               per_expert.mean()))
        r = member.comm.output_region
        return epd_pb2.GetDispatchLayoutResponse(
            num_tokens_per_rank=tensors.describe(out.num_tokens_per_rank, r),
            num_tokens_per_expert=tensors.describe(out.num_tokens_per_expert, r),
            is_token_in_rank=tensors.describe(out.is_token_in_rank, r))

    def dispatch_op(self, session: Session, req: epd_pb2.DispatchRequest,
                    path: str) -> epd_pb2.DispatchResponse:
        """Validate (nothing changes on bad input), then notify + dispatch."""
        member = self.member(session, req.group_id)
        spec = member.spec
        self._check_alive(member)
        regions = session.regions
        x = tensors.resolve(req.x, regions, "x", ndim=2,
                            dtype=(spec.x_dtype, epd_pb2.FLOAT8_E4M3))
        fp8 = req.x.dtype == epd_pb2.FLOAT8_E4M3
        t = x.shape[0]
        if x.shape[1] != spec.hidden:
            raise InvalidArgument(f"x has hidden size {x.shape[1]}, the group's is {spec.hidden}")
        if t > spec.max_tokens_per_rank:
            raise InvalidArgument(f"{t} tokens exceed the group's max_tokens_per_rank="
                                  f"{spec.max_tokens_per_rank}")
        scales = None
        if fp8:
            if spec.hidden % dtypes.FP8_BLOCK:
                raise InvalidArgument(f"FP8 dispatch needs hidden % {dtypes.FP8_BLOCK} == 0, "
                                      f"the group's hidden is {spec.hidden}")
            if not tensors.is_set(req.x_scales):
                raise InvalidArgument("FP8 dispatch needs x_scales (float32 [T, hidden/128])")
            scales = tensors.resolve(req.x_scales, regions, "x_scales", ndim=2,
                                     dtype=epd_pb2.FLOAT32)
            want = (t, spec.hidden // dtypes.FP8_BLOCK)
            if scales.shape != want:
                raise InvalidArgument(f"x_scales has shape {list(scales.shape)}, expected "
                                      f"{list(want)}")
        elif tensors.is_set(req.x_scales):
            raise InvalidArgument(f"x_scales is only for FP8 payloads; x is "
                                  f"{dtypes.name(req.x.dtype)}")
        if req.expert_alignment < 0 or req.num_worst_tokens < 0:
            raise InvalidArgument("expert_alignment and num_worst_tokens must be >= 0")
        if req.num_worst_tokens > spec.max_recv_tokens:
            raise InvalidArgument(f"num_worst_tokens={req.num_worst_tokens} exceeds "
                                  f"num_ranks * max_tokens_per_rank={spec.max_recv_tokens}")
        cached = None
        idx = weights = None
        if req.cached_handle:
            cached = member.handles.get(req.cached_handle)
            if cached is None:
                raise FailedPrecondition(self._unknown_handle(member, req.cached_handle))
            self._check_kind(cached, req.cached_handle, NORMAL)
            if cached.num_tokens != t:
                raise InvalidArgument(f"cached dispatch with {t} tokens, but handle "
                                      f"{req.cached_handle} was made for {cached.num_tokens}")
            if tensors.is_set(req.topk_idx) or tensors.is_set(req.topk_weights):
                raise InvalidArgument("cached dispatch takes no topk_idx/topk_weights")
        else:
            if not tensors.is_set(req.topk_idx) or not tensors.is_set(req.topk_weights):
                raise InvalidArgument("dispatch needs topk_idx and topk_weights "
                                      "(or cached_handle)")
            idx = tensors.resolve(req.topk_idx, regions, "topk_idx", ndim=2, dtype=INDEX_DTYPES)
            weights = tensors.resolve(req.topk_weights, regions, "topk_weights", ndim=2,
                                      dtype=epd_pb2.FLOAT32)
            self._check_routing(spec, idx, weights, t)
        timeout = self._timeout(req.timeout_seconds)
        args = DispatchArgs(x, scales, idx, weights, max(req.expert_alignment, 1),
                            req.num_worst_tokens,
                            cached.backend_handle if cached is not None else None)
        member.dispatch_sequence += 1
        sequence = member.dispatch_sequence
        slot = session.counter_page.slot(member.counter_slot)
        t0 = time.perf_counter()
        try:
            self._check_values(session, req.ready_event, spec, idx)
            out = member.comm.dispatch(args, slot, sequence, time.monotonic() + timeout)
        except Exception as e:
            if int(slot[counter_page.SEQ]) < sequence:  # keep the page in step with requests
                counter_page.publish(slot, sequence, 0, [], status=1)
            if isinstance(e, DeadlineExceeded):
                metrics.TIMEOUTS.labels(spec.name).inc()
            raise
        metrics.DISPATCH_SECONDS.labels(spec.name, path, self.backend.name).observe(
            time.perf_counter() - t0)
        rows_out = req.num_worst_tokens or out.num_recv_tokens
        handle_id = self._store_handle(member, HandleInfo(out.handle, t, out.num_recv_tokens,
                                                          rows_out))
        member.dispatches += 1
        member.bytes_sent += out.bytes_sent
        member.bytes_received += out.bytes_received
        peer = "shm" if self.backend.name == "cpu" else "nvlink"
        metrics.BYTES_SENT.labels(spec.name, peer).inc(out.bytes_sent)
        metrics.BYTES_RECEIVED.labels(spec.name, peer).inc(out.bytes_received)
        metrics.RECV_TOKENS.labels(spec.name).inc(out.num_recv_tokens)
        if self.config.per_expert_metrics and out.num_recv_tokens_per_expert:
            base = member.rank * spec.num_local_experts
            for i, c in enumerate(out.num_recv_tokens_per_expert):
                metrics.EXPERT_RECV_TOKENS.labels(spec.name, str(base + i)).inc(c)
        r = member.comm.output_region
        resp = epd_pb2.DispatchResponse(
            recv_x=tensors.describe(out.recv_x, r, req.x.dtype),
            recv_src_idx=tensors.describe(out.recv_src_idx, r),
            rank_prefix_matrix=tensors.describe(out.rank_prefix_matrix, r),
            num_recv_tokens_per_expert=out.num_recv_tokens_per_expert,
            handle=handle_id, num_recv_tokens=out.num_recv_tokens, counter_sequence=sequence)
        if out.recv_x_scales is not None:
            resp.recv_x_scales.CopyFrom(tensors.describe(out.recv_x_scales, r))
        if out.recv_topk_idx is not None:
            resp.recv_topk_idx.CopyFrom(tensors.describe(out.recv_topk_idx, r))
            resp.recv_topk_weights.CopyFrom(tensors.describe(out.recv_topk_weights, r))
        return resp

    def _unknown_handle(self, member: GroupMember, handle: int) -> str:
        return (f"handle {handle} is not known to rank {member.rank} of group "
                f"{member.spec.name!r}: it expired (the last {self.config.max_handles} "
                f"dispatches are kept) or came from another group")

    @staticmethod
    def _check_kind(info: HandleInfo, handle: int, want: str) -> None:
        if info.kind != want:
            use = "LowLatencyCombine" if info.kind == LOW_LATENCY else "Combine (or a cached " \
                                                                      "Dispatch)"
            raise FailedPrecondition(f"handle {handle} comes from a {info.kind} dispatch; "
                                     f"pass it to {use}")

    def _store_handle(self, member: GroupMember, info: HandleInfo) -> int:
        hid = member.next_handle
        member.next_handle += 1
        member.handles[hid] = info
        while len(member.handles) > self.config.max_handles:
            member.handles.popitem(last=False)
        return hid

    def combine_op(self, session: Session, req: epd_pb2.CombineRequest,
                   path: str) -> epd_pb2.CombineResponse:
        member = self.member(session, req.group_id)
        spec = member.spec
        self._check_alive(member)
        info = member.handles.get(req.handle)
        if info is None:
            raise FailedPrecondition(self._unknown_handle(member, req.handle))
        self._check_kind(info, req.handle, NORMAL)
        regions = session.regions
        combine_dtype = spec.x_dtype
        x = tensors.resolve(req.x, regions, "x", ndim=2, dtype=combine_dtype)
        if x.shape != (info.rows_out, spec.hidden):
            raise InvalidArgument(f"combine x has shape {list(x.shape)}, expected "
                                  f"[{info.rows_out}, {spec.hidden}] (rows received by the "
                                  f"dispatch of handle {req.handle})")
        weights = None
        if tensors.is_set(req.topk_weights):
            weights = tensors.resolve(req.topk_weights, regions, "topk_weights", ndim=2,
                                      dtype=epd_pb2.FLOAT32)
            if weights.shape != (info.rows_out, spec.num_topk):
                raise InvalidArgument(f"combine topk_weights has shape {list(weights.shape)}, "
                                      f"expected [{info.rows_out}, {spec.num_topk}]")
        biases = []
        for name, desc in (("bias_0", req.bias_0), ("bias_1", req.bias_1)):
            if not tensors.is_set(desc):
                biases.append(None)
                continue
            b = tensors.resolve(desc, regions, name, ndim=2, dtype=combine_dtype)
            if b.shape != (info.num_tokens, spec.hidden):
                raise InvalidArgument(f"{name} has shape {list(b.shape)}, expected "
                                      f"[{info.num_tokens}, {spec.hidden}]")
            biases.append(b)
        timeout = self._timeout(req.timeout_seconds)
        args = CombineArgs(x, info.backend_handle, weights, biases[0], biases[1])
        t0 = time.perf_counter()
        try:
            self._check_values(session, req.ready_event, spec, None)
            out = member.comm.combine(args, time.monotonic() + timeout)
        except DeadlineExceeded:
            metrics.TIMEOUTS.labels(spec.name).inc()
            raise
        metrics.COMBINE_SECONDS.labels(spec.name, path, self.backend.name).observe(
            time.perf_counter() - t0)
        member.combines += 1
        member.bytes_sent += out.bytes_sent
        member.bytes_received += out.bytes_received
        peer = "shm" if self.backend.name == "cpu" else "nvlink"
        metrics.BYTES_SENT.labels(spec.name, peer).inc(out.bytes_sent)
        metrics.BYTES_RECEIVED.labels(spec.name, peer).inc(out.bytes_received)
        r = member.comm.output_region
        resp = epd_pb2.CombineResponse(
            combined_x=tensors.describe(out.combined_x, r, spec.x_dtype))
        if out.combined_topk_weights is not None:
            resp.combined_topk_weights.CopyFrom(tensors.describe(out.combined_topk_weights, r))
        return resp

    # -- low-latency mode --------------------------------------------------------------------
    async def low_latency_dispatch(self, session: Session, req: epd_pb2.LowLatencyDispatchRequest
                                   ) -> epd_pb2.LowLatencyDispatchResponse:
        return await self._run(session, self.ll_dispatch_op, session, req, "grpc")

    async def low_latency_combine(self, session: Session, req: epd_pb2.LowLatencyCombineRequest
                                  ) -> epd_pb2.LowLatencyCombineResponse:
        return await self._run(session, self.ll_combine_op, session, req, "grpc")

    def _check_distinct(self, topk_idx) -> None:
        """Low-latency mode sends one row per (token, expert): a token may not name an expert
        twice."""
        if not topk_idx.shape[0] or topk_idx.shape[1] < 2:
            return
        srt = np.sort(self.backend.to_host(topk_idx), axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            t, j = (int(v) for v in np.argwhere(dup)[0])
            raise InvalidArgument(f"topk_idx[{t}] names expert {int(srt[t, j + 1])} twice; "
                                  f"low-latency mode needs distinct experts per token")

    def ll_dispatch_op(self, session: Session, req: epd_pb2.LowLatencyDispatchRequest,
                       path: str) -> epd_pb2.LowLatencyDispatchResponse:
        """DeepEP low_latency_dispatch. Validate (nothing changes on bad input), then run."""
        member = self.member(session, req.group_id)
        spec = member.spec
        self._check_alive(member)
        regions = session.regions
        m = req.num_max_dispatch_tokens_per_rank
        if m <= 0:
            raise InvalidArgument(f"num_max_dispatch_tokens_per_rank must be positive, got {m}")
        if m > spec.max_tokens_per_rank:
            raise InvalidArgument(f"num_max_dispatch_tokens_per_rank={m} exceeds the group's "
                                  f"max_tokens_per_rank={spec.max_tokens_per_rank} (its "
                                  f"low-latency buffers are sized by it)")
        if req.num_experts != spec.num_experts:
            raise InvalidArgument(f"num_experts={req.num_experts} does not match the group's "
                                  f"num_experts={spec.num_experts}")
        x = tensors.resolve(req.x, regions, "x", ndim=2, dtype=spec.x_dtype)
        t = x.shape[0]
        if x.shape[1] != spec.hidden:
            raise InvalidArgument(f"x has hidden size {x.shape[1]}, the group's is {spec.hidden}")
        if t > m:
            raise InvalidArgument(f"{t} tokens exceed num_max_dispatch_tokens_per_rank={m}")
        if req.use_fp8 and spec.hidden % dtypes.FP8_BLOCK:
            raise InvalidArgument(f"FP8 dispatch needs hidden % {dtypes.FP8_BLOCK} == 0, the "
                                  f"group's hidden is {spec.hidden}")
        if (req.round_scale or req.use_ue8m0) and not req.use_fp8:
            raise InvalidArgument("round_scale and use_ue8m0 shape FP8 scales; they need "
                                  "use_fp8")
        if not tensors.is_set(req.topk_idx):
            raise InvalidArgument("low-latency dispatch needs topk_idx")
        idx = tensors.resolve(req.topk_idx, regions, "topk_idx", ndim=2, dtype=INDEX_DTYPES)
        self._check_routing(spec, idx, None, t)
        stats = None
        if tensors.is_set(req.cumulative_local_expert_recv_stats):
            stats = tensors.resolve(req.cumulative_local_expert_recv_stats, regions,
                                    "cumulative_local_expert_recv_stats", ndim=1,
                                    dtype=epd_pb2.INT32)
            if stats.shape != (spec.num_local_experts,):
                raise InvalidArgument(f"cumulative_local_expert_recv_stats has shape "
                                      f"{list(stats.shape)}, expected "
                                      f"[{spec.num_local_experts}] (local experts)")
        timeout = self._timeout(req.timeout_seconds)
        # use_ue8m0: power-of-two scales, i.e. round_scale (carried as float32 here).
        args = LowLatencyDispatchArgs(x, idx, m, req.use_fp8, req.round_scale or req.use_ue8m0)
        t0 = time.perf_counter()
        try:
            self._check_values(session, req.ready_event, spec, idx)
            self._check_distinct(idx)
            out = member.comm.low_latency_dispatch(args, time.monotonic() + timeout)
        except DeadlineExceeded:
            metrics.TIMEOUTS.labels(spec.name).inc()
            raise
        metrics.DISPATCH_SECONDS.labels(spec.name, path, self.backend.name).observe(
            time.perf_counter() - t0)
        if stats is not None:
            stats += out.recv_count
        handle_id = self._store_handle(member, HandleInfo(out.handle, t, out.num_recv_rows, 0,
                                                          kind=LOW_LATENCY, num_max=m))
        member.dispatches += 1
        member.bytes_sent += out.bytes_sent
        member.bytes_received += out.bytes_received
        peer = "shm" if self.backend.name == "cpu" else "nvlink"
        metrics.BYTES_SENT.labels(spec.name, peer).inc(out.bytes_sent)
        metrics.BYTES_RECEIVED.labels(spec.name, peer).inc(out.bytes_received)
        metrics.RECV_TOKENS.labels(spec.name).inc(out.num_recv_rows)
        if self.config.per_expert_metrics and out.num_recv_rows:
            base = member.rank * spec.num_local_experts
            for i, c in enumerate(self.backend.to_host(out.recv_count)):
                metrics.EXPERT_RECV_TOKENS.labels(spec.name, str(base + i)).inc(int(c))
        r = member.comm.output_region
        resp = epd_pb2.LowLatencyDispatchResponse(
            recv_x=tensors.describe(out.recv_x, r,
                                    epd_pb2.FLOAT8_E4M3 if req.use_fp8 else spec.x_dtype),
            recv_count=tensors.describe(out.recv_count, r), handle=handle_id,
            recv_src_rank=tensors.describe(out.recv_src_rank, r),
            recv_src_idx=tensors.describe(out.recv_src_idx, r))
        if out.recv_x_scales is not None:
            resp.recv_x_scales.CopyFrom(tensors.describe(out.recv_x_scales, r))
        return resp

    def ll_combine_op(self, session: Session, req: epd_pb2.LowLatencyCombineRequest,
                      path: str) -> epd_pb2.LowLatencyCombineResponse:
        """DeepEP low_latency_combine (weighted). Validate, then run."""
        member = self.member(session, req.group_id)
        spec = member.spec
        self._check_alive(member)
        info = member.handles.get(req.handle)
        if info is None:
            raise FailedPrecondition(self._unknown_handle(member, req.handle))
        self._check_kind(info, req.handle, LOW_LATENCY)
        regions = session.regions
        x = tensors.resolve(req.x, regions, "x", ndim=3, dtype=spec.x_dtype)
        want = (spec.num_local_experts, spec.num_ranks * info.num_max, spec.hidden)
        if x.shape != want:
            raise InvalidArgument(f"low-latency combine x has shape {list(x.shape)}, expected "
                                  f"{list(want)} ([local experts, num_ranks * "
                                  f"num_max_dispatch_tokens_per_rank, hidden] of handle "
                                  f"{req.handle})")
        if not tensors.is_set(req.topk_idx) or not tensors.is_set(req.topk_weights):
            raise InvalidArgument("low-latency combine needs topk_idx and topk_weights")
        idx = tensors.resolve(req.topk_idx, regions, "topk_idx", ndim=2, dtype=INDEX_DTYPES)
        weights = tensors.resolve(req.topk_weights, regions, "topk_weights", ndim=2,
                                  dtype=epd_pb2.FLOAT32)
        self._check_routing(spec, idx, weights, info.num_tokens)
        out = None
        if tensors.is_set(req.out):
            out = tensors.resolve(req.out, regions, "out", ndim=2, dtype=spec.x_dtype)
            if out.shape != (info.num_tokens, spec.hidden):
                raise InvalidArgument(f"out has shape {list(out.shape)}, expected "
                                      f"[{info.num_tokens}, {spec.hidden}]")
        timeout = self._timeout(req.timeout_seconds)
        args = LowLatencyCombineArgs(x, idx, weights, info.backend_handle, out)
        t0 = time.perf_counter()
        try:
            self._check_values(session, req.ready_event, spec, idx)
            res = member.comm.low_latency_combine(args, time.monotonic() + timeout)
        except DeadlineExceeded:
            metrics.TIMEOUTS.labels(spec.name).inc()
            raise
        metrics.COMBINE_SECONDS.labels(spec.name, path, self.backend.name).observe(
            time.perf_counter() - t0)
        member.combines += 1
        member.bytes_sent += res.bytes_sent
        member.bytes_received += res.bytes_received
        peer = "shm" if self.backend.name == "cpu" else "nvlink"
        metrics.BYTES_SENT.labels(spec.name, peer).inc(res.bytes_sent)
        metrics.BYTES_RECEIVED.labels(spec.name, peer).inc(res.bytes_received)
        if out is not None:  # written in place: the caller's own tensor
            return epd_pb2.LowLatencyCombineResponse(combined_x=req.out)
        return epd_pb2.LowLatencyCombineResponse(
            combined_x=tensors.describe(res.combined_x, member.comm.output_region,
                                        spec.x_dtype))

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
        sweep_engine_files(self.config.shm_dir, self.index)
        if self._node_channel is not None:
            await self._node_channel.close()
        self.backend.close()
