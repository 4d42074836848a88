"""The engine: sessions, their regions and group memberships, the fast path, and lifecycle.

Transport-agnostic: the gRPC servicer (service.py) and the shared-memory fast path
(fast_path.py) decode requests and call these methods; the data-plane operations themselves
live in `ops.DataPlane`, and `Engine.OPERATIONS` binds the registry's data-plane operations
(proto/operations.py) to them. Every session's operations run through its `SessionExecutor`
(executor.py: worker thread, operation lock, teardown order); every call is admitted by the
engine's `EngineState` (refused once it drains, counted in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import functools
import hmac
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import Message

from ...proto import counter_page, engine_sockets, operations
from ...proto import fd_channel as fdc
from ...proto import ring as ring_format
from ...proto import spin as spin_mod
from ...proto.errors import (
    Aborted,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from ...proto.v1 import epd_pb2, epd_pb2_grpc
from .. import metrics, service_classes, tenant_pools
from ..backends.base import (
    Backend,
    GroupSpec,
    Membership,
    RankComm,
    Region,
)
from ..config import Config, in_pool, node_metadata
from ..engine_slots import EngineSlot
from ..mps import ENGINE_ENV as MPS_ENGINE_ENV
from .backlog import CallBacklog
from .executor import EngineState, SessionExecutor
from .fast_path import FastPathServer
from .ops import DataPlane
from .state import (
    ChannelTicket,
    GroupMember,
    Session,
    spec_from_proto,
    sweep_engine_files,
)
from .stream_calls import StreamCalls
from .watchdog import SlowOperations

log = logging.getLogger("epd.engine")
# A clean leave waits at most this long for peers still inside the last collective (within the
# client's own leave timeout, session.CLOSE_LEAVE_TIMEOUT); then it aborts the group anyway.
QUIESCE_SECONDS = 1.0
NODE_RPC_SECONDS = 5.0  # deadline of ReleaseRank, and the slack added to a rendezvous's
MPS_WARNED_PIDS = 4096  # client pids remembered for the once-per-pid MPS warning
TEARDOWN_STACKS_SECONDS = 15.0  # a session teardown this slow dumps every thread's stack
SETTLE_SECONDS = 2.0  # drain: how long teardowns already under way may take to finish

# (session, request, path label) -> response: what both transports run on a session's executor.
OperationFn = Callable[[Session, Message, str], Message]


class _NodeToken(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the secret the supervisor gave this engine at spawn (config.node_metadata)."""

    async def intercept_unary_unary(self, continuation, details, request):
        metadata = tuple(details.metadata or ()) + node_metadata()
        details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                             details.credentials, details.wait_for_ready)
        return await continuation(details, request)


