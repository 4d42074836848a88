"""CUDA MPS as part of the product (issue 10, item 5): `epd serve --mps auto|on|off`, the private
server's life, node mode, `epd env`, and the session's MPS fields, on the CPU.

No GPU here: a fake `nvidia-cuda-mps-control` (FAKE below) stands in for the real one closely
enough to test EPD's process management: `-d` daemonises, listens on
`$CUDA_MPS_PIPE_DIRECTORY/control` (a unix socket) and writes `nvidia-cuda-mps-control.pid`;
without `-d` it sends its stdin to the control socket; `quit` makes the daemon remove its pid
file and exit (leaving the control socket behind, as the real one does). Every invocation is
recorded. The daemon-level tests run `epd serve` through BOOT, which lets the cpu engines stand
in for CUDA ones as far as MPS is concerned (mps.uses_mps); the engines themselves are
unpatched processes that get the MPS environment from the supervisor. tests/gpu/test_mps_gpu.py
checks the real thing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import grpc
import pytest
import ranklib
from daemon_harness import HarnessDaemon

from epd.client import Session
from epd.client import mps as client_mps
from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server import config as config_mod
from epd.server import mps
from epd.server.cli import build_parser
from epd.server.demo import _free_port

pytestmark = pytest.mark.slow

FAKE = '''#!{python}
"""A stand-in for nvidia-cuda-mps-control (tests/test_mps.py)."""
import os, socket, sys, time
RECORD = {record!r}
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
ctl = os.path.join(pipe, "control")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
LIFETIME = 300.0  # a daemon no test quit still goes away


def record(*words):
    with open(RECORD, "a") as f:
        f.write(" ".join([str(os.getpid()), *words, "pipe=" + pipe,
                          "cvd=" + os.environ.get("CUDA_VISIBLE_DEVICES", "-")]) + "\\n")


def running():
    try:
        os.kill(int(open(pid_file).read()), 0)
        return True
    except (OSError, ValueError):
        return False


if sys.argv[1:] == ["-d"]:
    record("-d")
    if os.environ.get("FAKE_MPS_BROKEN"):
        print("fake: cannot start (FAKE_MPS_BROKEN)")
        sys.exit(3)
    if running():
        print("An instance of this daemon is already running")
        sys.exit(1)
    os.makedirs(pipe, exist_ok=True)
    if os.fork():
        deadline = time.monotonic() + 10
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if os.path.exists(ctl):
        os.unlink(ctl)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(ctl)
    srv.listen(8)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    end = time.monotonic() + LIFETIME
    while time.monotonic() < end:
        srv.settimeout(max(0.1, end - time.monotonic()))
        try:
            conn, _ = srv.accept()
        except OSError:
            break
        conn.settimeout(5)
        data = b""
        with __import__("contextlib").suppress(OSError):
            while chunk := conn.recv(4096):
                data += chunk
        quit_ = False
        for line in data.decode().split():
            record("cmd", line)
            if line == "get_server_list":
                conn.sendall(b"\\n")
            quit_ = quit_ or line == "quit"
        conn.close()
        if quit_:
            break
    os.unlink(pid_file)  # the control socket stays, as with the real daemon
    sys.exit(0)
else:
    data = sys.stdin.read()
    record("client", *data.split())
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(ctl)
    except OSError as e:
        print(f"Cannot find MPS control daemon process ({{e}})", file=sys.stderr)
        sys.exit(1)
    s.sendall(data.encode())
    s.shutdown(socket.SHUT_WR)
    while chunk := s.recv(4096):
        sys.stdout.write(chunk.decode())
'''

# `epd serve` whose cpu engines count as CUDA ones for MPS (the supervisor's decision only).
BOOT = ("import sys; from epd.server import mps; mps.uses_mps = lambda kind: True; "
        "from epd.server.cli import main; sys.exit(main(sys.argv[1:]))")


class Fake:
    """The fake binary in `<root>/bin`, and what it recorded."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.bin.mkdir()
        self.record = root / "fake-mps.log"
        exe = self.bin / mps.CONTROL_BINARY
        exe.write_text(FAKE.format(python=sys.executable, record=str(self.record)))
        exe.chmod(0o755)

    def calls(self) -> list[str]:
        return self.record.read_text().splitlines() if self.record.exists() else []

    def path(self) -> str:
        return f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"

    def run(self, pipe: str, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / mps.CONTROL_BINARY), *args], input=stdin,
                              text=True, capture_output=True, timeout=15,
                              env={**os.environ, mps.PIPE_ENV: pipe})


