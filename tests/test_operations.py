"""Operating the daemon (issue 12, findings 6, 7, 8, 11, 12, 13, 15, 16, 17): node.sock
authorization, per-session budgets, deadlines that are numbers, supervisor death and the socket
folder's lock, bounded metric label sets, malformed requests, the metrics folder, the shm folder
check, one-line start-up errors, leave vs abort, join mismatches told to every waiting rank."""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import ml_dtypes
import numpy as np
import pytest
from ranklib import wait_until

from epd.client import EpdError, Session
from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server.demo import Daemon

# The module's daemon: small budgets and label cap, so the tests reach them quickly.
DAEMON_EXTRA = ["--max-regions-per-session", "6", "--max-group-label-values", "8"]
GROUP_LABEL_CAP = 8
REGION_LIMIT = 6


def spec(name: str, num_ranks: int = 1, hidden: int = 128) -> dict:
    return dict(rank=0, num_ranks=num_ranks, num_experts=4 * num_ranks, hidden=hidden,
                max_tokens_per_rank=16, num_topk=2, dtype="bfloat16")


def join(s: Session, name: str, rank: int = 0, num_ranks: int = 1, hidden: int = 128,
         timeout: float = 10.0):
    kw = spec(name, num_ranks, hidden)
    kw["rank"] = rank
    return s.join(name, timeout=timeout, **kw)


def inputs(tokens: int = 8, hidden: int = 128, experts: int = 4, topk: int = 2):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
    idx = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    return x, idx.astype(np.int64), np.full((tokens, topk), 0.5, np.float32)


def node_stub(d) -> tuple[grpc.Channel, epd_pb2_grpc.NodeStub]:
    ch = grpc.insecure_channel(f"unix://{d.node_socket}")
    return ch, epd_pb2_grpc.NodeStub(ch)


def metric_lines(d, name: str) -> list[str]:
    return [ln for ln in d.get("/metrics")[1].splitlines() if ln.startswith(name)]


def metric_sum(d, name: str, **labels: str) -> float:
    total = 0.0
    for ln in metric_lines(d, name):
        head, _, value = ln.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def pair(d, name: str, hidden: int = 128):
    """Two sessions (one per engine) holding ranks 0 and 1 of a new 2-rank group."""
    s0, s1 = Session(d.socket(0)), Session(d.socket(1))
    with ThreadPoolExecutor(2) as ex:
        f0 = ex.submit(join, s0, name, 0, 2, hidden)
        f1 = ex.submit(join, s1, name, 1, 2, hidden)
        return (s0, s1), (f0.result(30), f1.result(30))


def both(fn0, fn1):
    with ThreadPoolExecutor(2) as ex:
        a, b = ex.submit(fn0), ex.submit(fn1)
        return a.result(30), b.result(30)


# -- 6: node.sock authorization ----------------------------------------------------------------
def test_client_cannot_release_a_rank_on_node_sock(daemon):
    (s0, s1), (g0, g1) = pair(daemon, "auth-victim")
    try:
        ch, node = node_stub(daemon)
        with ch:
            for call, req in ((node.ReleaseRank, epd_pb2.ReleaseRankRequest(
                                   group_id=g0.group_id, rank=0, reason="evil")),
                              (node.Rendezvous, epd_pb2.RendezvousRequest(
                                   rank=0, attached=True, group_id=g0.group_id)),
                              (node.GetBootstrap, epd_pb2.GetBootstrapRequest())):
                with pytest.raises(grpc.RpcError) as ei:
                    call(req, timeout=5)
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED, ei.value
            # A wrong token is refused alike; the topology stays open to clients.
            with pytest.raises(grpc.RpcError) as ei:
                node.ReleaseRank(epd_pb2.ReleaseRankRequest(group_id=g0.group_id, rank=0,
                                                            reason="evil"),
                                 metadata=(("epd-node-token", "0" * 64),), timeout=5)
            assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert node.GetTopology(epd_pb2.GetTopologyRequest(), timeout=5).engines
        _, idx, _ = inputs(experts=8)
        r0, r1 = both(lambda: g0.get_dispatch_layout(idx), lambda: g1.get_dispatch_layout(idx))
        assert int(np.asarray(r0[0]).sum()) > 0 and int(np.asarray(r1[0]).sum()) > 0
    finally:
        s0.close()
        s1.close()


