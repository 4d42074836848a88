"""Fixtures of the CPU suite: daemons (with a shared-memory leak check when they stop) and
persistent rank processes (see ranklib.RankPool)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # ranklib, also for spawned rank processes

import ranklib
from daemon_harness import HarnessDaemon, memfd_names

DAEMON_TIMEOUT = 3.0  # the daemon's --timeout-seconds in the shared fixtures
class TestDaemon(HarnessDaemon):
    """A Daemon whose shm files go to a private folder under /dev/shm, so that what it leaves
    behind can be told apart from other daemons running on the same machine."""

    __test__ = False

    def __init__(self, *, engines: int = 2, timeout_seconds: float = DAEMON_TIMEOUT,
                 extra: list[str] | None = None, private_shm: bool = True) -> None:
        self.shm_dir = (tempfile.mkdtemp(prefix="epd-test-", dir=ranklib.SHM) if private_shm
                        else ranklib.SHM)
        extra = list(extra or [])
        if private_shm:
            extra += ["--shm-dir", self.shm_dir]
        super().__init__(backend="cpu", engines=engines, timeout_seconds=timeout_seconds,
                         extra=extra)
        self.node_socket = os.path.join(self.socket_dir, "node.sock")

    def endpoints(self, n: int) -> list[str]:
        """Engine sockets for ranks 0..n-1, round robin."""
        return [self.socket(r % self.engines) for r in range(n)]

    def stop_and_check(self) -> None:
        """SIGTERM; the daemon must exit 0 and leave no files in its (private) shm folder.
        (Its shared memory is memfds, gone with its processes: tests that a live engine
        releases a closed session's memory check its mappings, daemon_harness.memfd_names.)"""
        hung = ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:  # (then stop() kills it: -9 alone says less)
                hung = " (it had not exited 30 s after SIGTERM)"
        log = self.log()
        rc = self.stop()
        if self.shm_dir != ranklib.SHM:
            leftovers = os.listdir(self.shm_dir)
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            assert not leftovers, f"daemon left files in its shm folder: {leftovers}\n{log}"
        assert rc == 0, f"daemon exited with {rc}{hung}\n{log[-4000:]}"


@contextlib.contextmanager
def running_daemon(**kw):
    d = TestDaemon(**kw)
    try:
        d.wait_ready(60)
    except BaseException:
        d.stop()
        if d.shm_dir != ranklib.SHM:
            shutil.rmtree(d.shm_dir, ignore_errors=True)
        raise
    try:
        yield d
    finally:
        d.stop_and_check()


@pytest.fixture(scope="module")
def daemon(request):
    """One daemon per test module: cpu backend, 2 engines, 3 s collective timeout. A module may
    set DAEMON_EXTRA (more `epd serve` flags) or DAEMON_ENGINES."""
    extra = getattr(request.module, "DAEMON_EXTRA", [])
    engines = getattr(request.module, "DAEMON_ENGINES", 2)
    with running_daemon(engines=engines, extra=extra) as d:
        yield d


@pytest.fixture(scope="session")
def rank_pool():
    """Persistent rank processes (spawn), shared by the whole run; always torn down."""
    pool = ranklib.RankPool(size=8)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def ranks(rank_pool):
    """The rank pool for one test: afterwards stuck tasks are killed, and no live rank process
    may keep client shm files (its sessions are closed)."""
    rank_pool.clear()
    yield rank_pool
    rank_pool.clear()  # a task still running (a failed test) is killed
    leaked = {pid: memfd_names(pid) for pid in rank_pool.live_pids()}
    leaked = {k: v for k, v in leaked.items() if v}
    assert not leaked, f"rank processes still hold EPD shared memory: {leaked}"


@pytest.fixture
def daemon_factory():
    """Start extra daemons inside a test: `with daemon_factory(engines=4) as d: ...`."""
    return running_daemon


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave nothing in /tmp: the tmp_path folders are removed (tmp_path_retention_policy), and
    so is pytest's per-user folder above them once empty."""
    factory = getattr(config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None)
    if base is not None and config.getini("tmp_path_retention_policy") == "none":
        with contextlib.suppress(OSError):
            base.parent.rmdir()  # (only when empty: another run's folders stay)
