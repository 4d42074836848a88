"""Log lines a client can cause, at most one per key a second: a client that repeats what is
refused (malformed requests at ring speed, connections beyond its caps, calls with a wrong
cluster token) must not fill the disk or hide other tenants' lines."""

from __future__ import annotations

import logging
import threading
import time

LOG_INTERVAL = 1.0  # seconds between two lines of one key


class RateLimitedLog:
    """At most one line per key per `interval`; the next line says how many were dropped."""

    def __init__(self, logger: logging.Logger, interval: float = LOG_INTERVAL) -> None:
        self.log, self.interval = logger, interval
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, text: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e18) < self.interval:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        more = f" ({dropped} more since the last line)" if dropped else ""
        self.log.warning("%s%s", text, more)
        return True
