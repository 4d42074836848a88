"""An engine that cannot start (a missing toolchain, a device that will not open): the
supervisor says why (readiness, `epd topology`, a metric), waits longer before each next
start instead of looping at a fixed pace, and serves as soon as a start succeeds."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import grpc
import pytest
from conftest import TestDaemon
from ranklib import wait_until

from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server.supervisor import EngineProc

pytestmark = pytest.mark.slow

# Imported by every Python process of the daemon (PYTHONPATH): in an engine (the supervisor sets
# EPD_SUPERVISOR_PID for its engines only), while the flag file exists, backend creation fails
# as a real one does at start-up.
SITECUSTOMIZE = '''
import os
flag = os.environ.get("EPD_TEST_BACKEND_BROKEN_WHILE")
if os.environ.get("EPD_SUPERVISOR_PID") and flag and os.path.exists(flag):
    import epd.server.backends as backends

    def make_backend(cfg, index, device=None):
        raise RuntimeError("the test took the backend away")

    backends.make_backend = make_backend
'''
REASON = "RuntimeError: the test took the backend away"


def _topology(d: TestDaemon) -> epd_pb2.GetTopologyResponse:
    with grpc.insecure_channel(f"unix://{d.node_socket}") as ch:
        return epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(), timeout=10)


def _engines_import(tmp_path, monkeypatch, source: str, flag_env: str):
    """Make the daemon's Python processes import `source` (a sitecustomize.py on PYTHONPATH)
    and give it a flag file, present until the test removes it, named by `flag_env`."""
    (tmp_path / "sitecustomize.py").write_text(source)
    flag = tmp_path / "flag"
    flag.write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv(flag_env, str(flag))
    return flag


def test_backoff_doubles_up_to_its_cap() -> None:
    e = EngineProc(0, "gpu0.sock")
    delays = []
    for n in range(8):
        e.failed_starts = n
        delays.append(e.backoff(0.5, 10.0))
    assert delays == [0.5, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    e.failed_starts = 3
    assert e.backoff(2.0, 0.0) == 2.0  # a cap below the base is the base
    e.failed_starts = 5000  # (a daemon whose engine never starts, for days: no overflow)
    assert e.backoff(1.0, 60.0) == 60.0


def test_engine_that_cannot_start_is_reported_then_recovers(tmp_path, monkeypatch) -> None:
    flag = _engines_import(tmp_path, monkeypatch, SITECUSTOMIZE,
                           "EPD_TEST_BACKEND_BROKEN_WHILE")
    d = TestDaemon(engines=1, extra=["--restart-backoff-seconds", "0.1",
                                     "--restart-backoff-max-seconds", "0.8"])
    try:
        seen: list[str] = []

        def failed_twice() -> bool:
            try:
                status, body = d.get("/readyz")
            except OSError:  # the supervisor's HTTP endpoint is not up yet
                return False
            seen.append(body)
            # (between two starts: while a start is under way there is no "next start")
            m = re.search(r"failed to start (\d+) time\(s\) in a row", body)
            return status == 503 and m is not None and int(m[1]) >= 2 \
                and "next start in" in body

        wait_until(failed_twice, 60, "two failed starts and the next start reported by "
                   "/readyz")
        assert REASON in seen[-1], seen[-1]
        e = _topology(d).engines[0]
        assert not e.ready and e.failed_starts >= 2 and e.last_failure == REASON
        assert 'epd_engine_start_failures{engine="0"}' in d.get("/metrics")[1]
        cli = subprocess.run([sys.executable, "-m", "epd.server.cli", "topology",
                              "--socket-dir", d.socket_dir], capture_output=True, text=True,
                             timeout=60)
        assert "NOT READY" in cli.stdout and "failed to start" in cli.stdout \
            and REASON in cli.stdout, cli.stdout + cli.stderr

        # The harness's wait gives up once starts keep failing, naming the reason.
        with pytest.raises(RuntimeError, match="the test took the backend away"):
            d.wait_ready(60)
        flag.unlink()  # the fault is fixed: a later start succeeds
        d.wait_ready(60, give_up_after_failed_starts=0)
        e = _topology(d).engines[0]
        assert e.ready and e.failed_starts == 0 and e.restarts >= 2
        assert e.last_failure == REASON  # the last exit's reason stays visible
        assert d.get("/readyz")[0] == 200
        metrics = d.get("/metrics")[1]
        assert 'epd_engine_start_failures{engine="0"} 0.0' in metrics, metrics
        assert not os.path.exists(os.path.join(d.socket_dir, "gpu0.failed"))
    finally:
        d.stop_and_check()


def test_a_daemon_that_does_not_start_leaves_nothing() -> None:
    """demo.Daemon (the demo's and the benchmarks' daemon) whose `epd serve` exits at once (a
    bad setting) raises with the daemon's words and removes its folder."""
    from epd.server.demo import Daemon

    d = Daemon(engines=1, extra=["--fast-path-spin-max-us", "nope"])
    with pytest.raises(RuntimeError, match="daemon exited with 2"), d:
        pass
    assert not os.path.exists(d.dir)


HANGING = '''
import os, time
flag = os.environ.get("EPD_TEST_BACKEND_HANGS_WHILE")
if os.environ.get("EPD_SUPERVISOR_PID") and flag and os.path.exists(flag):
    import epd.server.backends as backends

    def make_backend(cfg, index, device=None):
        while True:  # (stuck in its device's set-up; SIGTERM is not handled yet)
            time.sleep(1)

    backends.make_backend = make_backend
'''


def test_an_engine_stuck_at_start_is_killed_and_counted(tmp_path, monkeypatch) -> None:
    """An engine that never comes up and never exits (stuck opening its device) was 'not
    ready' for good with no reason: after --engine-start-timeout-seconds it is killed, the
    failed start is reported with that reason, and a later start serves."""
    flag = _engines_import(tmp_path, monkeypatch, HANGING, "EPD_TEST_BACKEND_HANGS_WHILE")
    d = TestDaemon(engines=1, extra=["--engine-start-timeout-seconds", "2",
                                     "--restart-backoff-seconds", "0.1"])
    try:
        def reported() -> bool:
            try:
                e = _topology(d).engines[0]
            except grpc.RpcError:
                return False
            return e.failed_starts >= 1 and "engine-start-timeout-seconds" in e.last_failure
        wait_until(reported, 60, "a start killed for its deadline, reported")
        flag.unlink()
        d.wait_ready(60, give_up_after_failed_starts=0)
        assert _topology(d).engines[0].ready
    finally:
        d.stop_and_check()
