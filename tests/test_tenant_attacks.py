"""A hostile local tenant with a valid session of its own (CPU backend): what test_security,
test_validation, test_fuzz and test_fast_path do not reach. Each test failed before its fix."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import ranklib

from epd.client import Session
from epd.proto import fd_channel as fdc
from epd.proto import ring as R
from epd.proto.errors import EpdError
from epd.proto.v1 import epd_pb2, epd_pb2_grpc

pytestmark = pytest.mark.slow
BUDGET = 8 << 20  # --max-region-bytes-per-session of the daemons below


def test_a_fast_path_ring_counts_against_the_sessions_bytes(daemon_factory) -> None:
    """OpenFastPath sizes the ring from the request (up to 1,024 slots of 1 MiB): an engine
    memfd its client maps read-write and can fill, which no budget counted, so a session of
    an 8 MiB --max-region-bytes-per-session made the engine hold 1 GiB."""
    with (daemon_factory(engines=1, extra=["--max-region-bytes-per-session", str(BUDGET)])
          as d, Session(d.socket(0), fast_path=False) as s):
        big = epd_pb2.OpenFastPathRequest(session_id=s.session_id, slots=R.MAX_SLOTS,
                                          slot_bytes=R.MAX_SLOT_BYTES)
        with pytest.raises(EpdError) as ei:
            s._transport.call("OpenFastPath", big, 10)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert "--max-region-bytes-per-session" in ei.value.message
        # (refused, it changed nothing: a ring within the budget opens, and its bytes count)
        s._transport.call("OpenFastPath", epd_pb2.OpenFastPathRequest(
            session_id=s.session_id, slots=4, slot_bytes=1 << 20), 10)
        with pytest.raises(EpdError) as ei:
            s.empty((BUDGET - (2 << 20),), "uint8")
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        s.empty((BUDGET - (6 << 20),), "uint8")


class _TicketEngine:
    """An engine as far as a descriptor-channel hello reaches it (its tickets), whose issue
    may stall the event loop `stall` seconds."""

    def __init__(self, stall: float = 0.0, serves: bool = True) -> None:
        self.tickets: dict[bytes, object] = {}
        self.stall = stall
        self._serves = serves

    def serves(self, uid: int, gid: int) -> bool:  # (Engine.serves: its tenant pool's uids)
        return self._serves

    def issue_ticket(self, ticket, peer, alive) -> None:
        time.sleep(self.stall)
        self.tickets[ticket] = peer

    def withdraw_ticket(self, ticket) -> None:
        self.tickets.pop(ticket, None)


def _hello(path: str) -> tuple[socket.socket, bytes]:
    """A descriptor-channel connection that said hello (never bound), and its ticket."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.settimeout(10)
    try:
        c.connect(path)
        fdc.send(c, epd_pb2.FdRequest(hello=epd_pb2.FdHello()))
        resp, fd = fdc.recv(c, epd_pb2.FdResponse)
        assert fd is None and resp.code == 0 and len(resp.ticket) >= 16, resp
    except BaseException:
        c.close()
        raise
    return c, resp.ticket


class _Opens:
    """OpenSession as a hostile client makes it (raw gRPC, any channel_ticket); the streams of
    the sessions it opened stay open (their leases) until close()."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(f"unix://{endpoint}")
        self.stub = epd_pb2_grpc.EngineStub(self.channel)
        self.held: list = []

    def open(self, ticket: bytes) -> tuple[grpc.StatusCode, str]:
        """(OK, session id) or the refusal's (code, details)."""
        stream = self.stub.OpenSession(epd_pb2.OpenSessionRequest(
            client_name="squatter", pid=os.getpid(), channel_ticket=ticket), timeout=120)
        try:
            first = next(stream)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        self.held.append(stream)
        assert first.HasField("opened"), first
        return grpc.StatusCode.OK, first.opened.session_id

    def close(self) -> None:
        for stream in self.held:
            stream.cancel()
        self.channel.close()


