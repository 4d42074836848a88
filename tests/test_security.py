"""Issue 12, tenants cannot hurt each other (CPU backend): memory by descriptor, sealed; sessions
authenticated by a secret token and the peer's credentials; no client-supplied paths; no engine
files in the shm folder. The multi-user test (daemon as its own uid, two client uids, one
outsider) is tests/test_multi_user.py."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
from daemon_harness import memfds
from ranklib import Case, case_round, check_case, join

from epd.client import EpdError, Session
from epd.client.tensors import ShmFile
from epd.proto import fd_channel as fdc
from epd.proto.v1 import epd_pb2, epd_pb2_grpc

DENIED = grpc.StatusCode.PERMISSION_DENIED


def solo_case(group: str) -> Case:
    return Case(group=group, num_ranks=1, num_experts=4, hidden=128, num_topk=2, tokens=(12,),
                use_empty=True)


def solo_round(s: Session, group: str):
    c = solo_case(group)
    g = join(s, c, 0)
    check_case(c, [case_round(s, g, c, 0)])
    return g


def stub(daemon, engine: int = 0):
    ch = grpc.insecure_channel(f"unix://{daemon.socket(engine)}")
    return ch, epd_pb2_grpc.EngineStub(ch)


def token_md(s: Session) -> tuple[tuple[str, bytes], ...]:
    return ((fdc.TOKEN_METADATA, s._channel.token),)


# -- finding 1: nothing the engine maps can be truncated -----------------------------------------
def test_truncation_is_impossible_and_the_engine_survives(daemon) -> None:
    with Session(daemon.socket(0), timeout=10) as s:
        g = solo_round(s, "sec-truncate")
        assert s.transport == "fastpath"
        # The engine-owned objects, fetched again by descriptor: sealed, so truncation (and
        # growth) fails with EPERM, from the client side, whoever tries.
        for name in (fdc.COUNTERS, fdc.RING, f"{fdc.OUTPUTS}{g.group_id}"):
            fd, size = s._channel.fetch(name)
            try:
                assert size > 0
                for bad in (0, size // 2, size + 4096):
                    with pytest.raises(OSError) as ei:
                        os.ftruncate(fd, bad)
                    assert ei.value.errno == errno.EPERM, (name, bad)
            finally:
                os.close(fd)
        # The client's own memory: sealed against shrinking before it is sent.
        x = s.empty((64, 128), np.float32)
        f = ShmFile.create(1 << 16)
        try:
            with pytest.raises(OSError) as ei:
                os.ftruncate(f.fd, 0)
            assert ei.value.errno == errno.EPERM
        finally:
            f.close()
        # Unsealed memory (or a plain file) is refused, naming the seal.
        raw = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        try:
            os.ftruncate(raw, 4096)
            with pytest.raises(EpdError) as ei:
                s._channel.register(raw, 4096)
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "F_SEAL_SHRINK" in ei.value.details
            # The client truncates its unsealed memfd: nothing of the engine maps it.
            os.ftruncate(raw, 0)
        finally:
            os.close(raw)
        x[...] = 1
        s.ping()
        check_case(solo_case("sec-truncate"), [case_round(s, g, solo_case("sec-truncate"), 0)])
    assert daemon.get("/readyz")[0] == 200


# -- finding 2: session ids are not credentials ------------------------------------------------
def test_another_client_cannot_act_as_a_session(daemon) -> None:
    victim = Session(daemon.socket(0), timeout=10)
    thief = Session(daemon.socket(0), timeout=10)
    ch, engine = stub(daemon)
    try:
        g = solo_round(victim, "sec-victim")
        sid = victim.session_id
        calls = [
            ("LeaveGroup", epd_pb2.LeaveGroupRequest(session_id=sid, group_id=g.group_id)),
            ("GetStats", epd_pb2.GetStatsRequest(session_id=sid)),
            ("Dispatch", epd_pb2.DispatchRequest(session_id=sid, group_id=g.group_id)),
            ("OpenFastPath", epd_pb2.OpenFastPathRequest(session_id=sid)),
            ("UnregisterRegion", epd_pb2.UnregisterRegionRequest(session_id=sid, region_id="r")),
        ]
        for metadata in ((), token_md(thief), ((fdc.TOKEN_METADATA, b"x" * 32),)):
            for method, req in calls:
                with pytest.raises(grpc.RpcError) as ei:
                    getattr(engine, method)(req, timeout=10, metadata=metadata)
                assert ei.value.code() == DENIED, (method, ei.value.details())
                assert sid in ei.value.details()
                assert victim._channel.token.hex() not in ei.value.details()
        # The thief's own token works for its own session only.
        engine.GetStats(epd_pb2.GetStatsRequest(session_id=thief.session_id), timeout=10,
                        metadata=token_md(thief))
        # Without a session: engine-wide counts, no session's groups.
        anon = engine.GetStats(epd_pb2.GetStatsRequest(), timeout=10)
        assert anon.sessions >= 2 and list(anon.groups) == []
        # The descriptor channel: a victim's id with another token is refused, and the victim's
        # token from another process (other peer credentials) too.
        bad = fdc.Channel(fdc.socket_path_for(daemon.socket(0)), sid, thief._channel.token)
        try:
            with pytest.raises(EpdError) as ei:
                bad.fetch(fdc.COUNTERS)
            assert ei.value.code == DENIED
        finally:
            bad.close()
        script = ("import sys, json; from epd.proto import fd_channel as f\n"
                  "from epd.proto.errors import EpdError\n"
                  "c = f.Channel(sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]))\n"
                  "try:\n    c.fetch('outputs/' + sys.argv[4]); print('OK')\n"
                  "except EpdError as e:\n    print(e.code.name)\n")
        out = subprocess.run([sys.executable, "-c", script, fdc.socket_path_for(daemon.socket(0)),
                              sid, victim._channel.token.hex(), g.group_id],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "PERMISSION_DENIED", out
        # The victim is untouched.
        stats = victim.stats()
        assert [x.group_id for x in stats.groups] == [g.group_id]
        check_case(solo_case("sec-victim"), [case_round(victim, g, solo_case("sec-victim"), 0)])
    finally:
        ch.close()
        thief.close()
        victim.close()


# -- finding 4: no client-supplied paths ---------------------------------------------------------
def test_a_client_name_cannot_forge_log_lines(daemon, monkeypatch) -> None:
    """The client's name goes into the engine's log lines and into the abort reasons other
    tenants read: control characters become "?" (a review forged a log line with a newline),
    and the pid shown is the descriptor channel's (SO_PEERCRED), not the one the client
    claims (OpenSessionRequest.pid, forged here)."""
    import types

    from epd.client import session as client_session

    forged = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os)
                                      if not k.startswith("__")})
    forged.getpid = lambda: 4242  # (OpenSession's pid; the socket's credentials stay real)
    monkeypatch.setattr(client_session, "os", forged)
    with Session(daemon.socket(0), client_name="evil\nINFO epd.engine: forged line") as s:
        sid = s.session_id
    monkeypatch.undo()
    text = daemon.log()
    assert not any(line.startswith("INFO epd.engine: forged") for line in text.splitlines())
    opened = next(line for line in text.splitlines() if f"opened session {sid}" in line)
    assert f"(evil?INFO epd.engine: forged line, pid {os.getpid()})" in opened, opened


def test_register_region_takes_no_path(daemon) -> None:
    assert "shm_path" not in epd_pb2.RegisterRegionRequest.DESCRIPTOR.fields_by_name
    with Session(daemon.socket(0), timeout=10) as s:
        ch = grpc.insecure_channel(f"unix://{daemon.socket(0)}")
        try:
            raw = ch.unary_unary("/epd.v1.Engine/RegisterRegion",
                                 request_serializer=lambda b: b,
                                 response_deserializer=epd_pb2.RegisterRegionResponse.FromString)
            # An old client's request: field 2 (shm_path) naming a daemon-only file.
            req = epd_pb2.RegisterRegionRequest(session_id=s.session_id, size_bytes=16)
            path = b"/etc/shadow"
            data = req.SerializeToString() + b"\x12" + bytes([len(path)]) + path
            with pytest.raises(grpc.RpcError) as ei:
                raw(data, timeout=10, metadata=token_md(s))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
            assert "descriptor channel" in ei.value.details()
        finally:
            ch.close()
        assert s.stats().regions == 0  # nothing was opened


# -- findings 2 and 3: no session ids in names, nothing in the shm folder ---------------------
def test_no_engine_files_and_no_session_ids_in_names(daemon) -> None:
    with Session(daemon.socket(0), timeout=10) as s:
        g = solo_round(s, "sec-names")
        s.empty((16, 16), np.float32)
        assert os.listdir(daemon.shm_dir) == []
        for root, _dirs, files in os.walk("/dev/shm"):
            for f in files:
                assert s.session_id not in f and g.group_id not in f, os.path.join(root, f)
        pid = daemon.engine_pid(0)
        names = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in memfds(pid, "epd-")]
        assert names and not [n for n in names if s.session_id in n]
        fds = fdc.socket_path_for(daemon.socket(0))
        assert oct(os.stat(fds).st_mode & 0o777) == oct(os.stat(daemon.socket(0)).st_mode & 0o777)
        assert os.stat(fds).st_mode & 0o007 == 0  # no access for other users


def test_descriptor_channel_drops_a_silent_connection(daemon) -> None:
    """A connection to the descriptor channel that never authenticates is closed by the engine
    (each costs it a thread), and the engine keeps serving sessions meanwhile."""
    import socket
    import time

    from epd.server.engine.fd_server import FIRST_REQUEST_SECONDS

    idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    idle.connect(fdc.socket_path_for(daemon.socket(0)))
    idle.settimeout(FIRST_REQUEST_SECONDS + 10)
    try:
        t0 = time.monotonic()
        with Session(daemon.socket(0), timeout=10) as s:  # others are served meanwhile
            solo_round(s, "sec-idle-channel")
        try:
            closed = idle.recv(16) == b""
        except ConnectionResetError:
            closed = True
        waited = time.monotonic() - t0
    finally:
        idle.close()
    assert closed, "the engine kept a silent descriptor-channel connection"
    assert FIRST_REQUEST_SECONDS - 1 <= waited <= FIRST_REQUEST_SECONDS + 5, waited


def test_the_descriptor_channel_waits_a_bounded_time_for_an_answer(tmp_path) -> None:
    """An engine that accepts the channel and never answers (stopped, stuck) must not hang the
    client: the request fails DEADLINE_EXCEEDED after the channel's timeout, and its connection,
    whose late answer would pair with the next request, is closed: the next request connects
    anew (here the server stays silent, so it times out too)."""
    import socket
    import threading
    import time

    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    accepted: list[socket.socket] = []
    t = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
    t.start()
    try:
        ch = fdc.Channel(path, "session", b"token", timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(EpdError) as ei:
            ch.fetch("counters")
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
        assert time.monotonic() - t0 < 2.0
        assert ch.sock is None  # (dropped: its late answer is never read)
        assert accepted[0].recv(4096) and accepted[0].recv(4096) == b""  # (the request; EOF)
        with pytest.raises(EpdError) as again:
            ch.fetch("counters")
        assert again.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, again.value
    finally:
        t.join(5)
        for s in (*accepted, server):
            s.close()


def test_a_malformed_packet_with_a_descriptor_leaks_nothing(daemon) -> None:
    """Anyone who can connect to an engine's descriptor channel (before any session token):
    a packet that is not an FdRequest, with a memfd attached, is answered INVALID_ARGUMENT and
    its descriptor closed (each one was kept open by the engine, with the memory behind it)."""
    import socket

    pid = daemon.engine_pid(0)

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))
    before = open_fds()
    for _ in range(20):  # (a connection refused at its first packet is closed: one each)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(fdc.socket_path_for(daemon.socket(0)))
            mfd = os.memfd_create("epd-test-junk", os.MFD_CLOEXEC)
            try:
                socket.send_fds(s, [b"\xff\xff\xff"], [mfd])
            finally:
                os.close(mfd)
            resp, fd = fdc.recv(s, epd_pb2.FdResponse)
            assert fd is None and resp.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp
            assert fdc.recv(s, epd_pb2.FdResponse) == (None, None)  # then closed
    assert open_fds() <= before + 2  # (not one per packet)


def _closed_within(s, seconds: float) -> bool:
    """Whether the engine closes its end of `s` within `seconds`."""
    s.settimeout(seconds)
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@contextlib.contextmanager
def _silent_connections(path: str, n: int):
    """`n` descriptor-channel connections that never speak, held for the block."""
    import socket
    import time

    held: list[socket.socket] = []
    try:
        for _ in range(n):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            held.append(c)
            c.connect(path)
        time.sleep(0.3)  # (the engine accepts them in its own thread)
        yield
    finally:
        for c in held:
            c.close()


def _next_connection_closed(path: str, seconds: float) -> bool:
    """Whether the engine closes one more connection within `seconds`."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as extra:
        extra.connect(path)
        return _closed_within(extra, seconds)