def _kill_fake(pipe: str) -> None:
    """A fake daemon a failed test left: ours (its pid file), killed by its id."""
    pid = mps.control_pid(pipe)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def root():
    """A short private folder in /tmp (unix socket paths must stay under 108 bytes), removed
    afterwards with anything left in it."""
    d = Path(tempfile.mkdtemp(prefix="epd-mps-"))
    try:
        yield d
    finally:
        for pipe in d.rglob("nvidia-cuda-mps-control.pid"):
            _kill_fake(str(pipe.parent))
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fake(root) -> Fake:
    return Fake(root)


# -- configuration -----------------------------------------------------------------------------
def test_config_mps_sources(tmp_path):
    assert config_mod.Config().mps == "auto"
    toml = tmp_path / "epd.toml"
    toml.write_text('mps = "off"\n')
    parser = build_parser()
    ns = parser.parse_args(["serve", "--config", str(toml)])
    assert config_mod.load(ns, env={}).mps == "off"
    assert config_mod.load(ns, env={"EPD_MPS": "on"}).mps == "on"
    ns = parser.parse_args(["serve", "--config", str(toml), "--mps", "auto"])
    assert config_mod.load(ns, env={"EPD_MPS": "on"}).mps == "auto"
    ns = parser.parse_args(["serve", "--mps", "maybe"])
    with pytest.raises(ValueError, match="mps"):
        config_mod.load(ns, env={})
    assert config_mod.Config(mps="on").to_env()["EPD_MPS"] == "on"


# -- the Mps class, in process -------------------------------------------------------------------
def _mps(root: Path, requested: str, fake: Fake | None, *, cuda: bool = True,
         **env: str) -> mps.Mps:
    environ = {"PATH": fake.path() if fake else str(root / "empty-bin"), **env}
    return mps.Mps(requested, str(root / "sock"), "cuda" if cuda else "cpu",
                   epd_pb2.CUDA if cuda else epd_pb2.CPU, environ=environ)


def test_private_server_start_and_stop(root, fake):
    (root / "sock").mkdir()
    m = _mps(root, "on", fake, CUDA_MPS_PIPE_DIRECTORY=str(root / "nothing-here"),
             CUDA_VISIBLE_DEVICES="3,1")
    m.start()
    try:
        pipe = str(root / "sock" / "mps" / "pipe")
        assert (m.mode, m.pipe_directory) == ("private", pipe)
        assert m.env() == {mps.PIPE_ENV: pipe, mps.LOG_ENV: str(root / "sock" / "mps" / "log"),
                           mps.ENGINE_ENV: pipe}
        pid = mps.control_pid(pipe)
        assert pid and os.path.exists(os.path.join(pipe, "control"))
        assert oct(os.stat(root / "sock" / "mps").st_mode & 0o777) == "0o750"
        (start,) = [c for c in fake.calls() if " -d " in c]
        assert f"pipe={pipe}" in start and "cvd=3,1" in start  # the daemon's GPUs
    finally:
        m.stop()
    assert not (root / "sock" / "mps").exists()
    assert not mps._alive(pid)
    assert m.mode == "off"
    assert [c.split()[1:3] for c in fake.calls()] == [["-d", "pipe=" + pipe],
                                                      ["client", "quit"], ["cmd", "quit"]]
    m.stop()  # idempotent


def test_node_server_is_used_and_never_stopped(root, fake):
    node = str(root / "node-pipe")
    assert fake.run(node, "-d").returncode == 0
    try:
        m = _mps(root, "auto", fake, CUDA_MPS_PIPE_DIRECTORY=node)
        m.start()
        assert (m.mode, m.pipe_directory) == ("node", node)
        assert m.env() == {mps.PIPE_ENV: node, mps.ENGINE_ENV: node}
        m.stop()
        assert mps.control_pid(node) is not None  # still serving
        assert not any("quit" in c for c in fake.calls())
        assert not (root / "sock").exists()
    finally:
        fake.run(node, stdin="quit\n")


def test_stale_control_socket_is_not_a_node_server(root, fake):
    """The control socket outlives its daemon: without a live pid file (and no answer on the
    socket) a private server is started instead."""
    node = str(root / "node-pipe")
    fake.run(node, "-d")
    fake.run(node, stdin="quit\n")
    ranklib.wait_until(lambda: mps.control_pid(node) is None, 10, "fake quit")
    assert os.path.exists(os.path.join(node, "control"))
    (root / "sock").mkdir()
    m = _mps(root, "on", fake, CUDA_MPS_PIPE_DIRECTORY=node)
    m.start()
    try:
        assert m.mode == "private"
    finally:
        m.stop()