def _sessions(s: Session, want: int) -> int:
    """The engine's count of sessions (GetStats), once it is `want` (a lease that ended is torn
    down a moment later), or as it is after a bounded wait."""
    with contextlib.suppress(TimeoutError):
        ranklib.wait_until(lambda: s.stats().sessions == want, 5, f"{want} sessions")
    return s.stats().sessions


def test_one_uid_cannot_hold_all_of_an_engines_sessions(daemon_factory) -> None:
    """--max-sessions-per-uid: a uid's sessions beyond the cap are refused by OpenSession
    (the engine knows the uid from the ticket of the client's descriptor-channel hello),
    naming the flag; the engine's other places stay for other tenants, and a closed session
    frees its place."""
    with daemon_factory(engines=1, extra=["--max-sessions", "8",
                                          "--max-sessions-per-uid", "2"]) as d:
        held = [Session(d.socket(0), timeout=5) for _ in range(2)]
        try:
            with pytest.raises(EpdError) as err:
                Session(d.socket(0), timeout=5)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "--max-sessions-per-uid" in err.value.message
            assert f"uid {os.getuid()} holds 2 sessions" in err.value.message
            held.pop().close()
            deadline = time.monotonic() + 10  # (the engine ends it when it sees the lease go)
            while held[0].stats().sessions > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            with Session(d.socket(0), timeout=5) as again:
                again.ping()
            for s in held:
                s.ping()  # (untouched)
        finally:
            for s in held:
                s.close()


def test_open_session_needs_a_ticket_of_the_clients_channel(daemon_factory) -> None:
    """A session's uid was known only once its descriptor channel connected, after
    OpenSession: a session opened and never bound had no uid, escaped --max-sessions-per-uid
    and held a place of --max-sessions. OpenSession now needs the ticket of a hello on the
    channel (which gives the session its uid before it exists): without one, with a made-up
    one, or with one already used it is PERMISSION_DENIED, saying what to do, and opens
    nothing."""
    with daemon_factory(engines=1) as d, Session(d.socket(0), timeout=5) as legit:
        path = fdc.socket_path_for(d.socket(0))
        raw = _Opens(d.socket(0))
        try:
            for ticket in (b"", secrets.token_bytes(16), b"x"):
                code, details = raw.open(ticket)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (ticket, code, details)
                assert path in details and "hello" in details, details
            assert _sessions(legit, 1) == 1
            conn, ticket = _hello(path)
            try:
                code, _ = raw.open(ticket)
                assert code == grpc.StatusCode.OK  # (a hostile client's own session: one)
                code, details = raw.open(ticket)  # used: it opens no second one
                assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
            finally:
                conn.close()
            assert _sessions(legit, 2) == 2
            legit.ping()
        finally:
            raw.close()


def test_a_ticket_dies_with_its_connection(daemon_factory) -> None:
    """A ticket opens a session only while the connection that got it is open: one closed by
    its client is dead at once, one that does not bind within FIRST_REQUEST_SECONDS of its
    hello is closed by the engine, and a second hello closes its connection (tickets cannot
    pile up beyond the connections a uid may hold unbound)."""
    from epd.server.engine.fd_server import FIRST_REQUEST_SECONDS
    with daemon_factory(engines=1) as d, Session(d.socket(0), timeout=5) as legit:
        path = fdc.socket_path_for(d.socket(0))
        raw = _Opens(d.socket(0))
        try:
            conn, closed = _hello(path)
            conn.close()
            code, details = raw.open(closed)  # (at once: no wait for the engine to notice)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)

            twice, ticket = _hello(path)
            with twice:
                fdc.send(twice, epd_pb2.FdRequest(hello=epd_pb2.FdHello()))
                resp, _ = fdc.recv(twice, epd_pb2.FdResponse)
                assert resp.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp
                assert fdc.recv(twice, epd_pb2.FdResponse) == (None, None)  # closed
            assert raw.open(ticket)[0] == grpc.StatusCode.PERMISSION_DENIED

            idle, ticket = _hello(path)
            with idle:
                t0 = time.monotonic()
                idle.settimeout(FIRST_REQUEST_SECONDS + 10)
                with contextlib.suppress(ConnectionResetError):  # (or closed: reset)
                    assert idle.recv(16) == b""
                assert time.monotonic() - t0 <= FIRST_REQUEST_SECONDS + 5
            assert raw.open(ticket)[0] == grpc.StatusCode.PERMISSION_DENIED
            assert _sessions(legit, 1) == 1
        finally:
            raw.close()