def test_a_connection_refused_at_authentication_is_closed(daemon) -> None:
    """The descriptor channel answers a first request with a wrong token and closes the
    connection: an unauthenticated connection cannot stay open by sending bad requests (each
    one restarted its first-request timer before)."""
    import socket

    with Session(daemon.socket(0), timeout=10) as victim, \
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(fdc.socket_path_for(daemon.socket(0)))
        fdc.send(s, epd_pb2.FdRequest(session_id=victim.session_id, session_token=b"x" * 32,
                                      fetch=epd_pb2.FetchFd(name="counters")))
        resp, fd = fdc.recv(s, epd_pb2.FdResponse)
        assert fd is None and resp.code == DENIED.value[0], resp
        assert _closed_within(s, 5.0)
        solo_round(victim, "sec-refused-channel")  # the session it named is untouched


def test_unauthenticated_channel_connections_are_capped_per_uid(daemon) -> None:
    """One uid holds at most MAX_UNBOUND_PER_UID descriptor-channel connections that have not
    authenticated: the next is closed at once (not after the first-request timeout), so one
    tenant's silent connections cannot fill the engine-wide cap; closed, they free the slots."""
    import time

    from epd.server.engine.fd_server import FIRST_REQUEST_SECONDS, MAX_UNBOUND_PER_UID

    path = fdc.socket_path_for(daemon.socket(0))
    with _silent_connections(path, MAX_UNBOUND_PER_UID):
        t0 = time.monotonic()
        assert _next_connection_closed(path, FIRST_REQUEST_SECONDS / 2)
        assert time.monotonic() - t0 < FIRST_REQUEST_SECONDS / 2
    deadline = time.monotonic() + 10
    while True:  # the engine notices the closed ones shortly
        try:
            with Session(daemon.socket(0), timeout=10) as s:
                solo_round(s, "sec-unbound-cap")
            break
        except EpdError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_one_uid_holds_at_most_its_share_of_channel_connections(daemon_factory) -> None:
    """All of one uid's descriptor-channel connections, authenticated or not, are capped
    (fd_server.per_uid_cap: two per session the uid may open, at least the unauthenticated
    cap): before, four uids at their session and unauthenticated caps filled the engine's
    1,024 and locked every other tenant out. Here (2 sessions a uid: 64) a session's own
    connection and 63 silent ones are the uid's whole share; the next is closed at once, and
    the session goes on."""

    from epd.server.engine.fd_server import (
        FIRST_REQUEST_SECONDS,
        MAX_CONNECTIONS,
        MAX_UNBOUND_PER_UID,
        per_uid_cap,
    )

    assert per_uid_cap(64) == MAX_CONNECTIONS // 8 and per_uid_cap(0) == MAX_CONNECTIONS
    cap = per_uid_cap(2)
    assert cap == MAX_UNBOUND_PER_UID  # (so the unauthenticated cap alone would let one more)
    with daemon_factory(engines=1, extra=["--max-sessions-per-uid", "2"]) as d, \
            Session(d.socket(0), timeout=10) as s:
        solo_round(s, "sec-uid-share")  # (its channel connection is bound)
        path = fdc.socket_path_for(d.socket(0))
        with _silent_connections(path, cap - 1):
            assert _next_connection_closed(path, FIRST_REQUEST_SECONDS / 2)
            solo_round(s, "sec-uid-share-after")


