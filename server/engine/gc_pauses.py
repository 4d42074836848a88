"""The engine's garbage collector: what it costs the threads that serve calls, and less of it.

CPython's cyclic collector stops every thread of the process while it runs, and a full
collection walks every tracked object: an engine holds some 40k after its imports (NumPy,
gRPC, protobuf, prometheus_client; more with CuPy), 27 ms per full collection on this
project's CPU machine. A call that arrives during one waits for it, which is a p99 of
milliseconds for a latency group whose calls take a few hundred µs (issue 14).

`install()`, once the engine is up, moves everything that exists then into the permanent
generation (`gc.freeze()`): modules, compiled kernels and the backend's state are never walked
again, while what calls and sessions create afterwards is collected as before. It also times
every collection; `flush()` (the engine's event loop, every FLUSH_SECONDS) puts the pauses into
`epd_engine_gc_pause_seconds{generation}`, so an operator sees the pauses a tenant's latency
figures include. `--no-gc-freeze` keeps the collector as CPython sets it.

The callback itself takes no lock and touches no metric: a collection can start inside any
allocation, including one made while its thread holds prometheus_client's value lock, and
observing from there would wait for that lock forever (an engine hung that way in the CPU
suite). It only appends to a deque (atomic under the GIL).
"""

from __future__ import annotations

import collections
import gc
import logging
import time

from .. import metrics

log = logging.getLogger("epd.engine")
FLUSH_SECONDS = 1.0
_started: list[float] = []  # the running collection's start (the collector does not nest)
_pauses: collections.deque[tuple[str, float]] = collections.deque(maxlen=100_000)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        _pauses.append((str(info.get("generation", -1)), time.perf_counter() - _started.pop()))


def flush() -> None:
    """Observe the pauses timed since the last flush (from a thread holding no metric lock)."""
    while _pauses:
        generation, seconds = _pauses.popleft()
        metrics.ENGINE_GC_PAUSE_SECONDS.labels(generation).observe(seconds)


def install(freeze: bool) -> None:
    """Time the engine's collections; with `freeze`, take what exists now out of them."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    if freeze:
        gc.collect()  # (what is garbage already goes now, not into the permanent generation)
        gc.freeze()
        log.debug("gc: %d objects frozen out of the collector's walks", gc.get_freeze_count())
    flush()
