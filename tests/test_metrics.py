"""Observability (DESIGN.md §8): the Prometheus series after real traffic, the HTTP health
endpoints and gRPC health checking on the sockets."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from daemon_harness import samples, value
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ranklib import Case, check_case, run_case

from epd.client import Session
from epd.proto.errors import EpdError

pytestmark = pytest.mark.slow
CASE = Case(group="metrics-g", num_ranks=2, num_experts=4, hidden=128, num_topk=2,
            tokens=(16, 24), seed=5)


@pytest.fixture(scope="module")
def traffic(daemon, rank_pool):
    rank_pool.clear()
    results = rank_pool.run_ok([(run_case, daemon.socket(r), CASE, r) for r in range(2)])
    check_case(CASE, results)
    with Session(daemon.socket(0), timeout=5) as s, pytest.raises(EpdError):
        g = s.join("metrics-solo", rank=0, num_ranks=1, num_experts=2, hidden=128,
                   max_tokens_per_rank=4, num_topk=1)
        g.dispatch(np.zeros((4, 64), np.float32), np.zeros((4, 1), np.int64),
                   np.ones((4, 1), np.float32))
    return results


def test_latency_histograms(daemon, traffic):
    ss = samples(daemon)
    for kind in ("dispatch", "combine", "layout"):
        n = value(ss, f"epd_{kind}_seconds_count", group="metrics-g", path="fastpath",
                  backend="cpu")
        assert n == 2, (kind, n)  # one per rank
        inf = value(ss, f"epd_{kind}_seconds_bucket", group="metrics-g", le="+Inf")
        assert inf == n
        assert 0 < value(ss, f"epd_{kind}_seconds_sum", group="metrics-g") < 60


def test_request_counters_by_method_and_code(daemon, traffic):
    ss = samples(daemon)
    assert value(ss, "epd_requests_total", method="Dispatch", code="OK") >= 2
    assert value(ss, "epd_requests_total", method="Combine", code="OK") >= 2
    assert value(ss, "epd_requests_total", method="JoinGroup", code="OK") >= 3
    assert value(ss, "epd_requests_total", method="Dispatch", code="INVALID_ARGUMENT") >= 1


def test_request_cpu_on_both_transports(daemon, traffic):
    """epd_request_cpu_seconds_total counts the operations' CPU over the ring and over gRPC,
    so that divided by epd_requests_total it is the CPU per call whichever transport came."""
    with Session(daemon.socket(0), timeout=5, fast_path=False) as s:
        g = s.join("metrics-grpc", rank=0, num_ranks=1, num_experts=2, hidden=128,
                   max_tokens_per_rank=4, num_topk=1, dtype="float32")
        g.dispatch(np.zeros((4, 128), np.float32), np.zeros((4, 1), np.int64),
                   np.ones((4, 1), np.float32))
    ss = samples(daemon)
    assert value(ss, "epd_request_cpu_seconds_total", method="Dispatch", path="fastpath") > 0
    assert value(ss, "epd_request_cpu_seconds_total", method="Dispatch", path="grpc") > 0


def test_bytes_and_tokens(daemon, traffic):
    ss = samples(daemon)
    recv = sum(r["num_recv_tokens"] for r in traffic)
    assert value(ss, "epd_recv_tokens_total", group="metrics-g") == recv
    # Dispatch sends each (token, destination) row once; combine sends every received row back.
    row = CASE.hidden * 2
    assert value(ss, "epd_bytes_sent_total", group="metrics-g") == 2 * recv * row
    assert value(ss, "epd_bytes_received_total", group="metrics-g") == 2 * recv * row


def test_gauges(daemon, traffic):
    ss = samples(daemon)
    for e in ("0", "1"):
        assert value(ss, "epd_engine_up", engine=e) == 1
        assert value(ss, "epd_sessions", engine=e) == 0  # all sessions closed
        assert value(ss, "epd_stream_ops_armed", engine=e) == 0  # (the cpu backend arms none)
    assert value(ss, "epd_build_info", backend="cpu") == 1
    assert ss["epd_build_info"][0].labels["version"]
    # (the group is gone: its imbalance reads 0, and its alert stops firing)
    assert value(ss, "epd_expert_load_imbalance_ratio", group="metrics-g") == 0


def test_load_imbalance_while_the_group_lives(daemon):
    """max / mean of the last layout's tokens per expert while the group is held; 0 once the
    group is gone (it stayed at its last value, and EpdExpertLoadImbalance kept firing)."""
    with Session(daemon.socket(0), timeout=5) as s:
        g = s.join("metrics-skewed", rank=0, num_ranks=1, num_experts=4, hidden=128,
                   max_tokens_per_rank=8, num_topk=1)
        g.get_dispatch_layout(np.array([[0]] * 7 + [[1]], np.int64))  # 7, 1, 0, 0 tokens
        assert value(samples(daemon), "epd_expert_load_imbalance_ratio",
                     group="metrics-skewed") == 3.5
        g.leave()
        assert value(samples(daemon), "epd_expert_load_imbalance_ratio",
                     group="metrics-skewed") == 0


def test_sessions_gauge_counts_open_sessions(daemon):
    with Session(daemon.socket(1), timeout=5), Session(daemon.socket(1), timeout=5):
        assert value(samples(daemon), "epd_sessions", engine="1") == 2


def test_http_health(daemon):
    assert daemon.get("/healthz") == (200, "ok\n")
    status, text = daemon.get("/readyz")
    assert status == 200 and "ready: 2 engine(s)" in text
    assert daemon.get("/nope")[0] == 404


@pytest.mark.parametrize("sock,service", [("node.sock", ""), ("gpu0.sock", ""),
                                          ("gpu1.sock", ""), ("gpu0.sock", "epd.v1.Engine")])
def test_grpc_health(daemon, sock, service):
    with grpc.insecure_channel(f"unix://{daemon.socket_dir}/{sock}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_health_unknown_service(daemon):
    with grpc.insecure_channel(f"unix://{daemon.socket(0)}") as ch, \
            pytest.raises(grpc.RpcError) as ei:
        health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="nope"), timeout=5)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_batch_holds_updates_until_it_is_flushed():
    """metrics.batched(): a serving thread's increments and observations reach Prometheus at
    flush (summed, none lost); outside a batch, and on other threads, at once."""
    import threading

    from prometheus_client import CollectorRegistry, Counter, Histogram

    from epd.server import metrics

    reg = CollectorRegistry()
    c = Counter("t_batch", "t", ["g"], registry=reg)
    h = Histogram("t_batch_seconds", "t", ["g"], registry=reg, buckets=(1.0,))

    def get(name, **labels):
        return reg.get_sample_value(name, labels) or 0.0

    metrics.inc(c, ("a",), 2)
    assert get("t_batch_total", g="a") == 2  # no batch: at once
    with metrics.batched() as batch:
        for _ in range(3):
            metrics.inc(c, ("a",), 5)
            metrics.observe(h, ("a",), 0.5)
        other = threading.Thread(target=lambda: metrics.inc(c, ("b",), 7))
        other.start()
        other.join()
        assert get("t_batch_total", g="b") == 7  # another thread has no batch
        assert get("t_batch_total", g="a") == 2 and get("t_batch_seconds_count", g="a") == 0
        batch.flush()
        assert get("t_batch_total", g="a") == 17 and get("t_batch_seconds_count", g="a") == 3
        metrics.inc(c, ("a",), 1)
    assert get("t_batch_total", g="a") == 18  # flushed when the block ends
    assert get("t_batch_seconds_sum", g="a") == 1.5


def test_engine_gc_pauses_are_timed(daemon):
    # The engine times every collection from its start on, the full one before gc.freeze too.
    ss = samples(daemon)
    assert value(ss, "epd_engine_gc_pause_seconds_count", generation="2") >= 1
    assert 0 < value(ss, "epd_engine_gc_pause_seconds_sum", generation="2") < 5


def test_a_flush_observes_as_observe_would():
    """A batch's observations of one series are applied per bucket (metrics.observe_all):
    the exported buckets, count and sum are those of observing each value, bounds included
    (a value equal to a bound is in that bucket), above the last bound, and NaN."""
    import math
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from epd.server import metrics

    bounds = (1e-5, 1e-4, 1e-3, 0.5, 2.0)
    rng = random.Random(7)
    values = [rng.choice(bounds) for _ in range(50)] + [rng.uniform(0, 3) for _ in range(300)]
    values += [0.0, -1.0, 1e9, math.inf, math.nan]
    rng.shuffle(values)
    regs = [CollectorRegistry(), CollectorRegistry()]
    hs = [Histogram("t_all_seconds", "t", ["g"], registry=r, buckets=bounds) for r in regs]
    for v in values:
        hs[0].labels("a").observe(v)
    with metrics.batched():
        for v in values:
            metrics.observe(hs[1], ("a",), v)
        metrics.observe(hs[1], ("b",), 0.25)  # a series with one observation
    for le in [*map(str, bounds), "+Inf"]:
        want = regs[0].get_sample_value("t_all_seconds_bucket", {"g": "a", "le": le})
        got = regs[1].get_sample_value("t_all_seconds_bucket", {"g": "a", "le": le})
        assert got == want, le
    count = regs[1].get_sample_value("t_all_seconds_count", {"g": "a"})
    assert count == regs[0].get_sample_value("t_all_seconds_count", {"g": "a"}) == len(values) - 1
    assert math.isnan(regs[1].get_sample_value("t_all_seconds_sum", {"g": "a"}))
    assert regs[1].get_sample_value("t_all_seconds_bucket", {"g": "b", "le": "0.5"}) == 1
    finite = [v for v in values if not math.isnan(v) and not math.isinf(v)]
    metrics.observe_all(hs[1].labels("c"), finite)
    assert regs[1].get_sample_value("t_all_seconds_sum", {"g": "c"}) == math.fsum(finite)


def test_group_names_over_the_cap_do_not_grow_the_label_cache():
    """A name over --max-group-label-values shares the _overflow child: the per-metric cache of
    children stays as bounded as the exported label set however many names a tenant uses."""
    from prometheus_client import CollectorRegistry

    from epd.server import metrics

    saved_cap, saved_names = metrics._group_cap, set(metrics._group_names)
    try:
        # (from no names: the tests before this one label groups of one owner, whose share of
        # a cap is at least 16, so 14 of them left room for one new name, not three)
        metrics._group_names.clear()
        metrics.set_group_label_cap(len(metrics._group_names) + 3)
        reg = CollectorRegistry()
        c = metrics.GroupCounter("t_group_cap", "t", ["group", "peer"], registry=reg)
        for i in range(2000):
            c.labels(f"tenant-job-{i}", "shm").inc()
        assert len(c._epd_children) <= 4  # three names, and _overflow
        for i in range(metrics.RAW_LABEL_CACHE + 10):  # (the cache by asked-for values too)
            c.labels(f"more-{i}", "shm")
        assert len(c._epd_raw) <= metrics.RAW_LABEL_CACHE
        assert reg.get_sample_value("t_group_cap_total",
                                    {"group": metrics.OVERFLOW_GROUP, "peer": "shm"}) == 1997
        assert reg.get_sample_value("t_group_cap_total",
                                    {"group": "tenant-job-0", "peer": "shm"}) == 1
    finally:
        metrics._group_cap = saved_cap
        metrics._group_names.clear()
        metrics._group_names.update(saved_names)


def test_a_restarted_engine_counts_the_names_its_predecessors_labelled(tmp_path):
    """The label cap holds across restarts: names already in the multiprocess folder (the
    archive of dead engines, other live processes' files) count against a new process's cap,
    so an engine restarting in a loop cannot label `cap` new names each time."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from epd.server import metrics

    archive = MmapedDict(str(tmp_path / "counter_archive.db"))
    for i in range(5):
        archive.write_value(mmap_key("epd_calls_total", "epd_calls_total", ["group", "op"],
                                     [f"old-{i}", "dispatch"], "h"), 1.0, 0.0)
    archive.write_value(mmap_key("epd_up", "epd_up", [], [], "h"), 1.0, 0.0)  # no group label
    archive.close()
    (tmp_path / "gauge_livesum_1.db").write_bytes(b"not a sample file")  # skipped, not fatal
    (tmp_path / "counter_2.db").write_bytes(b"")  # (being created by another process)
    (tmp_path / "counter_3.db").write_bytes(b"\x01")  # (cut short: struct.error)
    saved_cap, saved_names = metrics._group_cap, set(metrics._group_names)
    try:
        metrics._group_names.clear()
        assert metrics.labels_in_folder(str(tmp_path)) == {f"old-{i}" for i in range(5)}
        metrics.set_group_label_cap(7, str(tmp_path))
        assert metrics.group_label("old-3") == "old-3"  # (already counted)
        assert [metrics.group_label(f"new-{i}") for i in range(3)] == [
            "new-0", "new-1", metrics.OVERFLOW_GROUP]
        metrics._group_names.clear()
        metrics.set_group_label_cap(3, str(tmp_path))  # more names than the cap: none new,
        # and the existing ones keep their label (their series exist; no split to _overflow)
        assert [metrics.group_label(f"old-{i}") for i in range(5)] == [
            f"old-{i}" for i in range(5)]
        assert metrics.group_label("new-9") == metrics.OVERFLOW_GROUP
    finally:
        metrics._group_cap = saved_cap
        metrics._group_names.clear()
        metrics._group_names.update(saved_names)


def test_a_dead_engines_files_are_folded_into_the_archive(tmp_path):
    """The counters and histograms of an engine gone are folded into one archive file per type
    (an engine restarting in a loop added a file per start, each re-read by every scrape);
    every total the endpoint exports stays the same, twice over (the archive accumulates)."""
    from prometheus_client import multiprocess
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from epd.server import metrics

    def write(pid: int, typ: str, name: str, labels: dict, value: float) -> None:
        d = MmapedDict(str(tmp_path / f"{typ}_{pid}.db"))
        d.write_value(mmap_key(name, name, list(labels), list(labels.values()), ""), value,
                      0.0)
        d.close()

    def totals() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in multiprocess.MultiProcessCollector(None, path=str(tmp_path)).collect()
                for s in f.samples}

    for pid in (101, 102):
        write(pid, "counter", "epd_t_total", {"group": "g"}, 3.0)
        write(pid, "histogram", "epd_t_seconds_bucket", {"le": "+Inf"}, 2.0)
    write(103, "counter", "epd_t_total", {"group": "g"}, 5.0)  # (alive)
    before = totals()
    assert before[("epd_t_total", (("group", "g"),))] == 11.0
    for pid in (101, 102):
        metrics.archive_dead_process(pid, str(tmp_path))
        assert totals() == before
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["counter_103.db", "counter_archive.db", "histogram_archive.db"], names


