"""The fast path watches the session's lease (issue 12, finding 5): when the engine dies, a call
waiting on the ring fails with UNAVAILABLE within ~100 ms instead of at its deadline, and later
calls fail at once."""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from ranklib import NoGrpc, comm_arrivals, wait_until

from epd.client import EpdError, Session
from epd.client.transport import FUTEX_WAIT_SECONDS, FastPathTransport
from epd.proto import ring as R
from epd.proto.v1 import epd_pb2
from epd.server.demo import Workload

DETECT_LIMIT = 0.5  # seconds from the kill to the failed call (the target is 0.1)
AT_ONCE = 1.0  # a later call (not its 30 s deadline; a loaded host may be slow)


def _waiting_call(t: FastPathTransport, out: list) -> threading.Thread:
    def run() -> None:
        try:
            t.call("Ping", epd_pb2.PingRequest(), 30)
            out.append(("ok", time.monotonic()))
        except EpdError as e:
            out.append((e, time.monotonic()))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    words, _, _ = t.ring.slot(0)
    wait_until(lambda: int(words[R.S_STATE]) == R.SUBMITTED, 5, "the call is on the ring")
    time.sleep(0.12)  # past the spin: asleep in FUTEX_WAIT, mid-slice
    return th


def _ring_without_engine(tmp_path, slots: int, slot_bytes: int):
    """(engine-side ring nobody serves, client FastPathTransport on it), for either ring API:
    a named file (Ring(path, ..., create=)) or a memfd (Ring.create / the descriptor)."""
    params = list(inspect.signature(FastPathTransport.__init__).parameters)
    if hasattr(R.Ring, "from_fd"):
        engine_side = R.Ring.create(slots, slot_bytes)
        where = (R.Ring.from_fd(os.dup(engine_side.fd), slots, slot_bytes)
                 if params[2] == "ring" else os.dup(engine_side.fd))
    else:
        where = str(tmp_path / "lease.ring")
        engine_side = R.Ring(where, slots, slot_bytes, create=True)
    t = FastPathTransport(NoGrpc(), where, slots, slot_bytes, 20e-6)  # type: ignore
    return engine_side, t


@pytest.mark.parametrize("wake", [True, False])
def test_waiting_ring_call_fails_when_the_lease_is_lost(tmp_path, wake: bool) -> None:
    """No engine answers the ring; the lease thread's `lease_lost` (or, without the futex wake,
    the bounded wait slice alone) ends the waiting call with UNAVAILABLE."""
    engine_side, t = _ring_without_engine(tmp_path, 4, R.MIN_SLOT_BYTES)
    try:
        out: list = []
        th = _waiting_call(t, out)
        t0 = time.monotonic()
        if wake:
            t.lease_lost("the engine went away: test")
        else:
            t.lost = "the engine went away: test"  # noticed at the next slice
        th.join(5)
        assert out, "the waiting call did not return"
        err, done = out[0]
        took = done - t0
        print(f"waiting ring call failed {took * 1e3:.1f} ms after the lease was lost "
              f"(futex wake: {wake})")
        assert isinstance(err, EpdError) and err.code == grpc.StatusCode.UNAVAILABLE
        assert "the engine went away" in err.details
        assert took < (1.0 if wake else FUTEX_WAIT_SECONDS + 1.0)  # (not the 30 s deadline;
        # a loaded 2-core host may deschedule the waiter for a while)
        t1 = time.monotonic()
        with pytest.raises(EpdError) as ei:
            t.call("Ping", epd_pb2.PingRequest(), 30)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        pending = t.call_async("Ping", epd_pb2.PingRequest(), 30)
        with pytest.raises(EpdError) as ei:
            pending.result()
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - t1 < AT_ONCE
    finally:
        t.close()
        engine_side.close(unlink=True)


@pytest.mark.slow
def test_engine_killed_fails_the_fast_path_call_at_once(daemon_factory) -> None:
    """Rank 0 dispatches through the ring while rank 1 never calls, so the call waits in the
    engine; SIGKILL of rank 0's engine fails it within DETECT_LIMIT (not deadline + 5 s)."""
    wl = Workload(2, [13, 9], 128, 8, 2, seed=21, drop_prob=0.1)
    with daemon_factory(engines=2) as d:
        sessions = [Session(d.socket(r)) for r in range(2)]
        s0 = sessions[0]
        dead_session = s0.session_id
        try:
            assert s0.transport == "fastpath"
            with ThreadPoolExecutor(2) as ex:
                groups = list(ex.map(lambda r: sessions[r].join(
                    "lease", rank=r, num_ranks=2, num_experts=wl.num_experts,
                    hidden=wl.hidden, max_tokens_per_rank=max(wl.tokens),
                    num_topk=wl.num_topk), range(2)))
            x, idx, w = wl.inputs(0)
            out: list = []

            def dispatch() -> None:
                try:
                    groups[0].dispatch(x, idx, w)  # the daemon's 3 s deadline (+5 s margin)
                    out.append(("completed without its peer", time.monotonic()))
                except EpdError as e:
                    out.append((e, time.monotonic()))
            th = threading.Thread(target=dispatch, daemon=True)
            th.start()
            gid = groups[0].group_id
            wait_until(lambda: (a := comm_arrivals(d.shm_dir, gid, 2)) is not None
                       and a[0] >= 1, 10, "rank 0 arrives in dispatch")
            ring = s0._transport.ring
            assert any(int(ring.slot(i)[0][R.S_STATE]) == R.SUBMITTED
                       for i in range(ring.slots)), "the dispatch is not waiting on the ring"
            time.sleep(0.1)  # the client sleeps in FUTEX_WAIT by now
            pid = d.engine_pid(0)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            th.join(20)
            assert out, "the dispatch did not return"
            err, done = out[0]
            took = done - killed
            print(f"fast-path call failed {took * 1e3:.1f} ms after SIGKILL of the engine")
            assert isinstance(err, EpdError), err
            assert err.code == grpc.StatusCode.UNAVAILABLE, err
            assert "the engine went away" in err.details and dead_session in err.details
            assert took < DETECT_LIMIT
            t1 = time.monotonic()
            with pytest.raises(EpdError) as ei:
                s0.ping()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(EpdError) as ei:
                groups[0].dispatch(x, idx, w)
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t1 < AT_ONCE
            wait_until(lambda: d.engine_pid(0) != pid and d.get("/readyz")[0] == 200, 30,
                       "engine 0 restarted")
        finally:
            for s in sessions:
                s.close()
            # The dead engine could not remove its session's files (test_faults.py).
            for f in os.listdir(d.shm_dir):
                if dead_session in f:
                    os.unlink(os.path.join(d.shm_dir, f))
