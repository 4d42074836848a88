"""Operations that run too long say where they are.

Every operation of an engine runs on a thread under its session's lock (executor.py); the
kernels' waits and every host wait have deadlines, yet an operation can still stall where no
deadline reaches (a driver call behind GPU work, a lock). The client then sees only its own
deadline ("did not complete in time") and the engine's log says nothing: a lazily loaded kernel
behind a stream parked for its client looked exactly like that on the H200. So one thread per
engine looks at the operations in flight once a second and logs, once per operation past
`--slow-operation-seconds`, its name, session and age and the stack of the thread running it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from ...proto.thread_names import NamedThread

log = logging.getLogger("epd.engine")

STACK_FRAMES = 12  # the innermost frames: where it waits


@dataclass(slots=True)
class _Running:
    name: str
    session: str
    started: float
    reported: bool = False


class SlowOperations:
    """The operation each thread is running (`begin`/`end`, on every call: one dict store and
    one pop, atomic in CPython, no lock) and the thread that reports slow ones. An operation
    runs on one thread under its session's lock, so a thread runs at most one at a time."""

    def __init__(self, threshold: float, period: float = 1.0) -> None:
        if threshold <= 0:
            raise ValueError("a watchdog needs a threshold > 0 (the engine makes none at 0)")
        self.threshold, self.period = threshold, period
        self._running: dict[int, _Running] = {}  # thread ident -> its operation
        self._stop = threading.Event()
        self._thread = NamedThread(target=self._watch, name="epd-slow-ops", daemon=True)
        self._thread.start()

    def begin(self, name: str, session: str) -> None:
        self._running[threading.get_ident()] = _Running(name, session, time.monotonic())

    def end(self) -> None:
        op = self._running.pop(threading.get_ident(), None)
        if op is not None and op.reported:
            log.warning("%s of %s finished after %.1f s", op.name, op.session,
                        time.monotonic() - op.started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            self.report()

    def report(self) -> int:
        """Log every operation past the threshold not reported yet; how many were."""
        now = time.monotonic()
        slow = [(tid, op) for tid, op in list(self._running.items())
                if not op.reported and now - op.started >= self.threshold]
        frames = sys._current_frames()  # (CPython: every thread's current frame)
        for tid, op in slow:
            op.reported = True
            frame = frames.get(tid)
            stack = "".join(traceback.format_stack(frame, limit=STACK_FRAMES)) if frame \
                else "  (its thread has no frame)\n"
            log.warning("%s of %s has been running for %.1f s (--slow-operation-seconds "
                        "%g); its thread is at:\n%s", op.name, op.session, now - op.started,
                        self.threshold, stack.rstrip())
        return len(slow)
