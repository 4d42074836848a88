"""An operation that runs past --slow-operation-seconds is logged once, with the stack of the
thread running it, and again when it ends; quick ones are not; off at 0 (server/engine/
watchdog.py through the session executor every operation runs in)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from epd.server.engine.executor import EngineState, SessionExecutor
from epd.server.engine.watchdog import SlowOperations


def _waits_for_the_driver(gate: threading.Event) -> str:
    gate.wait(5)  # stands for a driver call that does not return
    return "done"


def _quick() -> int:
    return 7


@pytest.fixture
def executor():
    slow = SlowOperations(0.2, period=0.05)
    ex = SessionExecutor(EngineState(0), "s0abcde", slow=slow)
    yield ex, slow
    slow.stop()
    ex.worker.shutdown(wait=True)


def test_a_stalled_operation_names_itself_and_where_it_waits(executor, caplog) -> None:
    ex, _ = executor
    caplog.set_level(logging.WARNING, logger="epd.engine")
    gate = threading.Event()
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(ex.call(_waits_for_the_driver, gate)))
    t.start()
    deadline = time.monotonic() + 5
    while "has been running" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # more periods: still reported once
    gate.set()
    t.join(5)
    assert result == ["done"]
    running = [r.getMessage() for r in caplog.records if "has been running" in r.getMessage()]
    assert len(running) == 1, running
    msg = running[0]
    assert msg.startswith("_waits_for_the_driver of s0abcde has been running for")
    assert "gate.wait(5)" in msg and "in _waits_for_the_driver" in msg  # its thread's stack
    assert any("_waits_for_the_driver of s0abcde finished after" in r.getMessage()
               for r in caplog.records)


def test_quick_operations_are_not_reported(executor, caplog) -> None:
    ex, slow = executor
    caplog.set_level(logging.WARNING, logger="epd.engine")
    assert [ex.call(_quick) for _ in range(50)] == [7] * 50
    time.sleep(0.3)
    assert slow.report() == 0 and "has been running" not in caplog.text


def test_off_at_zero_no_watchdog() -> None:
    """At 0 there is no watchdog: none can be made, and an executor without one runs calls."""
    with pytest.raises(ValueError):
        SlowOperations(0)
    ex = SessionExecutor(EngineState(0), "s0abcde")
    try:
        assert ex.call(_quick) == 7
    finally:
        ex.worker.shutdown(wait=True)
