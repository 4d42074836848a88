"""Class engines (`epd serve --class-engines`, issue 14): two engine processes per device, one
for latency groups (gpu<D>.latency.sock), one for throughput groups (gpu<D>.sock). The slots
and their sockets, the topology, a join on the wrong class's engine refused naming the right
socket (FAILED_PRECONDITION, nothing changed), a session opened for a class landing on its
engine, the DeepEP facade moving its session there on its own, and two pools of different
classes at once on their own engines exact against the reference (CPU backend)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from daemon_harness import samples, value
from ranklib import Case, case_round, check_case, join

from epd.client import EpdError, Session
from epd.client.buffer import Buffer
from epd.client.session import engine_socket
from epd.proto import engine_sockets
from epd.server import config
from epd.server import reference as ref
from epd.server.cli import build_parser
from epd.server.engine_slots import EngineSlot, engine_slots

POLICY = "ce-decode-*=latency, ce-prefill-*=throughput"
DAEMON_ENGINES = 2  # devices; the daemon runs two engines per device
DAEMON_EXTRA = ["--class-engines", "--service-class-policy", POLICY]


def test_slots_sockets_and_config():
    assert engine_slots(2) == [EngineSlot(0, 0, pe=0), EngineSlot(1, 1, pe=1)]
    assert engine_slots(2, True) == [
        EngineSlot(0, 0, "throughput", 0, 0), EngineSlot(1, 1, "throughput", 0, 1),
        EngineSlot(2, 0, "latency", 1, 0), EngineSlot(3, 1, "latency", 1, 1)]
    assert engine_sockets.socket_name(1, "latency") == "gpu1.latency.sock"
    assert engine_sockets.socket_name(1, "throughput") == engine_sockets.socket_name(1)
    assert engine_sockets.failure_file("/x/gpu1.latency.sock") == "/x/gpu1.latency.failed"
    msg = f"... runs only latency groups: {engine_sockets.OTHER_ENGINE_HINT}/x/gpu0.sock (Buf"
    assert engine_sockets.hinted_socket(msg, "/x/gpu1.sock") == "/x/gpu0.sock"
    assert engine_sockets.hinted_socket("no hint here", "/x/gpu1.sock") is None
    # a socket folder with a space; a group name holding the phrase (before the real hint)
    spaced = engine_sockets.socket_path("/run/my epd", 0, "latency")
    msg = (f"group 'open the session on /tmp/x.sock' is a latency group and engine 0 runs "
           f"only throughput groups: {engine_sockets.OTHER_ENGINE_HINT}{spaced} (Buffer(...")
    assert engine_sockets.hinted_socket(msg, spaced) == "/run/my epd/gpu0.latency.sock"
    # only an engine socket's own name, in the client's folder (a peer's words may hold the
    # phrase and any path; the client may see the folder elsewhere; a folder may hold .sock)
    assert engine_sockets.hinted_socket(f"{engine_sockets.OTHER_ENGINE_HINT}/evil/e.sock",
                                        spaced) is None
    assert engine_sockets.hinted_socket(
        f"{engine_sockets.OTHER_ENGINE_HINT}/run/epd.sock.d/gpu1.tenant-a.sock",
        "unix:///mnt/epd/gpu0.sock") == "/mnt/epd/gpu1.tenant-a.sock"
    cfg = config.load(build_parser().parse_args(["serve", "--class-engines"]), {})
    assert cfg.class_engines_on and cfg.engine_socket(0, "latency").endswith("gpu0.latency.sock")
    assert config.load(None, {"EPD_CLASS_ENGINES": "1"}).class_engines == "on"
    assert config.load(None, {"EPD_CLASS_ENGINES": "false"}).class_engines == "off"
    assert config.load(None, {}).class_engines == "auto"
    with pytest.raises(ValueError, match=r"class_engines: 'sometimes' is not one of"):
        config.load(None, {"EPD_CLASS_ENGINES": "sometimes"})
    with pytest.raises(ValueError, match="latency_heap_bytes must be >= 0"):
        config.load(None, {"EPD_LATENCY_HEAP_BYTES": "-1"})
    with pytest.raises(ValueError, match="class_engines is for one node"):
        config.load(None, {"EPD_CLASS_ENGINES": "1", "EPD_NUM_NODES": "2",
                           "EPD_CLUSTER_ADDRESS": "127.0.0.1:1", "EPD_CLUSTER_TOKEN_FILE": "/t"})


def test_client_picks_the_class_engine(tmp_path):
    folder = str(tmp_path)
    assert engine_socket(folder, 1, "latency") == os.path.join(folder, "gpu1.sock")  # none yet
    open(os.path.join(folder, "gpu1.latency.sock"), "w").close()
    assert engine_socket(folder, 1, "latency") == os.path.join(folder, "gpu1.latency.sock")
    assert engine_socket(folder, 1, "throughput") == os.path.join(folder, "gpu1.sock")
    assert engine_socket(folder, 1) == os.path.join(folder, "gpu1.sock")


def test_topology_shows_each_engine_class_and_device(daemon):
    for d in range(DAEMON_ENGINES):
        for cls in ("", "latency"):
            assert os.path.exists(daemon.socket(d, cls))
    r = subprocess.run([sys.executable, "-m", "epd.server.cli", "topology",
                        "--socket-dir", daemon.socket_dir], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.strip().startswith("engine ")]
    assert len(lines) == 2 * DAEMON_ENGINES, r.stdout
    assert "gpu0.sock cpu device 0 throughput groups only ready" in lines[0], lines[0]
    assert "gpu1.latency.sock cpu device 1 latency groups only ready" in lines[3], lines[3]
    ss = samples(daemon)
    for engine, device, cls in ((0, 0, "throughput"), (3, 1, "latency")):
        assert value(ss, "epd_engine_info", engine=str(engine), device=str(device),
                     service_class=cls) == 1


def _join1(s: Session, name: str, service_class: str | None = None):
    return s.join(name, rank=0, num_ranks=1, num_experts=2, hidden=128, max_tokens_per_rank=8,
                  num_topk=1, dtype="bfloat16", service_class=service_class)


def test_a_group_on_the_other_class_engine_is_refused_naming_its_socket(daemon):
    assert "class engines on (--class-engines on)" in daemon.log()  # (the start's choice)
    with Session(daemon.socket(1), timeout=10) as s:  # device 1's throughput engine
        with pytest.raises(EpdError) as ei:
            _join1(s, "ce-decode-wrong")  # the policy makes it latency
        e = ei.value
        assert e.code.name == "FAILED_PRECONDITION", e
        assert engine_sockets.hinted_socket(e.details, s.endpoint) == daemon.socket(1, "latency")
        assert "runs only throughput groups" in e.details and "EPD_SERVICE_CLASS=latency" \
            in e.details
        assert not s.stats().groups  # nothing changed: the session goes on
        assert _join1(s, "ce-prefill-right").service_class == "throughput"
    with Session(daemon.socket(1, "latency"), timeout=10) as s:
        with pytest.raises(EpdError) as ei:
            _join1(s, "ce-prefill-wrong")
        assert engine_sockets.hinted_socket(ei.value.details, s.endpoint) == daemon.socket(1)
        assert _join1(s, "ce-decode-right").service_class == "latency"
    with Session(socket_dir=daemon.socket_dir, engine=0, service_class="latency",
                 timeout=10) as s:
        assert s.endpoint == daemon.socket(0, "latency")
        assert _join1(s, "ce-decode-by-class").service_class == "latency"


def test_the_deepep_buffer_moves_to_its_class_engine(daemon):
    """No class asked: the policy makes the Buffer's groups latency; its first join is refused
    by the default engine and the Buffer reopens its session on the latency engine; asking
    goes there at once. Layout, dispatch and combine are exact (one rank)."""
    rng = np.random.default_rng(5)
    idx, w = ref.random_routing(rng, 12, 4, 2)
    x = ref.random_x(rng, 12, 256, np.float32)
    for kw in ({}, {"service_class": "latency"}):
        buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=1,
                     group_name="ce-decode-buf", **kw)
        try:
            assert buf.session.endpoint == daemon.socket(1, "latency" if kw else "")
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
            assert buf.session.endpoint == daemon.socket(1, "latency")
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
            combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            disp = ref.dispatch([x], [idx], [w], 4)[0]
            want = ref.combine([disp.recv_x], [disp], [12],
                               recv_topk_weights=[disp.recv_topk_weights])[0][0]
            np.testing.assert_array_equal(np.asarray(recv_x), disp.recv_x)
            np.testing.assert_array_equal(np.asarray(combined), want)
            assert {g.service_class for g in buf.session.stats().groups} == {1}  # LATENCY
        finally:
            buf.destroy()


def run_pool(endpoint: str, case: Case, rank: int) -> dict:
    with Session(endpoint, client_name=f"ce-rank{rank}", timeout=20) as s:
        g = join(s, case, rank)
        res = case_round(s, g, case, rank)
        res.update(service_class=g.service_class, engine=s.stats().engine_index)
        return res


def test_two_pools_on_their_own_engines_exact(daemon, ranks):
    decode = Case(group="ce-decode-pool", num_ranks=2, num_experts=8, hidden=256, num_topk=2,
                  tokens=(24, 17), seed=21, rounds=3)
    prefill = Case(group="ce-prefill-pool", num_ranks=2, num_experts=4, hidden=512,
                   num_topk=3, tokens=(64, 80), seed=22, rounds=3)
    calls = [(run_pool, daemon.socket(r, "latency"), decode, r) for r in range(2)] + \
        [(run_pool, daemon.socket(r), prefill, r) for r in range(2)]
    results = ranks.run_ok(calls)
    check_case(decode, results[:2])
    check_case(prefill, results[2:])
    # device r's latency engine is engine 2 + r; its throughput engine is engine r
    assert [(r["service_class"], r["engine"]) for r in results] == [
        ("latency", 2), ("latency", 3), ("throughput", 0), ("throughput", 1)]


def test_a_lost_cuda_class_engine_restarts_its_own_world_only(tmp_path, monkeypatch):
    """Device-free: on the cuda planner each class's engines form their own NVSHMEM world; an
    engine that exits takes down and restarts only its world's engines, after a new world
    for that class; bootstrap numbers a latency engine's PE from 0 in its world."""
    from types import SimpleNamespace

    from epd.server.backends.cuda_plan import CudaPlanner
    from epd.server.supervisor import Supervisor

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    cfg = config.load(None, {"EPD_CLASS_ENGINES": "1", "EPD_BACKEND": "cuda",
                             "EPD_SOCKET_DIR": str(tmp_path),
                             "EPD_LATENCY_HEAP_BYTES": str(1 << 30)})
    planner = CudaPlanner(cfg)
    worlds: list[int] = []

    def new_world(world: int = 0) -> None:  # (the real one asks NVSHMEM for a unique id)
        worlds.append(world)
        planner.start_world(world, b"u" * 8)

    planner.new_world = new_world
    sup = Supervisor(cfg, planner, 2)
    assert [(e.index, os.path.basename(e.socket_path)) for e in sup.engines] == [
        (0, "gpu0.sock"), (1, "gpu1.sock"), (2, "gpu0.latency.sock"),
        (3, "gpu1.latency.sock")]
    spawned: list[int] = []
    monkeypatch.setattr(sup, "_spawn", lambda e: spawned.append(e.index))
    monkeypatch.setattr(sup, "_engine_gone", lambda e: None)
    lost = sup.engines[3]
    lost.proc = SimpleNamespace(pid=4242)
    sup._exited(lost, 1)
    assert [e.index for e in sup.engines if e.restart_at is not None] == [2, 3]
    sup._restart(lost)
    assert worlds == [1] and spawned == [2, 3]
    assert sup.world_size(1) == 2
    boot = planner.bootstrap(lost.slot.pe, sup.world_size(1), lost.slot.world)
    assert (boot.pe, boot.num_pes, boot.generation, boot.nvshmem_uid) == (1, 2, 1, b"u" * 8)
    # the latency engines' heap is their own size (--latency-heap-bytes), in their environment
    # and their bootstrap; the throughput engines keep --nvshmem-heap-bytes
    assert boot.heap_bytes == 1 << 30
    assert planner.engine_env(1)["NVSHMEM_SYMMETRIC_SIZE"] == str(2 << 30)
    assert planner.engine_env(0)["NVSHMEM_SYMMETRIC_SIZE"] == str((4 << 30) + (1 << 30))
    # a latency group's plan lives in the latency engines' heap: the same offset as a
    # throughput group's, freed from its own heap
    from epd.proto.v1 import epd_pb2
    from epd.server.backends.base import GroupSpec
    from epd.server.backends.cuda_plan import decode_plan, plan_world

    def spec(name: str, cls: int) -> GroupSpec:
        return GroupSpec(name, 2, 8, 256, 16, 2, epd_pb2.BFLOAT16, True, cls)

    lat = planner.plan_group("l", spec("l", epd_pb2.LATENCY))
    thr = planner.plan_group("t", spec("t", epd_pb2.THROUGHPUT))
    assert (plan_world(lat), plan_world(thr)) == (1, 0)
    assert decode_plan(lat)[0] == decode_plan(thr)[0] == 0
    planner.free_group(lat)
    assert not planner.heap_of(1).used and planner.heap.used
    # a 1.8 GiB decode group: over the latency heap (1 GiB), named by its flag; the same
    # group as throughput, or not yet resolved (an engine's check), fits the 4 GiB heap
    decode = GroupSpec("d", 2, 256, 7168, 128, 8, epd_pb2.BFLOAT16, True, epd_pb2.LATENCY)
    with pytest.raises(EpdError, match="raise --latency-heap-bytes"):
        planner.validate_spec(decode)
    for cls in (epd_pb2.THROUGHPUT, epd_pb2.SERVICE_CLASS_UNSPECIFIED):
        planner.validate_spec(dataclasses.replace(decode, service_class=cls))
    big = GroupSpec("big", 8, 256, 7168, 1024, 8, epd_pb2.BFLOAT16, True, epd_pb2.LATENCY)
    with pytest.raises(EpdError, match="raise --latency-heap-bytes"):
        planner.plan_group("big", big)
    assert not planner.heap_of(1).used  # (nothing taken)


