"""Failures (DESIGN.md §4, §7): dead clients, missing ranks, dead engines, daemon shutdown.
Nothing may hang: every collective fails for all members with a status naming the culprit,
within the deadline, and the daemon stays up and usable."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ranklib
from conftest import DAEMON_TIMEOUT, TestDaemon
from daemon_harness import memfd_names
from ranklib import Case, check_case, member, run_case, wait_until

from epd.proto.v1 import epd_pb2, epd_pb2_grpc

pytestmark = pytest.mark.slow
SLACK = 1.0  # "within the configured timeout + 1 s"
_names = itertools.count()


def case(num_ranks: int = 4, **kw) -> Case:
    kw.setdefault("group", f"fault-{next(_names)}")
    return Case(num_ranks=num_ranks, num_experts=2 * num_ranks, hidden=128, num_topk=2,
                tokens=tuple(12 + r for r in range(num_ranks)), seed=next(_names), **kw)


def start_members(pool, endpoints, c: Case, timeout: float | None = DAEMON_TIMEOUT):
    tids = [pool.submit(r, member, endpoints[r], c, r, timeout) for r in range(c.num_ranks)]
    infos = [pool.event(r, timeout=60) for r in range(c.num_ranks)]
    assert len({i["group_id"] for i in infos}) == 1
    return tids, infos


def finish(pool, tids, ranks_alive):
    for r in ranks_alive:
        pool.cmd(r, "done")
    return pool.gather([tids[r] for r in ranks_alive], 30)


def engine_maps_of(d, pid: int) -> list[str]:
    """The client's memory (its `epd-client-<pid>-*` regions) the daemon's engines still
    hold: none once its session is torn down. (Shared memory is memfds: no file names.)"""
    return [n for e in range(d.engines) for n in memfd_names(
        topology(d).engines[e].pid, f"epd-client-{pid}-")]


def topology(d) -> epd_pb2.GetTopologyResponse:
    with grpc.insecure_channel(f"unix://{d.node_socket}") as ch:
        return epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(), timeout=5)


def assert_aborted_naming(res: dict, needle: str, what: str) -> None:
    assert res["code"] == "ABORTED", f"{what}: {res}"
    assert needle in res["details"], f"{what}: {needle!r} not in {res['details']!r}"
    assert res["elapsed"] < DAEMON_TIMEOUT + SLACK, f"{what}: took {res['elapsed']:.2f} s"


def new_group_works(pool, d, num_ranks: int = 4) -> None:
    c = case(num_ranks)
    check_case(c, pool.run_ok([(run_case, ep, c, r)
                               for r, ep in enumerate(d.endpoints(num_ranks))]))


def test_client_killed_before_a_collective(daemon, ranks):
    c = case()
    tids, infos = start_members(ranks, daemon.endpoints(4), c)
    for r in range(4):
        ranks.cmd(r, "round")
    check_case(c, [ranks.event(r) for r in range(4)])
    victim = infos[3]
    assert engine_maps_of(daemon, victim["pid"])  # (its regions, mapped by its engine)
    ranks.kill(3)
    gid = infos[0]["group_id"]
    reason = wait_until(lambda: ranklib.comm_abort_reason(daemon.shm_dir, gid), 5,
                        "the group is aborted after its rank 3 died")
    assert "rank 3" in reason
    for r in range(3):
        ranks.cmd(r, "dispatch")
    for r in range(3):
        assert_aborted_naming(ranks.event(r), "rank 3", f"rank {r}")
    finish(ranks, tids, range(3))
    wait_until(lambda: not engine_maps_of(daemon, victim["pid"]), 5,
               "the dead client's memory unmapped by the engines")
    assert daemon.get("/readyz")[0] == 200
    new_group_works(ranks, daemon)
    assert not [f for f in os.listdir(daemon.shm_dir) if gid in f]


def test_client_killed_during_a_collective(daemon, ranks):
    c = case()
    tids, infos = start_members(ranks, daemon.endpoints(4), c)
    victim = infos[3]
    gid = infos[0]["group_id"]
    for r in range(3):
        ranks.cmd(r, "dispatch")
    # Ranks 0-2 are inside the dispatch (arrived in the group's file), waiting for rank 3.
    wait_until(lambda: (a := ranklib.comm_arrivals(daemon.shm_dir, gid, 4)) is not None
               and (a[:3] >= 1).all(), 10, "ranks 0-2 arrive in dispatch")
    killed = time.monotonic()
    ranks.kill(3)
    for r in range(3):
        res = ranks.event(r, timeout=DAEMON_TIMEOUT + 5)
        assert_aborted_naming(res, "rank 3", f"rank {r}")
    assert time.monotonic() - killed < DAEMON_TIMEOUT + SLACK
    finish(ranks, tids, range(3))
    wait_until(lambda: not engine_maps_of(daemon, victim["pid"]), 5,
               "the dead client's memory unmapped by the engines")
    assert daemon.get("/readyz")[0] == 200
    new_group_works(ranks, daemon)


def test_killed_client_leaves_nothing_mapped(daemon, ranks):
    """A SIGKILLed client's shared memory is memfds (no file name can leak); the engine that
    mapped its regions unmaps them once the session is torn down, and holds no descriptor."""
    c = case(2)
    tids, infos = start_members(ranks, daemon.endpoints(2), c)
    for r in range(2):
        ranks.cmd(r, "round")
    [ranks.event(r) for r in range(2)]
    pid = infos[1]["pid"]
    assert engine_maps_of(daemon, pid)  # (a round ran: its regions are mapped)
    assert not [f for f in os.listdir(daemon.shm_dir) if str(pid) in f]
    ranks.kill(1)
    finish(ranks, tids, [0])
    wait_until(lambda: not engine_maps_of(daemon, pid), 5,
               "the dead client's memory unmapped by the engines")


def _never_dispatches(pool, d) -> list[dict]:
    c = case()
    tids, _ = start_members(pool, d.endpoints(4), c)
    for r in range(3):
        pool.cmd(r, "dispatch")
    results = [pool.event(r, timeout=DAEMON_TIMEOUT + 5) for r in range(3)]
    # The late rank now finds the group failed, with the reason.
    pool.cmd(3, "dispatch")
    late = pool.event(3)
    assert late["code"] == "ABORTED" and "[3]" in late["details"], late
    finish(pool, tids, range(4))
    assert d.get("/readyz")[0] == 200
    return results


def test_rank_that_never_dispatches(daemon, ranks):
    results = _never_dispatches(ranks, daemon)
    for res in results:
        assert res["code"] in ("DEADLINE_EXCEEDED", "ABORTED"), res
        assert "rank(s) [3] did not arrive" in res["details"], res
        assert DAEMON_TIMEOUT - 0.1 <= res["elapsed"] < DAEMON_TIMEOUT + SLACK, res
    assert any(res["code"] == "DEADLINE_EXCEEDED" for res in results), results


def test_rank_that_never_dispatches_all_get_deadline_exceeded(daemon, ranks):
    results = _never_dispatches(ranks, daemon)
    assert [res["code"] for res in results] == ["DEADLINE_EXCEEDED"] * 3, results


def test_default_client_deadline_is_the_daemons(daemon, ranks):
    c = case(2)
    tids, _ = start_members(ranks, daemon.endpoints(2), c, timeout=None)
    ranks.cmd(0, "dispatch")
    try:
        res = ranks.event(0, timeout=DAEMON_TIMEOUT + SLACK + 0.5)
    finally:
        ranks.kill(0)  # still blocked when the deadline is not the daemon's
        ranks.cmd(1, "done")
        ranks.gather([tids[1]], 30)
    assert res["code"] == "DEADLINE_EXCEEDED"


def test_engine_killed(daemon_factory, ranks):
    with daemon_factory(engines=2) as d:
        c = case(2)
        tids, infos = start_members(ranks, d.endpoints(2), c)
        assert [i["engine"] for i in infos] == [0, 1]
        gid = infos[0]["group_id"]
        before = topology(d).engines[1]
        assert before.ready and before.restarts == 0 and before.pid > 0
        ranks.cmd(0, "dispatch")
        wait_until(lambda: (a := ranklib.comm_arrivals(d.shm_dir, gid, 2)) is not None
                   and a[0] >= 1, 10, "rank 0 arrives in dispatch")
        os.kill(before.pid, signal.SIGKILL)
        res = ranks.event(0, timeout=DAEMON_TIMEOUT + 5)
        assert_aborted_naming(res, "engine 1", "rank 0")
        assert "[1]" in res["details"]
        # Rank 1's session was on the dead engine: its lease is gone.
        ranks.cmd(1, "wait_lost")
        assert ranks.event(1) == {"alive": False}
        after = wait_until(lambda: (e := topology(d).engines[1]).ready and e.restarts == 1
                           and e, 30, "engine 1 restarted and ready")
        assert after.pid != before.pid
        wait_until(lambda: d.get("/readyz")[0] == 200, 10, "daemon ready again")
        _status, body = d.get("/metrics")
        assert 'epd_engine_restarts_total{engine="1"} 1.0' in body
        finish(ranks, tids, range(2))
        # New sessions can rejoin the same group name (a fresh instance), on both engines.
        c2 = Case(group=c.group, num_ranks=2, num_experts=4, hidden=128, num_topk=2,
                  tokens=(12, 13), seed=c.seed)
        check_case(c2, ranks.run_ok([(run_case, ep, c2, r)
                                     for r, ep in enumerate(d.endpoints(2))]))


def test_dead_engine_files_removed(daemon_factory, ranks):
    """Engines create no files (their shared memory is memfds, gone with them), but an older
    engine's files would be left: the supervisor sweeps the folder of a dead engine's files
    before it restarts it (a stale file planted here; another engine's stays)."""
    from epd.server.engine.state import engine_files_prefix

    with daemon_factory(engines=2) as d:
        stale = os.path.join(d.shm_dir, f"{engine_files_prefix(1)}stale.counters")
        other = os.path.join(d.shm_dir, f"{engine_files_prefix(0)}stale.counters")
        for path in (stale, other):
            with open(path, "wb") as f:
                f.write(b"x")
        c = case(2)
        tids, _ = start_members(ranks, d.endpoints(2), c)
        pid = topology(d).engines[1].pid
        os.kill(pid, signal.SIGKILL)
        ranks.cmd(1, "wait_lost")
        ranks.event(1)
        finish(ranks, tids, range(2))
        wait_until(lambda: (e := topology(d).engines[1]).ready and e.restarts == 1, 30,
                   "engine 1 restarted and ready")
        try:
            assert not os.path.exists(stale)
            assert os.path.exists(other)
        finally:
            for path in (stale, other):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def _thread_round(session, c: Case, rank: int) -> dict:
    return ranklib.case_round(session, ranklib.join(session, c, rank), c, rank)


def test_sigterm_right_after_close():
    """Clients (threads of this process) close their sessions and the daemon gets SIGTERM at
    once; twice, since it is a race."""
    from epd.client import Session
    for attempt in range(2):
        d = TestDaemon(engines=2)
        try:
            d.wait_ready(60)
            c = case(2)
            sessions = [Session(ep, timeout=10) for ep in d.endpoints(2)]
            with ThreadPoolExecutor(2) as ex:
                results = list(ex.map(_thread_round, sessions, [c, c], range(2)))
            check_case(c, results)
            for s in sessions:
                s.close()
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(30) == 0
            assert os.listdir(d.shm_dir) == [], f"attempt {attempt}"
        finally:
            d.stop()
            shutil.rmtree(d.shm_dir, ignore_errors=True)


def test_sigterm_exits_cleanly(ranks):
    """SIGTERM with a live session: exit 0, sockets and the daemon's shm files gone (default
    shm folder /dev/shm), and the client sees its lease end."""
    d = TestDaemon(engines=2, private_shm=False)
    try:
        d.wait_ready(60)
        c = case(2)
        tids, infos = start_members(ranks, d.endpoints(2), c)
        for r in range(2):
            ranks.cmd(r, "round")
        check_case(c, [ranks.event(r) for r in range(2)])
        for r in range(2):
            ranks.cmd(r, "wait_lost")
        sockets = [d.node_socket, d.socket(0), d.socket(1)]
        assert all(os.path.exists(s) for s in sockets)
        mine = [f for f in os.listdir(ranklib.SHM)
                if any(i["session_id"] in f for i in infos) or infos[0]["group_id"] in f]
        # Counter pages, outputs, the group's memory: memfds, never files (issue 12).
        assert mine == [], mine
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(30)
        assert rc == 0, d.log()[-3000:]
        for r in range(2):
            assert ranks.event(r) == {"alive": False}
        assert all(o.ok for o in finish(ranks, tids, range(2)))
        assert [s for s in sockets if os.path.exists(s)] == []
        left = [f for f in mine if os.path.exists(os.path.join(ranklib.SHM, f))]
        assert left == [], left
    finally:
        d.stop()


def test_sigterm_fails_joins_that_can_no_longer_form():
    """SIGTERM while a rank waits at a group's rendezvous for a peer that can no longer join
    (the draining engines refuse new calls): its join fails at once with UNAVAILABLE naming
    the drain, and the daemon exits without waiting for the join's deadline (60 s here; it
    held the drain until --drain-seconds, then the engine was killed)."""
    import threading

    from epd.client import EpdError, Session

    d = TestDaemon(engines=1, extra=["--drain-seconds", "30"])
    try:
        d.wait_ready(60)
        out: dict = {}

        def join() -> None:
            with Session(d.socket(0), client_name="drain-join", timeout=60) as s:
                try:
                    s.join("drain-join", rank=0, num_ranks=2, num_experts=4, hidden=16,
                           max_tokens_per_rank=8, num_topk=2, timeout=60)
                    out["res"] = "joined"
                except EpdError as e:
                    out["res"] = e
        th = threading.Thread(target=join, daemon=True)
        th.start()
        wait_until(lambda: topology(d).throughput_groups + topology(d).latency_groups == 1,
                   30, "the join at the rendezvous")
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        th.join(20)
        assert not th.is_alive()
        err = out["res"]
        assert isinstance(err, EpdError) and err.code == grpc.StatusCode.UNAVAILABLE, err
        assert "group 'drain-join' cannot form: the daemon is shutting down" in err.message, err
        assert d.proc.wait(30) == 0, d.log()[-3000:]
        assert time.monotonic() - t0 < 12, time.monotonic() - t0
    finally:
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)