class AttachHandoff:
    """The comm a join's attach makes on the session's worker. The join may go away while the
    worker attaches (its client cancelled it, or its session's teardown stopped waiting for
    the worker); the comm is then closed by whichever of the two comes second, and the rank
    released only after that, as everywhere (a release lets the group, and its memory, go
    while the comm would still write there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._running = False
        self._comm: RankComm | None = None
        self._after_close: Callable[[], None] | None = None

    def attach(self, backend: Backend, spec: GroupSpec, membership: Membership,
               refusal: Callable[[RankComm], str | None] | None = None) -> RankComm:
        """On the worker: attach, and hand the comm over unless the join went away.
        `refusal(comm)`: a check of the attached comm, made before it is handed over (so
        never on a comm the join's going away closes meanwhile); a reason it gives closes the
        comm and fails the attach with FAILED_PRECONDITION."""
        with self._lock:
            if self._abandoned:  # (gone before the worker got here: nothing to undo)
                raise Aborted("the join went away before its rank attached")
            self._running = True
        try:
            comm = backend.attach(spec, membership)
            try:
                why = refusal(comm) if refusal is not None else None
                if why is not None:
                    raise FailedPrecondition(why)
            except BaseException:
                close_quietly(comm)
                raise
        except BaseException:
            with self._lock:
                self._running = False
                after = self._after_close
            if after is not None:  # (the join went meanwhile: its rank is released now)
                after()
            raise
        with self._lock:
            self._running = False
            if not self._abandoned:
                self._comm = comm
                return comm
            after = self._after_close
        close_quietly(comm)
        if after is not None:
            after()
        raise Aborted("the join went away while its rank attached")

    def abandon(self, after_close: Callable[[], None]) -> tuple[RankComm | None, bool]:
        """The join goes away: (the comm the attach made already, for the caller to close
        before it releases the rank; whether the attach still runs, in which case it closes
        its comm itself and then calls `after_close` (from the worker), which releases)."""
        with self._lock:
            self._abandoned = True
            comm, self._comm = self._comm, None
            if self._running:
                self._after_close = after_close
            return comm, self._running


def _rejoin_refusal(comm: RankComm, spec: GroupSpec, rank: int, group_id: str) -> str | None:
    """Why a replacement placed in a shrink group (rendezvous `rejoining`) can never take part
    there, or None. Such a join fails (its rank goes back) rather than hold a rank of a dead
    instance, every call of it refused; the name forms afresh once the old members have left.
    - the group's abort word is up (a rank's deadline, a failed launch: the group failed as a
      whole; the coordinator, seeing only masked ranks go, does not know);
    - every other rank is gone (went away, or is a replacement itself still waiting to be
      brought in): no rank is left to make the Rejoin collective with it."""
    reason = comm.abort_reason()
    if reason is not None:
        return (f"group {spec.name!r} ({group_id}) was aborted ({reason}): a replacement "
                f"cannot rejoin it; the name forms afresh once every rank of it has left")
    states = comm.mask_states()
    if all(s == comm.MASK_GONE for r, s in enumerate(states) if r != rank):
        return (f"no rank of group {spec.name!r} ({group_id}) takes part any more (every "
                f"other rank went away or waits to rejoin): none can bring rank {rank} back; "
                f"the name forms afresh once every rank of it has left")
    return None


def close_quietly(comm: RankComm) -> None:
    try:
        comm.close()
    except Exception:  # (a comm whose context broke: nothing more to free here)
        log.exception("closing an abandoned attach's comm failed")


def printable(text: str) -> str:
    """A client's words as they may go into a log line or another tenant's message."""
    return "".join(c if c.isprintable() else "?" for c in text)


class Engine(StreamCalls, DataPlane):
    # The registry's operations that run on a session's executor, by name: the gRPC servicer
    # runs the collectives through them, the fast-path ring every operation it carries
    # (operations.RING_METHODS). tests/test_registry.py checks the coverage.
    OPERATIONS: dict[str, str] = {
        "GetDispatchLayout": "layout_op", "Dispatch": "dispatch_op", "Combine": "combine_op",
        "LowLatencyDispatch": "ll_dispatch_op", "LowLatencyCombine": "ll_combine_op",
        "GetStats": "stats_op", "Ping": "ping_op", "ReleaseHandles": "release_handles_op",
        "RankMask": "rank_mask_op", "Rejoin": "rejoin_op"}
    # The descriptor channel's FdServer.drop_session (app.py sets it): a session's
    # connections end with it.
    on_session_closed: Callable[[str], None] | None = None

    def __init__(self, config: Config, index: int, backend: Backend,
                 slot: EngineSlot | None = None) -> None:
        self.config = config
        self.index = index
        self.backend = backend
        self._background: set[asyncio.Task] = set()  # (_spawn: work no cancel may stop)
        # Its device and, with class engines, the one service class whose groups it runs.
        self.slot = slot or EngineSlot(index, index)
        self.socket_path = config.engine_socket(self.slot.device, self.slot.service_class,
                                                self.slot.tenant_pool)
        self.sessions: dict[str, Session] = {}
        # Tickets of descriptor-channel hellos, until OpenSession takes one or its connection
        # closes (fd_server.py: at most MAX_UNBOUND_PER_UID connections of a uid hold one).
        self.tickets: dict[bytes, ChannelTicket] = {}
        self.state = EngineState(index)
        self.backlog = CallBacklog()  # gRPC calls under way per session (backlog.py)
        self._label = str(index)
        self._node_channel: grpc.aio.Channel | None = None
        # CUDA MPS: the pipe folder of the server this engine's context is on (empty: none;
        # the supervisor says, mps.ENGINE_ENV; each session knows whether its client is on it,
        # Session.on_engine_mps), the client pids already warned about.
        self.mps_pipe_directory = os.environ.get(MPS_ENGINE_ENV, "")
        self._mps_warned: set[int] = set()
        # Service classes: the policy joins are resolved by (parsed once; config.load checked
        # it), and the (group, class) series of epd_group_service_class this engine has set.
        self.policy = config.service_classes
        self.tenants = config.tenants  # (parsed once: a session's open checks its uid)
        self._class_series: set[tuple[str, str]] = set()
        self._held_series: set[str] = set()  # group labels of epd_group_held_bytes
        self._sms_series: set[tuple[str, str]] = set()  # (group, mode) of epd_group_sms
        from .pacing import Pacer
        from .stream_ops import StreamOps
        self.stream_ops = StreamOps(self)
        self.pacer = Pacer(config.throughput_pause_us * 1e-6, self.stream_ops.latency_rung)
        self.slow_ops = (SlowOperations(config.slow_operation_seconds)
                         if config.slow_operation_seconds > 0 else None)  # (0: off)

    @property
    def draining(self) -> bool:
        return self.state.draining

    def operation(self, name: str) -> OperationFn:
        """The synchronous operation a transport runs for registry operation `name`; a
        collective goes through the pacer (server/engine/pacing.py)."""
        fn: OperationFn = getattr(self, self.OPERATIONS[name])
        if name not in operations.COLLECTIVES or not self.pacer.enabled:
            return fn

        def paced(session: Session, req: Message, path: str) -> Message:
            member = session.members.get(getattr(req, "group_id", ""))
            if member is None:
                return fn(session, req, path)
            return self.pacer.run(member.service_class, member.spec.label,
                                  lambda: fn(session, req, path))
        return paced

    def ping_op(self, session: Session, req: epd_pb2.PingRequest,
                path: str) -> epd_pb2.PingResponse:
        return epd_pb2.PingResponse()

    def stats_op(self, session: Session, req: epd_pb2.GetStatsRequest,
                 path: str) -> epd_pb2.GetStatsResponse:
        return self.stats(session)

    def refuse(self, name: str, request: Message, reason: EpdError) -> None:
        """A call was refused because the engine drains. If it is a collective of a group this
        session holds, its peers cannot complete that collective: abort the group now, so they
        fail with ABORTED at once instead of waiting for their deadline. Any thread."""
        if name not in operations.COLLECTIVES:
            return
        s = self.sessions.get(getattr(request, "session_id", ""))
        m = s.members.get(getattr(request, "group_id", "")) if s is not None else None
        if m is None:
            return
        text = (f"rank {m.rank} of group {m.spec.name!r} cannot take part in {name}: "
                f"{reason.message}")
        # Under the operation lock (the comm is closed under it), unless an operation of this
        # session holds it: then the teardown aborts the group a little later.
        if s.op_lock.acquire(timeout=0.1):
            try:
                if s.executor.closing is None:
                    self._abort(m, text, "engine_draining")
            finally:
                s.op_lock.release()

    # -- plumbing ----------------------------------------------------------------------------
    def _node(self) -> epd_pb2_grpc.NodeStub:
        """The supervisor's Node service; every call carries the engine's node token."""
        if self._node_channel is None:
            self._node_channel = grpc.aio.insecure_channel(
                f"unix://{self.config.node_socket}", interceptors=[_NodeToken()])
        return epd_pb2_grpc.NodeStub(self._node_channel)

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.closed.is_set():
            if self.state.draining:  # (its session was closed by the drain: the engine's
                self.state.check_open()  # state, UNAVAILABLE, not the client's NOT_FOUND)
            raise NotFound(f"session {session_id!r} is not open on engine {self.index}")
        return s

    def authenticate(self, session_id: str, token: bytes) -> Session:
        """The session a call names, if the call carries its token (PERMISSION_DENIED names
        the session, never the token)."""
        s = self.session(session_id)
        if not token or not hmac.compare_digest(token, s.token):
            raise PermissionDenied(f"the call does not carry the token of session "
                                   f"{session_id!r} (a session's calls must come from the "
                                   f"client that opened it)")
        return s

    def issue_ticket(self, ticket: bytes, peer: tuple[int, int, int],
                     alive: Callable[[], bool]) -> None:
        """A descriptor-channel connection's hello (peer: its SO_PEERCRED pid, uid, gid): a
        fresh secret (drawn by the connection's thread, fd_server.py, so that it can
        withdraw it even when this call came too late for it) that OpenSession must carry,
        so the engine knows a session's uid before it exists (grpcio does not give the gRPC
        peer's credentials). One use; withdrawn when its connection closes (`alive` says
        whether it is still open)."""
        self.state.check_open()
        # (a uid this engine opens no session for is sent on now, its connection closed: it
        # held one of the few outsiders' connections until OpenSession otherwise)
        self._check_tenant_pool(peer[1], peer[2])
        self.tickets[ticket] = ChannelTicket(peer, alive)

    def ticket_opened_session(self, ticket: bytes) -> bool:
        """Whether `ticket` opened a session that is still open (its client binds the ticket's
        connection once OpenSession's answer reaches it)."""
        return any(s.channel_ticket and hmac.compare_digest(ticket, s.channel_ticket)
                   and not s.closed.is_set() for s in self.sessions.values())

    def withdraw_ticket(self, ticket: bytes) -> None:
        """The connection of `ticket` closed: it opens nothing any more (if not used yet)."""
        self.tickets.pop(ticket, None)

    def _ticket(self, ticket: bytes) -> ChannelTicket:
        """The hello of an OpenSession's channel_ticket, if it is outstanding and its
        connection still open; PERMISSION_DENIED otherwise (missing, made up, used, or its
        connection gone)."""
        held = self.tickets.get(ticket) if ticket else None
        if held is not None and not held.alive():  # (closed, its thread not yet told)
            self.withdraw_ticket(ticket)
            held = None
        if held is None:
            raise PermissionDenied(
                f"OpenSession carries no ticket of an open descriptor-channel connection: "
                f"connect the engine's descriptor channel "
                f"{fdc.socket_path_for(self.socket_path)} first and send hello "
                f"(OpenSessionRequest.channel_ticket; a ticket opens one session and dies "
                f"with its connection)")
        return held

    def check_peer(self, session: Session, peer: tuple[int, int, int], ticket: bytes) -> None:
        """A descriptor-channel connection binding to `session` ((pid, uid, gid) from
        SO_PEERCRED; `ticket`: its hello's, b"" if it sent none) is refused unless its
        credentials are the session's (those of the connection whose ticket opened it), and a
        connection that said hello binds only to the session its ticket opened."""
        if ticket and not hmac.compare_digest(ticket, session.channel_ticket):
            raise PermissionDenied(f"this descriptor-channel connection's ticket did not open "
                                   f"{session.describe()} (a connection that said hello binds "
                                   f"to the session its ticket opened)")
        if session.peer != peer:
            raise PermissionDenied(f"{session.describe()} belongs to another process "
                                   f"(pid/uid/gid differ from its descriptor channel's)")

    def fetch_fd(self, session: Session, name: str) -> tuple[int, int]:
        """(a duplicate of the descriptor, size) of an engine-owned memfd of the session;
        the caller sends and closes the duplicate."""
        fd, size = -1, 0
        if name == fdc.COUNTERS:
            fd, size = getattr(session.counter_page, "fd", -1), counter_page.PAGE_BYTES
        elif name == fdc.RING and session.fast_path is not None:
            fd, size = session.fast_path.ring.fd, session.fast_path.ring.size
        elif name.startswith(fdc.OUTPUTS):
            m = session.members.get(name[len(fdc.OUTPUTS):])
            region = m.comm.output_region if m is not None else None
            fd, size = getattr(region, "fd", -1), getattr(region, "size", 0)
        if fd is None or fd < 0:
            raise NotFound(f"{session.describe()} has no shared object {name!r} to fetch")
        return os.dup(fd), size

    def _check_region_budget(self, session: Session, size: int) -> None:
        """One more region of `size` bytes fits the session's budgets (count and bytes), for
        memfds and CUDA IPC regions alike."""
        count = len(session.regions) + len(session.registering)
        if count >= self.config.max_regions_per_session:
            raise ResourceExhausted(f"{session.describe()} has {count} regions, "
                                    f"the maximum (--max-regions-per-session)")
        if size <= 0:
            raise InvalidArgument("size_bytes must be positive")
        self._check_bytes(session, size, f"{size} more")

    def _check_bytes(self, session: Session, size: int, what: str) -> None:
        """`size` more bytes fit the session's --max-region-bytes-per-session, which counts its
        registered regions and the engine memory its memberships' outputs take (the cpu
        backend sizes them from the spec: one client could otherwise make the engine allocate
        and fill any amount of host memory)."""
        held = (sum(r.size for r in session.regions.values() if not r.borrowed)
                + sum(session.registering.values())
                + sum(self.backend.output_bytes(m.spec) for m in session.members.values())
                + sum(self.backend.output_bytes(s) for s in session.joining.values())
                # The fast-path ring: engine memory sized by OpenFastPath's request (up to
                # 1 GiB) that its client maps read-write and can fill, so it counts too.
                + (session.fast_path.ring.size if session.fast_path is not None else 0))
        limit = self.config.max_region_bytes_per_session
        if held + size > limit:
            raise ResourceExhausted(f"{session.describe()} holds {held} bytes of regions and "
                                    f"group outputs; {what} exceed the maximum of {limit} "
                                    f"(--max-region-bytes-per-session)")

    def register_memfd(self, session: Session, fd: int, size: int) -> Region:
        """A client memfd as a region: checked (sealed against shrinking, large enough),
        mapped, and the received descriptor closed. Owns `fd`."""
        try:
            if session.executor.closing is not None:
                raise Aborted(f"{session.describe()} is closing")
            self._check_region_budget(session, size)
            rid = "r" + secrets.token_hex(8)
            region = self.backend.map_memfd(rid, fd, size)
        finally:
            os.close(fd)
        session.regions[rid] = region
        self._refresh_gauges()
        return region

    def member(self, session: Session, group_id: str) -> GroupMember:
        m = session.members.get(group_id)
        if m is None:
            raise NotFound(f"group {group_id!r} is not joined by {session.describe()}")
        return m

    def _timeout(self, requested: float) -> float:
        """A request's deadline: 0 takes the default; NaN, inf and negatives are refused (NaN
        passed `< 0` and disabled the deadline)."""
        if not math.isfinite(requested) or requested < 0:
            raise InvalidArgument(f"timeout_seconds must be a finite number >= 0 (0: the "
                                  f"default), got {requested}")
        return min(requested or self.config.timeout_seconds, self.config.max_timeout_seconds)

    def _refresh_gauges(self) -> None:
        # Snapshots (list() copies a dict in one step under the GIL): sessions' workers, ring
        # threads and teardown threads add and remove members and regions meanwhile, and a
        # Python-level iteration over a dict another thread resizes raises RuntimeError.
        sessions = list(self.sessions.values())
        members = [m for s in sessions for m in list(s.members.values())]
        regions = [r for s in sessions for r in list(s.regions.values())]
        metrics.SESSIONS.labels(self._label).set(len(sessions))
        metrics.SESSIONS_WITHOUT_MPS.labels(self._label).set(
            sum(s.on_engine_mps is False for s in sessions) if self.mps_pipe_directory else 0)
        metrics.GROUPS.labels(self._label).set(len(members))
        metrics.REGIONS.labels(self._label).set(len(regions))
        metrics.REGION_BYTES.labels(self._label).set(sum(r.size for r in regions))
        metrics.STREAM_OPS_ARMED.labels(self._label).set(sum(len(s.stream_ops)
                                                             for s in sessions))
        # Ranks held per (group, class); series of groups gone drop to 0 (a multiprocess
        # series cannot be removed, see metrics.py).
        ranks: dict[tuple[str, str], int] = {}
        held: dict[str, int] = {}
        sms: dict[tuple[str, str], int] = {}
        for m in members:
            key = (metrics.group_label(m.spec.label), m.service_class)
            ranks[key] = ranks.get(key, 0) + 1
            held[key[0]] = held.get(key[0], 0) + m.comm.held_bytes
            for mode, n in (("normal", m.comm.num_sms), ("low_latency", m.comm.ll_num_sms)):
                sms[(key[0], mode)] = max(sms.get((key[0], mode), 0), n)
        for label in self._held_series - set(held):
            metrics.GROUP_HELD_BYTES.labels(label).set(0)
            # (a group gone has no load to be imbalanced: its alert must stop firing)
            metrics.LOAD_IMBALANCE.labels(label).set(0)
        for label, n in held.items():
            metrics.GROUP_HELD_BYTES.labels(label).set(n)
        self._held_series |= set(held)
        for key in self._sms_series - set(sms):
            metrics.GROUP_SMS.labels(*key).set(0)
        for key, n in sms.items():
            metrics.GROUP_SMS.labels(*key).set(n)
        self._sms_series |= set(sms)
        for key in self._class_series - set(ranks):
            metrics.GROUP_SERVICE_CLASS.labels(*key).set(0)
        for key, n in ranks.items():
            metrics.GROUP_SERVICE_CLASS.labels(*key).set(n)
        self._class_series |= set(ranks)

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self, client_name: str, pid: int, ticket: bytes) -> Session:
        """A new session for the holder of `ticket` (a descriptor-channel hello's, taken: one
        use), whose uid is the ticket's: within --max-sessions-per-uid and --max-sessions.
        Refused, it changes nothing (the ticket stays the connection's)."""
        self.state.check_open()
        peer = self._ticket(ticket).peer
        self._check_tenant_pool(peer[1], peer[2])
        live = [s for s in self.sessions.values() if not s.teardown_done]
        cap, uid = self.config.max_sessions_per_uid, peer[1]
        held = sum(1 for s in live if s.peer is not None and s.peer[1] == uid)
        if cap and held >= cap:
            raise ResourceExhausted(f"uid {uid} holds {held} sessions of engine {self.index}, "
                                    f"the most one uid may (--max-sessions-per-uid)")
        if len(live) >= self.config.max_sessions:
            raise ResourceExhausted(f"engine {self.index} has {len(live)} sessions, the maximum "
                                    f"(--max-sessions)")
        sid = secrets.token_hex(8)
        page = self.backend.open_counter_page()  # a sealed memfd, fetched over the channel
        del self.tickets[ticket]
        # (printable only: the name goes into log lines and other tenants' abort reasons)
        name = printable(client_name[:64])
        s = Session(sid, name, pid, page,
                    SessionExecutor(self.state, f"s{sid[:6]}", self.backend.thread_init,
                                    self.slow_ops),
                    token=secrets.token_bytes(32), peer=peer, channel_ticket=ticket)
        self.sessions[sid] = s
        self._refresh_gauges()
        log.info("opened %s: peer pid %d uid %d gid %d", s.describe(), *peer)
        return s

    def serves(self, uid: int, gid: int) -> bool:
        """Whether this engine opens sessions for `uid` (_check_tenant_pool); any thread."""
        theirs, mine = tenant_pools.pool_of(self.tenants, uid, gid), self.slot.tenant_pool
        return theirs == mine or (uid == os.geteuid() and not mine)

    def _check_tenant_pool(self, uid: int, gid: int) -> None:
        """A tenant pool's engine serves only that pool's uids, and a pool's uids only its own
        engines (tenant_pools.py): FAILED_PRECONDITION naming the socket of the engine this
        client's sessions open on (its Session follows it). The daemon's own uid (the
        operator's tools) is served by the shared engines too; by a pool's only where the pool
        lists it, since every client on the daemon's MPS server runs as that uid (a review:
        exempt everywhere, every MPS client reached every pool's heap)."""
        if self.serves(uid, gid):
            return
        theirs = tenant_pools.pool_of(self.tenants, uid, gid)
        mine = self.slot.tenant_pool
        other = self.config.engine_socket(self.slot.device, self.slot.service_class, theirs)
        whose = f"tenant pool {theirs!r}" if theirs else "no tenant pool"
        raise FailedPrecondition(
            f"uid {uid} is in {whose} and engine {self.index} serves only "
            f"{f'tenant pool {mine!r}' if mine else 'the uids of no tenant pool'} "
            f"(--tenant-pools): {engine_sockets.OTHER_ENGINE_HINT}{other}")

    def session_mps(self, session: Session, client_pipe_directory: str,
                    client_pipe_present: bool) -> bool:
        """Whether the client of a new session shares this engine's MPS server (same pipe
        folder, and its control socket is visible to the client). A client that is not still
        works, only slower (time-sliced): counted in epd_sessions_without_mps and logged once
        per client pid."""
        mine = self.mps_pipe_directory
        on = bool(mine and client_pipe_present and client_pipe_directory
                  and os.path.normpath(client_pipe_directory) == os.path.normpath(mine))
        session.on_engine_mps = on
        if mine and not on:
            self._refresh_gauges()
            pid = session.peer[0] if session.peer is not None else session.pid  # (SO_PEERCRED)
            if pid not in self._mps_warned:
                if len(self._mps_warned) >= MPS_WARNED_PIDS:
                    self._mps_warned.clear()
                self._mps_warned.add(pid)
                # (the client's words, printable only: a newline would forge a log line)
                folder = printable(client_pipe_directory[:256]) or "(none)"
                where = (f"MPS pipe folder {folder}"
                         f"{'' if client_pipe_present else ', no MPS server there'}")
                log.warning("%s is not on engine %d's CUDA MPS server (%s; the engine's: %s): "
                            "its calls share the GPU by time slices, much slower; run the "
                            "client under eval \"$(epd env)\"", session.describe(), self.index,
                            where, mine)
        return on

    async def close_session(self, session: Session, reason: str) -> None:
        """Tear a session down exactly once, in the executor's order: refuse later calls, abort
        its groups and release its stream ops (waking what is in flight), stop its fast path
        and worker, then, with no operation running, close comms, regions and counter page."""
        if session.teardown_done:
            return
        session.teardown_done = True
        session.closed.set()
        if self.on_session_closed is not None:
            self.on_session_closed(session.session_id)
        text = f"{session.describe()} {reason}"

        # Each step is logged and passed if it fails (a comm whose context broke), so the
        # others still run and the session still goes: a teardown that stopped half way would
        # keep counting against --max-sessions and keep its peers' ranks.
        def step(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception:
                log.exception("closing %s: %s failed", session.describe(), what)

        def interrupt_member(member: GroupMember) -> None:
            self._abort(member, f"rank {member.rank} of group {member.spec.name!r} went "
                                f"away: {text}")
            # Then let its stream pass the READY waits the client will never write.
            member.comm.release_stream(session.counter_page.slot(member.counter_slot))

        async def interrupt() -> None:
            for member in list(session.members.values()):
                step(f"aborting group {member.spec.name!r}", lambda m=member: interrupt_member(m))
            if session.stream_ops:  # release client streams waiting on them
                await session.executor.off_loop(step, "releasing stream ops",
                                                lambda: self.stream_ops.release_session(session))

        def release() -> None:
            # (under the operation lock: an op that an arm still running during interrupt()
            # registered goes here, while its comm and counter page are still open; copies
            # of the dicts, which a join finishing on the event loop may change meanwhile)
            step("releasing stream ops",
                 lambda: self.stream_ops.release_session(session, locked=True))
            for member in list(session.members.values()):  # streams released by interrupt()
                step(f"closing group {member.spec.name!r}", member.comm.close)
            for region in list(session.regions.values()):
                if not region.borrowed:
                    step(f"closing region {region.region_id}", region.close)
            step("closing the counter page", session.counter_page.close)
            step("closing events", lambda: self.backend.close_events(session.events))

        # A teardown that takes long is a bug worth every thread's stack in the log (one timer
        # per process: a second teardown at once replaces the first's).
        faulthandler.dump_traceback_later(TEARDOWN_STACKS_SECONDS, exit=False)
        try:
            await session.executor.shutdown(reason, interrupt, release)
        except Exception:  # (each step logs its own; this is the executor's)
            log.exception("closing %s: the executor's teardown failed", session.describe())
        finally:
            faulthandler.cancel_dump_traceback_later()
            members = list(session.members.values())
            session.members.clear()
            session.regions.clear()
            self.sessions.pop(session.session_id, None)
            self._refresh_gauges()
        for member in members:
            await self._release_rank(member, f"rank {member.rank} of group "
                                             f"{member.spec.name!r} went away: {text}")
        log.info("closed %s: %s", session.describe(), reason)

    @staticmethod
    def _abort(member: GroupMember, text: str, why: str = "member_left") -> None:
        """Raise the group's abort word: wakes this rank's own pending waits and every peer's.
        Unmaps nothing. A clean leave (why="left") is counted in epd_group_leaves_total, not
        as an abort (the EpdGroupAborts alert is for faults). In a shrink group on a backend
        that masks ranks, only this rank's own waits end: the group goes on without it (the
        supervisor masks the rank when it is released)."""
        if member.spec.shrink and member.comm.supports_rank_masking:
            if why == "left":
                metrics.LEAVES.inc()
            member.comm.stop(text)
            return
        if member.comm.abort_reason() is None:
            if why == "left":
                metrics.LEAVES.inc()
            else:
                metrics.ABORTS.labels(why).inc()
        member.comm.abort(text)

    async def _release_rank(self, member: GroupMember, text: str, left: bool = False) -> None:
        try:
            await self._node().ReleaseRank(
                epd_pb2.ReleaseRankRequest(group_id=member.group_id, rank=member.rank,
                                           reason=text, left=left), timeout=NODE_RPC_SECONDS)
        except grpc.aio.AioRpcError as e:
            log.warning("could not release rank %d of %s: %s", member.rank, member.group_id,
                        e.details())

    async def _drop_member(self, session: Session, member: GroupMember, reason: str,
                           why: str = "member_left") -> None:
        """One membership ends while its session lives (left, or a join that failed): abort,
        release its stream ops, close the comm with no operation running, release the rank."""
        if session.members.get(member.group_id) is not member:
            return  # the session's teardown has it
        text = f"rank {member.rank} of group {member.spec.name!r} went away: {reason}"
        if why == "left":  # a clean leave: let peers finish reading what this rank published
            try:
                await session.executor.off_loop(member.comm.quiesce,
                                                time.monotonic() + QUIESCE_SECONDS)
            except Exception:  # (its session's teardown closed the comm meanwhile)
                log.debug("quiescing rank %d of %r failed", member.rank, member.spec.name,
                          exc_info=True)
        if session.teardown_done:  # the session's teardown, begun meanwhile, has the member
            return
        self._abort(member, text, why)
        if any(o.member is member for o in list(session.stream_ops.values())):
            await session.executor.off_loop(self.stream_ops.release_member, session, member)

        def close() -> bool:
            if session.teardown_done or session.members.get(member.group_id) is not member:
                return False  # (the teardown, or another leave of it, has it)
            # (an op armed for it after the pass above, by an arm that was running then)
            self.stream_ops.release_member(session, member, locked=True)
            session.members.pop(member.group_id, None)
            try:  # (a comm whose context broke: logged, and the rank is released anyway)
                member.comm.release_stream(session.counter_page.slot(member.counter_slot))
                member.comm.close()
            except Exception:
                log.exception("closing rank %d of group %r failed", member.rank,
                              member.spec.name)
            session.free_slots.append(member.counter_slot)
            return True
        async def finish() -> None:
            if await session.executor.off_loop(session.executor.exclusive, close) is False:
                return
            session.members.pop(member.group_id, None)
            await self._release_rank(member, text, left=why == "left")
            self._refresh_gauges()
        # Shielded: a leave whose client stops waiting (its deadline) still releases the rank
        # once its comm is closed, or the group and its plan would never be freed.
        await asyncio.shield(finish())

    # -- groups ------------------------------------------------------------------------------
    def _check_class_engine(self, group: str, cls: int) -> None:
        """A class engine runs groups of its class only: FAILED_PRECONDITION naming the socket
        of the engine that runs `group`'s class on this device (the client's Buffer reopens
        its session there)."""
        mine, theirs = self.slot.service_class, service_classes.name(cls)
        if not mine or mine == theirs:
            return
        other = self.config.engine_socket(self.slot.device, theirs, self.slot.tenant_pool)
        raise FailedPrecondition(
            f"group {group!r} is a {theirs} group and engine {self.index} (device "
            f"{self.slot.device}) runs only {mine} groups (--class-engines): "
            f"{engine_sockets.OTHER_ENGINE_HINT}{other} "
            f"(Buffer(service_class={theirs!r}) or EPD_SERVICE_CLASS={theirs} picks it)")

    async def join_group(self, session: Session, req: epd_pb2.JoinGroupRequest) -> GroupMember:
        spec = spec_from_proto(req.spec)
        self.backend.validate_spec(spec)  # before the rendezvous: every rank fails alike
        if not 0 <= req.rank < spec.num_ranks:
            raise InvalidArgument(f"rank {req.rank} is out of range for num_ranks="
                                  f"{spec.num_ranks}")
        if (any(m.spec.name == spec.name for m in session.members.values())
                or spec.name in session.joining):
            raise FailedPrecondition(f"{session.describe()} already holds a rank of group "
                                     f"{spec.name!r}")
        if not session.free_slots:
            raise ResourceExhausted(f"a session can join at most {counter_page.NUM_SLOTS} groups")
        held = len(session.members) + len(session.joining)
        if held >= self.config.max_groups_per_session:
            raise ResourceExhausted(f"{session.describe()} holds {held} groups, the maximum "
                                    f"(--max-groups-per-session)")
        need = self.backend.output_bytes(spec)
        if need:
            self._check_bytes(session, need, f"group {spec.name!r}'s outputs, {need} bytes of "
                                             f"engine memory,")
        slot = session.take_slot(f"a session can join at most {counter_page.NUM_SLOTS} groups")
        # The name and the counter slot are the join's from here, across its awaits: two
        # joins of one session at once must not both pass the checks above.
        session.joining[spec.name] = spec
        try:
            return await self._join(session, req, spec, slot)
        finally:
            session.joining.pop(spec.name, None)

    async def _join(self, session: Session, req: epd_pb2.JoinGroupRequest, spec: GroupSpec,
                    slot: int) -> GroupMember:
        """join_group after its checks, with the counter slot it reserved: the slot goes back
        if no member is made of it (a member's teardown returns its own)."""
        member: GroupMember | None = None
        try:
            timeout = self._timeout(req.timeout_seconds)
            if session.peer is None:  # (a session opens with its channel's: never, but
                # the policy below must not run without them)
                raise FailedPrecondition(
                    f"{session.describe()} has no client credentials (its descriptor "
                    f"channel's, {fdc.socket_path_for(self.socket_path)}): a group's "
                    f"admission policy needs them")
            _, uid, gid = session.peer
            # The class is decided here, before the rendezvous (PERMISSION_DENIED naming the
            # rule changes nothing), and travels in the spec: ranks that disagree fail together.
            cls = self.policy.resolve(spec.name, uid, req.spec.service_class)
            self._check_class_engine(spec.name, cls)
            shared = in_pool(uid, gid, self.config.allowed_uids, self.config.allowed_gids)
            pool = tenant_pools.pool_of(self.tenants, uid, gid)
            spec = dataclasses.replace(spec, service_class=cls, metrics_name=metrics.owned_label(
                spec.name, uid, shared, pool))
            spec_proto = epd_pb2.GroupSpec()
            spec_proto.CopyFrom(req.spec)
            spec_proto.service_class = cls
            try:
                resp = await self._node().Rendezvous(epd_pb2.RendezvousRequest(
                    spec=spec_proto, rank=req.rank, engine_index=self.index,
                    session_id=session.session_id, timeout_seconds=timeout,
                    peer_uid=uid, peer_gid=gid, has_peer=True),
                    timeout=timeout + NODE_RPC_SECONDS)
            except grpc.aio.AioRpcError as e:
                raise EpdError(e.code(), e.details() or "rendezvous failed") from None
            membership = Membership.from_rendezvous(req.rank, resp)
            handoff = AttachHandoff()
            try:
                # A replacement can only be brought in by ranks that take part (the Rejoin
                # collective); the coordinator, which sees ranks go but neither a group's abort
                # word nor who came back, may place it in an instance where none does (checked
                # on the worker within the attach: a cuda comm reads its control block from the
                # device, and a join going away meanwhile must not close the comm under it).
                refusal = (functools.partial(_rejoin_refusal, spec=spec, rank=req.rank,
                                             group_id=resp.group_id)
                           if resp.rejoining else None)
                comm = await session.executor.run(handoff.attach, self.backend, spec,
                                                  membership, refusal)
                if session.closed.is_set():  # (its teardown began meanwhile: it would not
                    raise Aborted("session closed during join")  # see this comm)
            except BaseException as e:  # (cancelled too: the client went away meanwhile)
                loop = asyncio.get_running_loop()
                release = functools.partial(self._release_unattached, resp.group_id,
                                            req.rank, f"attach failed: {e!r}")
                left, running = handoff.abandon(
                    lambda: self._spawn_from_thread(loop, release))
                if not running:  # (else the worker closes its comm, then releases)
                    self._spawn(self._close_then_release(left, release))
                raise
            member = GroupMember(spec, membership, comm, slot)
        finally:
            if member is None:  # (back where it was taken: a refused join changes nothing,
                session.free_slots.insert(0, slot)  # not even which slot the next join gets)
        # The attach barrier: every rank attached, or the member goes again.
        session.members[member.group_id] = member
        try:
            await self._node().Rendezvous(epd_pb2.RendezvousRequest(
                spec=spec_proto, rank=req.rank, engine_index=self.index,
                session_id=session.session_id, timeout_seconds=timeout, attached=True,
                group_id=resp.group_id), timeout=timeout + NODE_RPC_SECONDS)
        except grpc.aio.AioRpcError as e:
            await self._drop_member(session, member, f"attach barrier failed: {e.details()}")
            raise EpdError(e.code(), e.details() or "attach barrier failed") from None
        except BaseException:  # (the join cancelled there: the member goes, or the session
            # would hold the group's name until it ends)
            await asyncio.shield(self._drop_member(session, member,
                                                   "the join was cancelled at the attach "
                                                   "barrier"))
            raise
        if comm.output_region.borrowed:  # outputs may come back as inputs (combine(recv_x))
            session.regions.setdefault(comm.output_region.region_id, comm.output_region)
        if session.closed.is_set():  # the client vanished while we waited for its peers
            await self._drop_member(session, member, "closed during join")
            raise Aborted("session closed during join")
        self._refresh_gauges()
        log.info("%s joined group %r (%s) as rank %d/%d, service class %s%s", session.describe(),
                 spec.name, member.group_id, req.rank, spec.num_ranks, member.service_class,
                 (", hierarchical normal mode over nodes"
                  + (" in two stages" if comm.two_stage else "")) if comm.hierarchical else "")
        return member

    async def _release_unattached(self, group_id: str, rank: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await self._node().ReleaseRank(epd_pb2.ReleaseRankRequest(
                group_id=group_id, rank=rank, reason=reason), timeout=NODE_RPC_SECONDS)

    async def _close_then_release(self, comm: RankComm | None,
                                  release: Callable[[], Awaitable[None]]) -> None:
        if comm is not None:  # (off the event loop: a cuda comm frees device memory)
            await asyncio.to_thread(close_quietly, comm)
        await release()

    def _spawn_from_thread(self, loop: asyncio.AbstractEventLoop,
                           release: Callable[[], Awaitable[None]]) -> None:
        """From a worker thread: run `release()` on the loop (gone at exit: the engine's end
        releases its ranks anyway, engine_lost)."""
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(lambda: self._spawn(release()))

    def _spawn(self, coro) -> None:
        """Run `coro` to its end whatever happens to the task that started it (a join being
        cancelled): kept referenced until done."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def leave_group(self, session: Session, group_id: str) -> None:
        member = self.member(session, group_id)
        await self._drop_member(session, member, "left the group", why="left")

    # -- fast path ---------------------------------------------------------------------------
    def open_fast_path(self, session: Session,
                       req: epd_pb2.OpenFastPathRequest) -> epd_pb2.OpenFastPathResponse:
        if not self.config.fast_path:
            raise FailedPrecondition("the fast path is disabled on this engine (--fast-path)")
        if session.fast_path is not None:
            raise FailedPrecondition(f"{session.describe()} already has a fast path")
        if session.executor.closing is not None:
            raise Aborted(f"{session.describe()} is closing")
        slots = req.slots or self.config.fast_path_slots
        slot_bytes = req.slot_bytes or self.config.fast_path_slot_bytes
        if not (1 <= slots <= ring_format.MAX_SLOTS
                and ring_format.MIN_SLOT_BYTES <= slot_bytes <= ring_format.MAX_SLOT_BYTES):
            raise InvalidArgument(f"slots must lie in [1, {ring_format.MAX_SLOTS}] and "
                                  f"slot_bytes in [{ring_format.MIN_SLOT_BYTES}, "
                                  f"{ring_format.MAX_SLOT_BYTES}]")
        self._check_bytes(session, ring_format.ring_bytes(slots, slot_bytes),
                          f"a fast-path ring of {slots} slots of {slot_bytes} bytes")
        window = spin_mod.SpinWindow(self.config.fast_path_spin_us * 1e-6,
                                     self.config.fast_path_spin_max_us * 1e-6)
        # The ring is a sealed memfd the client fetches as "ring" over the descriptor channel.
        session.fast_path = FastPathServer(self, session, slots, slot_bytes, window)
        session.executor.attach(session.fast_path)
        session.fast_path.start()
        log.info("%s uses the fast path (%d slots of %d bytes)", session.describe(), slots,
                 slot_bytes)
        return epd_pb2.OpenFastPathResponse(
            slots=slots, slot_bytes=slot_bytes, spin_seconds=window.base,
            reply_spin_max_seconds=(window.base if self.backend.collectives_on_host
                                    else window.longest))

    # -- stream-ordered calls -----------------------------------------------------------------
    async def arm_stream_op(self, session: Session, req: epd_pb2.ArmStreamOpRequest
                            ) -> epd_pb2.ArmStreamOpResponse:
        # (StreamOps.arm counts the session's ops under its operation lock)
        return await session.executor.run(self.stream_ops.arm, session, req)

    async def disarm_stream_op(self, session: Session, op_id: int) -> None:
        # In the session's order, under its operation lock: an arm of a combine that reads
        # this dispatch cannot slip between disarm's check and its removal.
        await session.executor.run(functools.partial(self.stream_ops.disarm, locked=True),
                                   session, op_id)

    def stats(self, session: Session | None) -> epd_pb2.GetStatsResponse:
        """Counters of one session's memberships; without a session, engine-wide counts only
        (no session sees another's groups)."""
        groups = []
        sessions = [session] if session is not None else list(self.sessions.values())
        for s in sessions if session is not None else ():
            armed: dict[int, int] = {}
            for op in list(s.stream_ops.values()):
                armed[id(op.member)] = armed.get(id(op.member), 0) + 1
            for m in list(s.members.values()):  # a snapshot: other threads change it
                reason = m.comm.abort_reason()
                groups.append(epd_pb2.GroupStats(
                    group_id=m.group_id, name=m.spec.name, rank=m.rank,
                    num_ranks=m.spec.num_ranks, dispatches=m.dispatches, combines=m.combines,
                    bytes_sent=m.bytes_sent, bytes_received=m.bytes_received,
                    aborted=reason is not None, abort_reason=reason or "",
                    handles=len(m.handles), service_class=m.spec.service_class,
                    stream_priority=m.comm.stream_priority, num_sms=m.comm.num_sms,
                    ll_num_sms=m.comm.ll_num_sms, queued_calls=m.queued_calls,
                    queue_wait_seconds=m.queue_wait_seconds, held_bytes=m.comm.held_bytes,
                    hierarchical=m.comm.hierarchical, two_stage=m.comm.two_stage,
                    armed_calls=armed.get(id(m), 0)))
        regions = [r for s in sessions for r in list(s.regions.values()) if not r.borrowed]
        return epd_pb2.GetStatsResponse(engine_index=self.index, sessions=len(self.sessions),
                                        groups=groups, regions=len(regions),
                                        region_bytes=sum(r.size for r in regions))

    # -- regions -----------------------------------------------------------------------------
    async def register_region(self, session: Session,
                              req: epd_pb2.RegisterRegionRequest) -> Region:
        self._check_region_budget(session, req.size_bytes)
        which = req.WhichOneof("source")
        if which is None:  # host memory comes by descriptor, never by path
            raise InvalidArgument("a region over gRPC needs cuda_ipc_handle; host memory is a "
                                  "sealed memfd sent over the descriptor channel "
                                  "(FdRequest.register_memfd)")
        rid = "r" + secrets.token_hex(8)
        session.registering[rid] = req.size_bytes  # (held across the await: see Session)
        def drop(region: Region) -> None:  # (its client gave up while it opened: nobody
            try:  # would close it, nor count it in the budgets)
                session.executor.later(region.close)
            except Aborted:  # (the session's worker is shut down by now)
                asyncio.get_running_loop().run_in_executor(None, region.close)

        try:
            region = await session.executor.run(lambda: self.backend.open_region(
                rid, ipc_handle=req.cuda_ipc_handle, size=req.size_bytes,
                device_ordinal=req.device_ordinal), discard=drop)
        finally:
            session.registering.pop(rid, None)
        if session.teardown_done:  # (closed while it opened: nobody would close it later)
            try:
                await asyncio.to_thread(region.close)
            except Exception:
                log.exception("closing region %s of a closed session failed", rid)
            raise Aborted(f"{session.describe()} closed while region {rid} was registered")
        session.regions[rid] = region
        self._refresh_gauges()
        return region

    def unregister_region(self, session: Session, region_id: str) -> None:
        region = session.regions.get(region_id)
        if region is None:
            raise NotFound(f"region {region_id!r} is not registered by {session.describe()}")
        if region.borrowed:
            raise FailedPrecondition(f"region {region_id!r} belongs to the engine")
        # An armed op addresses its tensors on every trigger (its launches were packed at
        # arm time): unmapped under it, a trigger would fault the engine's GPU context.
        users = sorted(op.op_id for op in list(session.stream_ops.values())
                       if op.armed and region_id in op.regions)
        if users:
            raise FailedPrecondition(f"region {region_id!r} is read by armed stream "
                                     f"op(s) {users}: disarm them first (DisarmStreamOp, or "
                                     f"leave their group)")
        del session.regions[region_id]
        # A queued call may still read it: close it in worker order.
        session.executor.later(region.close)
        self._refresh_gauges()

    # -- lifecycle ---------------------------------------------------------------------------
    async def drain(self, seconds: float) -> None:
        """Refuse new sessions and calls (UNAVAILABLE), let the calls in flight on every
        transport finish (at most `seconds`), then tear every session down (executor order)."""
        left = await self.state.drain(seconds)
        if left:
            log.warning("engine %d: %d call(s) still running after %.1f s; tearing down",
                        self.index, left, seconds)
        why = "engine shutting down"
        if self.config.num_nodes > 1:  # cluster mode: peers on other nodes learn which node
            why += f" (engine {self.index} of node {self.config.node_rank})"
        for s in list(self.sessions.values()):
            await self.close_session(s, why)
        settle = time.monotonic() + SETTLE_SECONDS
        while self.sessions and time.monotonic() < settle:
            await asyncio.sleep(0.01)  # teardowns already under way (streams that just ended)
        self.stream_ops.stop()
        if self.slow_ops is not None:
            self.slow_ops.stop()
        sweep_engine_files(self.config.shm_dir, self.index)
        if self._node_channel is not None:
            await self._node_channel.close()
        self.backend.close()

