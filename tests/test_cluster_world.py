"""A world over all nodes (server/cluster_world.py, the CUDA engine's NVSHMEM world in cluster
mode): when node 0 forms it, when it is lost, and the PEs the engines get from it. Pure logic
and the CUDA planner's sizes: no GPU."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from epd.proto.errors import EpdError, FailedPrecondition
from epd.proto.v1 import epd_pb2
from epd.server.backends.cuda_plan import CudaPlanner
from epd.server.cluster_world import NodeState, WorldKeeper


def _nodes(gens: dict[int, int], engines=(2, 1, 3), inc: dict[int, str] | None = None):
    inc = inc or {}
    return {r: NodeState(inc.get(r, f"i{r}"), engines[r], g) for r, g in gens.items()}


def test_formed_once_every_node_holds_a_lease_and_runs_no_engines() -> None:
    k = WorldKeeper(3)
    assert k.form(_nodes({0: 0, 1: 0})) is None  # node 2 has no lease yet
    assert k.form(_nodes({0: 0, 1: 0, 2: 7})) is None  # node 2 still runs an older world
    w = k.form(_nodes({0: 0, 1: 0, 2: 0}))
    assert (w.generation, w.node_first_pe, w.num_pes) == (1, (0, 2, 3), 6)
    assert k.form(_nodes({0: 0, 1: 0, 2: 0})) is None  # one world at a time
    # nodes that have not started in it yet do not lose it
    assert k.lost(_nodes({0: 1, 1: 0, 2: 0})) is None
    assert k.lost(_nodes({0: 1, 1: 1, 2: 1})) is None


@pytest.mark.parametrize("change, words", [
    (lambda n: n.pop(1), "node 1 went away"),
    (lambda n: n.update(_nodes({2: 1}, inc={2: "new"})), "node 2 restarted"),
    (lambda n: n.update(_nodes({1: 0})), "node 1's engines left the world"),
])
def test_lost_when_a_node_leaves_it_then_formed_again(change, words) -> None:
    k = WorldKeeper(3)
    k.form(_nodes({0: 0, 1: 0, 2: 0}))
    nodes = _nodes({0: 1, 1: 1, 2: 1})
    assert k.lost(nodes) is None
    change(nodes)
    assert words in k.lost(nodes)
    assert k.world is None and k.lost(nodes) is None  # said once
    # the next world waits for every node to have stopped its engines
    assert k.form(_nodes({0: 0, 1: 1, 2: 0})) is None
    w = k.form(_nodes({0: 0, 1: 0, 2: 0}))
    assert w.generation == 2


def test_cuda_engines_get_their_pe_in_the_world() -> None:
    cfg = SimpleNamespace(nvshmem_heap_bytes=1 << 30, num_nodes=3, node_rank=1, cuda_cluster=True)
    node1 = CudaPlanner(cfg)
    with pytest.raises(FailedPrecondition, match="not formed yet"):
        node1.bootstrap(0, 1)
    k = WorldKeeper(3)
    w = k.form(_nodes({0: 0, 1: 0, 2: 0}))
    node0 = CudaPlanner(SimpleNamespace(**{**vars(cfg), "node_rank": 0}))
    node0.new_world = lambda: setattr(node0, "uid", b"u" * 128)  # (nvshmem: GPU machines)
    msg = node0.form_world(w)
    node1.adopt_world(msg)  # from the lease stream
    b = node1.bootstrap(0, 1)
    assert (b.pe, b.num_pes, list(b.node_first_pe), b.generation) == (2, 6, [0, 2, 3], 1)
    assert b.nvshmem_uid == b"u" * 128
    assert node0.bootstrap(1, 2).pe == 1
    node1.leave_world()
    with pytest.raises(FailedPrecondition):
        node1.bootstrap(0, 1)


class _Sup:
    """What ClusterHub / ClusterMember use of a supervisor in world mode, recording what they
    make it do (the real enter/leave start and stop engine processes)."""

    def __init__(self, node_rank: int, engines: int = 2) -> None:
        self.cfg = SimpleNamespace(num_nodes=2, node_rank=node_rank, cuda_cluster=True,
                                   nvshmem_heap_bytes=1 << 30, cluster_heartbeat_seconds=1.0,
                                   cluster_address="127.0.0.1:1")
        self.planner = CudaPlanner(self.cfg)
        self.planner.new_world = lambda: setattr(self.planner, "uid", b"u" * 128)
        self.engines = [SimpleNamespace(index=i, socket_path="", ready=False, proc=None,
                                        restarts=0) for i in range(engines)]
        self.incarnation, self.world_generation, self.world_left = f"inc{node_rank}", 0, 0
        self.world_mode, self.stopping, self.log = True, False, []
        self.cluster_tls = None  # (plaintext Cluster port)

    def enter_world(self, world) -> None:
        if self.world_generation:
            self.leave_world("replaced")
        self.planner.adopt_world(world)
        self.world_generation = world.generation
        self.log.append(("enter", world.generation))

    def leave_world(self, why: str) -> None:
        self.planner.leave_world()
        self.world_left = max(self.world_left, self.world_generation)
        self.world_generation = 0
        self.log.append(("leave", why))
        if getattr(self, "hub", None) is not None:
            self.hub.tend_world()


def test_node_0_and_a_member_follow_the_world_through_a_loss() -> None:
    from epd.server.cluster import ClusterHub, ClusterMember, NodeLease

    sup0, sup1 = _Sup(0), _Sup(1, engines=3)
    hub = sup0.hub = ClusterHub(sup0, "t")
    member = ClusterMember(sup1, "t")
    hub.tend_world()
    assert sup0.log == []  # node 1 holds no lease yet
    lease = NodeLease(1, sup1.incarnation, "n1", [epd_pb2.EngineInfo()] * 3)
    hub.nodes[1] = lease
    hub.tend_world()
    assert sup0.log == [("enter", 1)] and hub._event().world.num_pes == 5
    info = hub._event().cluster  # (what `epd topology` prints)
    assert (info.world_generation, info.world_num_pes) == (1, 5)
    member._follow_world(hub._event())
    assert sup1.log == [("enter", 1)] and sup1.planner.bootstrap(2, 3).pe == 4
    lease.world_generation = 1  # its heartbeat
    hub.tend_world()
    # an engine of node 1 dies: it stops the others and reports 0; node 0 loses the world
    sup1.leave_world("engine 0 exited")
    lease.world_generation = 0
    hub.tend_world()
    assert sup0.log[1][0] == "leave" and "node 1's engines left" in sup0.log[1][1]
    # ... and forms the next at once: both nodes run no engines
    assert sup0.log[2] == ("enter", 2) and hub._event().world.generation == 2
    member._follow_world(hub._event())
    assert sup1.log[-1] == ("enter", 2)
    # a stale event of the world it left never brings node 1 back into it
    stale = epd_pb2.ClusterLeaseEvent()
    stale.world.generation = 1
    member._follow_world(stale)
    assert sup1.world_generation == 2
    # node 0 ends node 1's lease: the world is lost on node 0; node 1, told by an event
    # without a world, stops its engines
    lease.world_generation = 2
    hub.tend_world()
    lease.live = False
    hub.tend_world()
    assert sup0.world_generation == 0 and "node 1 went away" in sup0.log[-1][1]
    member._follow_world(hub._event())
    assert sup1.world_generation == 0 and sup1.log[-1][0] == "leave"


class _Context:
    """A gRPC servicer context: the cluster token sent, abort raising as grpc.aio's does."""

    def __init__(self, token: str) -> None:
        self.token = token

    def invocation_metadata(self):
        return (("epd-cluster-token", self.token),)

    def peer(self) -> str:
        return "ipv4:10.0.0.2:5555"

    async def abort(self, code, details):
        raise AssertionError((code, details))


