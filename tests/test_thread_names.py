"""EPD's threads carry their names into the OS (proto/thread_names.py), where `top -H`, `ps -L`
and `epd bench`'s engine CPU by thread read them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from epd.proto.thread_names import NamedThread, named_initializer
from epd.server.bench.workers import cpu_by_thread, thread_cpu


def _comm() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def test_a_named_thread_has_its_name_in_the_os_cut_to_15_bytes() -> None:
    seen: list[str] = []
    t = NamedThread(target=lambda: seen.append(_comm()), name="epd-poller-0")
    t.start()
    t.join(5)
    long = NamedThread(target=lambda: seen.append(_comm()), name="epd-a-rather-long-name")
    long.start()
    long.join(5)
    assert seen == ["epd-poller-0", "epd-a-rather-lo"]


def test_an_executor_worker_is_named_then_runs_the_given_initializer() -> None:
    ran: list[str] = []
    with ThreadPoolExecutor(1, initializer=named_initializer(
            "epd-s1a2b3c", lambda: ran.append("init"))) as ex:
        assert ex.submit(_comm).result(5) == "epd-s1a2b3c"
    assert ran == ["init"]


def test_cpu_by_thread_folds_session_ids_and_counts_a_busy_thread() -> None:
    import os

    def burn() -> None:
        t = time.thread_time()
        while time.thread_time() - t < 0.05:
            pass
    before = thread_cpu([os.getpid()])
    done = threading.Event()
    busy = NamedThread(target=lambda: (burn(), done.wait(5)), name="epd-fast-abc123")
    short = NamedThread(target=burn, name="epd-gone")  # (ends before the second read)
    busy.start()
    short.start()
    short.join(5)
    # (join returns before the OS thread is gone: wait until /proc no longer lists it, or
    # the second read still sees it, as a CI run once did)
    gone_by = time.monotonic() + 5
    while os.path.exists(f"/proc/self/task/{short.native_id}") and time.monotonic() < gone_by:
        time.sleep(0.005)
    try:
        deadline = time.monotonic() + 5
        got = cpu_by_thread(before, thread_cpu([os.getpid()]))
        while got.get("epd-fast-*", 0.0) < 0.04 and time.monotonic() < deadline:
            time.sleep(0.01)
            got = cpu_by_thread(before, thread_cpu([os.getpid()]))
        assert got.get("epd-fast-*", 0.0) >= 0.04, got
        assert "epd-fast-abc123" not in got and "epd-gone" not in got
        assert all(sec >= 0 for sec in got.values()), got
    finally:
        done.set()
        busy.join(5)
