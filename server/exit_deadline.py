"""The bounded end of a daemon process (an engine's or the supervisor's), once it is done."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time


def exit_within(seconds: float, code: int, log: logging.Logger) -> None:
    """Arm the end of the process's life, once it is done serving. Its exit joins threads
    (concurrent.futures joins its workers at exit: an engine's session workers, asyncio's
    default executor). One stuck in a call that never returns (a driver call the drain gave
    up on, a metrics read) would keep the process forever, an engine holding its device: if it
    has not exited `seconds` from now, the threads still running are logged, the logs
    flushed, and the process ends with `code`. (Metrics need no flush: their files are shared
    mappings.)"""
    def cut_short() -> None:
        time.sleep(seconds)
        me = threading.current_thread()
        stuck = [t.name for t in threading.enumerate()
                 if t is not me and t is not threading.main_thread() and not t.daemon]
        log.error("still not exited %.0f s after it stopped serving: thread(s) %s never "
                  "returned (a stuck operation); exiting now with code %d", seconds,
                  ", ".join(stuck) or "(none)", code)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    threading.Thread(target=cut_short, name="epd-exit-deadline", daemon=True).start()