def test_node_0_checks_what_another_node_asks_of_its_coordinator() -> None:
    """A rendezvous naming an engine its node does not have is INVALID_ARGUMENT (the engine
    index picks the rank's PE); a release from a node without a live lease is not passed on
    (node_lost released its ranks); a release from a live one goes on naming its node (the
    coordinator lets a node release its own ranks only)."""
    from epd.server.cluster import ClusterHub, NodeLease

    sup0 = _Sup(0)
    released: list[tuple] = []
    sup0.coordinator = SimpleNamespace(
        release=lambda *a, **kw: released.append((a, kw)),
        rendezvous=lambda *a, **kw: None)
    hub = ClusterHub(sup0, "t")
    hub.nodes[1] = NodeLease(1, "inc1", "n1", [epd_pb2.EngineInfo()] * 3)
    ctx = _Context("t")

    def call(method: str, req):
        return asyncio.run(getattr(hub, method)(req, ctx))

    rv = epd_pb2.ClusterRendezvousRequest(node_rank=1, incarnation="inc1",
                                          request=epd_pb2.RendezvousRequest(engine_index=3))
    with pytest.raises(AssertionError) as ei:
        call("Rendezvous", rv)
    code, details = ei.value.args[0]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node 1 has 3 engine(s)" in details
    rel = epd_pb2.ClusterReleaseRequest(
        node_rank=1, incarnation="old", request=epd_pb2.ReleaseRankRequest(
            group_id="g1", rank=2, reason="gone"))
    call("ReleaseRank", rel)
    assert released == []  # (another incarnation: no lease)
    rel.incarnation = "inc1"
    call("ReleaseRank", rel)
    assert released == [(("g1", 2, "gone"), {"left": False, "node": 1})]


