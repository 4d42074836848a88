"""What one tenant can make an engine hold, bounded (an adversarial helper's findings): the gRPC
calls a session has under way (each held parsed in the engine while its worker is busy), the
memory of a low-latency combine's routing check, and the log lines of refused descriptor-channel
connections. Each case: the bound holds and another tenant's group stays exact."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import tracemalloc

import grpc
import numpy as np
import pytest
import ranklib
from conftest import running_daemon

from epd.client import Session
from epd.proto import fd_channel as fdc
from epd.proto.errors import EpdError
from epd.proto.v1 import epd_pb2
from epd.server.backends import base
from epd.server.engine import backlog


def _bystander_round(d, tag: str) -> None:
    case = ranklib.Case(f"bystander-{tag}", 2, 8, 64, 2, (6, 5), seed=3)
    out = ranklib.all_at_once(
        {r: (lambda r=r: ranklib.run_case(d.socket(0), case, r)) for r in range(2)})
    ranklib.check_case(case, [out[r] for r in range(2)])


def _blocked_session(d, name: str):
    """A session whose worker waits in a dispatch its peer never joins (up to 12 s)."""
    a = Session(d.socket(0), client_name="blocked", timeout=30, fast_path=False)
    p = Session(d.socket(0), client_name="absent-peer", timeout=30, fast_path=False)
    case = ranklib.Case(name, 2, 4, 64, 2, (8, 8), seed=1)
    g = ranklib.all_at_once({0: lambda: ranklib.join(a, case, 0),
                             1: lambda: ranklib.join(p, case, 1)})[0]
    inp = case.inputs(0)
    ended: list[BaseException] = []

    def wait() -> None:
        try:
            g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"], timeout=12)
        except BaseException as e:  # its deadline: the peer never came
            ended.append(e)
    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.5)  # (its worker now waits in the collective)
    return a, p, g, t


def _futures(s: Session, n: int, request) -> list[grpc.Future]:
    t = s._transport
    return [t.stub.ReleaseHandles.future(request, timeout=60, metadata=t.metadata)
            for _ in range(n)]


def _codes(futures: list[grpc.Future], within: float) -> list[grpc.StatusCode]:
    """The codes of those answered within `within` seconds (the queued ones are cancelled)."""
    deadline, out = time.monotonic() + within, []
    for f in futures:
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
            out.append(grpc.StatusCode.OK)
        except grpc.FutureTimeoutError:
            f.cancel()
        except grpc.RpcError as e:
            out.append(e.code())
    return out


def test_a_sessions_calls_under_way_are_bounded():
    """Calls behind a dispatch that waits for its peer: beyond MAX_CALLS_PER_SESSION they are
    RESOURCE_EXHAUSTED at once, beyond the uid's request bytes too; another tenant's group
    stays exact meanwhile; once the dispatch ends the session's calls run again."""
    with running_daemon(engines=1, timeout_seconds=30) as d:
        _bystander_round(d, "before")
        a, p, g, blocked = _blocked_session(d, "blocker-1")
        try:
            small = epd_pb2.ReleaseHandlesRequest(session_id=a.session_id, group_id=g.group_id,
                                                  handles=[1])
            extra = 8
            futures = _futures(a, backlog.MAX_CALLS_PER_SESSION + extra, small)
            refused = futures[-extra:]
            codes = _codes(refused, within=5)
            assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * extra, codes
            msg = refused[0].exception().details()
            assert "calls under way already" in msg and str(a.session_id) in msg, msg
            _bystander_round(d, "during")
            for f in futures[:-extra]:
                f.cancel()
            blocked.join(40)
            assert not blocked.is_alive()
            # Large requests: the uid's bytes bound (64 MiB) before the count's
            big = epd_pb2.ReleaseHandlesRequest(
                session_id=a.session_id, group_id=g.group_id,
                handles=[(1 << 62) + i for i in range(400_000)])
            size = big.ByteSize()
            fit = backlog.MAX_BYTES_PER_UID // size
            a2, p2, g2, blocked2 = _blocked_session(d, "blocker-2")
            try:
                big.session_id, big.group_id = a2.session_id, g2.group_id
                futures = _futures(a2, fit + 3, big)
                codes = _codes(futures[fit:], within=10)
                assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 3, codes
                assert any("would pass the engine's bound" in f.exception().details()
                           for f in futures[fit:] if f.done() and f.exception() is not None)
                for f in futures:
                    f.cancel()
            finally:
                blocked2.join(40)
                a2.close()
                p2.close()
        finally:
            a.close()
            p.close()
        _bystander_round(d, "after")


