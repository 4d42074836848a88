"""Diagnostic: what the engine's threads are doing while the stream-op poller is stuck.

On the H200 the poller's round sometimes stays 1-14 ms inside a low-latency chain's top-up (a
few driver calls) or an armed op's launch while a prefill pool's calls run in the same engine
(docs/BENCHMARKS.md, nineteenth session); the chain then runs dry and a decode call waits. The
round's own timers say where the poller was, not what held it. With `EPD_STALL_PROBE=<file>` in
an engine's environment a thread looks every `PERIOD_SECONDS`; while the poller has been inside
a watched section for more than `THRESHOLD_SECONDS` it takes the Python stacks of every other
thread (`sys._current_frames`: a thread inside a C call shows the line that made it) and counts
their innermost frames. The counts go to the file as JSON, rewritten at most every
`WRITE_SECONDS` and at stop. Off (no thread, one `None` check per section) unless set.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

THRESHOLD_SECONDS = 1e-3
PERIOD_SECONDS = 2e-4
WRITE_SECONDS = 1.0
FRAMES = 4  # innermost frames per thread: the call that waits and what made it
TOP = 60  # stacks kept in the file, most seen first


def _stack(frame: FrameType | None) -> str:
    parts = []
    while frame is not None and len(parts) < FRAMES:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts)


class StallProbe:
    def __init__(self, path: str, threshold: float = THRESHOLD_SECONDS,
                 period: float = PERIOD_SECONDS) -> None:
        self.path, self.threshold, self.period = path, threshold, period
        self._section: tuple[str, float, int] | None = None  # (name, since, serial)
        self._serial = 0
        self.stalls: collections.Counter[str] = collections.Counter()  # sections over
        self.samples: collections.Counter[str] = collections.Counter()  # "thread | stack"
        self._sampled = 0
        self._counted = 0  # the serial of the last section counted as a stall
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="epd-stall-probe")
        self._thread.start()

    @classmethod
    def from_env(cls) -> StallProbe | None:
        path = os.environ.get("EPD_STALL_PROBE", "")
        return cls(path) if path else None

    @contextmanager
    def watch(self, name: str) -> Iterator[None]:
        """The poller is in section `name` for the block (one tuple store each way)."""
        self._serial += 1
        self._section = (name, time.perf_counter(), self._serial)
        try:
            yield
        finally:
            self._section = None

    def _run(self) -> None:
        written = time.monotonic()
        me = threading.get_ident()
        while not self._stop.wait(self.period):
            section = self._section
            if section is not None and time.perf_counter() - section[1] > self.threshold:
                name, _, serial = section
                if serial != self._counted:  # (sections follow one another: one count each)
                    self._counted = serial
                    self.stalls[name] += 1
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frame in sys._current_frames().items():
                    if ident == me:
                        continue
                    label = names.get(ident, str(ident))
                    self.samples[f"{name} | {label} | {_stack(frame)}"] += 1
                self._sampled += 1
            if time.monotonic() - written > WRITE_SECONDS:
                self.write()
                written = time.monotonic()

    def summary(self) -> dict:
        return {"threshold_ms": self.threshold * 1e3, "period_ms": self.period * 1e3,
                "stalls": dict(self.stalls), "looks": self._sampled,
                "stacks": [{"n": n, "stack": k} for k, n in self.samples.most_common(TOP)]}

    def write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary(), f, indent=1)
        os.replace(tmp, self.path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.write()
