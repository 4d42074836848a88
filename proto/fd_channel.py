"""Memory by descriptor: sealed memfds and the descriptor channel, shared by engine and client.

Shared memory between a client and its engine is never a named file. Each side creates a memfd
(`memfd_create`), sizes it and seals it (`F_SEAL_SHRINK`: no one, not even its creator, can
truncate it any more, so a mapping of it can never SIGBUS), and passes the descriptor over a
unix SOCK_SEQPACKET socket beside the engine's gRPC socket (`<socket-dir>/gpu<N>.fds`) as
SCM_RIGHTS. The receiver checks the seals and the size, maps it and closes the descriptor.

Wire: one protobuf per packet (`FdRequest` from the client, `FdResponse` from the engine), each
with at most one descriptor. A client connects before it opens its session: its first request
is `hello`, answered with a one-use ticket for OpenSession (the engine reads the peer's
credentials, SO_PEERCRED, from the connection and gives them to the session the ticket opens);
the next request carries the session id and its secret token, and binds the connection to it.
Engine-owned objects (counter page, ring, output regions) are sealed against shrinking and
growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) and fetched by name: "counters", "ring",
"outputs/<group_id>".
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import mmap
import os
import socket
import struct
import threading

import grpc
from google.protobuf.message import DecodeError

from .errors import (
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    from_status_value,
)
from .v1 import epd_pb2

# fcntl's sealing constants (missing from Python's fcntl module before 3.8 / on some builds).
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
MFD_CLOEXEC = getattr(os, "MFD_CLOEXEC", 0x0001)
MFD_ALLOW_SEALING = getattr(os, "MFD_ALLOW_SEALING", 0x0002)
REQUEST_SECONDS = 60.0  # a client's longest wait for one answer on the descriptor channel

CLIENT_SEALS = F_SEAL_SHRINK  # client memory: the engine requires at least this
ENGINE_SEALS = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL  # engine-owned objects: fixed size
MAX_PACKET = 4096  # one FdRequest / FdResponse (they are tiny)
TOKEN_METADATA = "epd-session-token-bin"  # gRPC metadata key of the session token
SOCKET_SUFFIX = ".fds"

COUNTERS, RING, OUTPUTS = "counters", "ring", "outputs/"  # FetchFd names ("outputs/<gid>")


def socket_path_for(grpc_socket: str) -> str:
    """The descriptor channel beside an engine's gRPC socket (gpu0.sock -> gpu0.fds)."""
    base = grpc_socket[:-len(".sock")] if grpc_socket.endswith(".sock") else grpc_socket
    return base + SOCKET_SUFFIX


def create_memfd(name: str, size: int, seals: int) -> int:
    """A memfd of `size` bytes (zero-filled), sealed with `seals`; returns the descriptor."""
    fd = os.memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seals_of(fd: int) -> int:
    try:
        return fcntl.fcntl(fd, F_GET_SEALS)
    except OSError:  # not a memfd (a regular file, a pipe): no seals at all
        return 0


TMPFS_MAGIC = 0x01021994  # statfs f_type of shared memory (memfd_create without MFD_HUGETLB)
_libc = ctypes.CDLL(None, use_errno=True)


def filesystem_type(fd: int) -> int | None:
    """fstatfs(fd)'s f_type (None where the call is not there)."""
    buf = ctypes.create_string_buffer(256)  # (struct statfs is 120 bytes on 64-bit Linux)
    fstatfs = getattr(_libc, "fstatfs", None)
    if fstatfs is None or fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def check_shared_memory(fd: int, what: str = "memory") -> os.stat_result:
    """Refuse a descriptor that is not a regular file of plain shared memory (a memfd made
    without MFD_HUGETLB): InvalidArgument. Its stat. Such a descriptor's close never waits,
    which a socket's (SO_LINGER with unsent data) or a FUSE file's may: the engine screens a
    received descriptor so on the connection's own thread, before its event loop touches it."""
    st = os.fstat(fd)
    if not (st.st_mode & 0o170000) == 0o100000:
        raise InvalidArgument(f"{what}: the descriptor is not a memfd")
    kind = filesystem_type(fd)
    if kind is not None and kind != TMPFS_MAGIC:
        # A huge-page memfd (MFD_HUGETLB) passes every seal check, yet its client can punch
        # its pages out and take the pool's free pages: the engine's next read is a SIGBUS
        # that kills it and every tenant's sessions with it (a review).
        raise InvalidArgument(f"{what}: the memfd is not plain shared memory (filesystem "
                              f"{kind:#x}; a huge-page memfd, MFD_HUGETLB, can lose its pages "
                              f"under the engine): create it without MFD_HUGETLB")
    return st


