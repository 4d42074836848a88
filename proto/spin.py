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
    if not timeout >= 0:  # NaN: no comparison with it is ever true, so the loop never ended
        timeout = 0.0
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


class SpinWindow:
    """How long a thread spins for what it waits for before it sleeps on its futex: the
    engine's ring thread for the next request (below), a client for an answer (the same rule
    over the times its recent answers of that operation took; client/transport.py).

    A caller's sequence of calls leaves gaps between an answer and the next request: short
    where the caller only handles the answer (output tensors, stream operations; layout then
    dispatch), long where it computes (the experts between dispatch and combine, attention
    between layers). A thread that sleeps after a short spin pays a futex wake-up on each
    request after a short gap (measured on the H200: a 500 µs spin took layout + dispatch +
    combine at D from 2554 to 2263 µs and the engine's work per layout from 192 to 105 µs);
    spinning that long after every answer would burn a core through the long gaps. So the
    window follows the gaps that came after the same kind of answer (its operation): `stretch`
    times their moving average when that fits within `longest`, else the `base` window (then
    the caller is computing, and a sleep costs nothing). A gap counts at most 2 x `longest`,
    so an idle minute is forgotten after a few quick calls."""

    STRETCH = 1.5
    ALPHA = 0.25  # weight of the newest gap in the moving average

    def __init__(self, base: float, longest: float) -> None:
        self.base = max(base, 0.0)
        self.longest = max(longest, self.base)
        self._gap: dict[int | None, float] = {}  # answered operation -> moving average of the gaps

    def seen(self, after: int, gap: float) -> None:
        """`gap` seconds passed from answering operation `after` to the next request (the
        thread's wake-up included)."""
        gap = min(gap, 2 * self.longest)
        old = self._gap.get(after)
        self._gap[after] = gap if old is None else old + self.ALPHA * (gap - old)

    def window(self, after: int | None) -> float:
        """Seconds to spin after answering operation `after` (None: nothing answered yet)."""
        gap = self._gap.get(after)
        if gap is None:
            return self.base
        want = self.STRETCH * gap
        return want if self.base < want <= self.longest else self.base
