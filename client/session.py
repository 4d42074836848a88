"""The client API: a `Session` with one engine; the `Group`s it joins are in client/group.py.

    with Session(socket_dir="/run/epd", engine=0) as s:
        g = s.join("moe-layer", rank=0, num_ranks=2, num_experts=8, hidden=256,
                   max_tokens_per_rank=128, num_topk=2)
        out = g.dispatch(x, topk_idx, topk_weights)
        y = expert(out.recv_x, out.recv_topk_idx)
        combined, weights = g.combine(y, out.handle, topk_weights=out.recv_topk_weights)

The session's gRPC stream is its lease: when this process exits, the engine frees everything
the session held and aborts the groups it belonged to. How tensors reach the engine (shared
memory or CUDA IPC) is the session's memory strategy (client/memory.py), chosen at open from
the engine's backend. Every failure raises `EpdError` (`proto/errors.py`): the daemon's status
and message, or INVALID_ARGUMENT for a bad argument found here; `TypeError` only for an object
that is no array at all.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import grpc
import numpy as np
from google.protobuf.message import Message

from ..proto import dtypes, engine_sockets
from ..proto import fd_channel as fdc
from ..proto.errors import EpdError, FailedPrecondition, InvalidArgument, Unavailable, error
from ..proto.v1 import epd_pb2
from . import fork_guard
from . import memory as M
from . import tensors as T
from .group import RPC_MARGIN, Group, service_class_value
from .tensors import Array
from .transport import (
    FastPathTransport,
    GrpcTransport,
    PendingCall,
    SessionStream,
    Transport,
    check_fast_path_ring,
)

if TYPE_CHECKING:
    from .stream_ops import StreamOp

DEFAULT_SOCKET_DIR = "/run/epd"
CONTROL_TIMEOUT = 30.0  # calls that wait for no peer (open, register, leave, stats)
DEFAULT_TIMEOUT = 10.0  # collective deadline when the daemon does not say (it always does)
MAX_TIMEOUT = 1e8  # seconds (three years): a call's longest deadline (_check_timeout)
WATCHER_JOIN_TIMEOUT = 5.0  # closing: how long to wait for the lease thread to end
CLOSE_LEAVE_TIMEOUT = 2.0  # closing: a clean leave of each group, else the lease's end aborts it
# A leave that failed so: the engine is not answering, and the next one would wait as long.
UNANSWERED = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})

log = logging.getLogger("epd.client")


def engine_socket(socket_dir: str | None = None, engine: int = 0,
                  service_class: str | None = None) -> str:
    """The socket of the engine on device `engine` that runs groups of `service_class`: the
    latency engine's where the daemon runs class engines (`epd serve --class-engines`) and the
    class is latency, else gpu<engine>.sock (proto/engine_sockets.py)."""
    folder = socket_dir or os.environ.get("EPD_SOCKET_DIR", DEFAULT_SOCKET_DIR)
    if service_class == engine_sockets.LATENCY:
        path = engine_sockets.socket_path(folder, engine, service_class)
        if os.path.exists(path):
            return path
    return engine_sockets.socket_path(folder, engine)


def _check_timeout(t: float) -> float:
    """A deadline in seconds: positive and finite (NaN would disable it, inf never end), at
    most MAX_TIMEOUT (a longer one is that: gRPC refuses deadlines from about 1e10 s on, and the
    engine bounds every call's by its --max-timeout-seconds anyway)."""
    try:
        value = float(t)
    except (TypeError, ValueError):
        raise InvalidArgument(f"timeout must be a number of seconds, got {t!r}") from None
    if not (0 < value < float("inf")):  # also false for NaN
        raise InvalidArgument(f"timeout must be a positive finite number of seconds, got {t!r}")
    return min(value, MAX_TIMEOUT)


def _engine_timeout(value: float) -> float:
    """The engine's default deadline, checked, not trusted: NaN, inf or <= 0 (0: an engine that
    does not say) is DEFAULT_TIMEOUT, since every wait of a call without its own ends by it
    (a NaN deadline made counter-page waits spin forever)."""
    if 0 < value < float("inf"):
        return float(value)
    if value:
        log.warning("the engine's default deadline %r is not a positive finite number of "
                    "seconds: %s s is used", value, DEFAULT_TIMEOUT)
    return DEFAULT_TIMEOUT


class Session:
    def __init__(self, endpoint: str | None = None, *, socket_dir: str | None = None,
                 engine: int = 0, client_name: str = "", timeout: float | None = None,
                 fast_path: bool | None = None, transport: Transport | None = None,
                 service_class: str | None = None) -> None:
        """`timeout`: deadline of joins and collectives in seconds; None takes the daemon's
        (`--timeout-seconds`). Calls may pass their own. `fast_path`: use the same-host
        shared-memory ring for data-plane calls when the engine offers it (default: yes, unless
        EPD_FAST_PATH=0); otherwise, or if it is unavailable, gRPC.

        `service_class` picks the engine when the daemon runs class engines (`epd serve
        --class-engines`): "latency" opens the session on the device's latency engine, any
        other value or None on its default engine; an endpoint given wins. Where the daemon
        runs tenant pools (`epd serve --tenant-pools`), an engine that does not serve this
        process's uid answers with the socket of the one that does, and the session opens
        there (once; not with a `transport` of the caller's).

        A session that cannot be opened raises `EpdError` with the daemon's status (UNAVAILABLE
        when nothing listens, RESOURCE_EXHAUSTED at --max-sessions, ...) and leaves no thread,
        connection or file behind. The endpoint is an engine's unix socket (`.../gpu<N>.sock`,
        or `unix://` and that path): the engine's descriptor channel is beside it."""
        self.timeout = None if timeout is None else _check_timeout(timeout)
        self._start(endpoint or engine_socket(socket_dir, engine, service_class), client_name,
                    fast_path, transport)
        if self._redirect is not None:  # a tenant pool's uid on another engine (and back)
            other, self._redirect = self._redirect, None
            log.info("session: %s sends this uid's sessions to %s (--tenant-pools)",
                     self.endpoint, other)
            self._start(other, client_name, fast_path, None)
            if self._redirect is not None:
                raise FailedPrecondition(f"could not open a session on {other}: it sends this "
                                         f"uid's sessions on to {self._redirect}")

    def _start(self, endpoint: str, client_name: str, fast_path: bool | None,
               transport: Transport | None) -> None:
        """Open the session on `endpoint`. An engine that serves only another tenant pool's
        sessions (or only a pool's, and this uid is in none) refuses naming the socket of the
        one that serves this uid: `_redirect` is set to it and nothing stays open, where the
        caller gave no transport of its own (which is bound to its endpoint)."""
        self.endpoint = endpoint
        self._redirect: str | None = None
        fd_socket = self._fd_socket_path()  # (INVALID_ARGUMENT before anything is opened)
        self.fast_path_error = ""
        # Every attribute exists before the lease thread starts: it, and close() after a failed
        # open, may look at any of them.
        self._closed = False
        self._pid, self._fork_generation = os.getpid(), fork_guard.generation()
        self._lost: str | None = None  # why the lease ended (None while it holds)
        self._lost_error: EpdError | None = None  # the status it ended with, if any
        self._opened: epd_pb2.SessionOpened | None = None
        self._ready = threading.Event()
        self._groups: dict[str, Group] = {}
        self._stream_ops: dict[int, StreamOp] = {}  # armed stream-ordered calls (stream_ops.py)
        # The dispatch_async in flight: (its PendingDispatch, weakly; its call)
        self._in_flight: tuple[Callable[[], object], PendingCall] | None = None
        self._holding: PendingCall | None = None  # the dispatch whose staged inputs are held
        self._flight_lock = threading.Lock()  # (dispatch_async's check and start, together)
        self._memory: M.Memory | None = None
        self._counter_file: T.ShmFile | None = None
        self._channel: fdc.Channel | None = None  # the engine's descriptor channel
        self._stream: SessionStream | None = None
        self._watcher: threading.Thread | None = None
        self._transport: Transport = transport or GrpcTransport(self.endpoint)
        try:
            self._open(client_name or f"pid{os.getpid()}", fast_path, fd_socket)
        except BaseException as e:
            self.close()
            other = (engine_sockets.hinted_socket(e.details, endpoint) if isinstance(e, EpdError)
                     and e.code == grpc.StatusCode.FAILED_PRECONDITION and transport is None
                     and "--tenant-pools" in e.details else None)
            if other is None:
                raise
            self._redirect = other

    def _open(self, client_name: str, fast_path: bool | None, fd_socket: str) -> None:
        from . import mps  # the client's view of CUDA MPS (sent, and compared by the engine)
        where = f"could not open a session on {self.endpoint}"
        # The descriptor channel first: OpenSession needs the ticket of its hello, through
        # which the engine knows this process's uid (SO_PEERCRED) before the session exists.
        try:
            self._channel = fdc.Channel(fd_socket)
            ticket = self._channel.hello()
        except EpdError as e:
            raise error(e.code, f"{where}: {e.message}") from None
        self._stream = self._transport.open_stream(epd_pb2.OpenSessionRequest(
            client_name=client_name, pid=os.getpid(), channel_ticket=ticket,
            **mps.request_fields()))
        watcher = threading.Thread(target=self._watch, name="epd-session", daemon=True)
        watcher.start()  # (kept once started: close() after a failed open joins it)
        self._watcher = watcher
        if not self._ready.wait(CONTROL_TIMEOUT):
            raise EpdError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{where}: no answer within {CONTROL_TIMEOUT} s")
        if self._opened is None:
            e = self._lost_error or Unavailable(self._lost or "no answer")
            raise error(e.code, f"{where}: {e.message}")
        o = self._opened
        self.session_id = o.session_id
        self.engine_index = o.engine_index
        self.device_ordinal = o.device_ordinal
        self.server_version = o.version
        self.default_timeout = _engine_timeout(o.default_timeout_seconds)
        # Whether this process shares the engine's CUDA MPS server (warned once if not).
        self.mps_pipe_directory = o.mps_pipe_directory
        self.on_engine_mps = o.client_on_engine_mps
        mps.warn_if_off_engine_mps(o)
        # The session's secret: every later call carries it (gRPC metadata, the channel).
        set_token = getattr(self._transport, "set_token", None)
        if set_token is not None:
            set_token(o.session_token)
        self._channel.bind(self.session_id, o.session_token)
        fd, _ = self._channel.fetch(fdc.COUNTERS)  # (binds the connection to the session)
        self._counter_file = T.ShmFile.from_fd(fd, o.counter_page_bytes, fdc.COUNTERS)
        self._memory = M.for_backend(o.backend, self._register_region, self._unregister_region,
                                     self._counter_file, o.device_ordinal,
                                     register_fd=self._channel.register,
                                     fetch=self._channel.fetch)
        self.backend = self._memory.backend  # "cpu" or "cuda", for reports
        if fast_path is None:
            fast_path = os.environ.get("EPD_FAST_PATH", "1") != "0"
        if fast_path and isinstance(self._transport, GrpcTransport):
            try:
                fp = cast(epd_pb2.OpenFastPathResponse, self._transport.call(
                    "OpenFastPath", epd_pb2.OpenFastPathRequest(session_id=self.session_id),
                    CONTROL_TIMEOUT))
                try:  # (an offer this client cannot use: refused before the ring is fetched)
                    check_fast_path_ring(fp.slots, fp.slot_bytes)
                except ValueError as e:
                    log.warning("session %s: fast path refused, gRPC carries every call: %s",
                                self.session_id, e)
                    raise
                ring_fd, _ = self._channel.fetch(fdc.RING)  # a sealed memfd, never a path
                self._transport = FastPathTransport(self._transport, ring_fd, fp.slots,
                                                    fp.slot_bytes, fp.spin_seconds,
                                                    fp.reply_spin_max_seconds)
            except (EpdError, OSError, ValueError) as e:
                self.fast_path_error = str(e)  # stay on gRPC, which carries everything

    def _fd_socket_path(self) -> str:
        """The engine's descriptor channel, beside the gRPC socket this process connects to
        (gpu0.sock -> gpu0.fds; the engine's own path for it may differ under a bind mount).
        It is connected before OpenSession, so an endpoint that is no such path is refused."""
        ep = self.endpoint
        if ep.startswith("unix:"):
            ep = ep.removeprefix("unix://").removeprefix("unix:")
        elif not ep.startswith("/"):
            ep = ""  # (host:port, a name: nothing beside it)
        if not ep.endswith(".sock"):
            raise InvalidArgument(f"endpoint {self.endpoint!r} is not an engine's unix socket "
                                  f"(a path ending in .sock, e.g. /run/epd/gpu0.sock, or "
                                  f"unix:// and that path): a session needs the engine's "
                                  f"descriptor channel beside it")
        return fdc.socket_path_for(ep)

    # -- lease -------------------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            for event in self._stream:
                if event.HasField("opened"):
                    self._opened = event.opened
                    self._ready.set()
            self._lost = "the engine ended the session"
        except grpc.RpcError as e:
            self._lost_error = EpdError.from_rpc(e)
            self._lost = f"{e.code().name}: {e.details()}"
        finally:
            self._ready.set()
            for op in list(self._stream_ops.values()):  # no stream may wait forever on them
                op.release()
            for g in list(self._groups.values()):
                g._release_stream()
            # The ring has no lease of its own: fail the calls waiting on it now, not at
            # their deadline (the engine may be dead and never answer).
            lease_lost = getattr(self._transport, "lease_lost", None)
            if lease_lost is not None:
                who = f"session {getattr(self, 'session_id', '?')} on {self.endpoint}"
                lease_lost(f"{who} was closed" if self._closed else
                           f"the engine went away: {who}: {self._lost}")

    def _dispatch_started(self, pending: object, future: PendingCall) -> None:
        """A dispatch_async is in flight: its staged inputs are held until it is answered."""
        self._in_flight = (weakref.ref(pending), future)
        self._holding = future
        self.memory.hold_staging()

    def _release_hold(self, future: PendingCall) -> None:
        """The engine is done with the staged inputs of `future`'s dispatch (once)."""
        if self._holding is future:
            self._holding = None
            if self._memory is not None and not self._closed:
                self._memory.release_staging()

    def _dispatch_done(self, future: PendingCall) -> None:
        """The dispatch_async of `future` has its answer: it is no longer in flight and its
        staged inputs may be reused (once: a second result() of it changes nothing)."""
        if self._in_flight is not None and self._in_flight[1] is future:
            self._in_flight = None
        self._release_hold(future)

    def _reap_in_flight(self) -> None:
        """Before a call stages its inputs: a dispatch_async the engine has answered no longer
        holds the staging, even while its result is not taken; one whose PendingDispatch was
        dropped is no longer in flight at all. (Without this, a dropped or never-read
        PendingDispatch kept staging from being reset for the rest of the session, and every
        staging file outgrown meanwhile stayed registered.)"""
        flight = self._in_flight
        if flight is None:
            return
        pending, future = flight
        if (self._holding is not future and pending() is not None) or not future.done():
            return
        self._release_hold(future)
        if pending() is None and self._in_flight is flight:
            self._in_flight = None

    @property
    def alive(self) -> bool:
        return self._lost is None and not self._closed

    @property
    def usable_here(self) -> bool:
        """False in a forked child: the session is the parent's (client/fork_guard.py)."""
        return not fork_guard.inherited(self._fork_generation)

    def _check_open(self) -> None:
        """Raise unless calls can go to the engine (before touching any mapped memory)."""
        if self._closed:
            raise FailedPrecondition("the session is closed")
        if fork_guard.inherited(self._fork_generation):
            raise FailedPrecondition(fork_guard.refusal(self._pid))
        if self._lost is not None:
            raise Unavailable(f"session lost: {self._lost}")

    def _call(self, method: str, request: Message, timeout: float | None = None) -> Message:
        self._check_open()
        return self._transport.call(method, request, timeout or CONTROL_TIMEOUT)

    def _call_async(self, method: str, request: Message, timeout: float) -> PendingCall:
        self._check_open()
        return self._transport.call_async(method, request, timeout)

    # -- memory ------------------------------------------------------------------------------
    @property
    def memory(self) -> M.Memory:
        """The session's memory strategy (client/memory.py); raises once the session closed."""
        self._check_open()
        assert self._memory is not None  # set by a successful open, which precedes any call
        return self._memory

    def empty(self, shape: tuple[int, ...] | int, dtype: np.dtype | type | str,
              like: Array = None) -> Array:
        """An array the engine reads without a copy: on the cpu backend it lives in a
        registered shared-memory region (NumPy, or torch when `like` is a torch tensor); on the
        cuda backend it is a device array on the engine's GPU."""
        dt = np.dtype(dtype)
        T.wire_dtype(dt, "empty()")
        return self.memory.empty(T.check_shape(shape, dt, "empty()"), dt, like)

    def _register_region(self, req: epd_pb2.RegisterRegionRequest) -> str:
        req.session_id = self.session_id
        resp = cast(epd_pb2.RegisterRegionResponse, self._call("RegisterRegion", req))
        return resp.region_id

    def _unregister_region(self, region_id: str) -> None:
        self._call("UnregisterRegion", epd_pb2.UnregisterRegionRequest(
            session_id=self.session_id, region_id=region_id))

    def _descs(self, arrays: dict[str, Array | None], event: bool = True) -> M.Descs:
        """Descriptors for a call's inputs (the memory strategy's `describe`)."""
        memory = self.memory
        self._reap_in_flight()
        return memory.describe(arrays, event=event)

    def _write_back(self, name: str, user: Array) -> None:
        self.memory.write_back(name, user)

    @property
    def _user_regions(self) -> list[T.ShmFile]:
        """Regions from `empty()` on the cpu backend (tests look at them)."""
        return getattr(self._memory, "user_regions", [])

    # -- groups ------------------------------------------------------------------------------
    def join(self, name: str, *, rank: int, num_ranks: int, num_experts: int, hidden: int,
             max_tokens_per_rank: int, num_topk: int, dtype: str = "bfloat16",
             low_latency_mode: bool = False, timeout: float | None = None,
             service_class: str | None = None, shrink: bool = False) -> Group:
        """Join (and with the other ranks, form) a group; blocks until all ranks arrived.
        `low_latency_mode` reserves the low-latency buffers (sized by max_tokens_per_rank),
        which the cuda backend needs for `low_latency_dispatch`. `service_class` ("latency"
        for decode, "throughput" for prefill and training; None: the daemon's policy default
        for the group) must be the same on every rank; a class the daemon's policy does not
        allow raises PermissionDenied naming the rule. `Group.service_class` says which class
        the group got. `shrink` (low-latency groups; DeepEP's shrink mode): a rank that goes
        away is masked instead of aborting the group (`Group.rank_mask`)."""
        try:
            x_dtype = dtypes.from_name(dtype)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        spec = epd_pb2.GroupSpec(name=name, num_ranks=num_ranks, num_experts=num_experts,
                                 hidden=hidden, max_tokens_per_rank=max_tokens_per_rank,
                                 num_topk=num_topk, x_dtype=x_dtype,
                                 low_latency_mode=low_latency_mode,
                                 service_class=service_class_value(service_class),
                                 shrink=shrink)
        wait = self._deadline(timeout)
        resp = cast(epd_pb2.JoinGroupResponse, self._call("JoinGroup", epd_pb2.JoinGroupRequest(
            session_id=self.session_id, spec=spec, rank=rank, timeout_seconds=wait),
            wait + RPC_MARGIN))
        try:
            g = Group(self, spec, resp)
        except BaseException:
            # The engine made the membership; its peers would wait on this rank until the
            # session ends: leave it now (bounded, best effort; the lease's end is the backstop).
            self._leave_quietly(resp.group_id)
            raise
        self._groups[g.group_id] = g
        return g

    def _leave_quietly(self, group_id: str) -> None:
        """LeaveGroup within CLOSE_LEAVE_TIMEOUT; a failure is logged, never raised."""
        try:
            self._transport.call("LeaveGroup", epd_pb2.LeaveGroupRequest(
                session_id=self.session_id, group_id=group_id), CLOSE_LEAVE_TIMEOUT)
        except Exception as e:
            log.warning("session %s: could not leave group %s: %s", self.session_id,
                        group_id, e)

    def _deadline(self, timeout: float | None) -> float:
        """A call's deadline: its own, else the session's, else the daemon's default."""
        for t in (timeout, self.timeout):
            if t is not None:
                return _check_timeout(t)
        return self.default_timeout

    @property
    def transport(self) -> str:
        """'fastpath' or 'grpc': how data-plane calls travel now."""
        t = self._transport
        return "grpc" if getattr(t, "broken", None) else t.name

    def ping(self) -> None:
        """The empty operation: one round trip to the engine (measures the transport)."""
        self._call("Ping", epd_pb2.PingRequest())

    def stats(self) -> epd_pb2.GetStatsResponse:
        return cast(epd_pb2.GetStatsResponse, self._call(
            "GetStats", epd_pb2.GetStatsRequest(session_id=self.session_id)))

    def close(self) -> None:
        """End the lease: the engine leaves every group of this session and frees its memory.
        Idempotent; later calls raise EpdError(FAILED_PRECONDITION)."""
        if self._closed:
            return
        self._closed = True
        if fork_guard.inherited(self._fork_generation):
            return  # (a forked child's copy: the lease, ring and groups are the parent's)
        for op in list(self._stream_ops.values()):
            op.release()
        self._stream_ops.clear()
        answering = self._lost is None
        for g in list(self._groups.values()):
            # A clean close leaves its groups (counted as leaves, not aborts); if that cannot
            # be done quickly, the end of the lease aborts them as for a crashed client. An
            # engine that let one leave run out (stopped, wedged) is not asked again: each
            # would wait CLOSE_LEAVE_TIMEOUT, and close() took that times the groups.
            if answering:
                answering = self._leave_on_close(g.group_id)
            g._release()
        if self._stream is not None:
            self._stream.cancel()
        if self._watcher is not None:
            self._watcher.join(timeout=WATCHER_JOIN_TIMEOUT)
        self._transport.close()
        if self._channel is not None:
            self._channel.close()
        if self._memory is not None:
            self._memory.close()  # before the counter page goes (CUDA maps it)
        if self._counter_file is not None:
            self._counter_file.close(unlink=False)

    def _leave_on_close(self, group_id: str) -> bool:
        """close(): LeaveGroup within CLOSE_LEAVE_TIMEOUT; False when the engine did not answer
        in time (DEADLINE_EXCEEDED, UNAVAILABLE): the remaining groups go with the lease."""
        try:
            self._transport.call("LeaveGroup", epd_pb2.LeaveGroupRequest(
                session_id=self.session_id, group_id=group_id), CLOSE_LEAVE_TIMEOUT)
        except EpdError as e:
            return e.code not in UNANSWERED
        return True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
