"""The same-host fast path (shared-memory request ring): same results as gRPC, wrap-around, a
full ring, client death with requests queued, fallback, and an idle engine that sleeps."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from daemon_harness import HarnessDaemon as Daemon  # demo's Daemon + engine CPU measurement
from daemon_harness import memfds
from ranklib import comm_arrivals, wait_until

from epd.client import EpdError, Session
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref
from epd.server.demo import Workload

pytestmark = pytest.mark.slow
WL = Workload(2, [13, 9], 128, 8, 2, seed=21, drop_prob=0.1)


@pytest.fixture(scope="module")
def daemon():
    d = Daemon(backend="cpu", engines=2, timeout_seconds=3,
               extra=["--fast-path-slots", "4", "--fast-path-spin-us", "20"])
    d.wait_ready(30)
    yield d
    assert d.stop() == 0


def _round(s: Session, group: str, rank: int, wl: Workload, rounds: int = 1):
    x, idx, w = wl.inputs(rank)
    g = s.join(group, rank=rank, num_ranks=wl.num_ranks, num_experts=wl.num_experts,
               hidden=wl.hidden, max_tokens_per_rank=max(wl.tokens), num_topk=wl.num_topk)
    for _ in range(rounds):
        out = g.dispatch(x, idx, w, expert_alignment=2)
        cx, cw = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
    g.leave()
    return out, cx, cw


def _rounds(sessions: list[Session], group: str, wl: Workload, rounds: int = 1) -> list:
    """Every rank's `_round` at once (rank r on sessions[r]), then the sessions closed."""
    try:
        with ThreadPoolExecutor(len(sessions)) as ex:
            return list(ex.map(lambda r: _round(sessions[r], group, r, wl, rounds=rounds),
                               range(len(sessions))))
    finally:
        for s in sessions:
            s.close()


def _expected(wl: Workload):
    ins = wl.all_inputs()
    disp = ref.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                        wl.num_experts, expert_alignment=2)
    comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    return disp, comb