def check_sealed(fd: int, size: int, seals: int = CLIENT_SEALS, what: str = "memory") -> None:
    """Refuse a descriptor that is not a sealed shared-memory object of at least `size` bytes
    (InvalidArgument naming the missing seal or the size)."""
    st = check_shared_memory(fd, what)
    have = seals_of(fd)
    missing = seals & ~have
    if missing:
        names = [n for n, v in (("F_SEAL_SHRINK", F_SEAL_SHRINK), ("F_SEAL_GROW", F_SEAL_GROW),
                                ("F_SEAL_SEAL", F_SEAL_SEAL)) if missing & v]
        raise InvalidArgument(f"{what}: the memfd is not sealed with {' | '.join(names)} "
                              f"(create it with MFD_ALLOW_SEALING and add the seal: a region "
                              f"that can shrink could crash the engine)")
    if st.st_size < size:
        raise InvalidArgument(f"{what}: the memfd has {st.st_size} bytes, fewer than the "
                              f"{size} declared")
    if have & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE) or fcntl.fcntl(fd, fcntl.F_GETFL) & \
            os.O_ACCMODE != os.O_RDWR:
        raise InvalidArgument(f"{what}: the memfd is not writable (sealed against writes, or "
                              f"opened read-only): the engine maps regions read-write")


def close_mapping(mm: mmap.mmap) -> bool:
    """Unmap, if no view exports the mapping; True when it is closed.

    Python's mmap keeps its own duplicate of the descriptor until it is closed, so a mapping
    that cannot be closed keeps a descriptor open. Views are often held only by reference
    cycles (an exception's traceback holds the frames whose locals view the mapping), which
    only the cycle collector frees: so a refused close collects once and tries again. A view
    still really in use keeps the mapping until it goes."""
    try:
        mm.close()
        return True
    except BufferError:
        gc.collect()
    try:
        mm.close()
        return True
    except BufferError:
        return False


def map_fd(fd: int, size: int) -> mmap.mmap:
    """A shared read-write mapping of `size` bytes of `fd` (the caller may close fd after)."""
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (SO_PEERCRED)."""
    # struct ucred: pid_t (signed), uid_t and gid_t (unsigned: a uid of 2**31 or more must not
    # read as negative, nor 2**32 - 1 as -1)
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, gid = struct.unpack("iII", raw)
    return pid, uid, gid


def send(sock: socket.socket, msg, fd: int | None = None) -> None:
    """One protobuf in one packet, with at most one descriptor (SCM_RIGHTS)."""
    data = msg.SerializeToString()
    if fd is None:
        sock.sendmsg([data])
    else:
        socket.send_fds(sock, [data], [fd])


def recv(sock: socket.socket, msg_type):
    """(message, descriptor or None); (None, None) at end of stream. Extra descriptors (a
    misbehaving peer) are closed."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_PACKET, 2)
    if not data and not fds:
        return None, None
    fd = fds[0] if fds else None
    for extra in fds[1:]:
        os.close(extra)
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise InvalidArgument("descriptor channel: packet or control data truncated")
        try:
            return msg_type.FromString(data), fd
        except DecodeError:
            raise InvalidArgument(f"descriptor channel: not a {msg_type.__name__} "
                                  f"({len(data)} bytes)") from None
    except BaseException:  # (the descriptor of a refused packet is nobody's: never kept)
        if fd is not None:
            os.close(fd)
        raise


