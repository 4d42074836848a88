"""How EPD's host threads wait for a few microseconds: spin without holding the GIL, sleep
without Linux's timer slack.

Every hop of a call has a thread waiting for a word in shared memory (the engine's ring thread
for a request, the client for the answer, the stream-op poller for a doorbell, a rank for its
receive counts). Two habits of CPython on Linux made each such wait cost ~60 µs, whatever the
real latency:

* `time.sleep(0)`, the usual way to spin while letting other threads have the GIL, is a
  `clock_nanosleep`, and the kernel rounds every timed sleep up by the thread's *timer slack*
  (50 µs by default): one look per ~60 µs (measured: 61 µs per `sleep(0)`, 80 µs per
  `sleep(20e-6)`, 1.1 µs per `os.sched_yield()`).
* a pure-Python spin holds the GIL, so a thread waiting in one starves the engine's other
  threads (other sessions' rings, the poller) for up to the switch interval.

So a spin relaxes with `relax()` (`sched_yield`, which releases the GIL and has no timer), and a
process whose threads sleep in short slices (the engine) sets a fine timer slack once, before its
threads start (threads inherit it). A client's threads are its caller's: the client library only
spins with `relax()` and leaves their timer slack alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections.abc import Callable

PR_SET_TIMERSLACK, PR_GET_TIMERSLACK = 29, 30  # <linux/prctl.h>
ENGINE_TIMER_SLACK_NS = 1000  # what an engine's threads get (Linux's default: 50 000)

relax: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


def timer_slack_ns() -> int | None:
    """The calling thread's timer slack (None where it cannot be read)."""
    prctl = _prctl()
    if prctl is None:
        return None
    value = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)
    return value if value >= 0 else None


def set_timer_slack_ns(ns: int) -> bool:
    """Set the calling thread's timer slack (inherited by the threads it starts later);
    whether it took."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_TIMERSLACK, int(ns), 0, 0, 0) == 0


def wait_until(ready: Callable[[], bool], timeout: float, *, spin: float = 5e-4,
               nap: float = 20e-6) -> bool:
    """Until `ready()` (True) or `timeout` seconds (False): `relax()` between looks for the
    first `spin` seconds, then sleep `nap` between looks."""
    start = time.perf_counter()
    deadline = start + timeout
    spin_until = start + min(spin, timeout)
    while not ready():
        now = time.perf_counter()
        if now < spin_until:
            relax()
        elif now >= deadline:
            return ready()
        else:
            time.sleep(nap)
    return True