def test_engine_that_hangs_at_stop_is_killed_and_its_sockets_removed():
    """An engine that does not stop (SIGSTOPped: it never sees the SIGTERM) is killed after the
    drain deadline, and the supervisor removes the sockets it could not (gpu0.sock and its
    descriptor channel gpu0.fds): the socket folder is left empty, as after a clean stop."""
    d = TestDaemon(engines=1, extra=["--drain-seconds", "0.2"])
    try:
        d.wait_ready(60)
        engine = d.engine_pid(0)
        names = sorted(os.listdir(d.socket_dir))
        assert "gpu0.sock" in names and "gpu0.fds" in names, names
        os.kill(engine, signal.SIGSTOP)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0, d.log()[-3000:]
        assert "engine 0 did not stop in time; killing it" in d.log()
        assert os.listdir(d.socket_dir) == [], os.listdir(d.socket_dir)
    finally:
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)


def test_an_engine_that_stops_answering_is_not_ready_then_killed(daemon_factory):
    """A ready engine whose health check goes unanswered (here: stopped with SIGSTOP, as a
    wedged event loop looks from outside) is marked not ready after
    --engine-unresponsive-seconds (/readyz 503, epd_engine_up 0), ready again once it answers,
    and killed, then restarted, after --engine-hung-seconds. (Ready engines were never checked
    again: a wedged one stayed "ready" and held its clients to their deadlines for good.)"""
    with daemon_factory(engines=2, extra=["--engine-unresponsive-seconds", "1.5",
                                          "--engine-hung-seconds", "5"]) as d:
        pid = topology(d).engines[1].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not topology(d).engines[1].ready, 10, "engine 1 not ready")
            assert d.get("/readyz")[0] == 503
            assert 'epd_engine_up{engine="1"} 0.0' in d.get("/metrics")[1]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: topology(d).engines[1].ready, 10, "engine 1 answers again")
        assert topology(d).engines[1].pid == pid and d.get("/readyz")[0] == 200
        os.kill(pid, signal.SIGSTOP)  # for good this time: killed, restarted
        after = wait_until(lambda: (e := topology(d).engines[1]).ready and e.pid != pid and e,
                           30, "engine 1 killed and restarted")
        assert after.restarts == 1
        wait_until(lambda: d.get("/readyz")[0] == 200, 10, "daemon ready again")


