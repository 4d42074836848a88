"""Closing CUDA IPC mappings (and unregistering host pages) only while the engine has no GPU
work in flight.

Why: `cudaIpcCloseMemHandle` waits for the device, and while it waits the driver holds back
every other launch of the process (benchmarks/probe_ipc_close.py on one H200, with and without
MPS, with CuPy's binding and cuda.bindings alike: a second thread's launch, or the kernel it
launched, waited 2.8-3.0 s until a spinning kernel gave up). In the engine a rank's kernel spins
for its peers' kernels, which this same process launches; closing a departed client's mapping
then stalls the survivors until their deadline (the CUDA rank-masking test's failure).

`cudaHostUnregister` of a departed client's counter page is the same kind of call (it unpins
memory the device may be using) and goes the same way.

So the engine never closes a mapping at once: it queues the close, and a closer thread runs
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
from collections.abc import Callable

from ...proto.thread_names import NamedThread
from ..in_flight import InFlight

log = logging.getLogger("epd.cuda")
POLL_SECONDS = 0.05  # how often the closer looks for a quiet moment


class QuietCloser:
    """Queue of IPC mappings to close when the engine is quiet (see the module docstring)."""

    def __init__(self, quiet: Callable[[], bool],
                 pending: Callable[[int], None] = lambda n: None,
                 thread_init: Callable[[], None] = lambda: None) -> None:
        """`pending(n)` hears the queue's length whenever it changes (a gauge); `thread_init`
        runs first on its thread (the engine's device: a CUDA call there would otherwise make
        device 0's context current, one more context on that GPU)."""
        self._quiet, self._report, self._thread_init = quiet, pending, thread_init
        self._launching = InFlight()  # calls under way that may launch GPU work
        self._lock = self._launching.lock
        self._pending: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def launching(self) -> contextlib.AbstractContextManager[None]:
        """Held by every call that launches GPU work (cheap: a lock and a counter)."""
        return self._launching.call()

    def close_later(self, close: Callable[[], None]) -> None:
        if self._stopped:  # (the device is synchronised for good: nothing to wait for)
            _run_logged(close)
            return
        with self._lock:
            self._pending.append(close)
            self._report(len(self._pending))
            if self._thread is None and not self._stopped:
                self._thread = NamedThread(target=self._run, name="epd-ipc-close",
                                            daemon=True)
                self._thread.start()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def try_close(self) -> int:
        """Run the queue now if the engine is quiet; how many closes ran."""
        with self._lock:
            if not self._pending or self._launching or not self._quiet():
                return 0
            closes, self._pending = self._pending, []
            for close in closes:  # under the lock: no launch starts until they are done
                _run_logged(close)
            self._report(0)
        return len(closes)

    def _run(self) -> None:
        try:
            self._thread_init()
        except Exception:
            log.exception("selecting the engine's device on the IPC-close thread")
        while not self._stopped:
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            try:
                self.try_close()
            except Exception:  # a failed stream query must not end the thread: try again
                log.exception("looking for a quiet moment to close CUDA mappings")

    def stop(self) -> None:
        """After the device's last synchronisation: close everything left."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            closes, self._pending = self._pending, []
        for close in closes:
            _run_logged(close)


def _run_logged(close: Callable[[], None]) -> None:
    """One close; a failure is logged (the others still run)."""
    try:
        close()
    except Exception:
        log.exception("closing %r", close)