def _check(results, wl: Workload) -> None:
    disp, comb = _expected(wl)
    for r, (out, cx, cw) in enumerate(results):
        np.testing.assert_array_equal(out.recv_x.view(np.uint16), disp[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(out.recv_topk_idx, disp[r].recv_topk_idx)
        assert out.num_recv_tokens_per_expert == disp[r].num_recv_tokens_per_expert
        np.testing.assert_array_equal(cx.view(np.uint16), comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(cw, comb[r][1])


@pytest.mark.parametrize("fast", [True, False])
def test_both_paths_give_the_reference(daemon, fast: bool) -> None:
    sessions = [Session(daemon.socket(r), fast_path=fast) for r in range(2)]
    try:
        assert [s.transport for s in sessions] == ["fastpath" if fast else "grpc"] * 2
        with ThreadPoolExecutor(2) as ex:
            res = list(ex.map(lambda r: _round(sessions[r], f"paths-{fast}", r, WL),
                              range(2)))
        _check(res, WL)
    finally:
        for s in sessions:
            s.close()


def test_the_protocols_with_host_fences_on(monkeypatch) -> None:
    """What a weakly ordered host (aarch64) runs, forced on here (EPD_HOST_FENCES=1): the
    fences between data and flags on both sides of the rings, the counter pages and the comm
    file (proto/host_order.py). Results stay exact and the client's fences ran."""
    from epd.proto import host_order

    monkeypatch.setenv("EPD_HOST_FENCES", "1")  # (the daemon's engines, at import)
    ran = {"publish": 0, "consume": 0}

    def counted(kind: str):
        def fence() -> None:
            ran[kind] += 1
            host_order.full()
        return fence
    monkeypatch.setattr(host_order, "publish", counted("publish"))
    monkeypatch.setattr(host_order, "consume", counted("consume"))
    d = Daemon(backend="cpu", engines=2, timeout_seconds=3, extra=["--fast-path-slots", "4"])
    try:
        d.wait_ready(30)
        _check(_rounds([Session(d.socket(r)) for r in range(2)], "fenced", WL, rounds=8), WL)
        assert ran["publish"] >= 8 * 3 and ran["consume"] >= 8 * 3, ran
        assert d.log().count("host memory fences on the shared-memory protocols") == 2
    finally:
        assert d.stop() == 0


def test_the_fence_is_per_thread_and_never_blocks() -> None:
    """full() releases and takes again a lock of the calling thread's own: threads never
    wait for each other's."""
    from epd.proto import host_order

    def many() -> None:
        for _ in range(20_000):
            host_order.full()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        for f in [ex.submit(many) for _ in range(4)]:
            f.result(10)
    assert time.perf_counter() - t0 < 10


def test_ring_wraps_around_many_times(daemon) -> None:
    """4 slots, 40 rounds of 3 ring calls each: the ring wraps ~30 times, results stay exact."""
    sessions = [Session(daemon.socket(r)) for r in range(2)]
    try:
        with ThreadPoolExecutor(2) as ex:
            res = list(ex.map(lambda r: _round(sessions[r], "wrap", r, WL, rounds=40),
                              range(2)))
        _check(res, WL)
        (st,) = [g for g in sessions[0].stats().groups] or [None]
        assert st is None  # the group was left
    finally:
        for s in sessions:
            s.close()


def test_many_clients_on_one_engine(daemon) -> None:
    wl = Workload(4, [5, 0, 11, 7], 128, 8, 2, seed=4, drop_prob=0.2)
    _check(_rounds([Session(daemon.socket(0)) for _ in range(4)], "many", wl, rounds=5), wl)


def test_full_ring_is_resource_exhausted(daemon) -> None:
    """A dispatch whose peer never comes holds the engine; the ring fills behind it and the
    next call gets RESOURCE_EXHAUSTED instead of hanging. The session recovers afterwards."""
    s = Session(daemon.socket(0))
    peer = Session(daemon.socket(1))
    try:
        x, idx, w = WL.inputs(0)
        with ThreadPoolExecutor(2) as ex:
            jf = ex.submit(peer.join, "full", rank=1, num_ranks=2, num_experts=8, hidden=128,
                           max_tokens_per_rank=16, num_topk=2)
            g = s.join("full", rank=0, num_ranks=2, num_experts=8, hidden=128,
                       max_tokens_per_rank=16, num_topk=2)
            jf.result()
        outcome: list[str] = []

        def blocked_dispatch() -> None:
            try:
                g.dispatch(x, idx, w, timeout=2.5)
                outcome.append("completed without its peer")
            except EpdError as e:
                outcome.append(e.code.name)

        arrived = comm_arrivals("", g.group_id, 2)
        stuck = threading.Thread(target=blocked_dispatch)
        stuck.start()
        wait_until(lambda: (a := comm_arrivals("", g.group_id, 2)) is not None
                   and a[0] > arrived[0], 10, "the dispatch inside its collective")
        pings = [s._transport._submit("Ping", b"", 10) for _ in range(3)]  # slots 2..4
        with pytest.raises(EpdError) as ei:
            s._transport.call("Ping", epd_pb2.PingRequest(), 0.5)  # slot 1 still busy
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ring full" in ei.value.details
        stuck.join(10)
        assert outcome == ["DEADLINE_EXCEEDED"]
        for p in pings:
            p.result()
        s.ping()  # the ring works again
        assert s.transport == "fastpath"
    finally:
        s.close()
        peer.close()


def _doomed(socket: str, q) -> None:
    s = Session(socket)
    s.join("doomed", rank=0, num_ranks=2, num_experts=8, hidden=128, max_tokens_per_rank=16,
           num_topk=2, timeout=10)
    x, idx, w = WL.inputs(0)
    g = s._groups[next(iter(s._groups))]
    d = s._descs({"x": x, "topk_idx": idx, "topk_weights": w})
    req = epd_pb2.DispatchRequest(session_id=s.session_id, group_id=g.group_id,
                                  timeout_seconds=30, **d)
    s._transport._submit("Dispatch", req.SerializeToString(), 60)  # blocks on its peer
    for _ in range(3):
        s._transport._submit("Ping", b"", 60)  # queued behind it
    q.put(os.getpid())
    time.sleep(60)


def test_client_death_with_requests_queued(daemon) -> None:
    peer = Session(daemon.socket(1))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_doomed, args=(daemon.socket(0), q))
    p.start()
    try:
        peer.join("doomed", rank=1, num_ranks=2, num_experts=8, hidden=128,
                  max_tokens_per_rank=16, num_topk=2, timeout=10)
        pid = q.get(timeout=30)
        # Rings are memfds the engine holds (no file in the shm folder): count its descriptors.
        engine = daemon.engine_pid(0)
        rings_before = len(memfds(engine, "epd-ring"))
        assert rings_before
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        p.join(10)
        # The engine notices the broken lease, aborts the group and frees the ring at once,
        # far sooner than the 30 s deadline of the queued dispatch.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(memfds(engine, "epd-ring")) >= rings_before:
            time.sleep(0.05)
        assert len(memfds(engine, "epd-ring")) < rings_before
        assert time.monotonic() - t0 < 10
        assert daemon.get("/readyz")[0] == 200
        with Session(daemon.socket(0)) as s:
            s.ping()
            assert s.transport == "fastpath"
    finally:
        if p.is_alive():
            p.kill()
        peer.close()


def test_fallback_when_the_engine_offers_none() -> None:
    with Daemon(backend="cpu", engines=2, extra=["--no-fast-path"]) as d:
        sessions = [Session(d.socket(r)) for r in range(2)]
        try:
            assert [s.transport for s in sessions] == ["grpc", "grpc"]
            assert "disabled" in sessions[0].fast_path_error
            with ThreadPoolExecutor(2) as ex:
                res = list(ex.map(lambda r: _round(sessions[r], "fallback", r, WL), range(2)))
            _check(res, WL)
        finally:
            for s in sessions:
                s.close()


def test_client_reply_spin_is_the_base_where_collectives_run_on_the_host(daemon) -> None:
    """The cpu engine's collectives run on the host's cores: its clients are not asked to spin
    longer for answers than the base window, however fast the answers come (the CUDA engine
    offers --fast-path-spin-max-us)."""
    with Session(daemon.socket(0)) as s:
        assert s.transport == "fastpath"
        window = s._transport.spin
        assert window.longest == window.base > 0
        for _ in range(20):
            s.ping()
        assert all(window.window(op) == window.base for op in window._gap)
        assert window._gap, "the answers' times were not recorded"


def test_idle_engine_sleeps(daemon) -> None:
    with Session(daemon.socket(0)) as s:
        s.ping()
        time.sleep(0.3)
        used = daemon.engine_cpu_fraction(0, 2.0)
        assert s.transport == "fastpath"
    assert used < 0.05, f"idle engine used {used:.1%} of a core"


def test_fast_path_metrics_are_labelled(daemon) -> None:
    sessions = [Session(daemon.socket(r)) for r in range(2)]
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda r: _round(sessions[r], "metrics-fp", r, WL), range(2)))
    finally:
        for s in sessions:
            s.close()
    body = daemon.get("/metrics")[1]
    assert 'epd_dispatch_seconds_count{backend="cpu",group="metrics-fp",path="fastpath"}' \
        in body
    assert 'epd_requests_total{code="OK",method="Dispatch"}' in body