def test_on_without_the_binary_is_an_error(root):
    m = _mps(root, "on", None, CUDA_MPS_PIPE_DIRECTORY=str(root / "none"))
    with pytest.raises(mps.MpsError, match=f"{mps.CONTROL_BINARY} is not on PATH") as e:
        m.start()
    assert "\n" not in str(e.value) and "--mps auto or off" in str(e.value)
    assert m.mode == "off"


def test_auto_without_the_binary_is_off(root, caplog):
    with caplog.at_level(logging.INFO, logger="epd.mps"):
        m = _mps(root, "auto", None, CUDA_MPS_PIPE_DIRECTORY=str(root / "none"))
        m.start()
    assert m.mode == "off" and m.env() == {mps.ENGINE_ENV: ""}
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_cpu_backend_never_starts_mps(root, fake):
    m = _mps(root, "auto", fake, cuda=False)
    m.start()
    assert m.mode == "off" and not fake.calls()
    with pytest.raises(mps.MpsError, match="cpu backend"):
        _mps(root, "on", fake, cuda=False).start()
    _mps(root, "off", fake).start()
    assert not fake.calls()


def test_a_failing_binary(root, fake, caplog, monkeypatch):
    """`on`: an error with the binary's last line; auto: off with a WARNING. Nothing is left
    in the socket folder either way."""
    (root / "sock").mkdir()
    with pytest.raises(mps.MpsError, match=r"exit code 3.*FAKE_MPS_BROKEN"):
        _mps(root, "on", fake, FAKE_MPS_BROKEN="1").start()
    assert os.listdir(root / "sock") == []
    with caplog.at_level(logging.INFO, logger="epd.mps"):
        m = _mps(root, "auto", fake, FAKE_MPS_BROKEN="1")
        m.start()
    assert m.mode == "off" and any(r.levelname == "WARNING" for r in caplog.records)
    assert os.listdir(root / "sock") == []


def test_a_private_server_left_by_an_earlier_daemon_is_replaced(root, fake):
    (root / "sock").mkdir()
    pipe = str(root / "sock" / "mps" / "pipe")
    os.makedirs(pipe)
    fake.run(pipe, "-d")
    old = mps.control_pid(pipe)
    m = _mps(root, "on", fake)
    m.start()
    try:
        assert m.mode == "private" and not mps._alive(old)
        assert mps.control_pid(pipe) not in (None, old)
    finally:
        m.stop()


@pytest.mark.parametrize("requested", ["off", "cpu"])
def test_a_private_server_left_by_an_earlier_daemon_goes_whatever_the_mode(root, fake,
                                                                           requested):
    """An earlier daemon killed without stopping its private server: the next daemon on the
    socket folder quits it even when it runs without MPS itself (--mps off, the cpu backend),
    and removes its folder."""
    (root / "sock").mkdir()
    pipe = str(root / "sock" / "mps" / "pipe")
    os.makedirs(pipe)
    fake.run(pipe, "-d")
    old = mps.control_pid(pipe)
    assert old is not None and mps._alive(old)
    m = (_mps(root, "off", fake) if requested == "off"
         else _mps(root, "auto", fake, cuda=False))
    m.start()
    assert m.mode == "off" and not mps._alive(old)
    assert not (root / "sock" / "mps").exists()