STOPPED_CLIENT = (
    "import sys, time\n"
    "from epd.client import Session\n"
    "s = Session(sys.argv[1], timeout=10)\n"
    "print('open', flush=True)\n"
    "time.sleep(120)\n")


def test_a_stopped_client_loses_its_session_to_the_keepalive() -> None:
    """A client process that stops answering (SIGSTOP, a frozen process) loses its session
    within about 2 x --session-keepalive-seconds: the engine's pings go unanswered and the
    lease stream ends (gRPC's own server keepalive is two hours, and stops after two pings
    without data), so its ranks are released instead of held for hours. A client that is
    merely idle keeps its session."""
    import subprocess
    import sys

    d = TestDaemon(engines=1, extra=["--session-keepalive-seconds", "1"])
    procs = []
    try:
        d.wait_ready(60)

        def sessions() -> int:
            with grpc.insecure_channel(f"unix://{d.socket(0)}") as ch:
                return epd_pb2_grpc.EngineStub(ch).GetStats(epd_pb2.GetStatsRequest(),
                                                            timeout=10).sessions
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", STOPPED_CLIENT, d.socket(0)],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "open"
        assert sessions() == 2
        time.sleep(4)  # idle, answering pings: kept
        assert sessions() == 2
        procs[0].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_until(lambda: sessions() == 1, 20, "the stopped client's session ended")
        assert time.monotonic() - t0 < 15
        assert sessions() == 1  # (the idle one still holds its own)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
            p.stdout.close()
        d.stop_and_check()
