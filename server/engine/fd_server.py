"""The engine's descriptor channel: `<socket-dir>/gpu<N>.fds`, a unix SOCK_SEQPACKET socket
(proto/fd_channel.py has the wire and the memfd helpers).

One thread accepts, one thread per connection reads requests; each request is handled on the
engine's event loop (where gRPC handlers run, so sessions and regions change in one place).
The first request of a connection must name a session and carry its token; the connection is
then bound to that session and the peer's credentials (SO_PEERCRED) are recorded on it: a later
connection of other credentials is refused. Requests: fetch an engine-owned memfd by name
("counters", "ring", "outputs/<group_id>"), or register a client memfd (sealed F_SEAL_SHRINK)
as a region; the engine maps it and closes the descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from typing import TYPE_CHECKING

import grpc

from ...proto import fd_channel as fdc
from ...proto.errors import EpdError, InvalidArgument, PermissionDenied, status_value
from ...proto.v1 import epd_pb2
from .executor import as_epd_error

if TYPE_CHECKING:
    from .core import Engine
    from .state import Session

log = logging.getLogger("epd.engine")
CALL_SECONDS = 60.0  # longest a request may take on the event loop
# A connection costs a thread: connections are capped, and one that does not authenticate in
# time is closed, so no client can exhaust the engine's threads for the others.
MAX_CONNECTIONS = 1024
FIRST_REQUEST_SECONDS = 10.0


class FdServer:
    def __init__(self, engine: Engine, path: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.path, self.loop = engine, path, loop
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.bind(path)
        os.chmod(path, 0o660)  # the gRPC socket's permissions
        self.sock.listen(64)
        self._stop = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True, name="epd-fds")

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
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    log.warning("descriptor channel: %d connections open, refusing another",
                                len(self._conns))
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.settimeout(FIRST_REQUEST_SECONDS)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="epd-fds-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        session: Session | None = None
        try:
            peer = fdc.peer_credentials(conn)
            while not self._stop:
                fd = None
                try:
                    try:
                        req, fd = fdc.recv(conn, epd_pb2.FdRequest)
                    except OSError:  # the peer went away, or never spoke in time: close
                        return
                    if req is None:
                        return
                    if session is None:
                        session = self._call(self._bind, req, peer)
                        conn.settimeout(None)  # bound: a session's channel may idle
                    elif req.session_id and req.session_id != session.session_id:
                        raise PermissionDenied("this descriptor channel belongs to another "
                                               "session")
                    given, fd = fd, None  # handed over: the handler closes it, always
                    resp, out_fd = self._call(self._handle, session, req, given)
                except EpdError as e:
                    resp, out_fd = epd_pb2.FdResponse(code=status_value(e.code),
                                                      message=e.message), None
                except Exception as e:  # a bug: logged, answered, serving goes on
                    err = as_epd_error("FdChannel", e)
                    resp, out_fd = epd_pb2.FdResponse(code=status_value(err.code),
                                                      message=err.message), None
                finally:
                    if fd is not None:
                        os.close(fd)
                try:
                    fdc.send(conn, resp, out_fd)
                finally:
                    if out_fd is not None:
                        os.close(out_fd)  # our duplicate (Engine.fetch_fd)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _call(self, fn, *args):
        """Run fn(*args) on the event loop (where the engine's state changes)."""
        async def run():
            return fn(*args)
        if self.loop.is_closed():
            raise EpdError(grpc.StatusCode.UNAVAILABLE, "the engine is stopping")
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(CALL_SECONDS)

    # -- on the event loop ---------------------------------------------------------------------
    def _bind(self, req: epd_pb2.FdRequest, peer: tuple[int, int, int]) -> Session:
        s = self.engine.authenticate(req.session_id, req.session_token)
        self.engine.record_peer(s, peer)
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
