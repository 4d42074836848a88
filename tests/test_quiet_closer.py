"""The CUDA engine closes a departed client's IPC mappings only when no GPU work is in flight
(server/backends/cuda_quiet.py): never while a launching call is under way or a stream is busy,
soon after the engine is quiet, everything left at stop(). The GPU half (the rank-masking test
that stalled when a close came in the middle of a collective) is tests/gpu/test_rank_masking_gpu.py;
here the gating with the device replaced by two callables."""

from __future__ import annotations

import threading
import time

from epd.server.backends.cuda_quiet import POLL_SECONDS, QuietCloser


def _wait_for(cond, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def test_closes_only_when_quiet_and_no_launch_is_under_way() -> None:
    closed: list[int] = []
    busy = threading.Event()
    busy.set()  # a stream has work in flight
    closer = QuietCloser(lambda: not busy.is_set())
    try:
        closer.close_later(lambda: closed.append(0x1000))
        closer.close_later(lambda: closed.append(0x2000))
        time.sleep(5 * POLL_SECONDS)
        assert closed == [] and closer.pending == 2  # busy streams: nothing closed
        with closer.launching():
            busy.clear()  # streams idle, but a launching call is under way
            time.sleep(5 * POLL_SECONDS)
            assert closed == []
        assert _wait_for(lambda: closed == [0x1000, 0x2000]), closed
        assert closer.pending == 0
    finally:
        closer.stop()


def test_a_launch_waits_for_a_close_in_progress() -> None:
    """The closer holds its lock while it closes: a launch that comes meanwhile starts after."""
    order: list[str] = []
    started = threading.Event()

    def slow_close() -> None:
        started.set()
        time.sleep(0.2)
        order.append("closed")

    closer = QuietCloser(lambda: True)
    try:
        closer.close_later(slow_close)
        assert started.wait(5)
        with closer.launching():
            order.append("launched")
        assert order == ["closed", "launched"]
    finally:
        closer.stop()


def test_a_failing_close_does_not_stop_the_others() -> None:
    closed: list[int] = []

    def bad() -> None:
        raise RuntimeError("cudaIpcCloseMemHandle failed")

    closer = QuietCloser(lambda: True)
    try:
        closer.close_later(bad)
        closer.close_later(lambda: closed.append(0x5000))
        assert _wait_for(lambda: closed == [0x5000])
        assert closer.pending == 0
    finally:
        closer.stop()


def test_the_queue_length_is_reported() -> None:
    """What epd_cuda_closes_pending shows: the closes waiting, 0 once they ran."""
    seen: list[int] = []
    quiet = threading.Event()
    closer = QuietCloser(quiet.is_set, seen.append)
    try:
        closer.close_later(lambda: None)
        closer.close_later(lambda: None)
        assert seen == [1, 2]
        quiet.set()
        assert _wait_for(lambda: seen[-1] == 0), seen
    finally:
        closer.stop()


def test_stop_closes_what_is_left() -> None:
    closed: list[int] = []
    closer = QuietCloser(lambda: False)  # never quiet
    closer.close_later(lambda: closed.append(0x4000))
    time.sleep(3 * POLL_SECONDS)
    assert closed == []
    closer.stop()
    assert closed == [0x4000]