def test_a_session_has_a_bounded_number_of_channel_connections(daemon) -> None:
    """A session's client keeps one descriptor-channel connection; more authenticate up to
    MAX_PER_SESSION and the next is RESOURCE_EXHAUSTED (and closed)."""
    from epd.server.engine.fd_server import MAX_PER_SESSION

    with Session(daemon.socket(0), timeout=10) as s:
        solo_round(s, "sec-session-channels")  # (its own connection is bound)
        path = fdc.socket_path_for(daemon.socket(0))
        extra = [fdc.Channel(path, s.session_id, s._channel.token) for _ in range(MAX_PER_SESSION)]
        try:
            for i, ch in enumerate(extra):
                if i < MAX_PER_SESSION - 1:
                    fd, _size = ch.fetch(fdc.COUNTERS)
                    os.close(fd)
                else:
                    with pytest.raises(EpdError) as ei:
                        ch.fetch(fdc.COUNTERS)
                    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
                    assert str(MAX_PER_SESSION) in ei.value.message
        finally:
            for ch in extra:
                ch.close()
        solo_round(s, "sec-session-channels-after")


def test_a_drain_refusal_on_a_ring_names_only_its_own_session() -> None:
    """While the engine drains, a collective refused on the fast path aborts the group it
    names (its peers would wait for it otherwise): the ring's ownership is checked first, so
    a request on one session's ring naming another session's group aborts nothing
    (PERMISSION_DENIED)."""
    import threading
    import types

    from epd.proto import operations
    from epd.server.engine.core import Engine
    from epd.server.engine.executor import EngineState
    from epd.server.engine.fast_path import FastPathServer

    aborted: list[str] = []

    def session(sid: str, gid: str):
        comm = types.SimpleNamespace(abort_reason=lambda: None, known_abort_reason=lambda: None,
                                     abort=aborted.append, supports_rank_masking=False)
        member = types.SimpleNamespace(rank=0, comm=comm,
                                       spec=types.SimpleNamespace(name=gid, shrink=False))
        ex = types.SimpleNamespace(op_lock=threading.Lock(), closing=None)
        return types.SimpleNamespace(session_id=sid, members={gid: member}, executor=ex,
                                     op_lock=ex.op_lock, closed=threading.Event(),
                                     describe=lambda: sid)
    engine = Engine.__new__(Engine)  # (only what refuse() and session() read)
    engine.index = 0
    engine.state = EngineState(0)
    engine.state.draining = True
    engine._abort = lambda m, text, why: m.comm.abort(text)
    victim, thief = session("victim", "g-victim"), session("thief", "g-thief")
    engine.sessions = {"victim": victim, "thief": thief}
    fp = FastPathServer.__new__(FastPathServer)
    fp.engine, fp.session = engine, thief
    fp._ops = {rid: (op, None) for rid, op in operations.BY_RING_ID.items()}
    fp.ring = types.SimpleNamespace(capacity=4096)
    rid = operations.OPERATIONS["Dispatch"].ring_id
    req = epd_pb2.DispatchRequest(session_id="victim", group_id="g-victim")
    code, message = fp._handle(rid, req.SerializeToString(), lambda *a: None)
    assert code == DENIED.value[0] and b"does not own this ring" in message, (code, message)
    assert aborted == []
    # The thief's own group, refused while draining, is aborted as before.
    req = epd_pb2.DispatchRequest(session_id="thief", group_id="g-thief")
    code, message = fp._handle(rid, req.SerializeToString(), lambda *a: None)
    assert code == grpc.StatusCode.UNAVAILABLE.value[0], (code, message)
    assert len(aborted) == 1 and "g-thief" in aborted[0]