def test_a_connection_waits_for_the_session_its_ticket_opened(daemon_factory) -> None:
    """The bind window after a hello (FIRST_REQUEST_SECONDS) ends once the ticket opens a
    session: the client binds when OpenSession's answer reaches it, however late (a stalled
    loop, a slow client), for as long as that session is open; once the session ends, the
    connection that never bound is closed."""
    from epd.server.engine.fd_server import FIRST_REQUEST_SECONDS
    with daemon_factory(engines=1) as d:
        path = fdc.socket_path_for(d.socket(0))
        channel = grpc.insecure_channel(f"unix://{d.socket(0)}")
        stub = epd_pb2_grpc.EngineStub(channel)
        late, ticket = _hello(path)
        idle, idle_ticket = _hello(path)
        try:
            opened = []
            streams = []
            for t in (ticket, idle_ticket):
                streams.append(stub.OpenSession(epd_pb2.OpenSessionRequest(
                    client_name="late-binder", pid=os.getpid(), channel_ticket=t), timeout=120))
                opened.append(next(streams[-1]).opened)
            time.sleep(FIRST_REQUEST_SECONDS + 2)  # (the answer reached the client this late)
            fdc.send(late, epd_pb2.FdRequest(session_id=opened[0].session_id,
                                             session_token=opened[0].session_token,
                                             fetch=epd_pb2.FetchFd(name=fdc.COUNTERS)))
            resp, fd = fdc.recv(late, epd_pb2.FdResponse)
            assert resp.code == 0 and fd is not None, resp
            os.close(fd)
            streams[1].cancel()  # the idle one's session ends: its connection goes
            t0 = time.monotonic()
            idle.settimeout(FIRST_REQUEST_SECONDS + 10)
            with contextlib.suppress(ConnectionResetError):
                assert idle.recv(16) == b""
            assert time.monotonic() - t0 <= FIRST_REQUEST_SECONDS + 5
        finally:
            for c in (late, idle):
                c.close()
            channel.close()


def test_a_hello_binds_its_connection_to_its_own_session(daemon_factory) -> None:
    """The connection that got a ticket binds only to the session that ticket opened (with
    that session's token): not to another session of the same process, whose token it has."""
    with daemon_factory(engines=1) as d:
        path = fdc.socket_path_for(d.socket(0))
        raw = _Opens(d.socket(0))
        a, ticket_a = _hello(path)
        b, _ticket_b = _hello(path)
        try:
            code, sid = raw.open(ticket_a)
            assert code == grpc.StatusCode.OK, sid
            with Session(d.socket(0), timeout=5) as other:  # (a session of this process)
                fdc.send(b, epd_pb2.FdRequest(session_id=other.session_id,
                                              session_token=other._channel.token,
                                              fetch=epd_pb2.FetchFd(name=fdc.COUNTERS)))
                resp, fd = fdc.recv(b, epd_pb2.FdResponse)
                assert fd is None and resp.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
                assert "ticket" in resp.message, resp
                other.ping()
        finally:
            raw.close()
            a.close()
            b.close()


