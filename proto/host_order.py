"""Memory order for the host side of EPD's shared-memory protocols: the fast-path ring
(client and engine processes), counter pages and trigger rings in mapped host memory (the host
and the GPU), the CPU backend's comm file (engine processes).

Each protocol publishes data, then a flag; its reader loads the flag, then the data. x86-64
keeps stores in order with stores and loads with loads (TSO), which these protocols were
written on. aarch64 (NVIDIA Grace, GH200) reorders both, so a reader could see a flag before
the data behind it. So a writer calls `publish()` before its flag store and a reader
`consume()` after its flag load; both are no-ops on x86-64. A handshake in which each side
stores, then loads what the other stored (the fast path's doorbell) needs `full()`, a store
before a later load, which TSO does not keep either: that one is a real fence everywhere.

Python has no fence instruction. A release followed by an acquire is one (ARMv8's
release/acquire are RCsc: loads and stores before the release are ordered before it, the
acquire after it, and those after the acquire after that); a per-thread lock released and
taken again gives both (CPython's lock is a semaphore on 3.12, glibc's sem_post a release and
its wait an acquire; a PyMutex of seq_cst atomics from 3.13). About 0.1-0.2 µs a call.
`EPD_HOST_FENCES=1` makes publish and consume fence on x86 as well (tests run the fenced
paths that way)."""

from __future__ import annotations

import os
import platform
import threading

_TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
FENCES = not _TSO or os.environ.get("EPD_HOST_FENCES", "") == "1"
_local = threading.local()


def full() -> None:
    """Order every load and store before this call before every one after it."""
    lock = getattr(_local, "lock", None)
    if lock is None:
        lock = _local.lock = threading.Lock()
    # Held from here on whatever the last call left: an exception raised between its release
    # and acquire (a signal handler's KeyboardInterrupt) left it free, and a release of a free
    # lock raised RuntimeError in every later call of the thread. (Per thread: never blocks.)
    lock.acquire(blocking=False)
    lock.release()
    lock.acquire()


def _nothing() -> None:
    return None


# A writer's data before its flag; a reader's flag before its data.
publish = full if FENCES else _nothing
consume = full if FENCES else _nothing
