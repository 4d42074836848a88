"""A call its client gave up on is not run later (CPU daemon, ranks as threads).

A session's operations run one at a time, in the client's order; a call can wait behind an
earlier one (a collective waiting for its peers). If the client's deadline passes meanwhile it
is told DEADLINE_EXCEEDED; the engine must then not run the call when its turn comes: a
dispatch would store a handle nobody holds (and, in a group of several ranks, pair with the
peers' next collective), an UnregisterRegion would remove a region the client still believes
registered. On the fast path the client's deadline travels in the request's ring slot, on gRPC
it is the call's own deadline.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from ranklib import Case, comm_arrivals, join, wait_until

from epd.client import Session
from epd.client import group as client_group
from epd.proto.errors import EpdError
from epd.proto.v1 import epd_pb2

H, E, K, T = 128, 4, 2, 6


def _blocked_session(daemon, name: str, fast_path: bool):
    """(session, its 2-rank group, the peer's session and group, a 1-rank group of the
    session): the session's next dispatch on the 2-rank group waits for the peer."""
    two = Case(f"{name}-two", 2, E, H, K, (T, T), max_tokens=8)
    one = Case(f"{name}-one", 1, E, H, K, (T,), max_tokens=8)
    s = Session(daemon.socket(0), timeout=10, fast_path=fast_path)
    p = Session(daemon.socket(0), timeout=10)
    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("p", join(p, two, 1, timeout=10)))
    t.start()
    g = join(s, two, 0, timeout=10)
    t.join()
    return s, g, p, got["p"], join(s, one, 0, timeout=10), two, one


def _hold(g, two: Case) -> tuple[threading.Thread, dict]:
    """Rank 0's dispatch on `g`, which holds the session's operations until rank 1 comes."""
    out: dict = {}
    i0 = two.inputs(0)

    def run() -> None:
        try:
            out["a"] = g.dispatch(i0["x"], i0["topk_idx"], i0["topk_weights"], timeout=20)
        except EpdError as e:
            out["a"] = e
    arrived = comm_arrivals("", g.group_id, 2)
    th = threading.Thread(target=run)
    th.start()
    # It holds the operation lock once it is inside its collective (its arrival counted).
    wait_until(lambda: (a := comm_arrivals("", g.group_id, 2)) is not None
               and a[0] > arrived[0], 10, "the dispatch inside its collective")
    return th, out


def _group_stats(s: Session, name: str):
    return next(g for g in s.stats().groups if g.name == name)


def test_a_dispatch_its_client_gave_up_on_is_not_run(daemon, monkeypatch) -> None:
    """On the fast path: the ring thread serves the session's calls in order, so the stale
    call is still read from its slot once the one before it returns."""
    monkeypatch.setattr(client_group, "RPC_MARGIN", 0.5)  # (the client's wait: 1 + 0.5 s)
    s, g, p, gp, g1, two, one = _blocked_session(daemon, "stale-d", True)
    try:
        assert s.transport == "fastpath"
        th, out = _hold(g, two)
        io = one.inputs(0)
        t0 = time.monotonic()
        with pytest.raises(EpdError) as ei:
            g1.dispatch(io["x"], io["topk_idx"], io["topk_weights"], timeout=1)
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
        assert time.monotonic() - t0 < 5
        i1 = two.inputs(1)
        gp.dispatch(i1["x"], i1["topk_idx"], i1["topk_weights"], timeout=20)  # lets A finish
        th.join(30)
        assert not isinstance(out["a"], Exception), out["a"]
        time.sleep(0.5)  # (the engine has reached the stale call by now, and refused it)
        st = _group_stats(s, one.group)
        assert (st.dispatches, st.handles) == (0, 0), st
        # The session goes on: the same call again runs (over gRPC after a fast-path timeout).
        d = g1.dispatch(io["x"], io["topk_idx"], io["topk_weights"], timeout=5)
        assert d.num_recv_tokens == int((io["topk_idx"] >= 0).any(axis=1).sum())
        st = _group_stats(s, one.group)
        assert (st.dispatches, st.handles) == (1, 1), st
    finally:
        s.close()
        p.close()


def test_an_unregister_its_client_gave_up_on_is_not_run(daemon) -> None:
    """On gRPC behind a fast-path call: the session's worker already waits for the operation
    lock when the client's deadline passes, so gRPC's cancellation cannot take the call back
    (a call still queued for the worker is dropped by it)."""
    s, g, p, gp, _, two, _ = _blocked_session(daemon, "stale-u", True)
    try:
        spare = s.empty((4096,), np.uint8)
        rid = s._descs({"x": spare})["x"].region_id
        assert s.transport == "fastpath"
        th, _ = _hold(g, two)  # (on the ring thread)
        with pytest.raises(EpdError) as ei:
            s._transport.inner.call("UnregisterRegion", epd_pb2.UnregisterRegionRequest(
                session_id=s.session_id, region_id=rid), 1)
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
        i1 = two.inputs(1)
        gp.dispatch(i1["x"], i1["topk_idx"], i1["topk_weights"], timeout=20)
        th.join(30)
        time.sleep(0.5)
        # Still registered, as its client believes: a call may name it.
        layout = s._transport.inner.call("GetDispatchLayout", epd_pb2.GetDispatchLayoutRequest(
            session_id=s.session_id, group_id=g.group_id, topk_idx=epd_pb2.TensorDesc(
                region_id=rid, shape=[1, K], dtype=epd_pb2.INT64)), 5)
        assert list(layout.num_tokens_per_expert.shape) == [E]
    finally:
        s.close()
        p.close()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fastpath", "grpc"])
