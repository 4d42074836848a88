"""proto/spin.py: waits that let go of the GIL and sleep without the kernel's timer slack."""

from __future__ import annotations

import threading
import time

import pytest

from epd.proto import spin


def test_wait_until_sees_a_word_set_by_another_thread() -> None:
    box = [0]
    t = threading.Timer(0.02, lambda: box.__setitem__(0, 1))
    t.start()
    t0 = time.perf_counter()
    assert spin.wait_until(lambda: box[0] == 1, 5.0, spin=1e-3)
    assert time.perf_counter() - t0 < 2.0
    t.join()


def test_wait_until_gives_up_at_its_timeout() -> None:
    t0 = time.perf_counter()
    assert not spin.wait_until(lambda: False, 0.05, spin=0.01)
    took = time.perf_counter() - t0
    assert 0.05 <= took < 1.0


def test_relax_lets_other_threads_run() -> None:
    """A thread spinning with relax() must not starve a Python thread of the same process (a
    pure-Python spin would hold the GIL for whole switch intervals)."""
    done = threading.Event()
    counted = [0]

    def work() -> None:
        while not done.is_set():
            counted[0] += 1

    t = threading.Thread(target=work)
    t.start()
    try:
        end = time.perf_counter() + 0.2
        looks = 0
        while time.perf_counter() < end:
            spin.relax()
            looks += 1
    finally:
        done.set()
        t.join()
    assert looks > 100 and counted[0] > 1000


@pytest.mark.skipif(spin.timer_slack_ns() is None, reason="no prctl timer slack (not Linux)")
def test_timer_slack_is_set_and_inherited() -> None:
    seen = {}

    def child() -> None:
        seen["child"] = spin.timer_slack_ns()

    def parent() -> None:
        assert spin.set_timer_slack_ns(2000)
        seen["parent"] = spin.timer_slack_ns()
        c = threading.Thread(target=child)
        c.start()
        c.join()

    p = threading.Thread(target=parent)  # not this thread: pytest's own keeps its slack
    p.start()
    p.join()
    assert seen == {"parent": 2000, "child": 2000}
