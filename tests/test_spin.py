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
        # Until both made progress, within a bound (not a fixed 0.2 s: on a loaded 2-core
        # machine another process takes the CPU, and a count in a fixed time measured that)
        end = time.perf_counter() + 10.0
        looks = 0
        while (looks <= 100 or counted[0] <= 1000) and time.perf_counter() < end:
            spin.relax()
            looks += 1
    finally:
        done.set()
        t.join()
    assert looks > 100 and counted[0] > 1000, (looks, counted[0])


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


def test_spin_window_stretches_over_short_gaps_only() -> None:
    """After an operation the caller follows quickly, the window covers the gap (1.5x its
    average); after one it follows slowly (computing), and for an operation never seen, the
    base window; idle gaps weigh at most 2 x `longest`, so a few quick calls undo them."""
    w = spin.SpinWindow(50e-6, 1e-3)
    layout, dispatch = 3, 4  # ring ids
    assert w.window(None) == w.window(layout) == 50e-6
    for _ in range(8):
        w.seen(layout, 200e-6)  # layout, then dispatch 200 µs later
        w.seen(dispatch, 5e-3)  # dispatch, then the experts compute for 5 ms
    assert abs(w.window(layout) - 300e-6) < 1e-9
    assert w.window(dispatch) == 50e-6
    w.seen(layout, 60.0)  # an idle minute after a layout: at most `longest` spent on it
    assert w.window(layout) <= 1e-3
    for _ in range(3):  # the caller now computes after its layouts: no stretch
        w.seen(layout, 60.0)
    assert w.window(layout) == 50e-6
    quick = 0
    while w.window(layout) == 50e-6:
        w.seen(layout, 200e-6)
        quick += 1
    assert quick <= 8, "the idle gap took too long to forget"
    assert w.window(layout) <= 1e-3


def test_spin_window_fixed_when_longest_is_not_above_base() -> None:
    w = spin.SpinWindow(50e-6, 0.0)  # fast_path_spin_max_us=0
    w.seen(1, 10e-6)
    assert w.window(1) == 50e-6  # (a shorter gap than the base never shrinks the window)
    w = spin.SpinWindow(50e-6, 1e-3)
    w.seen(1, 10e-6)
    assert w.window(1) == 50e-6