def test_a_sessions_channel_connections_end_with_it(daemon_factory) -> None:
    """A connection bound to a session stayed open after the session ended: until its idle
    check (30 s), or for good while its client kept sending requests (each answered
    NOT_FOUND). So one uid, opening and closing sessions and keeping their connections, held
    connections beyond --max-sessions-per-uid and its unbound cap, up to the engine's 1,024:
    every other tenant's next session (which connects the channel first) was refused. They
    are closed with their session."""
    with daemon_factory(engines=1) as d:
        path = fdc.socket_path_for(d.socket(0))
        s = Session(d.socket(0), timeout=5)
        kept = [fdc.Channel(path, s.session_id, s._channel.token, timeout=5) for _ in range(2)]
        try:
            for ch in kept:  # (bound: the session's, as its client's own)
                fd, _ = ch.fetch(fdc.COUNTERS)
                os.close(fd)
            s.close()
            idle, busy = kept
            deadline = time.monotonic() + 5
            answers = []
            while time.monotonic() < deadline:  # a client that keeps asking
                try:
                    fd, _ = busy.fetch(fdc.COUNTERS)
                    os.close(fd)
                    answers.append("OK")
                except EpdError as e:
                    answers.append(e.code.name)
                    if e.code == grpc.StatusCode.UNAVAILABLE:  # (closed by the engine)
                        break
                time.sleep(0.5)
            assert answers[-1] == "UNAVAILABLE", answers
            idle.sock.settimeout(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):  # (or closed: reset)
                assert idle.sock.recv(16) == b""  # (socket.timeout: still open)
        finally:
            s.close()
            for ch in kept:
                ch.close()