def test_the_combine_routing_check_takes_bounded_memory(monkeypatch):
    """check_combine_routing compared [T, K, K] at once (8 GiB of temporaries at T = 2^20,
    K = 64): now by chunks, with the same answers and the same error."""
    rng = np.random.default_rng(5)
    for t, k in ((0, 4), (1, 1), (37, 8), (300, 16)):
        dispatched = rng.integers(-1, 50, (t, k))
        pick = rng.integers(0, k, (t, k))
        combine = np.take_along_axis(dispatched, pick, axis=1)
        combine[rng.random((t, k)) < 0.2] = -1
        eq = (dispatched[:, None, :] == combine[:, :, None]) & (combine[:, :, None] >= 0)
        for chunk in (1, 7, 1 << 22):
            monkeypatch.setattr(base, "COMBINE_CHECK_ELEMENTS", chunk)
            got = base.check_combine_routing(dispatched, combine)
            ok = combine >= 0
            np.testing.assert_array_equal(got[ok], eq.argmax(axis=2)[ok])
        if t > 10:
            bad = combine.copy()
            bad[t - 3, 1], bad[t - 1, 0] = 99, 98
            monkeypatch.setattr(base, "COMBINE_CHECK_ELEMENTS", 5 * k * k)
            with pytest.raises(EpdError, match=rf"topk_idx\[{t - 3}, 1\] = 99"):
                base.check_combine_routing(dispatched, bad)
    monkeypatch.undo()
    t, k = 1 << 15, 64  # whole: 2 x 128 MiB of booleans
    dispatched = rng.integers(0, 1 << 20, (t, k))
    combine = dispatched[:, ::-1].copy()
    tracemalloc.start()
    try:
        base.check_combine_routing(dispatched, combine)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"


def test_refused_descriptor_connections_are_logged_rate_limited():
    """A uid holding its unauthenticated connections and connecting in a loop: each refusal
    wrote a line (30,000 a second); now one a second with the count of those left out."""
    with running_daemon(engines=1) as d:
        path = fdc.socket_path_for(d.socket(0))
        held = []
        try:
            for _ in range(64):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(path)
                held.append(c)
            time.sleep(0.3)
            t0, n = time.monotonic(), 0
            while time.monotonic() - t0 < 2.5:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                with contextlib.suppress(OSError):
                    c.connect(path)
                c.close()
                n += 1
            time.sleep(0.3)
            lines = [ln for ln in d.log().splitlines() if "refusing another" in ln]
            assert n > 100 and 1 <= len(lines) <= 5, (n, len(lines))
            assert any("more since the last line" in ln for ln in lines[1:]) or len(lines) == 1
        finally:
            for c in held:
                c.close()
        _bystander_round(d, "after-flood")


def test_calls_cancelled_while_they_wait_for_the_worker_leave_no_job_behind():
    """The backlog counts calls under way; a call cancelled (its deadline) while it waited in
    the worker's queue stayed there with its request, uncounted, until the worker got to it:
    a review grew an engine by 1.4 GiB with short-deadline calls behind a blocked dispatch.
    Now one call of the session is in the worker at a time, the others wait as coroutines,
    and a cancelled one is gone at once; one already in the worker is not run."""
    import asyncio

    from epd.server.engine import executor

    ex = executor.SessionExecutor(executor.EngineState(0), "session-t")
    release, ran = threading.Event(), []

    async def main() -> None:
        blocked = asyncio.ensure_future(ex.run(release.wait, 30))
        await asyncio.sleep(0.05)
        for i in range(300):
            call = asyncio.ensure_future(ex.run(ran.append, i))
            await asyncio.sleep(0)
            call.cancel()
        assert ex.worker._work_queue.qsize() == 0  # (only the blocked call, running)
        queued = asyncio.ensure_future(ex.run(ran.append, "last"))
        await asyncio.sleep(0.05)
        release.set()
        assert await blocked is True
        await queued
    asyncio.run(main())
    ex.worker.shutdown(wait=True)
    ex._waits.shutdown(wait=True)
    assert ran == ["last"], ran[:5]


def test_what_a_call_made_after_its_client_gave_up_is_discarded():
    """A call cancelled while it runs in the worker (a RegisterRegion whose client's deadline
    passed while the region opened): its result goes to `discard`, or the region stayed open,
    held by nobody and counted in no budget (a review)."""
    import asyncio

    from epd.server.engine import executor

    ex = executor.SessionExecutor(executor.EngineState(0), "session-t")
    started, release, dropped = threading.Event(), threading.Event(), []

    def open_region() -> str:
        started.set()
        release.wait(10)
        return "region r1"

    async def main() -> None:
        call = asyncio.ensure_future(ex.run(open_region, discard=dropped.append))
        while not started.is_set():
            await asyncio.sleep(0.01)
        call.cancel()
        release.set()
        for _ in range(200):
            if dropped:
                break
            await asyncio.sleep(0.01)
        assert call.cancelled()
        # A call that completes normally is not discarded
        assert await ex.run(lambda: "region r2", discard=dropped.append) == "region r2"
    asyncio.run(main())
    ex.worker.shutdown(wait=True)
    ex._waits.shutdown(wait=True)
    assert dropped == ["region r1"], dropped
