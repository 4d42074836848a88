"""The supervisor and the engines under failure: an engine that never exits after SIGKILL, an
engine whose worker is stuck in an operation, a spawn that fails (fork's EAGAIN) at the first
start or at a restart, SIGHUP and a stop signal before the event loop, the failure files
(gpuN.failed) at a stop, and background work of a session that fails.

Most tests drive the Supervisor with fake processes (FakeProc: nothing real is signalled); the
signal tests run `epd serve`, and the engine exit tests an engine entry point, as processes."""

from __future__ import annotations

import asyncio
import errno
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from conftest import TestDaemon
from prometheus_client import REGISTRY
from ranklib import wait_until

from epd.proto.v1 import epd_pb2
from epd.server import config, startup
from epd.server import supervisor as sup_mod
from epd.server.backends.cpu_plan import CpuPlanner
from epd.server.engine.executor import EngineState, SessionExecutor

NO_PID = 1 << 22  # above the largest pid_max: a FakeProc's pid is never a real process's
BOUND = 10.0  # seconds: any of the stops below takes far less once bounded


class FakeProc:
    """A subprocess.Popen stand-in. `exits_on`: the signals it exits on ("term", "kill"; none:
    stuck in the kernel). A wait without a timeout fails the test instead of hanging it."""

    def __init__(self, pid: int, exits_on: tuple[str, ...] = ("term", "kill"),
                 returncode: int | None = None) -> None:
        self.pid, self.exits_on, self.returncode = pid, exits_on, returncode
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGTERM and "term" in self.exits_on and self.returncode is None:
            self.returncode = -sig

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)
        if "kill" in self.exits_on and self.returncode is None:
            self.returncode = -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            raise AssertionError(f"an unbounded wait for pid {self.pid}, which never exits")
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("engine", timeout)