def test_a_member_follows_a_restarted_node_0s_worlds() -> None:
    """A restarted node 0 numbers its worlds from 1 again: a member that left world 1 of the
    old node 0 must enter world 1 of the new one (it ignored every world up to the one it had
    left, so the new node 0's engines waited for it until their start timeout, each time)."""
    from epd.server.cluster import ClusterHub, ClusterMember, NodeLease

    sup1 = _Sup(1, engines=3)
    member = ClusterMember(sup1, "t")
    for restart in range(2):
        sup0 = _Sup(0)
        sup0.incarnation = f"inc0-{restart}"
        hub = sup0.hub = ClusterHub(sup0, "t")
        hub.nodes[1] = NodeLease(1, sup1.incarnation, "n1", [epd_pb2.EngineInfo()] * 3)
        hub.tend_world()
        assert hub._event().world.generation == 1
        member._follow_world(hub._event())
        assert sup1.world_generation == 1 and sup1.log[-1] == ("enter", 1), sup1.log
        member._coordinator_lost("node 0 went away")  # (its lease stream broke)
        assert sup1.world_generation == 0 and sup1.world_left == 1
        # the old node 0's world, seen again, is still not entered
        member._follow_world(hub._event())
        assert sup1.world_generation == 0


def test_a_forwarded_release_is_retried_while_the_lease_lives() -> None:
    """A release node 0 did not answer (a blip) is sent again, backing off, until it answers;
    a lease that ended stops it (node 0 released the node's ranks itself then)."""
    from epd.server import cluster

    class Stub:
        def __init__(self, fail: int) -> None:
            self.calls, self.fail = 0, fail

        async def ReleaseRank(self, req, metadata, timeout):
            self.calls += 1
            if self.calls <= self.fail:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None,
                                           details="node 0 unreachable")
            return epd_pb2.ReleaseRankResponse()

    member = cluster.ClusterMember(_Sup(1), "t")
    member.connected, member.leases = True, 1
    req = epd_pb2.ClusterReleaseRequest(node_rank=1, incarnation="inc1",
                                        request=epd_pb2.ReleaseRankRequest(group_id="g", rank=2))
    saved = cluster.RELEASE_RETRY_SECONDS
    cluster.RELEASE_RETRY_SECONDS = 0.01
    try:
        member._stub = Stub(fail=2)
        asyncio.run(member._forward_release(req))
        assert member._stub.calls == 3  # two lost, the third answered
        member._stub = Stub(fail=100)

        async def lease_ends() -> None:
            task = asyncio.ensure_future(member._forward_release(req))
            await asyncio.sleep(0.05)
            member.connected = False
            await asyncio.wait_for(task, 2)
        asyncio.run(lease_ends())
        assert 1 <= member._stub.calls < 100
    finally:
        cluster.RELEASE_RETRY_SECONDS = saved