def test_registrations_at_once_cannot_pass_the_region_budget_together() -> None:
    """RegisterRegion checks the session's budget, then awaits the open on the session's
    worker: registrations in flight count against the budget, so calls at once cannot all
    pass the check (five at once with room for two: two regions, three RESOURCE_EXHAUSTED);
    one that finishes after its session closed is closed, not kept."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from epd.server.engine.core import Engine

    opened: list[str] = []
    closed: list[str] = []

    def open_region(rid: str, **_kw):
        time.sleep(0.2)
        opened.append(rid)
        return SimpleNamespace(region_id=rid, size=1024, borrowed=False,
                               close=lambda: closed.append(rid))

    async def run(fn, discard=None):  # (SessionExecutor.run: discard is for cancelled calls)
        return await asyncio.to_thread(fn)
    session = SimpleNamespace(regions={}, registering={}, members={}, joining={},
                              fast_path=None, teardown_done=False, describe=lambda: "session s",
                              executor=SimpleNamespace(run=run, closing=None),
                              op_lock=threading.Lock())
    engine = Engine.__new__(Engine)  # (only what register_region reads)
    engine.config = SimpleNamespace(max_regions_per_session=2,
                                    max_region_bytes_per_session=1 << 40)
    engine.backend = SimpleNamespace(open_region=open_region, output_bytes=lambda spec: 0)
    engine._refresh_gauges = lambda: None
    req = epd_pb2.RegisterRegionRequest(session_id="s", cuda_ipc_handle=b"h" * 64,
                                        size_bytes=1024)

    async def five():
        return await asyncio.gather(*(engine.register_region(session, req) for _ in range(5)),
                                    return_exceptions=True)
    out = asyncio.run(five())
    ok = [r for r in out if not isinstance(r, BaseException)]
    refused = [r for r in out if isinstance(r, EpdError)]
    assert len(ok) == 2 and len(refused) == 3, out
    assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), refused
    assert len(session.regions) == 2 and session.registering == {}

    async def closing():
        task = asyncio.ensure_future(engine.register_region(session, req))
        await asyncio.sleep(0.05)
        session.teardown_done = True
        return await asyncio.gather(task, return_exceptions=True)
    session.regions.clear()
    (late,) = asyncio.run(closing())
    assert isinstance(late, EpdError) and late.code == grpc.StatusCode.ABORTED, late
    assert closed == [opened[-1]] and session.regions == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="takes another uid (needs root)")
def test_peer_credentials_of_a_uid_above_two_to_the_31() -> None:
    """SO_PEERCRED's uid_t and gid_t are unsigned: a client of uid 3,000,000,000 read as a
    negative number, which matched no --allow-uids entry nor @UID rule (and uid 2**32 - 1
    would have read as the coordinator's shared namespace, -1)."""
    import socket as S

    from epd.proto import fd_channel as fdc

    big = 3_000_000_000
    name = f"\0epd-test-peercred-{os.getpid()}"  # (abstract: no file, no permissions)
    with S.socket(S.AF_UNIX, S.SOCK_SEQPACKET) as server:
        server.bind(name)
        server.listen(1)
        pid = os.fork()
        if pid == 0:  # the child: another uid and gid, then connect and wait to be read
            try:
                os.setgid(big + 1)
                os.setuid(big)
                c = S.socket(S.AF_UNIX, S.SOCK_SEQPACKET)
                c.connect(name)
                c.recv(1)
            finally:
                os._exit(0)
        try:
            server.settimeout(10)
            conn, _ = server.accept()
            with conn:
                got = fdc.peer_credentials(conn)
                conn.send(b"x")
        finally:
            os.waitpid(pid, 0)
    assert got == (pid, big, big + 1), got


def test_an_interrupted_channel_request_never_answers_the_next(daemon, monkeypatch) -> None:
    """An exception between a channel request's send and its answer (Ctrl-C, an alarm) left
    the answer queued, and every later request read the one before it: the next registration
    got the interrupted one's region id, and a dispatch read the wrong memory (a review). The
    connection is dropped instead; the next request connects again, bound to the session."""
    from epd.server import reference as ref

    real_recv = fdc.recv
    calls = {"n": 0}

    def interrupted_once(sock, msg_type):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real_recv(sock, msg_type)

    c = Case("sec-interrupted", 1, 4, 128, 2, (6,), max_tokens=8)
    with Session(daemon.socket(0), timeout=10) as s:
        g = join(s, c, 0, timeout=10)
        monkeypatch.setattr(fdc, "recv", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            s.empty((4,), np.float32)
        monkeypatch.setattr(fdc, "recv", real_recv)
        inp = c.inputs(0)
        x = s.empty(inp["x"].shape, inp["x"].dtype)
        x[...] = inp["x"]
        out = g.dispatch(x, inp["topk_idx"], inp["topk_weights"])
        want = ref.dispatch([inp["x"]], [inp["topk_idx"]], [inp["topk_weights"]],
                            c.num_experts)[0]
        np.testing.assert_array_equal(np.asarray(out.recv_x), want.recv_x)


def test_a_lingering_socket_sent_as_a_region_stops_no_other_session(daemon) -> None:
    """A client sends, as a register_memfd's memfd, the last reference to a TCP socket with
    SO_LINGER and unsent data its peer never reads, whose close waits out the linger time.
    The engine refuses it (INVALID_ARGUMENT: not a memfd) and closes it on that connection's
    own thread: another session's calls meanwhile are answered at once (before, its event
    loop made that close, and every session of the engine waited; a fuzzer found it). A
    descriptor with any other request is refused the same way."""
    import socket
    import struct
    import threading
    import time

    linger = 4
    with Session(daemon.socket(0), client_name="attacker", timeout=30) as s, \
            Session(daemon.socket(0), client_name="bystander", timeout=30) as other, \
            socket.socket() as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        c = socket.create_connection(lst.getsockname())
        peer, _ = lst.accept()  # (never reads)
        with peer:
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    c.send(b"x" * 65536)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger))
            got: dict = {}
            ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            ch.settimeout(30)
            ch.connect(fdc.socket_path_for(daemon.socket(0)))

            def attack() -> None:
                fdc.send(ch, epd_pb2.FdRequest(
                    session_id=s.session_id, session_token=s._channel.token,
                    register_memfd=epd_pb2.RegisterMemfd(size_bytes=4096)), c.fileno())
                c.close()  # (the engine holds the last reference now)
                got["resp"] = fdc.recv(ch, epd_pb2.FdResponse)
            th = threading.Thread(target=attack)
            th.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            for i in range(3):
                other.stats()
                solo_round(other, f"lingering-bystander-{i}")
            assert time.monotonic() - t0 < linger - 1, time.monotonic() - t0
            th.join(30)
            ch.close()
        resp, fd = got["resp"]
        assert fd is None and resp.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp
        assert "not a memfd" in resp.message, resp.message
        # A descriptor with a fetch: refused as well, nothing fetched.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ch2:
            ch2.settimeout(10)
            ch2.connect(fdc.socket_path_for(daemon.socket(0)))
            mfd = os.memfd_create("epd-test-fetch", os.MFD_CLOEXEC)
            try:
                fdc.send(ch2, epd_pb2.FdRequest(
                    session_id=s.session_id, session_token=s._channel.token,
                    fetch=epd_pb2.FetchFd(name=fdc.COUNTERS)), mfd)
            finally:
                os.close(mfd)
            resp, fd = fdc.recv(ch2, epd_pb2.FdResponse)
            assert fd is None and resp.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp
        assert s.stats().regions == 0
        solo_round(s, "lingering-attacker-after")