@pytest.mark.parametrize("content", [b"", b"\x01", b"\x10\x00\x00\x00garbage-of-a-file"])
def test_a_dead_engines_unreadable_file_is_set_aside(tmp_path, content):
    """A file cut short (prometheus_client raises struct.error, RuntimeError, ...) is moved
    out of every scrape's way (*.unreadable) with a ValueError naming it, not left in place."""
    from epd.server import metrics

    src = tmp_path / "counter_4242.db"
    src.write_bytes(content)
    with pytest.raises(ValueError, match=r"counter_4242\.db"):
        metrics.archive_dead_process(4242, str(tmp_path))
    assert not src.exists() and (tmp_path / "counter_4242.db.unreadable").exists()


def _requests(daemon) -> dict[tuple[str, str], float]:
    return {(s.labels["method"], s.labels["code"]): s.value
            for s in samples(daemon).get("epd_requests_total", [])}


def test_a_call_whose_client_deadline_passed_is_not_counted_ok(daemon):
    """A gRPC call cancelled under its handler (the client's deadline passed, or it cancelled)
    is counted with the status the client got, not OK: the handler's CancelledError skipped
    the error mapping and the count said OK for a JoinGroup the client saw fail."""
    import time

    from epd.proto import fd_channel as fdc
    from epd.proto.v1 import epd_pb2, epd_pb2_grpc

    with Session(daemon.socket(0), timeout=5) as s:
        grpc_transport = getattr(s._transport, "inner", s._transport)
        before = _requests(daemon)
        spec = epd_pb2.GroupSpec(name="metrics-deadline", num_ranks=2, num_experts=4,
                                 hidden=128, max_tokens_per_rank=8, num_topk=1, x_dtype=1)
        with grpc.insecure_channel(f"unix://{daemon.socket(0)}") as ch, \
                pytest.raises(grpc.RpcError) as ei:
            epd_pb2_grpc.EngineStub(ch).JoinGroup(  # its peer never comes: waits 2 s
                epd_pb2.JoinGroupRequest(session_id=s.session_id, spec=spec, rank=0,
                                         timeout_seconds=2), timeout=0.3,
                metadata=((fdc.TOKEN_METADATA, grpc_transport.metadata[0][1]),))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(2.5)  # (past the engine's own wait: whatever it would count, it has)
        after = _requests(daemon)
    changed = {k: after.get(k, 0) - before.get(k, 0) for k in after
               if k[0] == "JoinGroup" and after.get(k, 0) != before.get(k, 0)}
    assert changed == {("JoinGroup", "DEADLINE_EXCEEDED"): 1}, changed


