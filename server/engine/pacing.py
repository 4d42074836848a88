"""Pacing: a throughput-class call waits, bounded, while latency-class work is in the engine.

One engine process serves every group of its GPU, so a prefill pool's calls and a decode pool's
calls compete for the engine's host: its interpreter (the decode's armed ops are launched by
the poller thread, which needs it), and on the cpu backend the cores the collectives run on. A
throughput call that starts while latency work is in flight waits first, polling every
`POLL_SECONDS` with the interpreter released, for at most `--throughput-pause-us`: a throughput
group is slowed, never stalled, and its peers' deadlines are far longer than the pause.

Latency work in flight: a latency-class data call running on a session's thread (counted by
`latency()`), or an armed latency op whose trigger is pending or whose launch is running (the
poller, server/engine/stream_ops.py). A call of a group whose session the engine does not know
yet (refused a moment later) is not paced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from .. import metrics, service_classes
from ..in_flight import InFlight

T = TypeVar("T")
POLL_SECONDS = 20e-6


class Pacer:
    def __init__(self, max_pause_seconds: float,
                 rung: Callable[[], bool] = lambda: False) -> None:
        """`rung()`: whether an armed latency op waits for its launch (cheap, any thread)."""
        self.max_pause = max(0.0, max_pause_seconds)
        self._rung = rung
        self._latency = InFlight()

    @property
    def enabled(self) -> bool:
        """Off (the default pause 0): nothing is counted and collectives run unwrapped."""
        return self.max_pause > 0

    def latency(self) -> contextlib.AbstractContextManager[None]:
        """Latency work in flight for the duration of the block."""
        return self._latency.call()

    def busy(self) -> bool:
        return bool(self._latency) or self._rung()

    def admit(self, group: str) -> float:
        """Before a throughput call: wait while latency work is in flight, at most the pause.
        Returns the seconds waited (also counted in epd_paced_seconds_total)."""
        if self.max_pause <= 0 or not self.busy():
            return 0.0
        t0 = time.perf_counter()
        deadline = t0 + self.max_pause
        while self.busy() and time.perf_counter() < deadline:
            time.sleep(POLL_SECONDS)
        waited = time.perf_counter() - t0
        metrics.PACED_SECONDS.labels(group).inc(waited)
        metrics.PACED_CALLS.labels(group).inc()
        return waited

    def run(self, service_class: str, group: str, call: Callable[[], T]) -> T:
        """Run one data call of a group of `service_class` ("latency" or "throughput")."""
        if service_class == service_classes.LATENCY:
            with self.latency():
                return call()
        self.admit(group)
        return call()