def test_engine_threads_sleep_without_timer_slack(daemon) -> None:
    """Every thread of an engine (its gRPC threads and the ring threads started after start-up
    included) has the fine timer slack set before any of them started (proto/spin.py)."""
    from epd.proto import spin
    with Session(daemon.socket(0)) as s:
        s.ping()  # a fast-path ring thread exists now
        pid = daemon.engine_pid(0)
        tasks = os.listdir(f"/proc/{pid}/task")
        slack = {}
        for tid in tasks:
            try:
                with open(f"/proc/{tid}/timerslack_ns") as f:  # (a thread id opens too)
                    slack[tid] = int(f.read())
            except FileNotFoundError:  # a short-lived thread (a to_thread call) ended
                continue
    assert len(slack) > 3
    assert set(slack.values()) == {spin.ENGINE_TIMER_SLACK_NS}, slack


def test_an_error_cut_to_its_slot_still_decodes(daemon_factory) -> None:
    """An engine error longer than the ring slot is cut to it; cut inside a UTF-8 character it
    made the client raise UnicodeDecodeError instead of the call's EpdError."""
    with (daemon_factory(engines=1, extra=["--fast-path-slot-bytes", "4096"]) as d,
          Session(d.socket(0)) as s):
        assert s.transport == "fastpath"
        for n in (1003, 1004, 1005, 1006):  # (one of these cuts a 4-byte character)
            with pytest.raises(EpdError) as ei:
                s._transport.call("GetStats", epd_pb2.GetStatsRequest(session_id="😀" * n), 5)
            assert ei.value.code == grpc.StatusCode.NOT_FOUND, ei.value
        assert s.transport == "fastpath"


def test_a_stats_answer_larger_than_its_slot_comes_over_grpc(daemon_factory) -> None:
    """An answer that does not fit its ring slot is RESOURCE_EXHAUSTED from the ring (the
    operation ran); for a read-only call (GetStats: many groups, long abort reasons) the client
    asks again over gRPC, and the ring goes on serving. (A review: GetStats failed so.)"""
    from ranklib import Case, join

    with (daemon_factory(engines=1, extra=["--fast-path-slot-bytes", "4096"]) as d,
          Session(d.socket(0)) as s):
        assert s.transport == "fastpath"
        for i in range(40):
            join(s, Case(f"{'long-group-name-' * 6}{i}", 1, 4, 128, 2, (2,)), 0)
        st = s.stats()
        assert len(st.groups) == 40 and st.ByteSize() > 4096
        assert s.transport == "fastpath"
        s.ping()