def test_a_refusal_on_the_descriptor_channel_is_counted(daemon_factory):
    """A refused session is counted once, with its code: refused when its descriptor channel
    bound (--max-sessions-per-uid, before the channel connected ahead of OpenSession), the
    requests showed only an OpenSession OK (the channel's requests were counted nowhere); now
    the refusal is OpenSession's, and the channel's requests count by method (FdHello,
    FdFetch, FdRegisterMemfd) and code."""
    import time

    from epd.proto.errors import ResourceExhausted

    with daemon_factory(engines=1, extra=["--max-sessions-per-uid", "1"]) as d, \
            Session(d.socket(0), timeout=5):
        before = _requests(d)
        with pytest.raises(ResourceExhausted, match="max-sessions-per-uid"):
            Session(d.socket(0), timeout=5)
        time.sleep(0.5)
        after = _requests(d)
        assert after.get(("FdFetch", "OK"), 0) >= 1  # (the first session's ring, counters)
        assert after.get(("FdHello", "OK"), 0) - before.get(("FdHello", "OK"), 0) == 1
    refused = {k: after[k] - before.get(k, 0) for k in after
               if k[1] == "RESOURCE_EXHAUSTED" and after[k] != before.get(k, 0)}
    assert sum(refused.values()) == 1, refused


