"""Closing CUDA IPC mappings only while the engine has no GPU work in flight.

Why: `cudaIpcCloseMemHandle` waits for the device, and while it waits the driver holds back
every other launch of the process (benchmarks/probe_ipc_close.py on one H200, with and without
MPS, with CuPy's binding and cuda.bindings alike: a second thread's launch, or the kernel it
launched, waited 2.8-3.0 s until a spinning kernel gave up). In the engine a rank's kernel spins
for its peers' kernels, which this same process launches; closing a departed client's mapping
then stalls the survivors until their deadline (the CUDA rank-masking test's failure).

So the engine never closes a mapping at once: it queues the pointer, and a closer thread closes
the queue when no launch is under way (every launching call holds `launching()`) and every
stream of the engine is idle. It holds the lock while it closes, so no launch starts meanwhile;
with nothing in flight the close is quick. An engine that is never quiet (an armed low-latency
chain keeps kernels queued) keeps a departed client's mappings until it is; the backend closes
whatever is left after its last synchronisation.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("epd.cuda")
POLL_SECONDS = 0.05  # how often the closer looks for a quiet moment


class QuietCloser:
    """Queue of IPC mappings to close when the engine is quiet (see the module docstring)."""

    def __init__(self, close: Callable[[int], None], quiet: Callable[[], bool]) -> None:
        self._close, self._quiet = close, quiet
        self._lock = threading.Lock()
        self._active = 0  # calls under way that may launch GPU work
        self._pending: list[int] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Held by every call that launches GPU work (cheap: a lock and a counter)."""
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def close_later(self, ptr: int) -> None:
        with self._lock:
            self._pending.append(ptr)
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="epd-ipc-close",
                                                 daemon=True)
                self._thread.start()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def try_close(self) -> int:
        """Close the queue now if the engine is quiet; how many mappings were closed."""
        with self._lock:
            if not self._pending or self._active or not self._quiet():
                return 0
            ptrs, self._pending = self._pending, []
            for ptr in ptrs:  # under the lock: no launch starts until the closes are done
                self._close(ptr)
        return len(ptrs)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            try:
                self.try_close()
            except Exception:  # a failed query must not end the thread: log, try again
                log.exception("closing CUDA IPC mappings")

    def stop(self) -> None:
        """After the device's last synchronisation: close everything left."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            ptrs, self._pending = self._pending, []
        for ptr in ptrs:
            self._close(ptr)
