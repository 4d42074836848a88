"""Tenant pools (`epd serve --tenant-pools`, server/tenant_pools.py): a pool's uids get engines of
their own on every device (their own processes, NVSHMEM worlds and heaps), open sessions only
there, and no other uid opens one there. The parts without a daemon here; the daemon with real
uids at the end (needs root, as tests/test_multi_user.py)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import grpc
import pytest
from test_multi_user import SOCKET_GROUP, USER_A, USER_B, UserDaemon, result

from epd.proto import engine_sockets
from epd.proto.errors import EpdError
from epd.proto.v1 import epd_pb2
from epd.server import config, metrics, tenant_pools
from epd.server.backends import cpu_plan, cuda_plan
from epd.server.coordinator import Coordinator
from epd.server.engine_slots import engine_slots

BF16 = epd_pb2.BFLOAT16


def test_the_pools_text_is_parsed_and_checked() -> None:
    pools = tenant_pools.parse(" team-a=1001, 1002 ; b=gid:2000,1003;")
    assert pools == (tenant_pools.TenantPool("team-a", frozenset({1001, 1002}), frozenset()),
                     tenant_pools.TenantPool("b", frozenset({1003}), frozenset({2000})))
    assert tenant_pools.parse("") == ()
    for text, words in [("a", "NAME=ID"), ("A=1", "NAME=ID"), ("a b=1", "NAME=ID"),
                        ("x" * 25 + "=1", "NAME=ID"), ("a=", "lists no uid"),
                        ("a=1;a=2", "named twice"), ("a=1;b=1", r"both list \[1\]"),
                        ("a=gid:7;b=gid:7", "'gid:7'"), ("a=-1", "an id is"),
                        ("a=uid:1", "an id is"), (f"a={2**32 - 1}", "an id is"),
                        (";".join(f"p{i}=1{i}" for i in range(17)), "at most 16")]:
        with pytest.raises(ValueError, match=words):
            tenant_pools.parse(text)


def test_a_uid_belongs_to_the_pool_that_lists_it_before_one_that_lists_its_gid() -> None:
    pools = tenant_pools.parse("by-gid=gid:500;by-uid=1001")
    assert tenant_pools.pool_of(pools, 1001, 500) == "by-uid"
    assert tenant_pools.pool_of(pools, 1002, 500) == "by-gid"
    assert tenant_pools.pool_of(pools, 1002, 501) == ""


def test_the_daemon_refuses_pools_it_cannot_keep_apart() -> None:
    assert config.load(None, {"EPD_TENANT_POOLS": "a=1001"}).tenants[0].name == "a"
    for env, words in [({"EPD_TENANT_POOLS": "a=1001", "EPD_ALLOW_UIDS": "1001,1002"},
                        "--allow-uids"),
                       ({"EPD_TENANT_POOLS": "a=gid:9", "EPD_ALLOW_GIDS": "9"}, "gid:9"),
                       ({"EPD_TENANT_POOLS": "a=1001", "EPD_NUM_NODES": "2",
                         "EPD_NODE_RANK": "0", "EPD_CLUSTER_ADDRESS": "127.0.0.1:1"},
                        "one node"),
                       ({"EPD_TENANT_POOLS": "a=1001=2"}, "an id is"),
                       ({"EPD_TENANT_POOLS": "p" * 24 + "=1001", "EPD_SOCKET_DIR": "/" + "x" * 70},
                        "more than a unix socket takes")]:
        with pytest.raises(ValueError, match=words):
            config.load(None, env)


def test_each_pool_has_a_set_of_engines_per_class_in_a_world_of_its_own() -> None:
    slots = engine_slots(2, True, ["a"])
    assert [(s.index, s.device, s.service_class, s.world, s.pe, s.tenant_pool)
            for s in slots] == [
        (0, 0, "throughput", 0, 0, ""), (1, 1, "throughput", 0, 1, ""),
        (2, 0, "latency", 1, 0, ""), (3, 1, "latency", 1, 1, ""),
        (4, 0, "throughput", 2, 0, "a"), (5, 1, "throughput", 2, 1, "a"),
        (6, 0, "latency", 3, 0, "a"), (7, 1, "latency", 3, 1, "a")]
    assert engine_slots(2) == engine_slots(2, False, ())  # (no pools: as before)
    cfg = config.load(None, {"EPD_SOCKET_DIR": "/run/x"})
    assert [os.path.basename(cfg.engine_socket(s.device, s.service_class, s.tenant_pool))
            for s in slots[3:]] == ["gpu1.latency.sock", "gpu0.tenant-a.sock",
                                    "gpu1.tenant-a.sock", "gpu0.latency.tenant-a.sock",
                                    "gpu1.latency.tenant-a.sock"]
    assert slots[6].describe() == "engine 6 (device 0, tenant pool a, latency groups)"
    # (a refusal's hint names the socket, and the client finds it again)
    hint = f"... (--tenant-pools): {engine_sockets.OTHER_ENGINE_HINT}/run/x/gpu0.tenant-a.sock"
    assert engine_sockets.hinted_socket(hint, "/run/x/gpu0.sock") == "/run/x/gpu0.tenant-a.sock"


def test_each_world_has_its_own_heap_and_unique_id() -> None:
    """Device-free: the cuda planner keeps a heap allocator, a unique id and a generation per
    world; a pool's latency world is sized by --latency-heap-bytes like the shared one's."""
    planner = cuda_plan.CudaPlanner(SimpleNamespace(
        nvshmem_heap_bytes=4 << 30, latency_heap_bytes=1 << 30, class_engines="on",
        backend="cuda", shm_dir="/tmp", cuda_max_connections=12))
    for world in range(4):
        planner.start_world(world, bytes([65 + world]) * 8)
    from epd.server.backends.base import GroupSpec
    g = GroupSpec("g", 2, 8, 256, 16, 2, BF16, True, epd_pb2.THROUGHPUT)
    plans = {w: planner.plan_group(f"g{w}", g, world=w) for w in (0, 2)}
    assert {w: cuda_plan.plan_world(p) for w, p in plans.items()} == {0: 0, 2: 2}
    assert cuda_plan.decode_plan(plans[0])[0] == cuda_plan.decode_plan(plans[2])[0] == 0
    assert planner.heap_of(2).used and planner.heap_of(0).used and not planner.heap_of(3).used
    planner.free_group(plans[2])
    assert not planner.heap_of(2).used and planner.heap_of(0).used
    boots = {w: planner.bootstrap(1, 2, w) for w in (2, 3)}
    assert [(b.nvshmem_uid, b.heap_bytes, b.generation) for b in boots.values()] == [
        (b"C" * 8, 4 << 30, 1), (b"D" * 8, 1 << 30, 1)]
    assert planner.engine_env(3)["NVSHMEM_SYMMETRIC_SIZE"] == str(2 << 30)
    with pytest.raises(EpdError, match="world 5"):
        planner.bootstrap(0, 2, 5)


def _request(name: str, rank: int, uid: int, engine: int) -> epd_pb2.RendezvousRequest:
    spec = epd_pb2.GroupSpec(name=name, num_ranks=2, num_experts=8, hidden=128,
                             max_tokens_per_rank=16, num_topk=2, x_dtype=BF16)
    return epd_pb2.RendezvousRequest(spec=spec, rank=rank, engine_index=engine,
                                     session_id=f"s{uid}-{rank}-{engine}", timeout_seconds=0.5,
                                     peer_uid=uid, peer_gid=uid, has_peer=True)


def test_a_name_joined_on_two_worlds_makes_two_groups(tmp_path) -> None:
    """A group's ranks are all on engines of one world: the daemon's own uid, which any
    engine admits, joining one name on the shared engines and on a pool's forms one group in
    each world (one group across two worlds would pair heaps that are apart); a pool's uids
    share one namespace of names there, as the pool of --allow-uids does."""
    pools = tenant_pools.parse("a=7001,7002")
    worlds = {0: 0, 1: 0, 2: 1, 3: 1}  # engines 2, 3: the pool's
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)), tenant_pools=pools,
                        world_of=worlds.__getitem__)
    me = os.getuid()

    async def run():
        return await asyncio.gather(
            coord.rendezvous(_request("ep", 0, me, 0)), coord.rendezvous(_request("ep", 1, me, 3)),
            coord.rendezvous(_request("pool", 0, 7001, 2)),
            coord.rendezvous(_request("pool", 1, 7002, 3)), return_exceptions=True)
    apart0, apart1, pool0, pool1 = asyncio.run(run())
    for r in (apart0, apart1):  # (each waits for its rank 1 / 0 in its own world)
        assert isinstance(r, EpdError) and r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert pool0.group_id == pool1.group_id
    assert sorted(coord.by_name) == [((1, -2), "pool")]  # (the pool's namespace)


def test_a_pools_groups_are_labelled_as_the_pools() -> None:
    assert metrics.owned_label("ep0", 7001, False, "team-a") == "ep0 (tenant team-a)"
    assert metrics.owned_label("ep0 (tenant b)", os.geteuid(), False) == \
        f"ep0 (tenant b) (uid {os.geteuid()})"


# -- the daemon, with real uids (root) -------------------------------------------------------
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (it runs processes as other uids)")
def test_a_pools_sessions_run_on_its_own_engines_and_no_one_elses_there() -> None:
    d = UserDaemon(["--tenant-pools", f"team-a={USER_A}"])
    try:
        # user A opens on the shared socket and is sent to its pool's engine; user B on the
        # pool's socket is sent to the shared one; both work
        a = result(d.client(USER_A, [SOCKET_GROUP], "tp-solo", 0, 1, socket="gpu0.sock"))
        b = result(d.client(USER_B, [SOCKET_GROUP], "tp-solo", 0, 1,
                            socket="gpu0.tenant-team-a.sock"))
        assert a["code"] == b["code"] == "OK", (a, b)
        assert a["endpoint"].endswith("/gpu0.tenant-team-a.sock") and a["engine"] == 2, a
        assert b["endpoint"].endswith("/gpu0.sock") and b["engine"] == 0, b
        # a two-rank group of the pool across both devices: both ranks on the pool's engines
        both = [d.client(USER_A, [SOCKET_GROUP], "tp-pair", r, 2, engine=r) for r in range(2)]
        pair = [result(p) for p in both]
        assert [(r["code"], r["engine"]) for r in pair] == [("OK", 2), ("OK", 3)], pair
        # the daemon's topology: four engines, two processes of the pool's
        with grpc.insecure_channel(f"unix://{d.sock}/node.sock") as ch:
            from epd.proto.v1 import epd_pb2_grpc
            topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=10)
        assert [(e.index, e.device, e.tenant_pool) for e in topo.engines] == [
            (0, 0, ""), (1, 1, ""), (2, 0, "team-a"), (3, 1, "team-a")]
        assert len({e.pid for e in topo.engines}) == 4
        assert {"tp-solo (tenant team-a)", "tp-pair (tenant team-a)",
                f"tp-solo (uid {USER_B})"} <= d.dispatch_groups()
    finally:
        d.close()



def test_a_pools_class_engines_send_each_other_their_groups(daemon_factory) -> None:
    """With class engines too, a pool has a throughput and a latency engine per device: a
    latency group joined on the pool's throughput engine is refused naming the pool's latency
    engine's socket (not the shared one's), and runs there (as the daemon's own uid, which the
    pool lists)."""
    from epd.client import Session

    policy = "tp-decode*=latency, *=throughput"
    with daemon_factory(engines=1, extra=["--class-engines", "--service-class-policy", policy,
                                          "--tenant-pools", f"team-a=41002,{os.geteuid()}"]) as d:
        pool = os.path.join(d.socket_dir, "gpu0.tenant-team-a.sock")
        latency = os.path.join(d.socket_dir, "gpu0.latency.tenant-team-a.sock")
        spec = dict(rank=0, num_ranks=1, num_experts=4, hidden=128, max_tokens_per_rank=4,
                    num_topk=2)
        with Session(pool, timeout=10) as s:
            assert s.engine_index == 2  # (shared: 0 throughput, 1 latency; the pool's: 2, 3)
            with pytest.raises(EpdError) as ei:
                s.join("tp-decode", **spec)
            assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
            assert engine_sockets.hinted_socket(ei.value.details, pool) == latency
            s.join("tp-prefill", **spec)
        with Session(latency, timeout=10) as s:
            assert s.engine_index == 3
            s.join("tp-decode", **spec)


def test_the_daemons_uid_enters_a_pools_engines_only_where_the_pool_lists_it(
        daemon_factory) -> None:
    """Every client on the daemon's MPS server runs as the daemon's uid: a pool that does not
    list it sends its sessions to the shared engines (a review: admitted everywhere, every MPS
    client reached every pool's heap). A pool engine's engine-wide counts go to its sessions
    only."""
    from epd.client import Session
    from epd.proto.v1 import epd_pb2_grpc

    with daemon_factory(engines=1, extra=["--tenant-pools", "team-a=41002"]) as d:
        pool = os.path.join(d.socket_dir, "gpu0.tenant-team-a.sock")
        with Session(pool, timeout=10) as s:
            assert s.endpoint == d.socket(0) and s.engine_index == 0
        for sock, allowed in ((d.socket(0), True), (pool, False)):
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                call = epd_pb2_grpc.EngineStub(ch).GetStats
                if allowed:
                    call(epd_pb2.GetStatsRequest(), timeout=10)
                    continue
                with pytest.raises(grpc.RpcError) as ei:
                    call(epd_pb2.GetStatsRequest(), timeout=10)
                assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED, ei.value
