"""OS names for EPD's threads, so that `top -H`, `ps -L`, a profiler and `epd bench`'s CPU
breakdown tell the engine's poller from its fast-path threads (Python 3.12 names its threads
only for itself; the kernel sees every one as the program's name)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_PR_SET_NAME = 15  # prctl(2); the kernel keeps 15 bytes of a thread's name
try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # (not Linux: names stay Python's own)
    _prctl = None


def name_this_thread(name: str) -> None:
    """Give the calling thread's OS thread `name` (cut to 15 bytes; best effort)."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


class NamedThread(threading.Thread):
    """A thread whose OS name is its Python name (threading.Thread's arguments)."""

    def run(self) -> None:
        name_this_thread(self.name)
        super().run()


def named_initializer(prefix: str, then: Any = None) -> Any:
    """A ThreadPoolExecutor initializer that names its worker `prefix`, then calls `then`."""
    def init() -> None:
        name_this_thread(prefix)
        if then is not None:
            then()
    return init
