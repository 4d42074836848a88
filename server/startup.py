"""The daemon process from `epd serve` to exit, around the Supervisor: what must hold before
its event loop starts (the socket folder writable and locked, the backend usable, the metrics
folder, the open-files limit, stop signals noted) and what is removed on every exit (engines a
failed start left, a private MPS server, the metrics folder, the lock file). Every start-up
error is one line on stderr and exit code 2."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path

from ..proto import spin
from .config import Config, resolve_class_engines
from .open_files import raise_open_files_limit
from .supervisor import STOP_SIGNALS, StartupError, Stopped, Supervisor

log = logging.getLogger("epd.supervisor")
LOCK_NAME = "epd.lock"  # in the socket folder: held (flock) for the daemon's life
METRICS_PREFIX = "epd-metrics-"  # the metrics folder a daemon makes (tempfile.mkdtemp)
LOOP_CLOSE_SECONDS = 2.0  # tasks left when the supervisor's run() ends get this long to end
# `epd serve`'s process ends this long after run() returned, whatever thread is still running
# (exit_deadline): a stop ends in a bounded time even if something hangs at interpreter exit.
EXIT_SECONDS = 5.0


class EarlyStop:
    """A stop signal (STOP_SIGNALS) while no event loop handles them, before it starts and
    after it ended: noted, so that what the daemon creates before its loop (the lock, the
    metrics folder) is always removed after it. Supervisor.run reads `signum`: a daemon asked
    to stop before its loop stops at once, starting no engine. In a step that may hang and
    makes no file (`interruptible`: the backend's checks, the engines' detection) the signal
    ends the start at once (Stopped), as it did before the daemon handled it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, object] = {}
        self._fatal = False

    @contextlib.contextmanager
    def interruptible(self):
        if self.signum is not None:
            raise Stopped(self.signum)
        self._fatal = True
        try:
            yield
        finally:
            self._fatal = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # (only the main thread sets handlers; a daemon always runs there)
        for sig in STOP_SIGNALS:
            old = signal.signal(sig, self._note)
            self._saved.setdefault(sig, old)

    def _note(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self._fatal:
            self._fatal = False
            raise Stopped(signum)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        self._saved.clear()


def prepare_metrics_dir() -> tuple[str, bool]:
    """Multiprocess metrics: must be set before prometheus_client is imported anywhere.
    Returns (folder, whether this daemon created it and so removes it at exit)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix=METRICS_PREFIX)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        return path, True
    Path(path).mkdir(parents=True, exist_ok=True)
    # Stale samples of an earlier run, and the files archive_dead_process set aside as
    # unreadable (*.db.unreadable: no scrape reads them, and nothing else ever removed them,
    # so a folder given by the operator gathered one per such engine death across restarts).
    for pattern in ("*.db", "*.db.unreadable"):
        for f in Path(path).glob(pattern):
            f.unlink()
    return path, False


def _probe_writable(folder: str, setting: str) -> None:
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".epd-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise StartupError(f"{setting} {folder}: not a writable folder "
                           f"({e.strerror or e}); create it writable for the daemon's user "
                           f"or choose another") from None


def check_folders(cfg: Config) -> None:
    """Start-up checks of the folders: one line naming the setting and the fix.

    --shm-dir only has to be a writable folder now (the engine sweeps files of earlier versions
    there): shared memory travels as memfds over the descriptor channel, so the tmpfs/hugetlbfs
    check it once needed (cudaHostRegister of a counter page on disk failed at the first CUDA
    session) is moot."""
    _probe_writable(cfg.socket_dir, "--socket-dir")
    shm_dir = getattr(cfg, "shm_dir", None)
    if shm_dir:
        _probe_writable(shm_dir, "--shm-dir")


def lock_socket_dir(socket_dir: str) -> int:
    """Hold the socket folder's lock for the daemon's life (the fd is inherited by the engines).
    A second daemon on the same folder fails here, naming the pid that holds it."""
    path = os.path.join(socket_dir, LOCK_NAME)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as e:
            raise StartupError(f"--socket-dir {socket_dir}: cannot create {LOCK_NAME} "
                               f"({e.strerror or e}); make the folder writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.pread(fd, 32, 0).decode(errors="replace").strip().split("\n")[0]
                      or "?")
            os.close(fd)
            raise StartupError(f"--socket-dir {socket_dir}: another epd daemon (pid {holder}) "
                               f"serves this folder; stop it first or use another "
                               f"--socket-dir") from None
        # The daemon that held it unlinks the file at its exit: opened before that and locked
        # after, this lock is on a file no longer in the folder, and a third daemon creating
        # a fresh one would lock that too (two daemons on one folder). Locked, the file must
        # still be the folder's; else take the one there now.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    # The lock is ours: every process of an earlier daemon on this folder is gone (its engines
    # held the lock too). One that was SIGKILLed (OOM killer, kill -9) never ran its teardown:
    # the metrics folder it made in /tmp is removed here, named in the lock file
    # (record_metrics_dir), or each such death left one there for good.
    _remove_stale_metrics_dir(os.pread(fd, 4096, 0).decode(errors="replace"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def record_metrics_dir(lock_fd: int, folder: str) -> None:
    """Name the metrics folder this daemon made (and removes at exit) in its lock file, on the
    line after its pid: the next daemon on the socket folder removes it if this one dies
    without its teardown (lock_socket_dir)."""
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, f"{os.getpid()}\n{folder}\n".encode(), 0)


def _remove_stale_metrics_dir(lock_text: str) -> None:
    """Remove the metrics folder an earlier daemon named in the lock file: only a real folder
    (not a link) of ours whose name is one mkdtemp made for it (METRICS_PREFIX)."""
    lines = lock_text.split("\n")
    folder = lines[1].strip() if len(lines) > 1 else ""
    if not (folder and os.path.isabs(folder)
            and os.path.basename(folder).startswith(METRICS_PREFIX)):
        return
    try:
        st = os.lstat(folder)
    except OSError:
        return  # (its daemon removed it)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return
    log.warning("removing %s, the metrics folder of an earlier daemon on this socket folder "
                "that did not stop cleanly (killed?)", folder)
    shutil.rmtree(folder, ignore_errors=True)


def check_backend(cfg: Config) -> tuple[Config, str]:
    """`cfg` with the settings that depend on the backend resolved (--class-engines auto) and
    why class engines are on or off; StartupError where the backend cannot run here."""
    from .backends import class_engines_pay, missing_requirements, resolve_backend_name
    try:
        name = resolve_backend_name(cfg.backend)
    except ValueError as e:
        raise StartupError(f"--backend: {e}") from None
    missing = missing_requirements(name)
    if missing:
        raise StartupError(f"--backend {name}: {missing}")
    try:
        cfg, why = resolve_class_engines(cfg, name, class_engines_pay(name))
    except ValueError as e:
        raise StartupError(str(e)) from None
    return cfg, why


def _event_loop_run(coro) -> int:
    """Run the supervisor on a fresh loop (uvloop where installed), closed within a bound:
    asyncio.run's close waits without a limit for every task left to end its cancellation
    and for the default executor's threads, so one task that swallowed its cancellation (as
    grpc.aio's stream set-up can) or one read stuck in a thread kept the daemon from exiting,
    and from the teardown after its loop (leftover engines, private MPS, lock, metrics
    folder)."""
    try:
        import uvloop  # optional: only its absence falls back, not an ImportError inside
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=LOOP_CLOSE_SECONDS))
            stuck = [t.get_name() for t in left if not t.done()]
            if stuck:
                log.error("task(s) %s did not end %.0f s after their cancellation; the daemon "
                          "exits without them", ", ".join(stuck), LOOP_CLOSE_SECONDS)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # (its default executor shut down without waiting for its threads)


def _stop_mps(sup: Supervisor) -> None:
    """Stop the engines left (after a failure) and quit a private MPS server once no engine is
    left. The event loop (and its signal handlers) is gone by now: a stop signal must not cut
    this bounded teardown short."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS} if main else {}
    try:
        sup.stop_leftover_engines()
        sup.mps.stop()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def run(cfg: Config) -> int:
    """The daemon's life; every start-up error is one line on stderr and exit code 2, and the
    metrics folder this daemon created is removed on every exit path."""
    lock_fd: int | None = None
    metrics_dir, owned = "", False
    sup: Supervisor | None = None
    # Before any file is made: a stop signal from now until the loop handles it is noted, and
    # the daemon stops at once and cleanly (EarlyStop); the same after the loop, until the
    # teardown below is done.
    early = EarlyStop()
    early.install()
    # Engines inherit the timer slack of the thread that forks them, this one: fine from their
    # first instruction, so every engine thread has it (one an import starts too; proto/spin.py).
    spin.set_timer_slack_ns(spin.ENGINE_TIMER_SLACK_NS)
    raise_open_files_limit()
    try:
        check_folders(cfg)
        lock_fd = lock_socket_dir(cfg.socket_dir)
        with early.interruptible():
            cfg, class_engines_why = check_backend(cfg)
        metrics_dir, owned = prepare_metrics_dir()
        if owned:  # (removed by the next daemon here if this one is killed: lock_socket_dir)
            record_metrics_dir(lock_fd, metrics_dir)
        from .backends import make_planner

        try:
            with early.interruptible():
                planner = make_planner(cfg)
                engines = cfg.engines or planner.detect_engines()
            sup = Supervisor(cfg, planner, engines)
        except ImportError as e:
            raise StartupError(f"--backend {cfg.backend}: {e}; install what it needs or use "
                               f"--backend cpu") from None
        sup.lock_fd = lock_fd
        sup.early_stop = early
        sup.class_engines_why = class_engines_why
        sup.check_cluster()
        os.chmod(cfg.socket_dir, 0o750)  # keep the folder (clients may bind-mount it); tighten
        sup.bind_http()
        return _event_loop_run(sup.run())
    except StartupError as e:
        print(f"epd serve: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        log.info("signal %d before the daemon started: stopping", e.signum)
        return 0
    finally:
        early.install()  # (the loop removed its handlers: SIG_DFL would cut this short)
        try:
            if sup is not None:  # (engines a failed start left; their files; private MPS)
                _stop_mps(sup)
            if owned:
                shutil.rmtree(metrics_dir, ignore_errors=True)
            if lock_fd is not None:
                # Still holding the lock: a daemon starting now either fails on this inode or
                # creates a fresh file, so removing it leaves nothing behind and no window.
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(cfg.socket_dir, LOCK_NAME))
                os.close(lock_fd)
        finally:
            early.restore()