def test_an_engines_counters_survive_its_restart_once(daemon_factory):
    """A killed engine's counters stay exported exactly once (archived, neither lost nor
    double counted) and its live gauges go (mark_process_dead), on a real daemon."""
    import os
    import signal
    import time

    with daemon_factory(engines=1) as d:
        with Session(d.socket(0), timeout=5) as s:
            for _ in range(3):
                s.ping()
            time.sleep(0.5)  # (the ring thread flushes its batch once idle)
            before = samples(d)
            assert value(before, "epd_sessions", engine="0") == 1
            os.kill(d.engine_pid(0), signal.SIGKILL)
            time.sleep(1)
        d.wait_ready(30)
        after = samples(d)
    totals = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for s in before["epd_requests_total"]}
    assert totals and totals == {(s.name, tuple(sorted(s.labels.items()))): s.value
                                 for s in after["epd_requests_total"]}
    assert value(after, "epd_engine_restarts_total", engine="0") == 1
    assert all(s.value == 0 for s in after.get("epd_sessions", []))


def test_promtool_checks_a_scrape(daemon, traffic):
    """The exposition after real traffic passes `promtool check metrics` (names, types, help,
    histogram series), where promtool is installed (`make test` puts it in the venv)."""
    import os
    import shutil
    import subprocess
    import sys

    promtool = (shutil.which("promtool")
                or shutil.which("promtool", path=os.path.dirname(sys.executable)))
    if promtool is None:
        pytest.skip("promtool not installed")
    status, body = daemon.get("/metrics")
    assert status == 200
    p = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_tagged_group_names_label_is_mapped_once(monkeypatch):
    """The facade's group names carry an instance tag (`name@tag`) that the label drops: the
    child is found by the name as asked for, without mapping it again on every call (a
    hot-path call makes several metric updates)."""
    from prometheus_client import CollectorRegistry

    from epd.server import metrics

    calls: list[str] = []
    real = metrics.group_label
    monkeypatch.setattr(metrics, "group_label", lambda n: calls.append(n) or real(n))
    c = metrics.GroupCounter("t_group_tagged", "t", ["group", "op"],
                             registry=CollectorRegistry())
    for _ in range(5):
        c.labels("model-a@b3", "dispatch").inc()
    assert calls == ["model-a@b3"]
    assert c.labels("model-a@b3", "dispatch") is c.labels("model-a", "dispatch")