def test_sigusr1_writes_every_threads_stack_and_the_daemon_goes_on(daemon):
    """`kill -USR1` on an engine or the supervisor writes every thread's stack into the log
    (a hang in a driver call shows where), and neither process stops: calls still run."""
    pids = [int(p) for p in re.findall(r"engine 0 \(.*?\) started \(pid (\d+)\)",
                                         daemon.log())]
    assert pids, daemon.log()[-2000:]
    before = daemon.log().count("most recent call first")
    os.kill(pids[-1], signal.SIGUSR1)
    wait_until(lambda: daemon.log().count("most recent call first") > before, 10,
               "the engine's stacks in the log")
    assert "in _serve" in daemon.log() or "in run" in daemon.log()  # (the engine's threads)
    seen = daemon.log().count("most recent call first")
    os.kill(daemon.proc.pid, signal.SIGUSR1)
    wait_until(lambda: daemon.log().count("most recent call first") > seen, 10,
               "the supervisor's stacks in the log")
    assert daemon.proc.poll() is None
    with Session(daemon.socket(0)) as s:  # the engine still serves
        assert s.empty((16,), np.float32) is not None


# -- 7: budgets per session --------------------------------------------------------------------
def test_one_sessions_region_budget_does_not_refuse_another(daemon):
    with Session(daemon.socket(0)) as greedy, Session(daemon.socket(0)) as other:
        with pytest.raises(EpdError) as ei:
            for _ in range(REGION_LIMIT + 2):
                greedy.empty((256,), np.float32)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-regions-per-session" in str(ei.value)
        a = other.empty((8, 128), ml_dtypes.bfloat16)  # the other tenant still registers
        a[:] = 1
        g = join(other, "budget-other")
        x, idx, w = inputs()
        out = g.dispatch(x, idx, w)
        assert int(np.asarray(out.num_recv_tokens_per_expert).sum()) == idx.size


def test_budget_defaults():
    from epd.server.config import Config
    c = Config()
    assert c.max_regions_per_session == 256
    assert c.max_region_bytes_per_session > 0 and c.max_groups_per_session > 0
    assert c.max_stream_ops_per_session > 0 and c.max_group_label_values == 256


def test_systemd_unit_limits_fds():
    with open(os.path.join(os.path.dirname(__file__), "..", "deploy", "systemd",
                           "epd.service")) as f:
        unit = f.read()
    assert re.search(r"^LimitNOFILE=1048576$", unit, re.M)


# -- 8: deadlines are finite numbers -------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_bad_timeouts_are_invalid_on_grpc(daemon, bad):
    with Session(daemon.socket(0), fast_path=False) as s:
        req = epd_pb2.JoinGroupRequest(session_id=s.session_id, rank=0, timeout_seconds=bad,
                                       spec=epd_pb2.GroupSpec(
                                           name=f"nan-{bad}", num_ranks=1, num_experts=4,
                                           hidden=128, max_tokens_per_rank=16, num_topk=2,
                                           x_dtype=epd_pb2.BFLOAT16))
        with pytest.raises(EpdError) as ei:
            s._call("JoinGroup", req, 10)
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert "timeout_seconds" in str(ei.value)


def test_bad_timeouts_are_invalid_on_the_fast_path(daemon):
    with Session(daemon.socket(0)) as s:
        assert s.transport == "fastpath", s.fast_path_error  # (the daemon offers it)
        g = join(s, "nan-ring")
        sent = {}
        call_async = s._transport.call_async

        def spy(method, request, timeout):
            sent.setdefault(method, request)
            return call_async(method, request, timeout)
        s._transport.call_async = spy
        x, idx, w = inputs()
        g.dispatch(x, idx, w)  # a valid request, captured
        s._transport.call_async = call_async
        req = sent["Dispatch"]
        for bad in (math.nan, math.inf, -5.0):
            req.timeout_seconds = bad
            with pytest.raises(EpdError) as ei:
                s._transport._submit("Dispatch", req.SerializeToString(), 10).result()
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        for bad in (math.nan, math.inf, -1.0, 0.0):  # the client API refuses them first
            with pytest.raises(EpdError) as ei:
                g.dispatch(x, idx, w, timeout=bad)
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(EpdError) as ei:
        Session(daemon.socket(0), timeout=math.nan)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value


# -- 13: malformed requests ------------------------------------------------------------------------
GARBAGE = (b"\x0a\xff\xff\xff\xff\x0f", b"\xff", b"\x12\x05ab", b"\x08\x80\x80\x80\x80\x80\x80"
           b"\x80\x80\x80\x80\x80")


