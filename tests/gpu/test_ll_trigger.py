"""client/ll_trigger.py's kernel alone on the GPU, on a member's ring slot in mapped host
memory (as the session's counter page is): it publishes an entry, waits while the ring is
full and fails the call at its deadline, and stops waiting as soon as the session's release
is seen (it used to wait out the deadline, holding the caller's stream)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def slot():
    import cupy as cp

    from epd.client import ll_trigger

    from .local_group import MappedSlot

    ll_trigger.load(0)  # (loaded before a stream is parked on it, as the client does)
    page = MappedSlot(4096)
    ring, done = page.words.view(np.uint32)[:128], page.words.view(np.uint32)[512:513]
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        yield page, ring, done, stream
    finally:
        ring[66] = 1  # (whatever happened, no kernel stays in its wait)
        stream.synchronize()
        page.close()


def _launch(page, stream, entry: int, timeout: float) -> None:
    from epd.client import ll_trigger
    ll_trigger.trigger(stream.ptr, 0, page.ptr + 512 * 4, page.ptr, entry, timeout)


def _wait_done(stream, seconds: float) -> float:
    t0 = time.monotonic()
    while not stream.done and time.monotonic() - t0 < seconds:
        time.sleep(0.001)
    assert stream.done, f"the trigger still runs after {seconds} s"
    return time.monotonic() - t0


def test_an_entry_is_published_at_the_tail(slot) -> None:
    from epd.proto import abi
    page, ring, done, stream = slot
    ring[abi.LL_RING_TAIL], ring[abi.LL_RING_HEAD] = 130, 100  # (30 in flight: room)
    done[0] = 7
    _launch(page, stream, 0xABC, 5.0)
    _wait_done(stream, 10)
    assert ring[130 % abi.LL_RING] == 0xABC and ring[abi.LL_RING_TAIL] == 131
    assert done[0] == 0  # cleared for the op's end to write


def test_a_full_ring_fails_the_call_at_its_deadline(slot) -> None:
    from epd.proto import abi
    page, ring, done, stream = slot
    ring[abi.LL_RING_TAIL], ring[abi.LL_RING_HEAD] = 64, 0
    _launch(page, stream, 5, 0.2)
    took = _wait_done(stream, 10)
    assert took >= 0.15
    assert done[0] == abi.DONE_FAILED | (abi.ERR_RING_FULL << abi.DONE_CODE_SHIFT)
    assert ring[abi.LL_RING_TAIL] == 64  # nothing overwritten


def test_a_release_ends_the_wait_on_a_full_ring_at_once(slot) -> None:
    from epd.proto import abi
    page, ring, done, stream = slot
    ring[abi.LL_RING_TAIL], ring[abi.LL_RING_HEAD] = 64, 0
    _launch(page, stream, 5, 60.0)
    time.sleep(0.1)
    assert not stream.done  # (waiting for the head)
    ring[abi.LL_RING_RELEASED] = 1  # what StreamOp.release does when the session ends
    took = _wait_done(stream, 10)
    assert took < 5, took
    assert done[0] == abi.DONE_RELEASED and ring[abi.LL_RING_TAIL] == 64