OTHER_TENANT = 41031  # a uid of no one (run by the test, as root, in the socket's group)
TENANT = r"""
import json, sys
from epd.client import EpdError, Session
held = []
for _ in sys.stdin:  # a line: open one more session (and keep it), say how it went
    try:
        held.append(Session(sys.argv[1], timeout=5))
        held[-1].ping()
        print(json.dumps({"code": "OK"}), flush=True)
    except EpdError as e:
        print(json.dumps({"code": e.code.name, "details": e.message}), flush=True)
for s in held:
    s.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runs the other tenant as its uid)")
def test_a_flood_of_one_uid_leaves_other_tenants_their_places(daemon_factory) -> None:
    """One uid floods the engine without pause: OpenSessions without a ticket or with made-up
    ones, then also every descriptor-channel connection it may hold unbound, each with a
    ticket, and sessions up to --max-sessions-per-uid. Another uid's sessions still open, at
    once (before, the flood's sessions, opened and never bound, filled --max-sessions, and a
    flood faster than their 2 s grace refused every other tenant)."""
    from test_multi_user import become

    from epd.server.engine.fd_server import MAX_UNBOUND_PER_UID
    with daemon_factory(engines=1, extra=["--max-sessions", "4",
                                          "--max-sessions-per-uid", "2"]) as d:
        path = fdc.socket_path_for(d.socket(0))
        tenant = subprocess.Popen(
            [sys.executable, "-c", TENANT, d.socket(0)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=become(OTHER_TENANT, OTHER_TENANT, [os.getgid()]))

        def tenant_opens() -> dict:
            tenant.stdin.write("open\n")
            tenant.stdin.flush()
            line = tenant.stdout.readline()
            assert line, f"the other tenant ended (rc {tenant.poll()}): {tenant.stderr.read()}"
            return json.loads(line)

        raw = _Opens(d.socket(0))
        hellos: list[socket.socket] = []
        refused: list[grpc.StatusCode] = []
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                refused.append(raw.open(secrets.token_bytes(16) if len(refused) % 2 else b"")[0])
        flooding = threading.Thread(target=flood, daemon=True)
        flooding.start()
        try:
            ranklib.wait_until(lambda: len(refused) >= 8, 30, "a flood under way")
            assert tenant_opens() == {"code": "OK"}
            assert set(refused) == {grpc.StatusCode.PERMISSION_DENIED}, set(refused)
            tickets = []
            for _ in range(MAX_UNBOUND_PER_UID):  # (this uid's whole cap of unbound ones)
                conn, ticket = _hello(path)
                hellos.append(conn)
                tickets.append(ticket)
            for ticket in tickets[:2]:
                code, details = raw.open(ticket)
                assert code == grpc.StatusCode.OK, details
            code, details = raw.open(tickets[2])
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "--max-sessions-per-uid" in details, details
            assert tenant_opens() == {"code": "OK"}  # (the engine's last place)
            assert set(refused) == {grpc.StatusCode.PERMISSION_DENIED}, set(refused)
        finally:
            stop.set()
            flooding.join(30)
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                tenant.communicate("", timeout=30)
            if tenant.poll() is None:
                tenant.kill()
                tenant.wait(10)
            raw.close()
            for c in hellos:
                c.close()


def test_a_ticket_the_engine_took_too_late_is_still_withdrawn(tmp_path, monkeypatch) -> None:
    """A hello whose ticket the event loop took only after the connection's thread gave up
    waiting (a loop stalled past CALL_SECONDS): the thread answered the error and closed the
    connection, and the ticket, issued afterwards, stayed on the engine for good (its thread
    never learned it). The thread draws the ticket itself now and withdraws it at close."""
    import asyncio
    import socket as S
    import threading

    from epd.proto import fd_channel as fdc
    from epd.server.engine import fd_server

    monkeypatch.setattr(fd_server, "CALL_SECONDS", 0.1)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    engine = _TicketEngine(stall=0.5)  # (the loop stalls; the thread's wait is 0.1 s)
    server = fd_server.FdServer(engine, str(tmp_path / "gpu0.fds"), loop)
    server.start()
    try:
        with S.socket(S.AF_UNIX, S.SOCK_SEQPACKET) as c:
            c.settimeout(10)
            c.connect(str(tmp_path / "gpu0.fds"))
            fdc.send(c, epd_pb2.FdRequest(hello=epd_pb2.FdHello()))
            resp, _ = fdc.recv(c, epd_pb2.FdResponse)
            assert resp.code != 0 and not resp.ticket, resp  # (the thread gave up)
            assert fdc.recv(c, epd_pb2.FdResponse)[0] is None  # (and closed the connection)
        time.sleep(1.0)  # (the late issue has run, and whatever the thread queued after it)
        assert engine.tickets == {}
    finally:
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_the_descriptor_channel_outlives_a_full_descriptor_table(tmp_path, monkeypatch) -> None:
    """A failed accept (EMFILE: another tenant's connections filled the engine's descriptor
    table) does not end the channel: it accepts again once there is room, and the next hello
    is answered (a review: the accept thread returned, and every later session of the engine
    waited for a channel that never answered, while /readyz said ready)."""
    import asyncio
    import errno

    from epd.server.engine import fd_server

    class _FullTable:  # the listening socket, whose first accepts find no descriptor left
        def __init__(self, sock) -> None:
            self.sock, self.failures = sock, 3

        def accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    monkeypatch.setattr(fd_server, "ACCEPT_RETRY_SECONDS", 0.01)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    engine = _TicketEngine()
    server = fd_server.FdServer(engine, str(tmp_path / "gpu0.fds"), loop)
    full = server.sock = _FullTable(server.sock)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
            c.settimeout(10)
            c.connect(str(tmp_path / "gpu0.fds"))
            fdc.send(c, epd_pb2.FdRequest(hello=epd_pb2.FdHello()))
            resp, _ = fdc.recv(c, epd_pb2.FdResponse)
            assert resp.code == 0 and resp.ticket, resp
            # (issued before the answer; withdrawn once the connection closes unused)
            assert full.failures == 0 and list(engine.tickets) == [resp.ticket]
    finally:
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_an_unauthenticated_request_cannot_be_tens_of_megabytes(daemon) -> None:
    """A request is parsed before its session's token is checked: one of more than the
    engine's MAX_REQUEST_BYTES is refused by gRPC unread (a review grew an engine to 7.6 GiB
    with 25 MB requests of no session), and the engine answers the next one."""
    from epd.server.engine.app import MAX_REQUEST_BYTES

    with grpc.insecure_channel(f"unix://{daemon.socket(0)}", options=[
            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = epd_pb2_grpc.EngineStub(ch)
        big = epd_pb2.GetDispatchLayoutRequest(session_id="x" * (MAX_REQUEST_BYTES + 1))
        with pytest.raises(grpc.RpcError) as ei:
            stub.GetDispatchLayout(big, timeout=10)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        with pytest.raises(grpc.RpcError) as ei:  # (a small one is read: no such session)
            stub.GetDispatchLayout(epd_pb2.GetDispatchLayoutRequest(session_id="x"),
                                   timeout=10)
        assert ei.value.code() in (grpc.StatusCode.NOT_FOUND,
                                   grpc.StatusCode.UNAUTHENTICATED), ei.value


def _quietly(fn):
    """`fn` for a thread, whose EpdError (a deadline, a closed session) is expected."""
    def run() -> None:
        with contextlib.suppress(EpdError):
            fn()
    return run


def test_one_tenants_waiting_leaves_do_not_hold_anothers(daemon_factory) -> None:
    """Leaves whose close waits for the session's running operation (a collective its peer
    never joins) wait on their session's own threads: with more of them than the engine's
    shared thread pool has threads (min(32, CPUs + 4)), another tenant's join, round and leave
    still take well under a second (a review: they queued behind, 28 s, then the leave's
    deadline)."""
    n = min(32, (os.cpu_count() or 1) + 4) + 1
    spec = dict(num_experts=4, hidden=128, max_tokens_per_rank=4, num_topk=2)
    with daemon_factory(engines=1, extra=["--timeout-seconds", "3"]) as d:
        held: list[Session] = []
        try:
            for i in range(n):
                s, peer = Session(d.socket(0), timeout=60), Session(d.socket(0), timeout=60)
                held += [s, peer]
                threading.Thread(target=lambda p=peer, i=i: p.join(
                    f"hold{i}", rank=1, num_ranks=2, **spec), daemon=True).start()
                g = s.join(f"hold{i}", rank=0, num_ranks=2, **spec)
                spare = s.join(f"spare{i}", rank=0, num_ranks=1, **spec)
                hc = ranklib.Case(group=f"hold{i}", num_ranks=2, num_experts=4, hidden=128,
                                  num_topk=2, tokens=(4, 4))
                inp = hc.inputs(0)
                threading.Thread(target=_quietly(lambda g=g, inp=inp: g.dispatch(
                    inp["x"], inp["topk_idx"], inp["topk_weights"], timeout=20)),
                    daemon=True).start()
                time.sleep(0.2)  # (its dispatch holds the session's operations)
                threading.Thread(target=_quietly(spare.leave), daemon=True).start()
            time.sleep(1.0)
            c = ranklib.Case(group="bystander", num_ranks=1, num_experts=4, hidden=128,
                             num_topk=2, tokens=(4,))
            with Session(d.socket(0), timeout=10) as v:
                t0 = time.monotonic()
                g = ranklib.join(v, c, 0)
                ranklib.check_case(c, [ranklib.case_round(v, g, c, 0)])
                g.leave()
                took = time.monotonic() - t0
            assert took < 5.0, took
        finally:
            for s in held:
                s.close()


def test_uids_an_engine_serves_no_session_share_a_few_connections(tmp_path) -> None:
    """A tenant pool's engine opens no session for uids outside the pool; they connect only to
    be told where to go (at their hello). Outsiders share MAX_OUTSIDER_CONNECTIONS, and one uid
    holds at most MAX_OUTSIDER_PER_UID: 17 outsider uids holding 64 connections each filled
    the engine's 1024 and locked the pool's own uid out (an adversarial round), and one uid
    holding a small shared cap locked every pool tenant's first open out (a review). Here
    every connection is this test's uid's, an outsider's (the stand-in engine serves none):
    past the per-uid cap they are closed at once."""
    import asyncio

    from epd.server.engine import fd_server

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    server = fd_server.FdServer(_TicketEngine(serves=False), str(tmp_path / "gpu0.fds"), loop)
    server.start()
    held: list[socket.socket] = []
    try:
        cap = fd_server.MAX_OUTSIDER_PER_UID
        for _ in range(cap + 5):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(str(tmp_path / "gpu0.fds"))
            held.append(c)
        time.sleep(0.5)
        closed = 0
        for c in held:
            c.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                closed += c.recv(1) == b""
        assert closed == 5, closed
        assert len(server._outsiders) == cap
        for c in held:
            c.close()
        time.sleep(0.5)
        assert not server._outsiders and not server._conns
    finally:
        for c in held:
            c.close()
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
