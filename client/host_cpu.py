"""CPU this process spends spinning for the engine's replies and for a dispatch's receive
count, so that a benchmark can tell the client's own work per call (Python: descriptors,
requests, stream operations) from its waits (issue 10's "host CPU per call", which counts the
work). The fast-path transport spins briefly for each reply before it sleeps on a futex, and a
dispatch spins for the count its notify kernel publishes (the host wait DeepEP's dispatch has
too): CPU time, but not work.
"""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
_wait = 0.0


def wait_seconds() -> float:
    """Thread CPU seconds spent waiting for replies so far, all threads of this process."""
    return _wait


class waiting:
    """Count the calling thread's CPU inside the block as waiting."""

    __slots__ = ("_t0",)

    def __enter__(self) -> None:
        self._t0 = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        global _wait
        spent = time.thread_time() - self._t0
        with _lock:
            _wait += spent