def _noise(d) -> int:
    return sum(1 for ln in d.log().splitlines() if "Traceback" in ln or "malformed" in ln
               or "deserializ" in ln.lower())


def test_malformed_grpc_requests_are_invalid_argument_and_logged_rarely(daemon):
    before = _noise(daemon)
    with grpc.insecure_channel(f"unix://{daemon.socket(0)}") as ch:
        for method in ("Dispatch", "JoinGroup", "GetStats"):
            call = ch.unary_unary(f"/epd.v1.Engine/{method}", request_serializer=None,
                                  response_deserializer=None)
            for i in range(60):
                with pytest.raises(grpc.RpcError) as ei:
                    call(GARBAGE[i % len(GARBAGE)], timeout=5)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
                assert "malformed" in ei.value.details()
    time.sleep(0.2)
    assert _noise(daemon) - before <= 6  # rate-limited: a line per method per second


def test_malformed_ring_requests_are_invalid_argument_and_logged_rarely(daemon):
    before = _noise(daemon)
    with Session(daemon.socket(1)) as s:
        assert s.transport == "fastpath", s.fast_path_error  # (the daemon offers it)
        for i in range(300):
            with pytest.raises(EpdError) as ei:
                s._transport._submit("Dispatch", GARBAGE[i % len(GARBAGE)], 5).result()
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        s._transport.call("Ping", epd_pb2.PingRequest(), 5)  # serves
    time.sleep(0.2)
    assert _noise(daemon) - before <= 3


# -- 12: bounded metric label sets ---------------------------------------------------------------
def test_distinct_group_names_do_not_grow_series_without_bound(daemon):
    names = 5 * GROUP_LABEL_CAP
    with Session(daemon.socket(0)) as s:
        _, idx, _ = inputs()
        for i in range(names):
            g = join(s, f"card-{i}")
            g.get_dispatch_layout(idx)
            g.leave()
    groups = set()
    for ln in metric_lines(daemon, "epd_layout_seconds_count"):
        m = re.search(r'group="([^"]*)"', ln)
        if m and (m.group(1).startswith("card-") or m.group(1) == "_overflow"):
            groups.add(m.group(1))
    assert "_overflow" in groups
    assert len(groups) <= GROUP_LABEL_CAP + 1, sorted(groups)


# -- 17: a leave is not an abort; a join mismatch is told to every waiting rank ------------------
def test_leave_is_counted_as_a_leave_not_an_abort(daemon):
    aborts = metric_sum(daemon, "epd_group_aborts_total")
    leaves = metric_sum(daemon, "epd_group_leaves_total")
    (s0, s1), (g0, g1) = pair(daemon, "leaver")
    try:
        g0.leave()
        g1.leave()
    finally:
        s0.close()
        s1.close()
    wait_until(lambda: metric_sum(daemon, "epd_group_leaves_total") >= leaves + 1, 5, "leave")
    assert metric_sum(daemon, "epd_group_aborts_total") == aborts
    warnings = [ln for ln in daemon.log().splitlines()
                if "'leaver'" in ln and ("WARNING" in ln or "ERROR" in ln)]
    assert not warnings, warnings


def test_closing_a_session_leaves_its_groups(daemon):
    """A clean `Session.close()` without `leave()` is a leave too; only a lost lease (a crashed
    client) aborts the group for its peers."""
    aborts = metric_sum(daemon, "epd_group_aborts_total")
    leaves = metric_sum(daemon, "epd_group_leaves_total")
    (s0, s1), _ = pair(daemon, "closer")
    s0.close()
    s1.close()
    # The first leave ends the group; the second rank leaves an ended group (counted once).
    wait_until(lambda: metric_sum(daemon, "epd_group_leaves_total") >= leaves + 1, 5, "leave")
    assert metric_sum(daemon, "epd_group_aborts_total") == aborts


def test_join_mismatch_fails_every_waiting_rank_at_once(daemon):
    with Session(daemon.socket(0)) as s0, Session(daemon.socket(1)) as s1:
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            waiting = ex.submit(join, s0, "mismatch", 0, 2, 128, 10.0)
            time.sleep(0.5)
            with pytest.raises(EpdError) as late:
                join(s1, "mismatch", 1, 2, 256)
            assert late.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(EpdError) as first:
                waiting.result(30)
            elapsed = time.monotonic() - t0
        assert first.value.code == grpc.StatusCode.FAILED_PRECONDITION, first.value
        assert "hidden=256" in str(first.value) and "hidden=128" in str(first.value)
        assert elapsed < 5, f"the waiting rank learnt only after {elapsed:.1f} s"
        # The name is free again: a consistent pair forms.
        with ThreadPoolExecutor(2) as ex:
            a = ex.submit(join, s0, "mismatch", 0, 2, 256)
            b = ex.submit(join, s1, "mismatch", 1, 2, 256)
            assert a.result(30).group_id == b.result(30).group_id


