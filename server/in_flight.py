"""A count of calls under way, kept from any thread.

Pacing counts latency work in flight (engine/pacing.py); the CUDA engine counts calls that may
launch GPU work, so that it closes IPC mappings only when there are none (backends/cuda_quiet.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class InFlight:
    """`with in_flight.call():` counts one call for the block. `lock` is held whenever the
    count changes: whoever holds it sees no call begin or end meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        with self.lock:
            self.count += 1
        try:
            yield
        finally:
            with self.lock:
                self.count -= 1

    def __bool__(self) -> bool:
        return self.count > 0
