"""What operators see of the daemon: `epd_engine_up` from an engine's start, the HTTP endpoint
on an IPv6 address, and README.md's metrics table against server/metrics.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from epd.server import config, http, metrics, node_service
from epd.server import supervisor as sup_mod
from epd.server.backends.cpu_plan import CpuPlanner

ROOT = Path(__file__).resolve().parent.parent
NO_PID = 1 << 22  # above the largest pid_max: the fake engine is never a real process


def _cfg(tmp_path: Path, **env: str) -> config.Config:
    for sub in ("sock", "shm"):
        (tmp_path / sub).mkdir(exist_ok=True)
    return config.load(None, {"EPD_BACKEND": "cpu", "EPD_SOCKET_DIR": str(tmp_path / "sock"),
                              "EPD_SHM_DIR": str(tmp_path / "shm"), "EPD_METRICS_PORT": "0",
                              "EPD_MPS": "off", **env})


# -- epd_engine_up from the start ----------------------------------------------------------------
class _StartingProc:
    """A Popen stand-in for an engine stuck in its set-up: it runs and never serves."""

    def __init__(self) -> None:
        self.pid, self.returncode = NO_PID, None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


def _engine_up(index: int) -> float | None:
    return REGISTRY.get_sample_value("epd_engine_up", {"engine": str(index)})


def _forget_engine_up(index: int) -> None:
    """No epd_engine_up series for the engine in this process (as in a daemon that just began)."""
    with warnings.catch_warnings(), contextlib.suppress(KeyError):
        warnings.simplefilter("ignore")  # (multiprocess mode: only the in-process child goes)
        metrics.ENGINE_UP.remove(str(index))


def test_an_engine_that_never_becomes_ready_reads_down(tmp_path, monkeypatch):
    """An engine stuck in its first start had no epd_engine_up series (so no EpdEngineDown)
    until --engine-start-timeout-seconds killed it: the spawn sets 0, being ready sets 1."""
    sup = sup_mod.Supervisor(_cfg(tmp_path), CpuPlanner(str(tmp_path / "shm")), 1)
    e = sup.engines[0]
    monkeypatch.setattr(sup_mod.subprocess, "Popen",
                        lambda argv, env, pass_fds: _StartingProc())
    serving = False

    async def probe(engine, timeout: float = 1.0) -> bool:
        return serving
    monkeypatch.setattr(sup, "_probe", probe)
    _forget_engine_up(e.index)
    try:
        assert _engine_up(e.index) is None  # (the premise: no series before the start)
        sup._spawn(e)
        assert _engine_up(e.index) == 0
        asyncio.run(sup._watch(e))  # starting, not answering: still down, not missing
        assert not e.ready and _engine_up(e.index) == 0
        serving = True
        asyncio.run(sup._watch(e))
        assert e.ready and _engine_up(e.index) == 1
    finally:
        _forget_engine_up(e.index)


# -- the HTTP endpoint on IPv6 -------------------------------------------------------------------
def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def metrics_dir(tmp_path, monkeypatch) -> Path:
    """A multiprocess folder (the endpoint collects it) holding one engine's gauge sample."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    folder = tmp_path / "metrics"
    folder.mkdir()
    d = MmapedDict(str(folder / "gauge_livemax_4242.db"))
    d.write_value(mmap_key("epd_engine_up", "epd_engine_up", ["engine"], ["0"], "up"), 1.0,
                  0.0)
    d.close()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    return folder


def _stop(server) -> None:
    server.shutdown()
    server.server_close()


@needs_ipv6
def test_the_endpoint_serves_on_an_ipv6_address(metrics_dir):
    """wsgiref's server is AF_INET only: "::1" (a pod IP on an IPv6 cluster) raised gaierror
    and the daemon did not start (exit 2)."""
    server = http.start("::1", 0, lambda: (False, "engines not ready: [0]"))
    try:
        assert server.socket.family == socket.AF_INET6
        assert http.url(server).startswith("http://[::1]:")
        status, body = _get(http.url(server))
        assert status == 200 and 'epd_engine_up{engine="0"} 1.0' in body
        assert _get(http.url(server, "/readyz")) == (503, "engines not ready: [0]\n")
        assert _get(http.url(server, "/healthz")) == (200, "ok\n")
    finally:
        _stop(server)