def test_a_buffer_whose_groups_span_both_classes_is_told_which_socket(daemon_factory):
    """A session serves one class: a Buffer whose low-latency group the policy makes
    latency, after a normal-mode group of throughput on the default engine, gets the refusal
    naming the latency engine's socket; its first group goes on."""
    policy = "ce-split*-ll*=latency, *=throughput"
    with daemon_factory(engines=1, extra=["--class-engines", "--service-class-policy",
                                          policy]) as d:
        rng = np.random.default_rng(6)
        idx, w = ref.random_routing(rng, 8, 4, 2)
        x = ref.random_x(rng, 8, 128, np.float32)
        buf = Buffer(rank=0, num_ranks=1, socket_dir=d.socket_dir, engine=0,
                     group_name="ce-split")
        try:
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
            assert buf.session.endpoint == d.socket(0)
            with pytest.raises(EpdError) as ei:
                buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
            assert ei.value.code.name == "FAILED_PRECONDITION"
            assert engine_sockets.hinted_socket(ei.value.details,
                                                buf.session.endpoint) == d.socket(0, "latency")
            recv_x, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                      num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                      num_tokens_per_expert=n_expert)
            np.testing.assert_array_equal(np.asarray(recv_x),
                                          ref.dispatch([x], [idx], [w], 4)[0].recv_x)
        finally:
            buf.destroy()