# -- the daemon ------------------------------------------------------------------------------
class MpsDaemon(HarnessDaemon):
    """`epd serve` (cpu engines) started through BOOT in `root`, with the fake on PATH."""

    __test__ = False

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None,
                 boot: bool = True) -> None:
        self.dir = str(root)
        self.socket_dir = str(root / "sock")
        self.tmp = root / "tmp"  # the daemon's TMPDIR: its metrics folder goes there
        self.tmp.mkdir(exist_ok=True)
        self.metrics_port = _free_port()
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self.log_path = str(root / "daemon.log")
        self.engines = 1
        head = [sys.executable, "-c", BOOT] if boot else [sys.executable, "-m",
                                                         "epd.server.cli"]
        cmd = [*head, "serve", "--backend", "cpu", "--engines", "1", "--socket-dir",
               self.socket_dir, "--metrics-port", str(self.metrics_port),
               "--drain-seconds", "2", *args]
        full = {**os.environ, "TMPDIR": str(self.tmp), **(env or {})}
        full.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self._log = open(self.log_path, "w")  # noqa: SIM115  (as long as the daemon)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full)

    def topology(self) -> epd_pb2.GetTopologyResponse:
        with grpc.insecure_channel(f"unix://{self.socket_dir}/node.sock") as ch:
            return epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=5)

    def engine_environ(self, index: int = 0) -> dict[str, str]:
        raw = Path(f"/proc/{self.engine_pid(index)}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)

    def terminate(self) -> int:
        """SIGTERM and wait; the folders stay for the caller to inspect."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def stop(self, timeout: float = 20.0) -> int:  # the folder is the `root` fixture's
        return self.terminate()


def epd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd.server.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def one_line(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res
    assert len(lines) == 1, f"expected one line on stderr, got:\n{res.stderr}"
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@contextlib.contextmanager
def client_env(**env: str | None):
    """This process's environment for a Session opened inside (restored afterwards)."""
    old = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_private_server_with_the_daemon(root, fake, monkeypatch):
    """--mps on: a private server under the socket folder, its pipe in every engine's
    environment, `epd env` and the session fields; SIGTERM stops engines, then the server,
    and leaves nothing behind."""
    d = MpsDaemon(root, "--mps", "on", env={"PATH": fake.path(), "CUDA_VISIBLE_DEVICES": "1",
                                            mps.PIPE_ENV: str(root / "no-node-server")})
    try:
        d.wait_ready(60)
        pipe = os.path.join(d.socket_dir, "mps", "pipe")
        t = d.topology()
        assert (t.mps_mode, t.mps_pipe_directory) == ("private", pipe)
        server = mps.control_pid(pipe)
        assert server
        env = d.engine_environ()
        assert env[mps.PIPE_ENV] == pipe and env[mps.ENGINE_ENV] == pipe
        assert env[mps.LOG_ENV] == os.path.join(d.socket_dir, "mps", "log")
        metrics_dir = env["PROMETHEUS_MULTIPROC_DIR"]
        assert metrics_dir.startswith(str(d.tmp))

        res = epd("env", "--socket-dir", d.socket_dir)
        assert res.returncode == 0, res.stderr
        exports = [ln for ln in res.stdout.splitlines() if not ln.startswith("#")]
        assert exports == [f"export EPD_SOCKET_DIR={d.socket_dir}", f"export {mps.PIPE_ENV}={pipe}"]
        top = epd("topology", "--socket-dir", d.socket_dir)
        assert f"CUDA MPS: private, pipe folder {pipe}" in top.stdout, top.stdout

        # A client under `epd env` shares it; one with another pipe folder is warned, once.
        monkeypatch.setattr(client_mps, "_warned", False)
        with client_env(**{mps.PIPE_ENV: pipe}), warnings.catch_warnings():
            warnings.simplefilter("error", client_mps.MpsWarning)
            with Session(d.socket(0)) as s:
                assert s.on_engine_mps and s.mps_pipe_directory == pipe
                assert d.topology().engines[0].sessions_without_mps == 0
        other = str(root / "other-pipe")
        with client_env(**{mps.PIPE_ENV: other}):
            with pytest.warns(client_mps.MpsWarning, match=r'eval "\$\(epd env\)"'):
                s1 = Session(d.socket(0))
            with warnings.catch_warnings():
                warnings.simplefilter("error", client_mps.MpsWarning)
                s2 = Session(d.socket(0))  # the same process: no second warning
            with s1, s2:
                assert not s1.on_engine_mps and s1.mps_pipe_directory == pipe
                t = d.topology()
                assert t.engines[0].sessions_without_mps == 2
                top = epd("topology", "--socket-dir", d.socket_dir)
                assert "sessions-without-mps=2" in top.stdout, top.stdout
                _, text = d.get("/metrics")
                assert 'epd_sessions_without_mps{engine="0"} 2.0' in text
        ranklib.wait_until(lambda: d.topology().engines[0].sessions_without_mps == 0, 10,
                           "closed sessions uncounted")
        warned = [ln for ln in d.log().splitlines()
                  if "WARNING" in ln and "not on engine 0's CUDA MPS server" in ln]
        assert len(warned) == 1 and f"pid {os.getpid()}" in warned[0], warned
    finally:
        rc = d.terminate()
    log = d.log()
    assert rc == 0, log[-3000:]
    assert os.listdir(d.socket_dir) == [], os.listdir(d.socket_dir)
    assert not mps._alive(server)
    assert not os.path.exists(metrics_dir) and os.listdir(d.tmp) == []
    calls = [c.split()[1:3] for c in fake.calls()]
    assert calls[0] == ["-d", f"pipe={pipe}"] and ["cmd", "quit"] in calls
    assert any("cvd=1" in c for c in fake.calls() if " -d " in c)
    assert "MPS: private control daemon" in log and "private control daemon stopped" in log


def test_node_server_with_the_daemon(root, fake):
    """auto with a node server on the pipe folder in effect: used (engines told), not
    stopped when the daemon exits."""
    node = str(root / "node-pipe")
    assert fake.run(node, "-d").returncode == 0
    try:
        d = MpsDaemon(root, env={"PATH": fake.path(), mps.PIPE_ENV: node})
        try:
            d.wait_ready(60)
            t = d.topology()
            assert (t.mps_mode, t.mps_pipe_directory) == ("node", node)
            assert d.engine_environ()[mps.ENGINE_ENV] == node
            with client_env(**{mps.PIPE_ENV: node}), Session(d.socket(0)) as s:
                assert s.on_engine_mps
        finally:
            rc = d.terminate()
        assert rc == 0, d.log()[-3000:]
        assert mps.control_pid(node) is not None
        assert not any("quit" in c for c in fake.calls())
        assert os.listdir(d.socket_dir) == []
    finally:
        fake.run(node, stdin="quit\n")


def test_on_without_the_binary_exits_2(root):
    d = MpsDaemon(root, "--mps", "on", env={"PATH": str(root / "empty-bin"),
                                            mps.PIPE_ENV: str(root / "none")})
    rc = d.proc.wait(60)
    d.terminate()
    lines = d.log().strip().splitlines()
    assert rc == 2, d.log()
    assert len(lines) == 1 and mps.CONTROL_BINARY in lines[0] and "--mps on" in lines[0], lines
    assert os.listdir(d.socket_dir) == [] and os.listdir(d.tmp) == []


def test_cpu_backend_and_on_exits_2(root, fake):
    res = epd("serve", "--backend", "cpu", "--mps", "on", "--socket-dir", str(root / "sock"),
              "--metrics-port", "0", env={"PATH": fake.path(), "TMPDIR": str(root)})
    one_line(res, 2, "--mps on", "cpu backend")
    assert not fake.calls()


def test_cpu_backend_auto_is_off_and_epd_env_says_so(root, fake):
    d = MpsDaemon(root, boot=False, env={"PATH": fake.path()})
    try:
        d.wait_ready(60)
        t = d.topology()
        assert (t.mps_mode, t.mps_pipe_directory) == ("off", "")
        assert d.engine_environ()[mps.ENGINE_ENV] == ""
        res = epd("env", "--socket-dir", d.socket_dir)
        assert res.returncode == 0 and res.stderr == ""
        assert res.stdout.startswith("#") and "without CUDA MPS" in res.stdout
        # (the socket folder only: nothing of MPS)
        assert res.stdout.splitlines()[1:] == [f"export EPD_SOCKET_DIR={d.socket_dir}"]
        with Session(d.socket(0)) as s:
            assert not s.on_engine_mps and s.mps_pipe_directory == ""
        assert "CUDA MPS: off" in epd("topology", "--socket-dir", d.socket_dir).stdout
    finally:
        assert d.terminate() == 0, d.log()[-3000:]
    assert not fake.calls()


def test_epd_env_without_a_daemon(tmp_path):
    one_line(epd("env", "--socket-dir", str(tmp_path)), 1, "no daemon answers", "epd env")


def test_epd_env_refuses_another_uid(root, fake, monkeypatch, capsys):
    """An MPS server serves one uid at a time: exporting its pipe to another uid's client would
    make that client's CUDA wait for the engines' server to end."""
    from epd.server import cli

    d = MpsDaemon(root, "--mps", "on", env={"PATH": fake.path(),
                                            mps.PIPE_ENV: str(root / "none")})
    try:
        d.wait_ready(60)
        monkeypatch.setattr(os, "getuid", lambda: os.stat(d.socket_dir).st_uid + 1)
        assert cli.main(["env", "--socket-dir", d.socket_dir]) == 1
        out = capsys.readouterr()
        assert out.out == "" and "one uid at a time" in out.err
    finally:
        assert d.terminate() == 0, d.log()[-3000:]


def test_request_fields_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    assert client_mps.request_fields()["mps_pipe_directory"] == mps.DEFAULT_PIPE_DIRECTORY
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path))
    assert client_mps.request_fields() == {"mps_pipe_directory": str(tmp_path),
                                           "mps_pipe_present": False}
    (tmp_path / "control").touch()
    assert client_mps.request_fields()["mps_pipe_present"] is True


def test_alive_treats_a_zombie_as_gone():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    assert not mps._alive(p.pid)  # reaped here (it is our child), or seen as a zombie
    with contextlib.suppress(ChildProcessError):
        p.wait(1)