def test_a_timeout_of_centuries_still_travels(daemon, fast_path: bool) -> None:
    """A finite timeout puts the deadline the slot carries past its 64 bits (from about 1.8e10
    s), then past a float's range in nanoseconds (from about 1.8e299 s), and gRPC refuses a
    deadline from about 1e10 s on: a call's timeout is at most MAX_TIMEOUT (reviews: the
    client raised OverflowError from the ring write, and gRPC DEADLINE_EXCEEDED at once)."""
    one = Case(f"stale-far-{fast_path}", 1, E, H, K, (T,), max_tokens=8)
    with Session(daemon.socket(0), timeout=10, fast_path=fast_path) as s:
        g = join(s, one, 0, timeout=10)
        io = one.inputs(0)
        for timeout in (1e11, 1e300):
            d = g.dispatch(io["x"], io["topk_idx"], io["topk_weights"], timeout=timeout)
            assert s.transport == ("fastpath" if fast_path else "grpc")
            assert d.num_recv_tokens == int((io["topk_idx"] >= 0).any(axis=1).sum())


@pytest.mark.parametrize("fast_path", [True, False], ids=["fastpath", "grpc"])
def test_a_short_timeout_runs_on_an_idle_session(daemon, fast_path: bool) -> None:
    """The margin before a client's deadline is at most half the time a call had left when it
    came: a call of a 40 ms timeout that gets its turn at once runs (a review: every call of a
    timeout under 50 ms was refused as stale on an idle session)."""
    one = Case(f"stale-short-{fast_path}", 1, E, H, K, (T,), max_tokens=8)
    with Session(daemon.socket(0), timeout=10, fast_path=fast_path) as s:
        g = join(s, one, 0, timeout=10)
        io = one.inputs(0)
        req = epd_pb2.GetDispatchLayoutRequest(session_id=s.session_id, group_id=g.group_id,
                                               topk_idx=s._descs({"i": io["topk_idx"]})["i"])
        s._call("GetDispatchLayout", req, 5)  # (warm)
        ran = sum(1 for _ in range(5) if s._call("GetDispatchLayout", req, 0.04))
        assert ran == 5


def test_the_margin_is_half_the_time_left_at_most() -> None:
    from epd.server.engine.executor import STALE_MARGIN_SECONDS, stale
    assert not stale(None, 100.0, 1e9)
    # came with 1 s left: the full margin
    assert not stale(101.0, 0.0, 100.0) and stale(101.0, 0.96, 100.96)
    assert not stale(101.0, 0.9, 100.9)
    # came with 40 ms left: 20 ms
    assert not stale(100.04, 0.0, 100.0) and not stale(100.04, 0.019, 100.019)
    assert stale(100.04, 0.021, 100.021) and stale(100.04, 0.05, 100.05)
    assert STALE_MARGIN_SECONDS == 0.05


def test_a_call_its_arguments_refuse_is_not_counted_as_queued(daemon) -> None:
    """A synchronous dispatch with an SM count, or a combine naming an output (stream-ordered
    features), is refused by its arguments and not counted in queued_calls (a review found
    these checks after the count)."""
    one = Case("stale-count", 1, E, H, K, (T,), max_tokens=8)
    with Session(daemon.socket(0), timeout=10) as s:
        g = join(s, one, 0, timeout=10)
        io = one.inputs(0)
        req, t = g._dispatch_request(io["x"], io["topk_idx"], io["topk_weights"], None, 1, 0,
                                     None, 5, None, None, True)
        req.num_sms = 4
        with pytest.raises(EpdError, match="num_sms is for stream-ordered calls"):
            s._call("Dispatch", req, t)
        d = g.dispatch(io["x"], io["topk_idx"], io["topk_weights"])
        creq = epd_pb2.CombineRequest(session_id=s.session_id, group_id=g.group_id,
                                      handle=d.handle.handle_id, timeout_seconds=5,
                                      **s._descs({"x": d.recv_x, "out": d.recv_x}))
        with pytest.raises(EpdError, match="num_sms and out are for stream-ordered calls"):
            s._call("Combine", creq, 5)
        stats = next(x for x in s.stats().groups if x.name == one.group)
        assert stats.queued_calls == 1, stats  # (the dispatch that ran)