def test_throughput_engines_get_their_mps_share(tmp_path, monkeypatch):
    """--throughput-mps-percentage: the throughput class engines' environment caps their MPS
    share of the SMs; the latency engines get none; without class engines it is refused."""
    from types import SimpleNamespace

    from epd.server import supervisor as sup_mod
    from epd.server.backends.cpu_plan import CpuPlanner

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    cfg = config.load(None, {"EPD_CLASS_ENGINES": "1", "EPD_BACKEND": "cpu",
                             "EPD_SOCKET_DIR": str(tmp_path),
                             "EPD_THROUGHPUT_MPS_PERCENTAGE": "70"})
    sup = sup_mod.Supervisor(cfg, CpuPlanner(str(tmp_path)), 1)
    envs: dict[int, dict] = {}

    def popen(argv, env, pass_fds):
        envs[int(argv[argv.index("--index") + 1])] = env
        return SimpleNamespace(pid=1)

    monkeypatch.setattr(sup_mod.subprocess, "Popen", popen)
    for e in sup.engines:
        sup._spawn(e)
    assert envs[0].get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "70"  # throughput, device 0
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in envs[1]  # latency, device 0
    with pytest.raises(ValueError, match="needs class_engines"):
        config.load(None, {"EPD_THROUGHPUT_MPS_PERCENTAGE": "70", "EPD_CLASS_ENGINES": "off"})
    with pytest.raises(ValueError, match=r"must lie in \[0, 100\]"):
        config.load(None, {"EPD_CLASS_ENGINES": "1", "EPD_THROUGHPUT_MPS_PERCENTAGE": "101"})


