"""A diagnostic: cProfile of one engine thread, for where host time per call goes.

`EPD_PROFILE_DIR=<folder>` on the engines turns it on; `EPD_PROFILE_THREADS` names which
threads (a comma list of `fast`, each session's fast-path thread, and `poller`, the armed
ops' poller; default `fast`). From Python 3.12 cProfile allows one active profiler per
process (built on sys.monitoring, it then records every thread's calls, not only its own):
the first thread to start one has it; read a thread's own functions in its file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("epd.engine")


def run_profiled(kind: str, name: str, body: Callable[[], None]) -> None:
    """Run `body`, profiled into `<EPD_PROFILE_DIR>/<name>.prof` when `kind` is one of the
    threads asked for."""
    folder = os.environ.get("EPD_PROFILE_DIR")
    kinds = {k.strip() for k in os.environ.get("EPD_PROFILE_THREADS", "fast").split(",")}
    if not folder or kind not in kinds:
        body()
        return
    import cProfile
    prof = cProfile.Profile()
    try:
        prof.enable()
    except ValueError:  # (another thread of this process holds the one profiler)
        body()
        return
    try:
        body()
    finally:
        prof.disable()
        try:
            prof.dump_stats(os.path.join(folder, f"{name}.prof"))
        except OSError as e:  # (a diagnostic: never the thread's own error)
            log.warning("profile %s not written to %s: %s", name, folder, e)
