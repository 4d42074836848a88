"""Pacing (server/engine/pacing.py): a throughput call waits while latency work is in flight,
never longer than the pause; latency calls and idle engines are never delayed."""

from __future__ import annotations

import threading
import time

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