def test_the_endpoint_on_ipv4_and_by_name_as_before(metrics_dir):
    server = http.start("127.0.0.1", 0, lambda: (True, "ready"))
    try:
        assert server.socket.family == socket.AF_INET
        assert http.url(server).startswith("http://127.0.0.1:")
        assert _get(http.url(server, "/readyz")) == (200, "ready\n")
    finally:
        _stop(server)
    server = http.start("localhost", 0, lambda: (True, "ready"))
    try:
        assert _get(http.url(server, "/healthz")) == (200, "ok\n")
    finally:
        _stop(server)


def test_idle_connections_hold_no_threads_for_long(metrics_dir, monkeypatch):
    """Connections to the endpoint that say nothing: at most MAX_CONNECTIONS are served at
    once (a thread each), a silent one ends after IDLE_SECONDS, and the endpoint answers again
    after them (a review: 300 idle connections held 300 supervisor threads for good)."""
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(http._QuietHandler, "timeout", 0.5)
    server = http.start("127.0.0.1", 0, lambda: (True, "ready"))
    idle = []
    try:
        before = threading.active_count()
        for _ in range(20):
            c = socket.create_connection(server.server_address[:2], timeout=5)
            idle.append(c)
        time.sleep(0.2)
        assert threading.active_count() - before <= 4
        time.sleep(0.8)  # (the silent ones timed out)
        assert _get(http.url(server, "/readyz")) == (200, "ready\n")
        assert threading.active_count() - before <= 1
    finally:
        for c in idle:
            c.close()
        _stop(server)


def test_a_slow_connection_holds_its_slot_a_bounded_time(metrics_dir, monkeypatch):
    """A client that sends a byte every little while never meets the read timeout, yet its
    connection ends REQUEST_SECONDS after it came, and its slot with it (a fuzzer held
    /healthz shut with forty such connections)."""
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(http, "REQUEST_SECONDS", 1.0)
    monkeypatch.setattr(http._QuietHandler, "timeout", 0.5)
    server = http.start("127.0.0.1", 0, lambda: (True, "ready"))
    slow = []
    try:
        for _ in range(2):
            slow.append(socket.create_connection(server.server_address[:2], timeout=5))
        t0 = time.monotonic()
        ended = [False, False]
        while time.monotonic() - t0 < 3 and not all(ended):
            for i, c in enumerate(slow):
                if not ended[i]:
                    try:
                        c.sendall(b"G")  # (within every read timeout)
                    except OSError:
                        ended[i] = True
            time.sleep(0.2)
        assert all(ended) and time.monotonic() - t0 < 2.5, (ended, time.monotonic() - t0)
        assert _get(http.url(server, "/healthz")) == (200, "ok\n")
    finally:
        for c in slow:
            c.close()
        _stop(server)


@needs_ipv6
def test_the_supervisor_binds_ipv6_and_names_a_used_or_bad_address(tmp_path, metrics_dir):
    """Through the daemon's start-up: ::1 binds; a port in use there, or an address that is
    none, is still the one-line start-up error naming the setting."""
    sup = sup_mod.Supervisor(_cfg(tmp_path, EPD_METRICS_HOST="::1"),
                             CpuPlanner(str(tmp_path / "shm")), 1)
    sup.bind_http()
    try:
        port = sup._http.server_address[1]
        assert _get(f"http://[::1]:{port}/healthz") == (200, "ok\n")
        assert sup.metrics_url == f"http://[::1]:{port}/metrics"  # (topology, logs, bench)
        busy = sup_mod.Supervisor(_cfg(tmp_path, EPD_METRICS_HOST="::1",
                                       EPD_METRICS_PORT=str(port)),
                                  CpuPlanner(str(tmp_path / "shm")), 1)
        with pytest.raises(sup_mod.StartupError, match=r"^--metrics-port \d+: ::1:\d+ is "
                                                       r"already in use") as err:
            busy.bind_http()
        assert "\n" not in str(err.value)
    finally:
        _stop(sup._http)
    bad = sup_mod.Supervisor(_cfg(tmp_path, EPD_METRICS_HOST="no-such-host.invalid"),
                             CpuPlanner(str(tmp_path / "shm")), 1)
    with pytest.raises(sup_mod.StartupError,
                       match=r"^--metrics-host no-such-host\.invalid / --metrics-port 0: ") as err:
        bad.bind_http()
    assert "\n" not in str(err.value) and "cannot listen there" in str(err.value)