def test_one_owners_names_cannot_take_every_label():
    """One owner (a uid, a pool, a tenant pool, the daemon's own uid) labels at most a
    quarter of the cap (at least 16): a tenant's many groups leave room for the others' (a
    review pushed another tenant's group into _overflow with 260 one-rank groups)."""
    from epd.server import metrics

    saved_cap, saved_names = metrics._group_cap, set(metrics._group_names)
    try:
        metrics._group_names.clear()
        metrics._group_cap = 256
        got = [metrics.group_label(f"job-{i} (uid 1001)") for i in range(100)]
        assert got[:64] == [f"job-{i} (uid 1001)" for i in range(64)]
        assert set(got[64:]) == {metrics.OVERFLOW_GROUP}
        assert metrics.group_label("decode (uid 1002)") == "decode (uid 1002)"
        assert metrics.group_label("decode (tenant a)") == "decode (tenant a)"
        assert metrics.group_label("decode") == "decode"
        assert metrics.group_label("job-3 (uid 1001)") == "job-3 (uid 1001)"  # (has its own)
        metrics._group_cap = 8  # (a small cap: one owner may take it all, at most 16)
        metrics._group_names.clear()
        assert [metrics.group_label(f"j{i}") for i in range(9)][-1] == metrics.OVERFLOW_GROUP
        assert metrics.group_label("j7") == "j7"
    finally:
        metrics._group_cap = saved_cap
        metrics._group_names.clear()
        metrics._group_names.update(saved_names)
