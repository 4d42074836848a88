"""The engine's descriptor channel: `<socket-dir>/gpu<N>.fds`, a unix SOCK_SEQPACKET socket
(proto/fd_channel.py has the wire and the memfd helpers).

One thread accepts, one thread per connection reads requests; each request is handled on the
engine's event loop (where gRPC handlers run, so sessions and regions change in one place).
A client connects before it opens its session: the connection's first request is `hello`,
answered with a one-use ticket that records the peer's credentials (SO_PEERCRED: pid, uid, gid;
Engine.issue_ticket). OpenSession must carry it, so a session's uid is known before it exists
(--max-sessions-per-uid is applied there); the connection then binds to that session (its next
request carries the session's id and token): within FIRST_REQUEST_SECONDS of the hello while
the ticket is unused, then for as long as the session it opened is open (checked every
FIRST_REQUEST_SECONDS; the session's end closes it), and a ticket not used yet dies with its
connection. Another connection's first request names a
session and carries its token, and binds only if its credentials are the session's. Requests:
fetch an engine-owned memfd by name ("counters", "ring", "outputs/<group_id>"), or register a
client memfd (sealed F_SEAL_SHRINK) as a region; the engine maps it and closes the descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

import grpc

from ...proto import fd_channel as fdc
from ...proto.errors import EpdError, InvalidArgument, PermissionDenied, status_value
from ...proto.thread_names import NamedThread
from ...proto.v1 import epd_pb2
from .. import metrics
from ..rate_limited_log import RateLimitedLog
from .backlog import decrement
from .executor import as_epd_error

if TYPE_CHECKING:
    from .core import Engine
    from .state import Session

log = logging.getLogger("epd.engine")
CALL_SECONDS = 60.0  # longest a request may take on the event loop
# epd_requests_total's method of each request kind (a refusal when a connection binds is
# counted with the request that was refused).
_METHODS = {"fetch": "FdFetch", "register_memfd": "FdRegisterMemfd", "hello": "FdHello"}
# A connection costs a thread: connections are capped, and one that does not authenticate in
# time, or fails to, is closed, so no client can exhaust the engine's threads for the others.
# Caps per peer uid before authentication and per session after it keep one tenant's
# connections from filling the engine-wide cap (a session's client keeps one open). A
# connection with a ticket not used yet is unbound: the uid cap bounds its tickets too.
MAX_CONNECTIONS = 1024
# (a session opening holds one until its client binds: briefly, or for the session's life
# if its client never does; so --max-sessions-per-uid above 64 needs clients that bind)
MAX_UNBOUND_PER_UID = 64
MAX_PER_SESSION = 4
# Open at once, of the uids this engine serves no session (told where to go at their hello):
# in all, and of one uid (so that one cannot hold them all, every other pool tenant's first
# open then failing instead of being sent on)
MAX_OUTSIDER_CONNECTIONS, MAX_OUTSIDER_PER_UID = 128, 8
# accept()'s errors that pass (the process's or the system's descriptors or memory, for now):
# the channel waits this long and accepts again.
ACCEPT_BUSY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY_SECONDS = 0.1
REFUSALS = RateLimitedLog(log)  # refused connections: one line per uid a second


def per_uid_cap(max_sessions_per_uid: int) -> int:
    """The connections one uid may hold, bound and not: two per session it may open (its
    client keeps one; a hello waits for the next), at least the unbound cap; all of them where
    a uid's sessions are not capped (--max-sessions-per-uid 0: the operator has one tenant).
    With the default 64 sessions, 128: eight uids, not four, to fill MAX_CONNECTIONS."""
    if not max_sessions_per_uid:
        return MAX_CONNECTIONS
    return min(MAX_CONNECTIONS, max(MAX_UNBOUND_PER_UID, 2 * max_sessions_per_uid))

TICKET_BYTES = 16  # a hello's ticket (FdResponse.ticket)
# to the first request, and from a hello to the binding one unless the hello's ticket opened
# a session meanwhile (then for as long as that session is open)
FIRST_REQUEST_SECONDS = 10.0
IDLE_CHECK_SECONDS = 30.0  # how often a bound, idle connection checks its session is open


class FdServer:
    def __init__(self, engine: Engine, path: str, loop: asyncio.AbstractEventLoop,
                 max_sessions_per_uid: int = 0) -> None:
        """`max_sessions_per_uid`: the engine's --max-sessions-per-uid (`per_uid_cap`)."""
        self.engine, self.path, self.loop = engine, path, loop
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.bind(path)
        os.chmod(path, 0o660)  # the gRPC socket's permissions
        self.sock.listen(64)
        self._stop = False
        self._conns: set[socket.socket] = set()
        # Connections of uids this engine serves no session (their uid): each is refused at
        # its hello, naming the engine that serves it (Engine.issue_ticket)
        self._outsiders: dict[socket.socket, int] = {}
        self._unbound: dict[int, int] = {}  # peer uid -> its connections not yet bound
        self._of_uid: dict[int, int] = {}  # peer uid -> all its connections
        self.per_uid = per_uid_cap(max_sessions_per_uid)
        # session id -> its bound connections (shut down when it ends: drop_session)
        self._bound: dict[str, set[socket.socket]] = {}
        self._lock = threading.Lock()
        self.thread = NamedThread(target=self._accept, daemon=True, name="epd-fds")

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                if self._stop or e.errno not in ACCEPT_BUSY:
                    return  # (closed)
                # Out of descriptors or memory for now (another tenant's connections filled
                # the table): the channel stays, and accepts again once there is room; a
                # review found one failed accept ended it for good, every later session of
                # the engine then waiting for a channel that never answered.
                log.warning("descriptor channel: cannot accept a connection (%s); trying "
                            "again in %.1f s", e, ACCEPT_RETRY_SECONDS)
                time.sleep(ACCEPT_RETRY_SECONDS)
                continue
            try:
                peer = fdc.peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            uid = peer[1]
            # (a uid this engine opens no session for, e.g. outside its tenant pool, needs a
            # connection only to be told where to go, at its hello: outsiders share a few, or
            # they could fill the table and lock the pool out of its own engine)
            outsider = not self.engine.serves(uid, peer[2])
            with self._lock:
                unbound, held = self._unbound.get(uid, 0), self._of_uid.get(uid, 0)
                if len(self._conns) >= MAX_CONNECTIONS or unbound >= MAX_UNBOUND_PER_UID \
                        or held >= self.per_uid \
                        or (outsider and (len(self._outsiders) >= MAX_OUTSIDER_CONNECTIONS
                                          or sum(u == uid for u in self._outsiders.values())
                                          >= MAX_OUTSIDER_PER_UID)):
                    # (rate-limited: a client that connects in a loop wrote 30,000 lines a
                    # second, filling the disk or hiding other tenants' lines)
                    REFUSALS.warning(f"refused:{uid}", f"descriptor channel: {len(self._conns)} "
                                     f"connections open ({held} of uid {uid}, {unbound} of "
                                     f"them not authenticated), refusing another")
                    conn.close()
                    continue
                self._conns.add(conn)
                if outsider:
                    self._outsiders[conn] = uid
                self._unbound[uid] = unbound + 1
                self._of_uid[uid] = held + 1
            conn.settimeout(FIRST_REQUEST_SECONDS)
            try:
                NamedThread(target=self._serve, args=(conn, peer), daemon=True,
                            name="epd-fds-conn").start()
            except RuntimeError as e:  # (no thread could start: the connection is let go, and
                # its counts with it, or they stayed counted against the caps for good)
                log.warning("descriptor channel: cannot serve a connection of uid %d (%s)",
                            uid, e)
                with self._lock:
                    self._conns.discard(conn)
                    self._outsiders.pop(conn, None)
                    self._uncount_unbound(uid)
                    self._uncount(uid)
                conn.close()

    def _count_bound(self, uid: int, session_id: str, conn: socket.socket) -> bool:
        """Move a connection from its uid's unbound count to its session's bound ones;
        False (nothing moved) when the session has its cap of connections already."""
        with self._lock:
            bound = self._bound.setdefault(session_id, set())
            if len(bound) >= MAX_PER_SESSION:
                return False
            bound.add(conn)
            self._uncount_unbound(uid)
            return True

    def drop_session(self, session_id: str) -> None:
        """The session ended (Engine.close_session, on the event loop): its connections are
        shut down, so their threads end now. (Left to their idle check, they stayed open up
        to IDLE_CHECK_SECONDS, or for good while their client kept sending requests: one uid
        opening and closing sessions so held connections beyond its caps, up to
        MAX_CONNECTIONS, and every other tenant's next session was refused.)"""
        with self._lock:
            for c in self._bound.get(session_id, ()):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)

    def _uncount_unbound(self, uid: int) -> None:  # (under the lock)
        decrement(self._unbound, uid)

    def _uncount(self, uid: int) -> None:  # (under the lock) a connection of uid closed
        decrement(self._of_uid, uid)

    def _serve(self, conn: socket.socket, peer: tuple[int, int, int]) -> None:
        session: Session | None = None
        ticket: bytes | None = None  # its hello's, once it said hello
        try:
            while not self._stop:
                fd = None
                method, code = "FdChannel", grpc.StatusCode.OK  # (epd_requests_total)
                greeted = False  # this request was a hello, answered
                try:
                    try:
                        req, fd = fdc.recv(conn, epd_pb2.FdRequest)
                    except TimeoutError:
                        if session is not None and not session.closed.is_set():
                            continue  # bound and idle: its session is still open
                        if session is None and ticket is not None and \
                                self._ticket_session_open(ticket):
                            continue  # its session is open; the client binds once
                            # OpenSession's answer reaches it, however late that is
                        return  # never spoke in time, or its session ended: close
                    except OSError:  # the peer went away
                        return
                    if req is None:
                        return
                    which = req.WhichOneof("op")
                    method = _METHODS.get(which, method)
                    if which == "hello":
                        if session is not None or ticket is not None:
                            raise InvalidArgument("hello is a descriptor-channel connection's "
                                                  "first request, once")
                        # (drawn here: should the engine take it only after this thread
                        # gave up waiting, the close below still withdraws it)
                        ticket = secrets.token_bytes(TICKET_BYTES)
                        self._call(self.engine.issue_ticket, ticket, peer,
                                   lambda: _still_open(conn))
                        conn.settimeout(FIRST_REQUEST_SECONDS)  # to bind, from now
                        resp, out_fd, greeted = epd_pb2.FdResponse(ticket=ticket), None, True
                    else:
                        if session is None:
                            session = self._bind_connection(conn, req, peer, ticket or b"")
                            conn.settimeout(IDLE_CHECK_SECONDS)  # bound: may idle, not forever
                        elif req.session_id and req.session_id != session.session_id:
                            raise PermissionDenied("this descriptor channel belongs to another "
                                                   "session")
                        if fd is not None:
                            _screen(which, fd)  # (refused: closed below, on this thread)
                        given, fd = fd, None  # handed over: the handler closes it, always
                        resp, out_fd = self._call(self._handle, session, req, given)
                except EpdError as e:
                    code = e.code
                    resp, out_fd = epd_pb2.FdResponse(code=status_value(e.code),
                                                      message=e.message), None
                except Exception as e:  # a bug: logged, answered, serving goes on
                    err = as_epd_error("FdChannel", e)
                    code = err.code
                    resp, out_fd = epd_pb2.FdResponse(code=status_value(err.code),
                                                      message=err.message), None
                finally:
                    if fd is not None:
                        os.close(fd)
                metrics.REQUESTS.labels(method, code.name).inc()
                try:
                    fdc.send(conn, resp, out_fd)
                finally:
                    if out_fd is not None:
                        os.close(out_fd)  # our duplicate (Engine.fetch_fd)
                if session is None and not greeted:
                    return  # refused before it bound: a connection authenticates once
        except OSError:
            return
        finally:
            if ticket is not None and session is None and not self._stop:
                # (before the close: while the engine holds a ticket, its socket is open)
                with contextlib.suppress(Exception):
                    self._call(self.engine.withdraw_ticket, ticket)
            with self._lock:
                self._conns.discard(conn)
                self._outsiders.pop(conn, None)
                self._uncount(peer[1])
                if session is None:
                    self._uncount_unbound(peer[1])
                else:
                    bound = self._bound.get(session.session_id, set())
                    bound.discard(conn)
                    if not bound:
                        self._bound.pop(session.session_id, None)
            conn.close()

    def _bind_connection(self, conn: socket.socket, req: epd_pb2.FdRequest,
                         peer: tuple[int, int, int], ticket: bytes) -> Session:
        """The session a connection's first request after its hello (if any) binds it to,
        counted as bound; refused (raises) if the request may not bind it."""
        bound = self._call(self._bind, req, peer, ticket)
        if not self._count_bound(peer[1], bound.session_id, conn):
            raise EpdError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"session {bound.session_id!r} has {MAX_PER_SESSION} "
                           f"descriptor-channel connections open already")
        if bound.closed.is_set():  # (ended meanwhile: its drop_session may have come before
            with contextlib.suppress(OSError):  # this connection was counted)
                conn.shutdown(socket.SHUT_RDWR)
        return bound

    def _ticket_session_open(self, ticket: bytes) -> bool:
        try:
            return bool(self._call(self.engine.ticket_opened_session, ticket))
        except Exception:  # (the engine stopping, its loop stalled a minute: close)
            return False

    def _call(self, fn, *args):
        """Run fn(*args) on the event loop (where the engine's state changes)."""
        async def run():
            return fn(*args)
        if self.loop.is_closed():
            raise EpdError(grpc.StatusCode.UNAVAILABLE, "the engine is stopping")
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(CALL_SECONDS)

    # -- on the event loop ---------------------------------------------------------------------
    def _bind(self, req: epd_pb2.FdRequest, peer: tuple[int, int, int],
              ticket: bytes) -> Session:
        s = self.engine.authenticate(req.session_id, req.session_token)
        self.engine.check_peer(s, peer, ticket)
        return s

    def _handle(self, s: Session, req: epd_pb2.FdRequest,
                fd: int | None) -> tuple[epd_pb2.FdResponse, int | None]:
        """Owns `fd` (closes it, or register_memfd does)."""
        try:
            self.engine.session(s.session_id)  # still open
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        which = req.WhichOneof("op")
        if which == "fetch":
            if fd is not None:
                os.close(fd)
            out, size = self.engine.fetch_fd(s, req.fetch.name)
            return epd_pb2.FdResponse(size_bytes=size), out
        if which == "register_memfd":
            if fd is None:
                raise InvalidArgument("register_memfd needs a memfd sent with the request")
            region = self.engine.register_memfd(s, fd, req.register_memfd.size_bytes)
            return epd_pb2.FdResponse(region_id=region.region_id, size_bytes=region.size), None
        if fd is not None:
            os.close(fd)
        raise InvalidArgument("an FdRequest needs fetch or register_memfd")


def _screen(which: str | None, fd: int) -> None:
    """A descriptor a request carries goes to the event loop only if closing it there cannot
    wait: a register_memfd's memfd (plain shared memory). Anything else is refused here and
    closed by this connection's thread, whose close may wait (before, the loop closed it: a
    TCP socket sent with SO_LINGER and unsent data stopped every session of the engine for
    the linger time, and past --engine-hung-seconds the supervisor killed it; a fuzzer)."""
    if which != "register_memfd":
        raise InvalidArgument(f"an FdRequest carries a descriptor only with register_memfd "
                              f"(this one: {which or 'no op'})")
    fdc.check_shared_memory(fd, "region")


def _still_open(conn: socket.socket) -> bool:
    """Whether the peer still holds its end of `conn`: a hang-up is seen here at once, before
    the connection's thread reads the end of the stream (a ticket dies with its connection)."""
    fd = conn.fileno()
    if fd < 0:
        return False
    poll = select.poll()
    poll.register(fd, select.POLLRDHUP)  # (POLLHUP, POLLERR and POLLNVAL come unasked)
    gone = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL
    return not any(events & gone for _, events in poll.poll(0))
