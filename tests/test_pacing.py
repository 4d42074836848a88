"""Pacing (server/engine/pacing.py): a throughput call waits while latency work is in flight,
never longer than the pause; latency calls and idle engines are never delayed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from daemon_harness import samples, value
from ranklib import comm_arrivals, wait_until

from epd.client import EpdError, Session
from epd.server.engine.pacing import Pacer


def _hold_latency(p: Pacer, seconds: float) -> threading.Thread:
    started = threading.Event()

    def run() -> None:
        with p.latency():
            started.set()
            time.sleep(seconds)

    t = threading.Thread(target=run)
    t.start()
    started.wait(5)
    return t


def test_idle_engine_and_latency_calls_are_not_delayed() -> None:
    p = Pacer(0.5)
    assert p.admit("g") == 0.0
    t = _hold_latency(p, 0.2)
    t0 = time.perf_counter()
    assert p.run("latency", "decode", lambda: 7) == 7  # a latency call never waits
    assert time.perf_counter() - t0 < 0.1
    t.join()


def test_throughput_waits_for_latency_work_to_finish() -> None:
    p = Pacer(2.0)
    t = _hold_latency(p, 0.05)
    waited = p.admit("prefill")
    t.join()
    assert 0.02 <= waited < 1.0  # until the latency call ended, not the whole pause
    assert not p.busy()


def test_the_wait_is_bounded_by_the_pause() -> None:
    p = Pacer(0.03)
    t = _hold_latency(p, 0.5)
    t0 = time.perf_counter()
    ran = p.run("throughput", "prefill", lambda: "ran")
    took = time.perf_counter() - t0
    assert ran == "ran" and 0.025 <= took < 0.3
    t.join()


def test_rung_latency_ops_count_and_zero_pause_disables() -> None:
    rung = {"on": True}
    p = Pacer(0.02, rung=lambda: rung["on"])
    assert p.busy() and p.admit("prefill") >= 0.015
    rung["on"] = False
    assert p.admit("prefill") == 0.0
    off = Pacer(0.0, rung=lambda: True)
    assert off.admit("prefill") == 0.0


def test_latency_work_is_counted_across_threads() -> None:
    p = Pacer(1.0)
    threads = [_hold_latency(p, 0.05) for _ in range(3)]
    assert p.busy()
    for t in threads:
        t.join()
    assert not p.busy()


# -- through a daemon: the pacer sits in front of every collective ---------------------------

DAEMON_ENGINES = 1  # both pools on one engine, as on one GPU
DAEMON_EXTRA = ["--service-class-policy", "pace-decode-*=latency,pace-prefill-*=throughput",
                "--throughput-pause-us", "300000"]


def _join(s, name: str, rank: int, num_ranks: int):
    return s.join(name, rank=rank, num_ranks=num_ranks, num_experts=2 * num_ranks, hidden=64,
                  max_tokens_per_rank=8, num_topk=1, dtype="float32")


def _inputs(num_ranks: int):
    x = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)
    idx = (np.arange(4, dtype=np.int64) % (2 * num_ranks)).reshape(4, 1)
    return x, idx, np.ones((4, 1), np.float32)


def test_a_throughput_call_waits_while_a_latency_collective_runs(daemon) -> None:
    """A decode rank's dispatch waits for its peer (who never calls) until its deadline; a
    prefill call on the same engine meanwhile waits the pause (300 ms here), no longer, then
    runs; epd_paced_* count it. The decode call then fails on its own deadline."""
    with Session(daemon.socket(0), timeout=10) as a0, \
            Session(daemon.socket(0), timeout=10) as a1, \
            Session(daemon.socket(0), timeout=10) as b, ThreadPoolExecutor(2) as pool:
        j0 = pool.submit(_join, a0, "pace-decode-a", 0, 2)
        ga1 = _join(a1, "pace-decode-a", 1, 2)
        ga0 = j0.result(timeout=30)
        assert (ga0.service_class, ga1.service_class) == ("latency", "latency")
        gb = _join(b, "pace-prefill-a", 0, 1)
        assert gb.service_class == "throughput"
        gb.dispatch(*_inputs(1))  # warm: nothing in flight, so no pacing
        before = samples(daemon)
        arrived = comm_arrivals("", ga0.group_id, 2)
        stuck = pool.submit(ga0.dispatch, *_inputs(2), timeout=2.0)
        wait_until(lambda: (a := comm_arrivals("", ga0.group_id, 2)) is not None
                   and a[0] > arrived[0], 10, "rank 0 inside its collective")
        t0 = time.perf_counter()
        out = gb.dispatch(*_inputs(1))
        took = time.perf_counter() - t0
        assert out.num_recv_tokens == 4
        assert 0.25 <= took < 1.5, took  # paced by the pause, not by the decode's deadline
        with pytest.raises(EpdError) as ei:
            stuck.result(timeout=30)
        assert ei.value.code.name == "DEADLINE_EXCEEDED"
        after = samples(daemon)
        paced = value(after, "epd_paced_calls_total", group="pace-prefill-a")
        earlier = sum(x.value for x in before.get("epd_paced_calls_total", [])
                      if x.labels.get("group") == "pace-prefill-a")
        assert paced - earlier >= 1
        assert value(after, "epd_paced_seconds_total", group="pace-prefill-a") >= 0.25