class Channel:
    """The client end of an engine's descriptor channel, bound to one session: given its id
    and token, or later (`hello()` for the ticket OpenSession needs, then `bind()`). Every
    request waits at most `timeout` seconds for its answer (an engine alive but stopped must
    not hang the client). A request that does not get its answer (a timeout, or an exception
    such as KeyboardInterrupt between sending and reading) drops the connection, since a late
    answer would be taken for the next request's (a review: an interrupted registration gave
    the next one the earlier's region id, and a dispatch read the wrong memory); a bound
    channel connects again at its next request."""

    def __init__(self, path: str, session_id: str = "", token: bytes = b"",
                 timeout: float = REQUEST_SECONDS) -> None:
        self.path, self.session_id, self.token = path, session_id, token
        self.timeout = timeout
        self._lock = threading.Lock()  # one request/answer pair at a time
        self.sock: socket.socket | None = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise Unavailable(f"cannot connect to the descriptor channel {self.path}: "
                              f"{e}") from None
        return sock

    def request(self, req: epd_pb2.FdRequest, fd: int | None = None
                ) -> tuple[epd_pb2.FdResponse, int | None]:
        req.session_id, req.session_token = self.session_id, self.token
        if not self._lock.acquire(timeout=self.timeout):  # (another request's, at most its
            raise DeadlineExceeded(f"descriptor channel {self.path}: another request of this "
                                   f"process held it for {self.timeout:g} s")
        try:
            if self.sock is None:  # (an earlier request's answer never came: a new one)
                if not self.session_id:
                    raise Unavailable(f"descriptor channel {self.path}: an earlier request "
                                      f"was interrupted before the session was bound")
                self.sock = self._connect()
            answered = False
            try:
                send(self.sock, req, fd)
                resp, got = recv(self.sock, epd_pb2.FdResponse)
                answered = True
            finally:
                if not answered:  # (whatever stopped it: never read its answer as the next's)
                    self._drop()
        except TimeoutError:
            raise DeadlineExceeded(f"descriptor channel {self.path}: no answer within "
                                   f"{self.timeout:g} s (the next request connects again)"
                                   ) from None
        except OSError as e:
            raise Unavailable(f"descriptor channel {self.path}: {e}") from None
        finally:
            self._lock.release()
        if resp is None:
            raise Unavailable(f"descriptor channel {self.path}: the engine closed it")
        if resp.code:
            if got is not None:
                os.close(got)
            raise from_status_value(resp.code, resp.message)
        return resp, got

    def _drop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def hello(self) -> bytes:
        """The first request of an unbound connection: the engine's ticket for OpenSession
        (OpenSessionRequest.channel_ticket); then `bind()` to the session it opened."""
        try:
            resp, fd = self.request(epd_pb2.FdRequest(hello=epd_pb2.FdHello()))
        except EpdError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
            # An engine from before the hello reads it as a binding request naming no session
            raise FailedPrecondition(
                f"descriptor channel {self.path}: the engine does not know hello ({e.message}):"
                f" it is older than this client, which opens its session through the channel "
                f"first; run a daemon of this client's version") from None
        if fd is not None:
            os.close(fd)
        if not resp.ticket:
            raise EpdError(None, f"descriptor channel {self.path}: no ticket came with the "
                                 f"answer to hello")
        return resp.ticket

    def bind(self, session_id: str, token: bytes) -> None:
        """Every later request names this session (the next one binds the connection to it)."""
        self.session_id, self.token = session_id, token

    def fetch(self, name: str) -> tuple[int, int]:
        """(descriptor, size) of an engine-owned object; the caller maps and closes it."""
        resp, fd = self.request(epd_pb2.FdRequest(fetch=epd_pb2.FetchFd(name=name)))
        if fd is None:
            raise EpdError(None, f"descriptor channel: no descriptor came with {name!r}")
        return fd, resp.size_bytes

    def register(self, fd: int, size: int) -> str:
        """Register a sealed memfd as a region; returns its region id."""
        resp, extra = self.request(epd_pb2.FdRequest(
            register_memfd=epd_pb2.RegisterMemfd(size_bytes=size)), fd)
        if extra is not None:
            os.close(extra)
        return resp.region_id

    def close(self) -> None:
        self._drop()