@pytest.fixture
def folder():
    """A short private folder (socket paths have a length limit), removed afterwards."""
    path = tempfile.mkdtemp(prefix="epd-sf-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _cfg(folder: str, monkeypatch, **env: str) -> config.Config:
    metrics = os.path.join(folder, "metrics")
    for sub in ("sock", "shm", "metrics"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", metrics)
    return config.load(None, {"EPD_BACKEND": "cpu", "EPD_SOCKET_DIR": f"{folder}/sock",
                              "EPD_SHM_DIR": f"{folder}/shm", "EPD_METRICS_PORT": "0",
                              "EPD_DRAIN_SECONDS": "0.2", "EPD_MPS": "off", **env})


def _supervisor(folder: str, monkeypatch, engines: int = 1, **env: str) -> sup_mod.Supervisor:
    cfg = _cfg(folder, monkeypatch, **env)
    return sup_mod.Supervisor(cfg, CpuPlanner(cfg.shm_dir), engines)


def _touch(path: str) -> str:
    with open(path, "w") as f:
        f.write("RuntimeError: the test left it")
    return path


def _errors(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


# -- 1. a killed engine that never exits ---------------------------------------------------------
def test_an_engine_lost_that_never_exits_does_not_freeze_the_supervisor(folder, monkeypatch,
                                                                         caplog):
    """_engine_gone (on the event loop) waits a bounded time for a SIGKILLed engine, names its
    pid, and forgets it all the same."""
    sup = _supervisor(folder, monkeypatch)
    lost: list[int] = []
    monkeypatch.setattr(sup.coordinator, "engine_lost", lambda index, node: lost.append(index))
    e = sup.engines[0]
    e.proc, e.ready = FakeProc(NO_PID, exits_on=()), True
    sock = _touch(e.socket_path)
    t0 = time.monotonic()
    sup._engine_gone(e)
    assert time.monotonic() - t0 < BOUND
    assert e.proc.signals == [signal.SIGKILL]
    assert f"pid {NO_PID}" in _errors(caplog)
    assert lost == [0] and not e.ready and not os.path.exists(sock)


def test_leftover_engines_are_stopped_in_bounded_time_and_their_files_removed(
        folder, monkeypatch, caplog):
    """stop_leftover_engines: an engine that never exits is killed, waited for a bounded time
    and named; every engine's sockets and failure file (gpuN.failed) are removed."""
    monkeypatch.setattr(sup_mod, "LEFTOVER_ENGINE_SECONDS", 0.2)
    monkeypatch.setattr(sup_mod, "KILLED_EXIT_SECONDS", 0.2)
    sup = _supervisor(folder, monkeypatch, engines=2)
    stuck, failed = sup.engines
    stuck.proc = FakeProc(NO_PID, exits_on=())
    failed.proc = FakeProc(NO_PID + 1, returncode=3)  # (could not start, during the stop)
    files = [_touch(sup.cfg.engine_failure_file(failed.socket_path)), _touch(failed.socket_path),
             _touch(sup.cfg.engine_failure_file(stuck.socket_path))]
    t0 = time.monotonic()
    sup.stop_leftover_engines()
    assert time.monotonic() - t0 < BOUND
    assert stuck.proc.signals == [signal.SIGTERM, signal.SIGKILL]
    assert f"pid {NO_PID}" in _errors(caplog)
    assert [f for f in files if os.path.exists(f)] == []


def test_a_stop_with_an_engine_that_never_exits_finishes(folder, monkeypatch, caplog):
    """The drain of Supervisor.run: an engine that outlives SIGTERM and SIGKILL is named and
    left (the drain does not block on it); the failure file of one that exited while
    stopping is removed, and so is node.sock."""
    monkeypatch.setattr(sup_mod, "DRAIN_EXTRA_SECONDS", 0.0)
    monkeypatch.setattr(sup_mod, "KILLED_EXIT_SECONDS", 0.3)
    sup = _supervisor(folder, monkeypatch, engines=2)
    procs = {0: FakeProc(NO_PID, exits_on=()), 1: FakeProc(NO_PID + 1, exits_on=("term",))}

    def spawn(e: sup_mod.EngineProc) -> None:
        e.proc, e.started_at = procs[e.index], time.monotonic()
    monkeypatch.setattr(sup, "_spawn", spawn)
    failure = sup.cfg.engine_failure_file(sup.engines[1].socket_path)

    async def scenario() -> int:
        run = asyncio.create_task(sup.run())
        deadline = time.monotonic() + BOUND
        while not all(e.proc for e in sup.engines) and not run.done():
            assert time.monotonic() < deadline, "the engines were not started"
            await asyncio.sleep(0.01)
        assert os.path.exists(sup.cfg.node_socket)
        _touch(failure)  # (engine 1 could not start again, say, while the daemon stops)
        t0 = time.monotonic()
        sup.request_stop()
        rc = await asyncio.wait_for(run, BOUND)
        assert time.monotonic() - t0 < BOUND
        return rc

    assert asyncio.run(scenario()) == 0
    assert procs[0].signals == [signal.SIGTERM, signal.SIGKILL]
    assert procs[1].signals == [signal.SIGTERM]
    assert f"engine 0 (pid {NO_PID}) has not exited" in _errors(caplog)
    assert not os.path.exists(failure) and not os.path.exists(sup.cfg.node_socket)


# -- 3. a failed first spawn ---------------------------------------------------------------------
def test_a_failed_first_spawn_stops_the_engines_and_leaves_nothing(folder, monkeypatch,
                                                                   capsys):
    """fork fails (EAGAIN) for the second engine: the first is stopped, node.sock, the lock
    and the metrics folder are removed, and `epd serve` exits 2 with one line saying why."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")  # (restored afterwards; run() sets it)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.setattr(startup.spin, "set_timer_slack_ns", lambda ns: None)
    for sub in ("sock", "shm"):
        os.makedirs(os.path.join(folder, sub))
    cfg = config.load(None, {"EPD_BACKEND": "cpu", "EPD_SOCKET_DIR": f"{folder}/sock",
                             "EPD_SHM_DIR": f"{folder}/shm", "EPD_METRICS_PORT": "0",
                             "EPD_ENGINES": "2", "EPD_DRAIN_SECONDS": "0.2"})
    made: list[str] = []
    prepare = startup.prepare_metrics_dir

    def prepare_metrics_dir():
        path, owned = prepare()
        made.append(path)
        return path, owned
    monkeypatch.setattr(startup, "prepare_metrics_dir", prepare_metrics_dir)
    started: list[FakeProc] = []

    def spawn(self, e: sup_mod.EngineProc) -> None:
        if e.index == 1:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        e.proc = FakeProc(NO_PID, exits_on=("term",))
        started.append(e.proc)
    monkeypatch.setattr(sup_mod.Supervisor, "_spawn", spawn)
    try:
        rc = startup.run(cfg)
    finally:
        for path in made:  # (the metrics folder, if the run left it: reported below)
            leftover = os.path.exists(path)
            shutil.rmtree(path, ignore_errors=True)
            assert not leftover, f"the metrics folder {path} was left behind"
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "epd serve: cannot start engine 1's process" in err
    assert os.strerror(errno.EAGAIN) in err and len(err.strip().splitlines()) == 1, err
    assert [p.signals for p in started] == [[signal.SIGTERM]]
    assert made and os.listdir(cfg.socket_dir) == []  # no node.sock, no epd.lock


# -- 4. a restart that cannot spawn --------------------------------------------------------------
def _restarts() -> float:
    return REGISTRY.get_sample_value("epd_engine_restarts_total", {"engine": "0"}) or 0.0


def test_a_restart_that_cannot_spawn_is_a_failed_start(folder, monkeypatch):
    """Popen raising (EAGAIN) at a restart: no restart counted, the reason kept, the next try
    after the backoff, and the exit of the old process handled once (not again per look)."""
    sup = _supervisor(folder, monkeypatch, EPD_RESTART_BACKOFF_SECONDS="30")
    lost: list[int] = []
    monkeypatch.setattr(sup.coordinator, "engine_lost", lambda index, node: lost.append(index))
    e = sup.engines[0]
    e.proc, e.ready = FakeProc(NO_PID, returncode=1), True  # it served, then crashed
    spawned: list[FakeProc] = []

    def popen(argv, env, pass_fds):
        if not spawned:
            spawned.append(None)  # (the first try fails)
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        spawned.append(FakeProc(NO_PID + 1))
        return spawned[-1]

    async def look() -> None:  # what one round of Supervisor._monitor does for the engine
        try:
            await sup._watch(e)
        except Exception as err:
            sup._watch_failed(e, err)

    async def scenario() -> None:
        await look()  # the exit: its restart scheduled
        assert lost == [0] and e.restart_at is not None
        before = _restarts()
        e.restart_at = time.monotonic() - 1  # (due now)
        monkeypatch.setattr(sup_mod.subprocess, "Popen", popen)
        await look()  # the restart: fork fails
        assert e.restarts == 0 and _restarts() == before
        assert e.failed_starts == 1 and os.strerror(errno.EAGAIN) in e.last_failure
        assert e.restart_at is not None and e.restart_at > time.monotonic() + 10  # backoff
        assert e.proc.pid == NO_PID
        await look()
        await look()
        assert lost == [0], "the old process's exit was handled again"
        assert e.restart_at is not None
        e.restart_at = time.monotonic() - 1
        await look()  # the next try spawns
        assert e.proc is spawned[-1] and e.restart_at is None
        assert e.restarts == 1 and _restarts() == before + 1

    asyncio.run(scenario())


# -- 5. SIGHUP, and a stop signal before the event loop ------------------------------------------
@pytest.fixture
def tmpdir_env(folder, monkeypatch):
    """TMPDIR of the daemons a test starts: where their metrics folder goes."""
    path = os.path.join(folder, "tmp")
    os.mkdir(path)
    monkeypatch.setenv("TMPDIR", path)
    return path


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_sighup_stops_the_daemon_cleanly(tmpdir_env):
    d = TestDaemon(engines=1)
    try:
        d.wait_ready(60)
        engine = d.engine_pid(0)
        assert glob.glob(os.path.join(tmpdir_env, "epd-metrics-*"))
        d.proc.send_signal(signal.SIGHUP)
        rc = d.proc.wait(30)
        assert rc == 0, d.log()[-3000:]
        assert "stopped" in d.log()
        assert os.listdir(d.socket_dir) == []  # no node.sock, epd.lock, engine sockets
        assert os.listdir(tmpdir_env) == []  # no metrics folder
        assert _gone(engine)
    finally:
        d.stop_and_check()


EARLY_SIGNAL = textwrap.dedent('''
    import os, signal, sys
    from epd.server import cli, startup

    prepare = startup.prepare_metrics_dir

    def prepare_metrics_dir():  # (the window between the first files and the event loop)
        made = prepare()
        os.kill(os.getpid(), int(sys.argv[1]))
        return made

    startup.prepare_metrics_dir = prepare_metrics_dir
    sys.exit(cli.main(["serve", "--backend", "cpu", "--engines", "1", "--socket-dir",
                       sys.argv[2], "--shm-dir", sys.argv[3], "--metrics-port", "0"]))
''')


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_before_the_event_loop_leaves_nothing(folder, tmpdir_env, sig):
    """A signal after the lock and the metrics folder exist, before the loop handles signals:
    the daemon stops cleanly (exit 0, no engine started) and removes them."""
    sock, shm = os.path.join(folder, "sock"), os.path.join(folder, "shm")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EPD_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", EARLY_SIGNAL, str(int(sig)), sock, shm],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"signal {int(sig)} before the daemon started" in out.stderr
    assert "started (pid" not in out.stderr  # no engine
    assert os.listdir(sock) == [] and os.listdir(shm) == []
    assert os.listdir(tmpdir_env) == []  # no metrics folder


HUNG_START = textwrap.dedent('''
    import os, signal, sys, time
    from epd.server import cli, startup

    def check_backend(cfg):  # (a backend check stuck in a wedged driver)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        raise AssertionError("the stop signal did not end the start")

    startup.check_backend = check_backend
    sys.exit(cli.main(["serve", "--backend", "cpu", "--engines", "1", "--socket-dir",
                       sys.argv[1], "--shm-dir", sys.argv[2], "--metrics-port", "0"]))
''')


def test_a_stop_signal_ends_a_start_stuck_before_the_event_loop(folder, tmpdir_env):
    """SIGTERM while a start-up step hangs (the backend's checks, the engines' detection:
    steps that make no file) ends the start there, as it did before the daemon noted early
    signals, and removes the lock it already holds (systemd's stop would wait out its timeout)."""
    sock, shm = os.path.join(folder, "sock"), os.path.join(folder, "shm")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EPD_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", HUNG_START, sock, shm], env=env,
                         capture_output=True, text=True, timeout=50)
    assert time.monotonic() - t0 < 30
    assert out.returncode == 0, out.stderr[-3000:]
    assert "did not end the start" not in out.stderr
    assert os.listdir(sock) == [] and os.listdir(tmpdir_env) == []


def test_a_daemon_started_under_nohup_outlives_sighup(tmpdir_env):
    """A daemon started ignoring SIGHUP (nohup) keeps ignoring it, and so do its engines: it
    must outlive the terminal it was started from. SIGTERM still stops it cleanly."""
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (inherited by the daemon)
    try:
        d = TestDaemon(engines=1)
    finally:
        signal.signal(signal.SIGHUP, saved)
    try:
        d.wait_ready(60)
        engine = d.engine_pid(0)
        d.proc.send_signal(signal.SIGHUP)
        os.kill(engine, signal.SIGHUP)
        time.sleep(1.0)
        assert d.proc.poll() is None and not _gone(engine), d.log()[-3000:]
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0, d.log()[-3000:]
        assert _gone(engine)
    finally:
        d.stop_and_check()


# -- 2. an engine whose worker is stuck in an operation ------------------------------------------
ENGINE = textwrap.dedent('''
    import asyncio, sys, threading
    from epd.server.engine import app, executor

    executor.QUIESCE_SECONDS = 0.2  # (the teardown gives up on the operation at once)
    app.EXIT_SECONDS = float(sys.argv[1])
    stuck = sys.argv[2] == "stuck"

    async def serve(cfg, slot):  # a session torn down at the stop, as Engine.drain does
        ex = executor.SessionExecutor(executor.EngineState(0), "session-t")
        if stuck:  # an operation that never returns (a driver call)
            op = asyncio.ensure_future(ex.run(threading.Event().wait))
            await asyncio.sleep(0.1)
        else:
            await ex.run(lambda: None)

        async def interrupt():
            pass
        await ex.shutdown("engine shutting down", interrupt, lambda: None)
        print("serve returned", flush=True)

    app.serve = serve
    app.main(["--index", "0"])
''')


def _engine(exit_seconds: float, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EPD_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", ENGINE, str(exit_seconds), mode], env=env,
                         capture_output=True, text=True, timeout=60)
    return out, time.monotonic() - t0


def test_an_engine_whose_worker_is_stuck_still_exits():
    """Python would join the stuck worker (and the default executor waiting on it) forever at
    exit: the engine exits EXIT_SECONDS after serve() returned, with its code, naming it."""
    out, took = _engine(1.0, "stuck")
    assert "serve returned" in out.stdout, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exiting now with code 0" in out.stderr and "epd-session-t" in out.stderr
    assert took < 30


def test_an_engine_without_stuck_work_exits_at_once():
    out, took = _engine(30.0, "clean")
    assert "serve returned" in out.stdout, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exiting now" not in out.stderr
    assert took < 25  # (well before the 30 s deadline would cut it short)


SUPERVISOR_EXIT = textwrap.dedent('''
    import asyncio, contextlib, sys, threading
    from epd.server import cli, startup

    startup.EXIT_SECONDS = 1.0

    async def stubborn():  # a task that swallows every cancellation (as grpc.aio's set-up can)
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    async def supervisor_run():
        asyncio.ensure_future(stubborn())
        threading.Thread(target=threading.Event().wait, name="stuck-read").start()
        await asyncio.sleep(0.1)
        return 0

    def run(cfg):  # the loop as startup.run drives it, then its return
        code = startup._event_loop_run(supervisor_run())
        print("run returned", flush=True)
        return code

    startup.run = run
    sys.exit(cli.main(["serve", "--backend", "cpu", "--engines", "1", "--socket-dir",
                       sys.argv[1], "--metrics-port", "0"]))
''')


def test_the_supervisor_exits_despite_a_stubborn_task_and_a_stuck_thread(folder):
    """A task left on the supervisor's loop that ignores its cancellation, and a thread that
    never returns: asyncio.run's close waited for both without a limit (CI once saw a daemon
    keep running 30 s after SIGTERM). The loop closes within LOOP_CLOSE_SECONDS, the process
    ends EXIT_SECONDS after run() returned, with run()'s code, naming the thread."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("EPD_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SUPERVISOR_EXIT, os.path.join(folder, "sock")],
                         env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert "run returned" in out.stdout, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "did not end 2 s after their cancellation" in out.stderr, out.stderr[-3000:]
    assert "exiting now with code 0" in out.stderr and "stuck-read" in out.stderr
    assert took < 30


# -- 7. background work of a session that fails --------------------------------------------------
def test_a_failing_region_close_is_logged(caplog):
    ex = SessionExecutor(EngineState(0), "session-b")

    def close_region() -> None:
        raise OSError(errno.EIO, "munmap failed")
    try:
        ex.later(close_region)
        wait_until(lambda: "close_region" in _errors(caplog), 5, "the failure logged")
        assert "session-b" in _errors(caplog)
    finally:
        ex.worker.shutdown(wait=True)  # (idle by now: the failed work has run)


def test_work_left_for_later_waits_for_an_operation_on_another_thread():
    """`later` (a region's close after UnregisterRegion) runs under the operation lock: an
    operation the fast path runs on its own thread, which could be viewing that region, ends
    before the region is closed."""
    import threading

    ex = SessionExecutor(EngineState(0), "session-c")
    events: list[str] = []
    running, release = threading.Event(), threading.Event()

    def operation() -> None:  # (as the fast path's thread runs one: executor.call)
        running.set()
        release.wait(5)
        events.append("operation ends")
    t = threading.Thread(target=ex.call, args=(operation,))
    t.start()
    try:
        assert running.wait(5)
        done = ex.later(lambda: events.append("region closed"))
        time.sleep(0.2)
        assert events == []  # still waiting for the operation's lock
        release.set()
        done.result(5)
        assert events == ["operation ends", "region closed"]
    finally:
        release.set()
        t.join(5)
        ex.worker.shutdown(wait=True)


def test_a_world_whose_engine_cannot_start_is_left(folder, monkeypatch, caplog):
    """Cluster world mode: an engine that cannot be spawned (fork's EAGAIN) loses the world,
    as one that dies does: the engines started for it are stopped, the world is never entered
    again, and nothing escapes into the cluster's lease handling."""
    sup = _supervisor(folder, monkeypatch, engines=2)
    monkeypatch.setattr(sup.planner, "adopt_world", lambda world: None, raising=False)
    monkeypatch.setattr(sup.planner, "leave_world", lambda: None, raising=False)
    monkeypatch.setattr(sup.coordinator, "engine_lost", lambda index, node: None)
    started: list[FakeProc] = []

    def spawn(e) -> None:
        if e.index == 1:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        e.proc = FakeProc(NO_PID)
        started.append(e.proc)
    monkeypatch.setattr(sup, "_spawn", spawn)
    sup.enter_world(epd_pb2.ClusterWorld(generation=3, num_pes=4, node_first_pe=[0, 2]))
    assert (sup.world_generation, sup.world_left) == (0, 3)
    assert len(started) == 1 and started[0].signals == [signal.SIGKILL]
    assert all(e.proc is None for e in sup.engines)
    assert "engine 1 cannot start" in _errors(caplog)
    assert "EAGAIN" in sup.engines[1].last_failure or "temporarily" in sup.engines[1].last_failure