# -- start-up: one line, non-zero, nothing left behind (11, 15, 16, 17) -----------------------
def serve(tmp_path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`epd serve` with a private TMPDIR (its metrics folder goes there)."""
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    os.makedirs(env["TMPDIR"], exist_ok=True)
    defaults = {"--socket-dir": str(tmp_path / "sock"), "--metrics-port": "0",
                "--engines": "1", "--backend": "cpu"}
    for k, v in defaults.items():
        if k not in args:
            args = (*args, k, v)
    return subprocess.run([sys.executable, "-m", "epd.server.cli", "serve", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line(res: subprocess.CompletedProcess, *needles: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, res
    assert len(lines) == 1, f"expected one line on stderr, got:\n{res.stderr}"
    for n in needles:
        assert n in lines[0], (n, lines[0])


def no_metrics_dirs(tmp_path) -> None:
    left = glob.glob(str(tmp_path / "tmp" / "epd-metrics-*"))
    assert not left, f"metrics folders left behind: {left}"


def test_metrics_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = serve(tmp_path, "--metrics-port", str(port))
    assert_one_line(res, "--metrics-port", str(port))
    no_metrics_dirs(tmp_path)


def test_unwritable_socket_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = serve(tmp_path, "--socket-dir", str(blocker / "sock"))
    assert_one_line(res, "--socket-dir", str(blocker / "sock"))
    no_metrics_dirs(tmp_path)


def test_unwritable_shm_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = serve(tmp_path, "--shm-dir", str(blocker / "shm"))
    assert_one_line(res, "--shm-dir")


def test_cuda_without_cupy_is_one_line_and_runs_once(tmp_path):
    from epd.server.backends import cuda_backend_present
    if cuda_backend_present():
        pytest.skip("the [cuda] extra is installed here")
    res = serve(tmp_path, "--backend", "cuda")
    assert_one_line(res, "--backend cuda", "--backend cpu")
    no_metrics_dirs(tmp_path)


def _daemon(tmp_path, monkeypatch, **kw) -> Daemon:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(tmp))  # the daemon's environment: its metrics folder
    shm = tempfile.mkdtemp(prefix="epd-test-", dir="/dev/shm")
    extra = ["--shm-dir", shm, *kw.pop("extra", [])]
    d = Daemon(backend="cpu", engines=2, extra=extra, **kw)
    d.shm_dir = shm
    return d


def _engine_pids(d) -> list[int]:
    with grpc.insecure_channel(f"unix://{d.socket_dir}/node.sock") as ch:
        topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(), timeout=5)
    return [e.pid for e in topo.engines]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_daemon_stop_removes_its_metrics_folder(tmp_path, monkeypatch):
    d = _daemon(tmp_path, monkeypatch)
    try:
        d.wait_ready(60)
        assert glob.glob(str(tmp_path / "tmp" / "epd-metrics-*"))
    finally:
        rc = d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)
    assert rc == 0
    no_metrics_dirs(tmp_path)


def test_second_daemon_on_the_same_folder_refuses_to_start(tmp_path, monkeypatch):
    d = _daemon(tmp_path, monkeypatch)
    try:
        d.wait_ready(60)
        res = serve(tmp_path, "--socket-dir", d.socket_dir)
        assert_one_line(res, d.socket_dir, f"pid {d.proc.pid}")
        assert d.get("/readyz")[0] == 200
        assert os.path.exists(os.path.join(d.socket_dir, "node.sock"))
        with Session(d.socket(0)) as s:  # the first still serves
            join(s, "still-serving").get_dispatch_layout(inputs()[1])
    finally:
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)


def test_supervisor_killed_takes_its_engines_down(tmp_path, monkeypatch):
    d = _daemon(tmp_path, monkeypatch)
    try:
        d.wait_ready(60)
        pids = _engine_pids(d)
        with Session(d.socket(0)) as s:
            join(s, "orphan").get_dispatch_layout(inputs()[1])
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.wait(10)
            t0 = time.monotonic()
            wait_until(lambda: all(_gone(p) for p in pids), 5, "engines exited")
            assert time.monotonic() - t0 < 3
        for i in range(2):
            assert not os.path.exists(d.socket(i)), "an engine left its socket"
        assert not os.listdir(d.shm_dir), os.listdir(d.shm_dir)
        # The folder is free again: a new daemon starts on it.
        d2 = Daemon(backend="cpu", engines=1, extra=["--socket-dir", d.socket_dir,
                                                      "--shm-dir", d.shm_dir])
        try:
            d2.wait_ready(60)
        finally:
            d2.stop()
    finally:
        d.stop()
        shutil.rmtree(d.shm_dir, ignore_errors=True)


# -- 17: `make demo` installs only what the demo needs, visibly ------------------------------------
def _make_plan(target: str, tmp_path) -> str:
    root = os.path.join(os.path.dirname(__file__), "..")
    res = subprocess.run(["make", "-n", "-C", root, target, f"VENV={tmp_path}/venv"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_make_demo_installs_no_torch_and_shows_progress(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    demo = _make_plan("demo", tmp_path)
    assert "torch" not in demo, demo
    assert " -q " not in demo and "==>" in demo, demo  # progress, not silence
    test = _make_plan("test", tmp_path)
    assert "torch" in test and "optional" in test, test


# -- joins of one session at once ------------------------------------------------------------
def test_joins_at_once_keep_a_session_within_its_group_limit(daemon_factory):
    """JoinGroup awaits the rendezvous and the attach between its checks and its counter
    slot: joins of one session in flight together must not all pass the group limit (each
    reserves its name and slot before it awaits)."""
    with (daemon_factory(engines=1, extra=["--max-groups-per-session", "2"]) as d,
          Session(d.socket(0), fast_path=False) as s):
        def join(name: str) -> object:
            try:
                s.join(name, rank=0, num_ranks=1, num_experts=4, hidden=128,
                       max_tokens_per_rank=16, num_topk=2, timeout=20)
                return "ok"
            except EpdError as e:
                return e.code
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(join, [f"at-once-{i}" for i in range(6)]))
        assert got.count("ok") == 2, got
        assert set(got) == {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}, got
        # the refused joins took nothing: leaving one makes room for exactly one more
        next(iter(s._groups.values())).leave()
        assert join("after-leave") == "ok"
        assert join("one-too-many") == grpc.StatusCode.RESOURCE_EXHAUSTED



def test_a_groups_engine_outputs_count_against_the_sessions_bytes(daemon_factory):
    """The cpu backend allocates each membership's outputs in engine memory, sized from the
    spec the client sends: they count against --max-region-bytes-per-session, so one client
    cannot make the engine allocate (and zero-fill) any amount of host memory."""
    with (daemon_factory(engines=1, extra=["--max-region-bytes-per-session", str(8 << 20)])
          as d, Session(d.socket(0), fast_path=False) as s):
        with pytest.raises(EpdError) as ei:
            s.join("huge", rank=0, num_ranks=1, num_experts=8, hidden=8192,
                   max_tokens_per_rank=65536, num_topk=2, dtype="float32",
                   low_latency_mode=True, timeout=10)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert "--max-region-bytes-per-session" in ei.value.message
        s.join("small", rank=0, num_ranks=1, num_experts=4, hidden=64,
               max_tokens_per_rank=8, num_topk=2, timeout=10)  # (within the budget)


def test_a_reused_counter_slot_starts_from_zero(daemon):
    """A session has 64 counter slots, given back when a group is left and taken again by a
    later join: the new membership counts its dispatches from 1 again, so the slot must not
    keep its last owner's words (the 65th join's first async dispatch waited out its deadline
    for a count the page already seemed past)."""
    from epd.server import reference as ref
    rng = np.random.default_rng(3)
    idx, w = ref.random_routing(rng, 4, 8, 2, drop_prob=0.0)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    with Session(daemon.socket(0), timeout=5) as s:
        for i in range(66):
            g = s.join(f"slot-reuse-{i}", rank=0, num_ranks=1, num_experts=8, hidden=16,
                       num_topk=2, max_tokens_per_rank=8, dtype="float32")
            for _ in range(3 if i == 0 else 1):
                pending = g.dispatch_async(x, idx, w)
                num_recv, _ = pending.counts(timeout=5)
                out = pending.result()
                assert num_recv == out.num_recv_tokens == 4, i
            g.leave()