def test_node_0_refuses_a_node_whose_settings_differ() -> None:
    """A node whose engines would lay out or run groups spanning nodes differently (another
    --cuda-hierarchical, heap, backend) is refused at registration, naming the setting (such
    groups hung, or wrote into another group's heap range); one that agrees is registered."""
    from epd.server.cluster import ClusterHub, agreed_settings, settings_difference

    sup0 = _Sup(0)
    sup0.backend, sup0.cfg.cuda_hierarchical = "cuda", "auto"
    sup0.coordinator = SimpleNamespace(node_lost=lambda rank, why: [])
    hub = ClusterHub(sup0, "t")
    mine = agreed_settings(sup0)
    theirs = mine.replace("cuda_hierarchical=auto", "cuda_hierarchical=stages")
    assert settings_difference(mine, mine) == "" and settings_difference(mine, "") == ""
    assert settings_difference(mine, theirs) == ("cuda_hierarchical: auto on node 0, stages "
                                                 "there")

    async def register(settings: str):
        async def beats():
            yield epd_pb2.ClusterHeartbeat(node_rank=1, incarnation="i1", node_name="n1",
                                           agreed_settings=settings)
            await asyncio.sleep(10)
        stream = hub.Lease(beats(), _Context("t"))
        try:
            return await stream.__anext__()
        finally:
            await stream.aclose()

    with pytest.raises(AssertionError) as ei:
        asyncio.run(register(theirs))
    code, details = ei.value.args[0]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "cuda_hierarchical" in details
    assert 1 not in hub.nodes
    # the shared pool of names: compared as sets of ids (a member pooling other uids than
    # node 0 is refused, naming the setting; the same ids in another order agree)
    sup0.cfg.allow_uids = "1002,1001"
    pooled = agreed_settings(sup0)
    assert "allow_uids=1001,1002" in pooled
    sup0.cfg.allow_uids = "1001, 1002"
    assert settings_difference(agreed_settings(sup0), pooled) == ""
    assert settings_difference(pooled, mine) == "allow_uids: 1001,1002 on node 0,  there"
    sup0.cfg.allow_uids = ""
    for name in ("cluster_heartbeat_seconds", "num_nodes"):  # (lease timing; the ranks)
        assert f"{name}=" in mine
        other = ";".join(f"{k}=7" if k == name else f"{k}={v}" for k, v in
                         (i.split("=", 1) for i in mine.split(";")))
        with pytest.raises(AssertionError) as ei:
            asyncio.run(register(other))
        assert name in ei.value.args[0][1]
    assert asyncio.run(register(mine)).cluster.nodes[1].node_name == "n1"


def test_node_0_abandons_a_world_its_own_engine_could_not_start_in() -> None:
    """Node 0's engine cannot start in world g (its supervisor leaves g: world_left = g,
    generation 0, which alone reads as "not started yet"): node 0 stops advertising g at its
    next tend, and forms g + 1 once every node runs no engines. A failure of node 0's own while
    tending (the NVSHMEM id cannot be made) is logged, never raised into a node's lease."""
    from epd.server.cluster import ClusterHub, NodeLease

    class FailingOnce(_Sup):
        fail = True

        def enter_world(self, world) -> None:
            super().enter_world(world)
            if self.fail:  # (as Supervisor.enter_world does when a spawn fails)
                self.fail = False
                self.leave_world("engine 1 of node 0 cannot start")

    sup0, sup1 = FailingOnce(0), _Sup(1)
    hub = sup0.hub = ClusterHub(sup0, "t")
    hub.nodes[1] = NodeLease(1, sup1.incarnation, "n1", [epd_pb2.EngineInfo()] * 2)
    hub.tend_world()
    assert sup0.log[:2] == [("enter", 1), ("leave", "engine 1 of node 0 cannot start")]
    assert (sup0.world_generation, sup0.world_left) == (0, 1)
    hub.tend_world()  # the next heartbeat: world 1 is given up, world 2 formed and entered
    assert hub.keeper.generation == 2 and sup0.log[-1] == ("enter", 2)
    assert hub._event().world.generation == 2

    def cannot(world):
        raise RuntimeError("nvshmem: no unique id")
    sup0.planner.form_world = cannot
    sup0.leave_world("test")  # (node 0 again without a world; node 1 at 0)
    hub.tend_world()  # logged, not raised; the keeper holds no half-made world
    assert hub.keeper.world is None and hub.world is None


