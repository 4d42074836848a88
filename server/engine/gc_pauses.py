"""The engine's garbage collector: what it costs the threads that serve calls, and less of it.

CPython's cyclic collector stops every thread of the process while it runs, and a full
collection walks every tracked object: an engine holds some 40k after its imports (NumPy,
gRPC, protobuf, prometheus_client; more with CuPy), 27 ms per full collection on this
project's CPU machine. A call that arrives during one waits for it, which is a p99 of
milliseconds for a latency group whose calls take a few hundred µs (issue 14).

`install()`, once the engine is up, moves everything that exists then into the permanent
generation (`gc.freeze()`): modules, compiled kernels and the backend's state are never walked
again, while what calls and sessions create afterwards is collected as before. It also times
every collection into `epd_engine_gc_pause_seconds{generation}`, so an operator sees the pauses
a tenant's latency figures include. `--no-gc-freeze` keeps the collector as CPython sets it.
"""

from __future__ import annotations

import gc
import logging
import time

from .. import metrics

log = logging.getLogger("epd.engine")
_started: list[float] = []  # the running collection's start (the collector does not nest)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        # (held in the thread's batch when it has one: a gen-0 collection is frequent)
        metrics.observe(metrics.ENGINE_GC_PAUSE_SECONDS, (str(info.get("generation", -1)),),
                        time.perf_counter() - _started.pop())


def install(freeze: bool) -> None:
    """Time the engine's collections; with `freeze`, take what exists now out of them."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    if freeze:
        gc.collect()  # (what is garbage already goes now, not into the permanent generation)
        gc.freeze()
        log.debug("gc: %d objects frozen out of the collector's walks", gc.get_freeze_count())
