"""What a daemon leaves behind when it does not get to stop cleanly: a supervisor that was
SIGKILLed (OOM killer, kill -9) runs no teardown, so the next daemon on the same socket folder
must clean or reuse what it left, and a folder of the operator's must not gather files across
restarts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import grpc
import ranklib
from conftest import TestDaemon

from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server import startup

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _engine_env(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            key, _, value = item.partition(b"=")
            if key.decode() == name:
                return value.decode()
    return ""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _kill_supervisor(d: TestDaemon) -> list[int]:
    """SIGKILL the supervisor; its engines (parent-death signal) drain and exit."""
    engines = [d.engine_pid(i) for i in range(d.engines)]
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    ranklib.wait_until(lambda: all(_gone(p) for p in engines), 20, "orphaned engines exit")
    return engines


def _restart_on_same_folder(d: TestDaemon) -> None:
    """A new `epd serve` with the same arguments (socket folder, shm folder, port)."""
    env = dict(os.environ)
    env.pop(METRICS_ENV, None)
    d.proc = subprocess.Popen(d.proc.args, stdout=d._log, stderr=subprocess.STDOUT, env=env)
    d.wait_ready(60)


def _stop(d: TestDaemon) -> None:
    d.stop()
    shutil.rmtree(d.shm_dir, ignore_errors=True)


def test_the_metrics_folder_of_a_killed_supervisor_is_removed_by_the_next_daemon():
    """A SIGKILLed supervisor leaves its /tmp/epd-metrics-* folder (its removal is in the
    teardown it never ran); the next daemon on the same socket folder removes it, so repeated
    kills do not pile folders up in /tmp."""
    d = TestDaemon(engines=1)
    old = ""
    try:
        d.wait_ready(60)
        old = _engine_env(d.engine_pid(0), METRICS_ENV)
        assert os.path.basename(old).startswith("epd-metrics-"), old
        _kill_supervisor(d)
        assert os.path.isdir(old)  # (the leftover this test is about)
        _restart_on_same_folder(d)
        new = _engine_env(d.engine_pid(0), METRICS_ENV)
        assert new != old
        assert not os.path.exists(old), f"{old} of the killed daemon is still there"
        # the new daemon's own folder still goes at a clean stop
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        assert not os.path.exists(new)
    finally:
        _stop(d)
        if old:
            shutil.rmtree(old, ignore_errors=True)  # (leave nothing in /tmp, pass or fail)


def test_a_stale_failure_file_is_removed_at_start(tmp_path):
    """gpu<N>.failed of a killed daemon (an engine that could not start, or that it killed,
    just before it died) is removed when the next daemon starts: it would stay until that
    daemon's stop, and its engine's first exit would be reported with the stale reason."""
    sock = tmp_path / "sock"
    sock.mkdir()
    stale = sock / "gpu0.failed"
    stale.write_text("RuntimeError: a stale reason of an earlier daemon")
    d = TestDaemon(engines=1, extra=["--socket-dir", str(sock)])
    d.socket_dir = str(sock)
    try:
        d.wait_ready(60)
        assert not stale.exists(), "the stale failure file is still there"
        pid = d.engine_pid(0)
        os.kill(pid, signal.SIGKILL)
        ranklib.wait_until(lambda: d.engine_pid(0) not in (0, pid), 20, "engine restarted")
        with grpc.insecure_channel(f"unix://{sock}/node.sock") as ch:
            topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=5)
        assert "stale" not in topo.engines[0].last_failure, topo.engines[0].last_failure
    finally:
        _stop(d)


def test_set_aside_metrics_files_do_not_pile_up_in_a_given_folder(tmp_path, monkeypatch):
    """archive_dead_process sets an unreadable file of a dead engine aside as
    *.db.unreadable; in a folder the operator gives (PROMETHEUS_MULTIPROC_DIR) a new start
    removes them with the stale samples, instead of keeping them for good."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    for name in ("counter_12.db", "histogram_13.db.unreadable", "keep.txt"):
        (folder / name).write_bytes(b"x")
    monkeypatch.setenv(METRICS_ENV, str(folder))
    path, owned = startup.prepare_metrics_dir()
    assert (path, owned) == (str(folder), False)
    assert sorted(os.listdir(folder)) == ["keep.txt"]


def test_the_lock_file_names_the_metrics_folder_and_a_refusal_the_pid(tmp_path):
    """The lock file's first line stays the holder's pid (a refused second daemon names it);
    the second line is the folder the next daemon removes if this one is killed."""
    fd = startup.lock_socket_dir(str(tmp_path))
    try:
        startup.record_metrics_dir(fd, "/nonexistent/epd-metrics-x")
        with open(tmp_path / startup.LOCK_NAME) as f:
            assert f.read() == f"{os.getpid()}\n/nonexistent/epd-metrics-x\n"
        try:
            startup.lock_socket_dir(str(tmp_path))
        except startup.StartupError as e:
            assert f"(pid {os.getpid()})" in str(e), e
        else:
            raise AssertionError("a second lock of the folder succeeded")
    finally:
        os.close(fd)
    # only a folder named like ours is ever removed, never another path the file names
    other = tmp_path / "not-ours"
    other.mkdir()
    (tmp_path / startup.LOCK_NAME).write_text(f"1\n{other}\n")
    os.close(startup.lock_socket_dir(str(tmp_path)))
    assert other.is_dir()



def test_a_lock_taken_on_a_removed_lock_file_is_taken_again(tmp_path, monkeypatch):
    """The daemon holding the lock removes epd.lock at its exit. A new daemon that opened the
    file before that and locks it after holds a lock on a file no longer in the folder: a
    third daemon would create a fresh file and lock it too. The lock taken must be on the
    folder's file."""
    real = startup.fcntl.flock
    calls = []

    def flock(fd, op):  # the first lock lands just after the old holder removed the file
        if not calls:
            os.unlink(tmp_path / startup.LOCK_NAME)
        calls.append(op)
        return real(fd, op)
    monkeypatch.setattr(startup.fcntl, "flock", flock)
    fd = startup.lock_socket_dir(str(tmp_path))
    try:
        # the removal really ran (the patched flock was reached) and the lock was taken again
        assert len(calls) >= 2, calls
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / startup.LOCK_NAME))
    finally:
        os.close(fd)


def test_a_channel_connection_that_gets_no_thread_is_let_go(tmp_path, monkeypatch) -> None:
    """The descriptor channel serves each connection on a thread of its own; when none can
    start (the process's thread limit), the connection is closed and uncounted, else it stayed
    counted against the engine's and its uid's caps for good."""
    import socket
    import threading
    import time
    from types import SimpleNamespace

    from epd.server.engine import fd_server

    engine = SimpleNamespace(serves=lambda uid, gid: True)  # (all accept asks of it)
    server = fd_server.FdServer(engine, str(tmp_path / "fds.sock"), None)  # type: ignore[arg-type]
    real_start = threading.Thread.start

    def start(self) -> None:
        if self.name == "epd-fds-conn":
            raise RuntimeError("can't start new thread")
        real_start(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as c:
            c.settimeout(5)
            c.connect(server.path)
            assert c.recv(16) == b""  # (closed by the engine)
        deadline = time.monotonic() + 5
        while (server._conns or server._unbound) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server._conns and not server._unbound
    finally:
        server.close()
        server.thread.join(5)