def test_a_used_address_is_an_oserror(metrics_dir):
    """(What bind_http turns into its EADDRINUSE line.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError) as err:
            _stop(http.start("127.0.0.1", s.getsockname()[1], lambda: (True, "")))
    assert err.value.errno == errno.EADDRINUSE


# -- README.md's metrics table -------------------------------------------------------------------
def _metrics_table() -> list[tuple[str, str]]:
    """(metric cell, labels cell) of each row of README.md's metrics table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Metrics and health\n", 1)[1].split("\n## ", 1)[0]
    lines = section.split("\n")
    start = lines.index("| metric | type | labels |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows.append((cells[0], cells[-1]))
    return rows


def _defined_metrics() -> dict[str, MetricWrapperBase]:
    """The exported name (a counter's with _total) of every metric server/metrics.py defines."""
    out = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            out[obj._name + ("_total" if obj._type == "counter" else "")] = obj
    return out


def test_every_metric_is_in_the_readme_table():
    """The table omitted epd_stream_op_launch_seconds and epd_stream_op_detect_seconds: every
    metric of server/metrics.py has a row naming it (and its labels), and every metric a row
    names exists."""
    rows = _metrics_table()
    defined = _defined_metrics()
    assert len(rows) >= 20 and len(defined) >= 30  # (the parse found the table and the module)
    named = {n for cell, _ in rows for n in re.findall(r"`(epd_\w+)`", cell)}
    missing = sorted(set(defined) - named)
    assert not missing, f"metrics README.md's metrics table does not name: {missing}"
    stale = sorted(named - set(defined))
    assert not stale, f"README.md's metrics table names metrics server/metrics.py lacks: {stale}"
    for name, metric in defined.items():
        labels = [cell for first, cell in rows if f"`{name}`" in first]
        want = set(metric._labelnames)
        assert any(want <= set(re.findall(r"\w+", cell)) for cell in labels), \
            f"{name}: README.md's labels column does not list {sorted(want)}"


# -- epd demo / epd bench: usage errors and Ctrl-C -----------------------------------------------
def _cli(args: list[str], tmp_path: Path, timeout: float = 60):
    import os
    import subprocess
    import sys
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "epd.server.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


_SMALL = ["--tokens", "8", "--hidden", "64", "--experts", "8", "--topk", "2", "--ranks", "2"]


@pytest.mark.parametrize(("args", "words"), [
    (["--ranks", "0"], "--ranks must be >= 1"),          # was: ZeroDivisionError traceback
    (["--topk", "9"], "--topk 9 must be at most --experts 8"),  # was: a daemon, rank errors
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--hidden", "-1"], "--hidden must be >= 1"),
    (["--iters", "0"], "--iters must be >= 1"),          # was: NaN table, RuntimeWarnings, 0
    (["--engines", "-1"], "--engines must be >= 0"),     # was: RuntimeError traceback
    (["--metrics-port", "99999"], "--metrics-port must lie in [0, 65535]"),
])
def test_demo_usage_errors_are_one_line_exit_2(tmp_path, args, words):
    r = _cli(["demo", "--backend", "cpu", *_SMALL, *args], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("epd demo: ") and words in r.stderr
    assert "\n" not in r.stderr.strip() and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # no daemon was started


@pytest.mark.parametrize(("args", "words"), [
    (["--tokens", "abc"], "--tokens takes whole numbers"),  # was: ValueError traceback
    (["--shapes", "X"], "--shapes takes distinct names"),  # (was: exit code 1)
    (["--ranks", "1"], "--ranks must be >= 2"),
])
def test_bench_usage_errors_are_one_line_exit_2(tmp_path, args, words):
    r = _cli(["bench", "--backend", "cpu", "--hidden", "64", "--experts", "8", "--topk", "2",
              *args], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epd bench: ") and words in lines[0]


def test_ctrl_c_during_demo_leaves_nothing(tmp_path):
    """Ctrl-C (SIGINT to the foreground group) during `epd demo`: one line, exit 130, no
    traceback, no process or temporary folder left (was: tracebacks from every process, and
    the daemon's folder in TMPDIR when a second SIGINT cut the cleanup short)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
         "signal.default_int_handler); from epd.server.cli import main; sys.exit(main())",
         "demo", "--backend", "cpu", "--ranks", "2", "--tokens", "1024", "--hidden", "1024",
         "--experts", "8", "--topk", "2", "--iters", "100000"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the ranks run (the daemon's log is there)
            if len(subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True,
                                  text=True).stdout.split()) >= 6:
                break
            time.sleep(0.2)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)  # an impatient second Ctrl-C
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "epd demo: interrupted" in err, err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and subprocess.run(
            ["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 0:
        time.sleep(0.2)
    assert subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode != 0
    assert list(tmp_path.iterdir()) == []


def test_the_daemon_raises_its_open_files_soft_limit():
    """`epd serve` takes the hard limit of open descriptors as its soft one (engines inherit
    it): a shell's 1024 let a few sessions exhaust an engine (a fuzzer)."""
    code = ("import resource\n"
            "from epd.server.open_files import raise_open_files_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
            "raise_open_files_limit()\n"
            "want = hard if hard != resource.RLIM_INFINITY else 1 << 20\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (want, hard))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "True", r


def test_a_get_topology_flood_shares_its_reads_of_the_metrics_files(tmp_path, metrics_dir,
                                                                    monkeypatch):
    """Any client of node.sock may call GetTopology in a loop: the sessions-off-MPS counts
    (a whole collection of every process's metrics file, under the collection lock) are read
    one read at a time, shared by the calls that came before it started; a call after it
    gets a fresh read (counts read after the call came)."""
    from epd.proto.v1 import epd_pb2

    reads = []
    monkeypatch.setattr(node_service, "sessions_without_mps", lambda: reads.append(1) or {"0": 2})
    sup = sup_mod.Supervisor(_cfg(tmp_path), CpuPlanner(str(tmp_path / "shm")), 1)
    node = node_service.NodeService(sup)

    async def flood() -> list:
        return await asyncio.gather(*(node.GetTopology(epd_pb2.GetTopologyRequest(), None)
                                      for _ in range(50)))

    async def run() -> None:
        answers = await flood()
        # The first call's read, then one that the 49 which came while it ran share.
        assert len(reads) == 2 and all(a.engines[0].sessions_without_mps == 2 for a in answers)
        await node.GetTopology(epd_pb2.GetTopologyRequest(), None)
        assert len(reads) == 3  # (a later call: read again)
    asyncio.run(run())

    # Callers whose deadline cuts their wait short leave the read running, still one at a time
    running, most = [0], [0]

    def slow_read() -> dict:
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.02)
        running[0] -= 1
        return {"0": 1}
    monkeypatch.setattr(node_service, "sessions_without_mps", slow_read)

    async def cut_short() -> None:
        for _ in range(60):
            call = asyncio.ensure_future(node.GetTopology(epd_pb2.GetTopologyRequest(), None))
            await asyncio.sleep(0.002)
            call.cancel()
        await asyncio.sleep(0.1)
    asyncio.run(cut_short())
    assert most[0] == 1, most


def test_a_short_open_files_limit_is_named_at_start(tmp_path):
    """The budgets do not count descriptors: `epd serve` under a limit that cannot cover the
    sessions they allow says so at start, with the value it needs."""
    code = ("import logging, resource, sys\n"
            "logging.basicConfig(level='INFO', format='%(message)s')\n"
            "from epd.server import config, open_files\n"
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), min(4096, hard)))\n"
            "open_files.check_open_files_limit(config.load(None, {}))\n"
            "open_files.check_open_files_limit(config.load(None, {'EPD_MAX_SESSIONS': '4'}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "open-files limit" in ln]
    assert len(lines) == 1, r.stderr  # (4 sessions fit in 4096)
    assert "not --max-sessions 256" in lines[0] and "to 116992 or more" in lines[0], lines[0]