@pytest.mark.parametrize("env,backend,on,why", [
    ({}, "cuda", False, "gives no group the latency class"),  # (anyone may ask: no default)
    ({"EPD_SERVICE_CLASS_POLICY": "*=throughput"}, "cuda", False, "no group the latency"),
    ({"EPD_SERVICE_CLASS_POLICY": POLICY}, "cuda", True, "has latency groups"),
    ({"EPD_SERVICE_CLASS_POLICY": "*@1001=throughput/latency"}, "cuda", True, "latency groups"),
    ({"EPD_SERVICE_CLASS_POLICY": POLICY}, "cpu", False, "the cpu backend gains nothing"),
    ({"EPD_SERVICE_CLASS_POLICY": POLICY, "EPD_NUM_NODES": "2",
      "EPD_CLUSTER_ADDRESS": "127.0.0.1:1", "EPD_CLUSTER_TOKEN_FILE": "/t"}, "cuda", False,
     "cluster mode"),
    ({"EPD_SERVICE_CLASS_POLICY": POLICY, "EPD_CLASS_ENGINES": "off"}, "cuda", False,
     "--class-engines off"),
    ({"EPD_CLASS_ENGINES": "on"}, "cpu", True, "--class-engines on"),
])
def test_class_engines_auto_is_on_for_a_cuda_daemon_with_latency_groups(env, backend, on, why):
    """--class-engines auto (the default) decides once the backend is known; the engines get
    the decision, never auto."""
    from epd.server.backends import class_engines_pay
    cfg, reason = config.resolve_class_engines(config.load(None, env), backend,
                                               class_engines_pay(backend))
    assert cfg.class_engines == ("on" if on else "off") and cfg.class_engines_on is on
    assert why in reason
    assert cfg.to_env()["EPD_CLASS_ENGINES"] == cfg.class_engines


def test_an_mps_share_without_class_engines_refuses_to_start(tmp_path):
    """--throughput-mps-percentage where auto turns class engines off: the daemon does not
    start, and says why (the share would cap the latency groups' kernels too)."""
    with pytest.raises(ValueError, match=r"needs class_engines.*\(class engines are off: "
                                         "auto: the service-class policy gives no group"):
        config.resolve_class_engines(
            config.load(None, {"EPD_THROUGHPUT_MPS_PERCENTAGE": "70"}), "cuda", True)
    from epd.server import startup
    cfg = config.load(None, {"EPD_THROUGHPUT_MPS_PERCENTAGE": "70", "EPD_BACKEND": "cpu"})
    with pytest.raises(startup.StartupError, match="needs class_engines"):
        startup.check_backend(cfg)
    cfg, why = startup.check_backend(config.load(None, {"EPD_BACKEND": "cpu"}))
    assert cfg.class_engines == "off" and why.startswith("auto: the cpu backend")