def test_a_forwarded_rendezvous_ends_when_node_0s_lease_does() -> None:
    """A rendezvous forwarded to node 0 that waits (node 0 hung or cut off) ends as soon as
    the lease with node 0 does, UNAVAILABLE naming why, not at its own deadline (the
    rendezvous timeout + 5 s) as a bare "Deadline Exceeded"."""
    import time

    from epd.server.cluster import ClusterMember

    class Call:  # (what a grpc.aio unary call is to the member: awaitable, cancellable)
        def __init__(self) -> None:
            self.fut = asyncio.get_running_loop().create_future()

        def __await__(self):
            return self.fut.__await__()

        def cancel(self) -> bool:
            return self.fut.cancel()

    sup1 = _Sup(1)
    sup1.cfg.timeout_seconds = 600.0
    member = ClusterMember(sup1, "t")
    member._stub = SimpleNamespace(Rendezvous=lambda *a, **kw: Call())

    async def run():
        spec = epd_pb2.GroupSpec(name="g", num_ranks=2)
        task = asyncio.ensure_future(member.rendezvous(epd_pb2.RendezvousRequest(
            spec=spec, rank=1, timeout_seconds=600)))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        member._coordinator_lost("no heartbeat within 3 s")
        try:
            await asyncio.wait_for(task, 2)
        except EpdError as e:
            return e, time.monotonic() - t0
        raise AssertionError("the forwarded rendezvous answered")
    err, took = asyncio.run(run())
    assert took < 0.5
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert "node 0 (the cluster coordinator) went away (no heartbeat within 3 s)" in err.message
    assert member._forwarded == set() and member._cut == {}


def test_a_node_whose_engine_could_not_start_in_the_world_loses_it() -> None:
    """Node 1 is told of world g and cannot start an engine in it: it leaves g (runs no
    engines, reports generation 0 as a node not started yet would) and says so in its
    heartbeat (world_left = g); node 0 loses g at once and forms g + 1, not waiting out the
    other nodes' engine start timeout."""
    from epd.server.cluster import ClusterHub, ClusterMember, NodeLease

    class CannotStart(_Sup):
        def enter_world(self, world) -> None:
            super().enter_world(world)
            self.leave_world("engine 0 cannot start")  # (as Supervisor.enter_world does)

    sup0, sup1 = _Sup(0), CannotStart(1)
    sup1.backend = "cuda"  # (its heartbeat's agreed settings)
    hub = sup0.hub = ClusterHub(sup0, "t")
    member = ClusterMember(sup1, "t")
    lease = NodeLease(1, sup1.incarnation, "n1", [epd_pb2.EngineInfo()] * 2)
    hub.nodes[1] = lease
    hub.tend_world()
    assert sup0.log == [("enter", 1)]
    member._follow_world(hub._event())
    assert (sup1.world_generation, sup1.world_left) == (0, 1)
    hb = member._heartbeat()
    assert (hb.world_generation, hb.world_left) == (0, 1)
    lease.world_generation, lease.world_left = hb.world_generation, hb.world_left
    hub.tend_world()
    assert sup0.log[1][0] == "leave" and "node 1's engines could not run in world 1" in \
        sup0.log[1][1]
    assert sup0.log[2] == ("enter", 2) and hub._event().world.generation == 2
