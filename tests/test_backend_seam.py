"""The backend is the seam: the supervisor's coordinator checks a group spec against the chosen
backend's limits at rendezvous and tells a forming failure to every waiting rank. Runs on the
CPU: the CUDA planner is pure sizes (no CuPy)."""

from __future__ import annotations

import asyncio
import itertools
import os
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from epd.proto import dtypes
from epd.proto.errors import EpdError, InvalidArgument
from epd.proto.v1 import epd_pb2
from epd.server.backends import cpu_comm_file, cpu_plan, cuda_plan, make_planner
from epd.server.backends.base import GroupPlanner, GroupSpec
from epd.server.coordinator import Coordinator

BF16 = dtypes.from_name("bfloat16")


def _proto(num_ranks: int, topk: int, *, experts: int = 64, name: str = "g",
           tokens: int = 128, hidden: int = 1024) -> epd_pb2.GroupSpec:
    return epd_pb2.GroupSpec(name=name, num_ranks=num_ranks, num_experts=experts, hidden=hidden,
                             max_tokens_per_rank=tokens, num_topk=topk, x_dtype=BF16)


async def _all_ranks(coord: Coordinator, spec: epd_pb2.GroupSpec, timeout: float = 5.0):
    async def one(rank: int):
        try:
            return await coord.rendezvous(epd_pb2.RendezvousRequest(
                spec=spec, rank=rank, engine_index=rank % 2, session_id=f"s{rank}",
                timeout_seconds=timeout, peer_uid=os.getuid(), peer_gid=os.getgid(),
                has_peer=True))
        except EpdError as e:
            return e
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = await asyncio.gather(*(one(r) for r in range(spec.num_ranks)))
    return out, loop.time() - start


def _cuda_cfg(heap: int = 4 << 30) -> SimpleNamespace:
    return SimpleNamespace(nvshmem_heap_bytes=heap, backend="cuda", shm_dir="/tmp",
                           cuda_max_connections=12)


def test_cuda_limits_reach_every_rank_at_once() -> None:
    """Defect 4: 16 ranks with top-k 64 passes the generic check; the CUDA kernels take 8 ranks.
    Every rank gets INVALID_ARGUMENT naming the limit, without waiting for a deadline."""
    coord = Coordinator(cuda_plan.CudaPlanner(_cuda_cfg()))
    results, took = asyncio.run(_all_ranks(coord, _proto(16, 64)))
    assert took < 2.0
    for r in results:
        assert isinstance(r, EpdError) and r.code == grpc.StatusCode.INVALID_ARGUMENT, r
        assert "MAX_RANKS" in r.message and "16" in r.message
    assert not coord.by_name and not coord.by_id


class _FailingPlanner(cpu_plan.CpuPlanner):
    def __init__(self, shm_dir: str, exc: Exception) -> None:
        super().__init__(shm_dir)
        self.exc = exc

    def plan_group(self, group_id: str, spec: GroupSpec, rank_nodes=()) -> bytes:
        raise self.exc


@pytest.mark.parametrize(("exc", "code"), [
    (ValueError("boom: no room"), grpc.StatusCode.INTERNAL),
    (InvalidArgument("boom: too large"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_forming_failure_is_told_to_every_rank(tmp_path, exc, code) -> None:
    coord = Coordinator(_FailingPlanner(str(tmp_path), exc))
    results, took = asyncio.run(_all_ranks(coord, _proto(4, 2)))
    assert took < 2.0
    for r in results:
        assert isinstance(r, EpdError) and r.code == code, r
        assert "boom" in r.message
    assert not coord.by_name and not coord.by_id  # the next rendezvous starts afresh
    coord.planner = cpu_plan.CpuPlanner(str(tmp_path))
    results, _ = asyncio.run(_all_ranks(coord, _proto(4, 2)))
    assert all(isinstance(r, epd_pb2.RendezvousResponse) and r.plan for r in results)


def test_another_uids_joins_of_a_name_form_their_own_group(tmp_path) -> None:
    """Group names are each uid's own: another uid joining the ranks of a name in use (one
    taken, one free, then of the formed group) neither takes a rank of it nor learns of it (no
    refusal naming its session or uid): its ranks form a group of their own."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))
    spec = _proto(2, 2, name="owned")

    def req(rank: int, uid: int, sid: str) -> epd_pb2.RendezvousRequest:
        return epd_pb2.RendezvousRequest(spec=spec, rank=rank, engine_index=0, session_id=sid,
                                         timeout_seconds=5, peer_uid=uid, peer_gid=uid,
                                         has_peer=True)

    async def run():
        owner = asyncio.ensure_future(coord.rendezvous(req(0, 1000, "secret-session")))
        await asyncio.sleep(0.05)  # (rank 0 waits for rank 1)
        thieves = await asyncio.gather(*(coord.rendezvous(req(r, 2000, f"thief{r}"))
                                         for r in (0, 1)))
        partner = await coord.rendezvous(req(1, 1000, "partner"))
        return await owner, partner, thieves
    owner, partner, thieves = asyncio.run(run())
    assert owner.group_id == partner.group_id
    assert thieves[0].group_id == thieves[1].group_id != owner.group_id
    assert owner.plan != thieves[0].plan  # (two groups' memory, not one)
    assert sorted(coord.by_name) == [((0, 1000), "owned"), ((0, 2000), "owned")]


def test_a_name_taken_first_by_another_uid_stays_free_for_its_owner(tmp_path) -> None:
    """Taking a name first holds nothing against another uid: the other uid's group of that
    name forms while the first one's waits (before names were scoped, its joins were
    PERMISSION_DENIED for as long as the squatter held the name)."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))
    spec = _proto(2, 2, name="ep0")

    async def run():
        squat = asyncio.ensure_future(coord.rendezvous(_request(spec, 0, uid=os.getuid() + 4242,
                                                                timeout=0.5)))
        await asyncio.sleep(0.05)
        results, _ = await _all_ranks(coord, spec)
        with pytest.raises(EpdError) as ei:
            await squat
        return results, ei.value
    results, squat_error = asyncio.run(run())
    assert all(isinstance(r, epd_pb2.RendezvousResponse) for r in results), results
    assert results[0].group_id == results[1].group_id
    assert squat_error.code == grpc.StatusCode.DEADLINE_EXCEEDED, squat_error
    assert list(coord.by_name) == [((0, os.getuid()), "ep0")]


def test_a_shared_pools_uids_meet_by_name_and_only_they(tmp_path) -> None:
    """--allow-uids: the listed uids share one namespace, so a pool's ranks of several uids
    form one group; an unlisted uid's join of the name forms its own. A pool lists every uid
    it has: a listed uid does not meet an unlisted one's group either."""
    owner, member, outsider = 3000, 3001, 3002
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)),
                        allow_uids=frozenset({owner, member}))
    spec = _proto(3, 2, experts=48, name="pool")

    async def run():
        first = asyncio.ensure_future(coord.rendezvous(_request(spec, 0, uid=owner)))
        await asyncio.sleep(0.05)
        alone = asyncio.ensure_future(coord.rendezvous(_request(spec, 1, uid=outsider,
                                                                timeout=0.5)))
        rest = await asyncio.gather(*(coord.rendezvous(_request(spec, r, uid=member))
                                      for r in (1, 2)))
        with pytest.raises(EpdError) as ei:
            await alone
        return [await first, *rest], ei.value
    joined, alone_error = asyncio.run(run())
    assert len({r.group_id for r in joined}) == 1
    assert alone_error.code == grpc.StatusCode.DEADLINE_EXCEEDED, alone_error

    unlisted = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)), allow_uids=frozenset({member}))
    pair = _proto(2, 2, name="pair")

    async def apart():
        return await asyncio.gather(
            unlisted.rendezvous(_request(pair, 0, uid=owner, timeout=0.5)),
            unlisted.rendezvous(_request(pair, 1, uid=member, timeout=0.5)),
            return_exceptions=True)
    for r in asyncio.run(apart()):
        assert isinstance(r, EpdError) and r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r


def test_cpu_plan_travels_and_is_freed(tmp_path) -> None:
    planner = make_planner(SimpleNamespace(backend="cpu", shm_dir=str(tmp_path)))
    assert isinstance(planner, cpu_plan.CpuPlanner) and planner.proto_kind == epd_pb2.CPU
    coord = Coordinator(planner)
    results, _ = asyncio.run(_all_ranks(coord, _proto(2, 2)))
    plans = {r.plan for r in results}
    assert len(plans) == 1
    path = cpu_plan.comm_path(plans.pop())
    # A sealed memfd of the planner's process, nothing in the shm folder; it cannot be resized.
    assert path.startswith(f"/proc/{os.getpid()}/fd/") and os.path.exists(path)
    assert os.listdir(tmp_path) == []
    gid = results[0].group_id
    assert os.readlink(path) == f"/memfd:epd-{gid}.comm (deleted)"
    with open(path, "r+b") as f, pytest.raises(PermissionError):
        os.ftruncate(f.fileno(), 0)
    coord.release(gid, 0, "rank 0 went away")
    # the planner's abort_group
    header = np.fromfile(path, np.int64, count=cpu_comm_file.HEADER_BYTES // 8)
    assert "rank 0 went away" in (cpu_comm_file.read_abort(header) or "")
    coord.release(gid, 1, "")
    assert not os.path.exists(path)  # the planner closed its descriptor


def _spec(num_ranks: int, topk: int, **kw) -> GroupSpec:
    d = dict(name="g", num_ranks=num_ranks, num_experts=64, hidden=1024,
             max_tokens_per_rank=128, num_topk=topk, x_dtype=BF16)
    d.update(kw)
    return GroupSpec(**d)


@pytest.mark.parametrize(("spec", "words"), [
    (_spec(16, 8), "MAX_RANKS"),
    (_spec(8, 64), "MAX_TOPK"),
    (_spec(2, 2, num_experts=4096, low_latency_mode=True), "1024 local experts"),
    (_spec(8, 8, max_tokens_per_rank=1 << 20, hidden=8192), "nvshmem-heap-bytes"),
])
def test_cuda_planner_names_the_limit(spec: GroupSpec, words: str) -> None:
    planner = cuda_plan.CudaPlanner(_cuda_cfg())
    with pytest.raises(InvalidArgument, match=words):
        planner.validate_spec(spec)


def test_cuda_planner_heap_ranges() -> None:
    planner = cuda_plan.CudaPlanner(_cuda_cfg(64 << 20))
    spec = _spec(2, 2)
    size = cuda_plan.group_bytes(spec)
    a = planner.plan_group("a", spec)
    b = planner.plan_group("b", spec)
    (oa, na), ob = cuda_plan.decode_plan(a), cuda_plan.decode_plan(b)[0]
    assert (oa, na) == (0, size) and ob >= oa + size and ob % 256 == 0
    planner.free_group(a)
    assert cuda_plan.decode_plan(planner.plan_group("c", spec))[0] == 0
    assert planner.restart_all_on_engine_loss and planner.proto_kind == epd_pb2.CUDA
    assert planner.engine_env()["NVSHMEM_DISABLE_CUDA_VMM"] == "1"
    # the engines' hardware queues, from --cuda-max-connections (an MPS pool share)
    assert planner.engine_env()["CUDA_DEVICE_MAX_CONNECTIONS"] == "12"
    # one node: no NVSHMEM host proxy thread (it would spin a core per engine for nothing)
    assert planner.engine_env()["NVSHMEM_DISABLE_LOCAL_ONLY_PROXY"] == "1"


def test_backends_expose_their_kinds() -> None:
    from epd.server.backends.cpu import CpuBackend
    from epd.server.backends.cuda import CudaBackend
    assert (CpuBackend.proto_kind, CpuBackend.peer_class) == (epd_pb2.CPU, "shm")
    assert (CudaBackend.proto_kind, CudaBackend.peer_class) == (epd_pb2.CUDA, "nvlink")
    b = CpuBackend(0)
    with pytest.raises(InvalidArgument, match="MAX_RANKS"):
        b.validate_spec(_spec(cpu_comm_file.MAX_RANKS + 1, 2, num_experts=1024))
    assert issubclass(cpu_plan.CpuPlanner, GroupPlanner)


def test_cuda_peer_table_across_nodes() -> None:
    """Ranks of this node by pointer, ranks of other nodes as 0 with the symmetric address in
    this engine's own heap and their global PE (the NVSHMEM build's peer table, issue 13)."""
    heap, slot, off = 1 << 40, 4096, 1 << 20
    engine_bases = {0: 7 << 40, 1: 9 << 40}  # this node's engines (NVLink peer pointers)
    # 4 ranks: node 1 engines 0 and 1, node 0 engine 1, node 2 engine 0; nodes have 2, 2, 1
    # engines (first PEs 0, 2, 4); this engine is on node 1.
    bases, remote = cuda_plan.peer_table((1, 1, 0, 2), (0, 1, 1, 0), 1, off, slot,
                                         engine_bases, heap, (0, 2, 4))
    assert bases == [(7 << 40) + off, (9 << 40) + off + slot, 0, 0]
    assert remote == {2: (heap + off + 2 * slot, 1), 3: (heap + off + 3 * slot, 4)}
    # one node: no rank_nodes, every rank by pointer, nothing remote
    bases, remote = cuda_plan.peer_table((), (0, 1), 0, off, slot, engine_bases, heap, ())
    assert bases == [(7 << 40) + off, (9 << 40) + off + slot] and remote == {}


def test_cuda_groups_of_a_multi_node_world_hold_the_put_staging() -> None:
    """A world over several nodes sizes every low-latency group with the staging of puts
    (send_x, send_scales, send_y), planner and engines alike; one node does not pay for it."""
    spec = _spec(2, 8, num_experts=64, low_latency_mode=True, hidden=2048)
    one = cuda_plan.membership_layout(spec).low_latency
    many = cuda_plan.membership_layout(spec, remote=True).low_latency
    assert "send_y" not in one.offsets
    rows = one.num_local_experts * one.num_ranks * one.max_tokens
    assert many.offsets["send_y"] >= many.offsets["send_x"] + one.max_tokens * 2048 * 2
    assert many.end - one.end >= rows * 2048 * 2  # at least one more bf16 receive buffer
    cfg = _cuda_cfg(1 << 34)
    planner = cuda_plan.CudaPlanner(SimpleNamespace(**vars(cfg), num_nodes=2, cuda_cluster=True))
    _, size = cuda_plan.decode_plan(planner.plan_group("g", spec))
    assert size == cuda_plan.group_bytes(spec, remote=True) > cuda_plan.group_bytes(spec)


def test_cuda_normal_mode_of_a_multi_node_world_holds_its_put_staging() -> None:
    """Normal mode across nodes stages what goes to another node in the sender's own buffer
    (`net_send`): a dispatch's rows and FP8 scales, or a combine's rows and weights for every
    row it received; only in a world over several nodes, and not for a low-latency-only group."""
    spec = _spec(4, 8, num_experts=64, hidden=7168)
    one = cuda_plan.membership_layout(spec).kernel
    many = cuda_plan.membership_layout(spec, remote=True).kernel
    assert "net_send" not in one.offsets
    net = many.total_bytes - many.offsets["net_send"]
    t, h, k = spec.max_tokens_per_rank, 7168, 8
    assert net >= t * (h * 2 + h // 128 * 4)  # the dispatch: rows, then scales
    assert net >= 4 * t * (h * 2 + k * 4)  # the combine: every received row and its weights
    assert many.offsets["net_send"] >= one.total_bytes - 16  # after every other buffer
    ll16 = _spec(16, 8, num_experts=256, low_latency_mode=True, hidden=7168)
    assert "net_send" not in cuda_plan.membership_layout(ll16, remote=True).kernel.offsets


def test_cuda_low_latency_groups_may_have_more_ranks_than_normal_mode() -> None:
    """Low-latency groups up to LL_MAX_RANKS (EP across nodes), with no normal-mode buffers
    beyond 8 ranks; normal-mode groups stay at MAX_RANKS; the expert count is bounded."""
    from epd.proto import abi
    planner = cuda_plan.CudaPlanner(_cuda_cfg(1 << 36))
    ll16 = _spec(16, 8, num_experts=256, low_latency_mode=True, hidden=7168)
    planner.validate_spec(ll16)
    ml = cuda_plan.membership_layout(ll16)
    assert ml.kernel.max_recv == 0 and ml.low_latency.num_ranks == 16
    assert ml.kernel.offsets["recv_x"] == abi.CTRL_PAYLOAD_BYTES  # the control block alone
    planner.validate_spec(_spec(abi.LL_MAX_RANKS, 8, num_experts=abi.LL_MAX_RANKS * 2,
                                low_latency_mode=True))
    with pytest.raises(InvalidArgument, match="LL_MAX_RANKS"):
        planner.validate_spec(_spec(abi.LL_MAX_RANKS + 1, 8, num_experts=(abi.LL_MAX_RANKS + 1)
                                    * 2, low_latency_mode=True))
    with pytest.raises(InvalidArgument, match="LL_MAX_EXPERTS"):
        planner.validate_spec(_spec(64, 8, num_experts=64 * 256, low_latency_mode=True))
    with pytest.raises(InvalidArgument, match="MAX_RANKS"):
        planner.validate_spec(_spec(16, 8, num_experts=256))  # normal mode


def test_a_failed_launch_aborts_the_group_an_epd_error_does_not() -> None:
    """A CudaRankComm launch that fails with a CUDA error (INVALID_VALUE at a launch was seen on
    the H200) aborts the group, naming the rank and the error, so that peers stop at once; an
    EpdError (bad input, refused call) is the caller's and aborts nothing; a failing abort
    does not hide the original error."""
    import contextlib

    from epd.server.backends import cuda as cb

    class Comm:
        rank = 3
        spec = SimpleNamespace(name="g")
        backend = SimpleNamespace(closer=SimpleNamespace(launching=contextlib.nullcontext))

        def __init__(self, abort_fails: bool = False) -> None:
            self.aborted: list[str] = []
            self.abort_fails = abort_fails

        def abort(self, why: str) -> None:
            self.aborted.append(why)
            if self.abort_fails:
                raise RuntimeError("context is broken")

        @cb._launches
        def stream_dispatch(self, fail: str) -> int:
            if fail == "cuda":
                raise RuntimeError("CUDA_ERROR_INVALID_VALUE: invalid argument")
            if fail == "input":
                raise InvalidArgument("an expert id out of range")
            return 7

    c = Comm()
    assert c.stream_dispatch("") == 7 and c.aborted == []
    with pytest.raises(InvalidArgument):
        c.stream_dispatch("input")
    assert c.aborted == []
    with pytest.raises(RuntimeError, match="INVALID_VALUE"):
        c.stream_dispatch("cuda")
    assert c.aborted == ["rank 3: stream_dispatch failed in the engine "
                         "(CUDA_ERROR_INVALID_VALUE: invalid argument)"]
    c = Comm(abort_fails=True)
    with pytest.raises(RuntimeError, match="INVALID_VALUE"):
        c.stream_dispatch("cuda")


# -- two-stage hierarchical normal mode (cuda_stages.py): sizes and placement, no GPU ---------

def _cluster_planner(mode: str = "stages") -> cuda_plan.CudaPlanner:
    return cuda_plan.CudaPlanner(SimpleNamespace(**vars(_cuda_cfg(1 << 36)), num_nodes=2,
                                                 cuda_cluster=True, cuda_hierarchical=mode))


def test_two_stage_group_holds_a_rail_and_a_node_slot_per_rank() -> None:
    """2 nodes x 2 ranks: the rail stage is a flat group of 2 ranks (one per node) holding
    E / 2 experts each with T tokens per rank and puts to other nodes; the node stage a flat
    group of the node's 2 ranks with E / 2 experts and up to N x T tokens, by pointer; the
    whole group's slot holds notify alone (no receive buffers); the node slot ends with a
    forwarder's partials (N x T rows)."""
    from epd.server.backends.base import Hierarchy
    spec = _spec(4, 8, num_experts=64, hidden=7168, max_tokens_per_rank=512)
    h = Hierarchy(2, 2)
    lays = cuda_plan.stage_layouts(spec, h)
    assert (lays.rail.num_ranks, lays.rail.num_local_experts, lays.rail.max_recv) == (2, 32, 1024)
    assert "net_send" in lays.rail.offsets and "net_send" not in lays.node.offsets
    assert (lays.node.num_ranks, lays.node.num_local_experts, lays.node.max_recv) == (2, 16, 2048)
    flat = cuda_plan.membership_layout(spec, remote=True, two_stage=True)
    full = cuda_plan.membership_layout(spec, remote=True)
    assert flat.kernel.notify_only and flat.kernel.max_recv == full.kernel.max_recv
    assert flat.slot_bytes < full.slot_bytes - 4 * 512 * 7168 * 2  # no receive rows
    assert lays.flat_bytes == 4 * flat.slot_bytes
    assert lays.partial_x >= lays.node.total_bytes
    assert lays.partial_w - lays.partial_x >= 2 * 512 * 7168 * 2
    assert lays.node_bytes - lays.partial_w >= 2 * 512 * 8 * 4
    # every rank's slots, in order, none overlapping
    spans = sorted([(0, lays.flat_bytes)]
                   + [(lays.rail_at(r), lays.rail_at(r) + lays.rail.total_bytes)
                      for r in range(4)]
                   + [(lays.node_at(r), lays.node_at(r) + lays.node_bytes) for r in range(4)])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == lays.total_bytes == cuda_plan.group_bytes(spec, hierarchy=h)


@pytest.mark.parametrize(("rank_nodes", "mode", "two_stage"), [
    ((0, 0, 1, 1), "stages", True),
    ((3, 5), "stages", True),              # nodes need not be 0..N-1
    ((0, 1, 0, 1), "stages", False),       # not node-major: flat semantics, direct puts
    ((0, 0, 0, 1), "stages", False),       # not the same number of ranks per node
    ((0, 0, 0, 0), "stages", False),       # one node
    ((0, 0, 1, 1), "direct", False),       # --cuda-hierarchical direct
    ((0, 0, 1, 1), "auto", False),         # the default: direct up to 8 ranks
])
def test_the_planner_sizes_a_group_by_its_placement(rank_nodes, mode, two_stage) -> None:
    """The planner and the engines decide alike (two_stage_hierarchy) from the ranks' nodes,
    which the coordinator passes at forming; a two-stage group's range holds its stage
    slots, any other the flat slots with the staging of puts."""
    spec = _spec(len(rank_nodes), 4)
    planner = _cluster_planner(mode)
    _, size = cuda_plan.decode_plan(planner.plan_group("g", spec, rank_nodes))
    h = cuda_plan.two_stage_hierarchy(spec, rank_nodes, mode, True)
    assert (h is not None) == two_stage
    assert size == cuda_plan.group_bytes(spec, remote=True, hierarchy=h)
    # one node's world never runs stages, whatever the placement says
    assert cuda_plan.two_stage_hierarchy(spec, rank_nodes, mode, False) is None


@pytest.mark.parametrize(("rank_nodes", "hierarchy"), [
    ((0,) * 8 + (1,) * 8, (2, 8)),
    (tuple(n for n in range(4) for _ in range(4)), (4, 4)),
    (tuple(n for n in range(8) for _ in range(8)), (8, 8)),   # LL_MAX_RANKS
    (tuple(range(16)), None),                                 # a rail of 16 nodes
    ((0,) * 9 + (1,) * 9, None),                              # a node of 9 ranks
    ((0, 1) * 8, None),                                       # not node-major
])
@pytest.mark.parametrize("mode", ["stages", "auto"])
def test_a_group_beyond_max_ranks_runs_normal_mode_in_two_stages(rank_nodes, hierarchy,
                                                                 mode) -> None:
    """More than MAX_RANKS ranks (--cuda-hierarchical stages, or auto, the default): normal
    mode runs in two stages when both stage groups are within the flat kernels' limit (at
    most 8 nodes of at most 8 ranks), its whole-group
    notify in a notify-only slot for epd_wide_notify (its own flags and a payload per source
    of R + 4 + L words); any other placement of a normal-mode group is refused when it forms,
    naming the nodes, and a low-latency group keeps its low-latency-only slots."""
    from epd.proto import abi
    from epd.server.config import Config
    r = len(rank_nodes)
    spec = _spec(r, 4, num_experts=4 * r)
    assert Config.cuda_hierarchical == "auto"  # (the default runs every group it can)
    h = cuda_plan.two_stage_hierarchy(spec, rank_nodes, mode, True)
    assert (h and (h.num_nodes, h.per_node)) == hierarchy
    planner = _cluster_planner(mode)
    planner.validate_spec(spec)  # (placement is known only when the ranks join)
    ll = _spec(r, 4, num_experts=4 * r, low_latency_mode=True)
    if hierarchy is None:
        with pytest.raises(InvalidArgument, match=r"MAX_RANKS.*nodes \["):
            planner.plan_group("g", spec, rank_nodes)
        _, size = cuda_plan.decode_plan(planner.plan_group("l", ll, rank_nodes))
        assert size == cuda_plan.group_bytes(ll, remote=True)
        assert cuda_plan.membership_layout(ll, remote=True).kernel.max_recv == 0
        return
    flat = cuda_plan.membership_layout(spec, remote=True, two_stage=True).kernel
    assert flat.notify_only and flat.max_recv == r * spec.max_tokens_per_rank
    assert flat.offsets["recv_x"] >= abi.WIDE_PAYLOAD_BYTES + r * (r + 1 + 4) * 4
    assert abi.WIDE_NOTIFY_FLAG * 8 + abi.LL_MAX_RANKS * 8 == abi.WIDE_PAYLOAD_BYTES
    _, size = cuda_plan.decode_plan(planner.plan_group("g", spec, rank_nodes))
    assert size == cuda_plan.group_bytes(spec, remote=True, hierarchy=h)
    lays = cuda_plan.stage_layouts(spec, h)
    assert (lays.rail.num_ranks, lays.node.num_ranks) == hierarchy
    # a low-latency group of as many ranks: the stages (and its low-latency slots) only when
    # asked for; auto keeps its low-latency-only slots (stage slots would cost every engine)
    got = cuda_plan.two_stage_hierarchy(ll, rank_nodes, mode, True)
    assert (got is None) == (mode == "auto")
    both = cuda_plan.membership_layout(ll, remote=True, two_stage=True)
    assert both.kernel.notify_only and both.low_latency.num_ranks == r
    assert both.kernel.offsets["recv_x"] == flat.offsets["recv_x"]
    # one node (or --cuda-hierarchical direct): 8 ranks at most, named at validation
    for p in (cuda_plan.CudaPlanner(_cuda_cfg(1 << 36)), _cluster_planner("direct")):
        with pytest.raises(InvalidArgument, match="MAX_RANKS"):
            p.validate_spec(spec)


def test_the_coordinator_plans_with_the_ranks_nodes(tmp_path) -> None:
    """Forming passes each rank's node (where its session's engine is) to the planner."""
    seen = []

    class _Recording(cpu_plan.CpuPlanner):
        def plan_group(self, group_id, spec, rank_nodes=()) -> bytes:
            seen.append(tuple(rank_nodes))
            return super().plan_group(group_id, spec, rank_nodes)

    coord = Coordinator(_Recording(str(tmp_path)))
    spec = _proto(2, 2)

    async def both():
        async def one(rank: int, node: int):
            return await coord.rendezvous(epd_pb2.RendezvousRequest(
                spec=spec, rank=rank, engine_index=0, session_id=f"s{rank}",
                timeout_seconds=5, peer_uid=os.getuid(), peer_gid=os.getgid(),
                has_peer=True), node=node)
        return await asyncio.gather(one(0, 0), one(1, 1))
    resps = asyncio.run(both())
    assert seen == [(0, 1)] and list(resps[0].rank_nodes) == [0, 1]
    for r in range(2):
        coord.release(resps[0].group_id, r, "")


@pytest.mark.parametrize(("rank_nodes", "formed"), [
    ((0,) * 8 + (1,) * 8, True),   # node-major: two stages
    ((0, 1) * 8, False),           # not node-major: no way to run it
])
def test_a_sixteen_rank_normal_group_forms_by_its_placement(rank_nodes, formed) -> None:
    """Through the coordinator of a world over two nodes (default --cuda-hierarchical auto):
    a 16-rank normal-mode group placed node-major forms (in two stages); placed otherwise,
    every rank learns at once that it cannot, with INVALID_ARGUMENT naming the nodes and the
    limit, and nothing is left behind."""
    coord = Coordinator(_cluster_planner("auto"))
    spec = _proto(16, 4)

    async def every_rank():
        async def one(rank: int):
            try:
                return await coord.rendezvous(epd_pb2.RendezvousRequest(
                    spec=spec, rank=rank, engine_index=0, session_id=f"s{rank}",
                    timeout_seconds=5, peer_uid=os.getuid(), peer_gid=os.getgid(),
                    has_peer=True), node=rank_nodes[rank])
            except EpdError as e:
                return e
        loop = asyncio.get_running_loop()
        start = loop.time()
        out = await asyncio.gather(*(one(r) for r in range(16)))
        return out, loop.time() - start

    results, took = asyncio.run(every_rank())
    assert took < 2.0
    if formed:
        assert all(list(r.rank_nodes) == list(rank_nodes) for r in results), results[0]
        for r in range(16):
            coord.release(results[0].group_id, r, "")
    else:
        for r in results:
            assert isinstance(r, EpdError) and r.code == grpc.StatusCode.INVALID_ARGUMENT, r
            assert "MAX_RANKS" in r.message and "nodes [0, 1, 0, 1" in r.message, r.message
    assert not coord.by_name and not coord.by_id


def test_stage_peers_name_each_stage_rank_where_it_is() -> None:
    """2 nodes x 2 ranks, this engine on node 1: rank 3's rail is group ranks [1, 3] (rank 1
    on node 0, by NVSHMEM: its slot's symmetric address and PE), its node stage [2, 3] (by
    pointer into their engines' heaps)."""
    from epd.server.backends.cuda_stages import Placement
    heap, off, slot = 1 << 40, 1 << 20, 4096
    place = Placement((0, 0, 1, 1), (0, 1, 0, 1), 1, {0: 7 << 40, 1: 9 << 40}, heap, (0, 2))
    bases, remote = place.peers([1, 3], off, slot)
    assert bases == [0, (9 << 40) + off + 3 * slot]
    assert remote == {0: (heap + off + slot, 1)}  # node 0's engine 1 is PE 1
    bases, remote = place.peers([2, 3], off, slot)
    assert bases == [(7 << 40) + off + 2 * slot, (9 << 40) + off + 3 * slot] and not remote


def _request(spec: epd_pb2.GroupSpec, rank: int, *, engine: int = 0, uid: int | None = None,
             timeout: float = 20.0) -> epd_pb2.RendezvousRequest:
    return epd_pb2.RendezvousRequest(
        spec=spec, rank=rank, engine_index=engine, session_id=f"s{rank}",
        timeout_seconds=timeout, peer_uid=os.getuid() if uid is None else uid,
        peer_gid=os.getgid(), has_peer=True)


def test_an_engine_lost_while_its_group_forms_fails_the_waiting_ranks_at_once(tmp_path) -> None:
    """Ranks 0 (engine 0) and 1 (engine 1) wait for rank 2; engine 0 exits: rank 1 learns it
    now, naming the engine, instead of at its 20 s deadline naming rank 0 as one that "did not
    join"; the name forms afresh after."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))
    spec = _proto(4, 2, name="forming")  # (ranks 0 and 1 wait; 2 and 3 come later)

    async def run():
        waiting = [asyncio.ensure_future(coord.rendezvous(_request(spec, r, engine=r)))
                   for r in range(2)]
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        coord.engine_lost(0)
        got = await asyncio.gather(*waiting, return_exceptions=True)
        return got, loop.time() - t0
    got, took = asyncio.run(run())
    assert took < 2.0
    for r in got:
        assert isinstance(r, EpdError) and r.code == grpc.StatusCode.FAILED_PRECONDITION, r
        assert "aborted while forming" in r.message and "engine 0" in r.message
    results, _ = asyncio.run(_all_ranks(coord, spec))
    assert all(isinstance(r, epd_pb2.RendezvousResponse) for r in results), results


def test_another_tenants_join_cannot_fail_a_forming_group(tmp_path) -> None:
    """A join of another uid that names a forming group with another spec does not reach it
    (it waits in its own namespace) and changes nothing: the owner's group still forms."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))
    spec = _proto(2, 2, name="train")
    other = _proto(2, 2, name="train", hidden=2048)

    async def run():
        rank0 = asyncio.ensure_future(coord.rendezvous(_request(spec, 0)))
        await asyncio.sleep(0.05)
        with pytest.raises(EpdError) as ei:
            await coord.rendezvous(_request(other, 1, uid=os.getuid() + 4242, timeout=0.3))
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
        rank1 = await coord.rendezvous(_request(spec, 1))
        return await rank0, rank1
    r0, r1 = asyncio.run(run())
    assert r0.group_id == r1.group_id and r0.plan


@pytest.mark.parametrize("shrink", [False, True])
def test_a_rank_cancelled_once_its_group_formed_is_released(tmp_path, shrink: bool) -> None:
    """The last rank's arrival forms the group; a rank whose join is cancelled then (its client
    went away before its engine learned the group's id) is released by the coordinator, which
    aborts the group: the other rank learns it at once, and the group and its plan go (nothing
    else would free them)."""
    waiting: list[asyncio.Task] = []

    class _CancelsRank0(cpu_plan.CpuPlanner):  # (its client goes as the group forms)
        def plan_group(self, group_id, spec, rank_nodes=()) -> bytes:
            waiting[0].cancel()
            return super().plan_group(group_id, spec, rank_nodes)
    coord = Coordinator(_CancelsRank0(str(tmp_path)))
    spec = _proto(2, 2, name="cancelled")
    spec.shrink = spec.low_latency_mode = shrink  # (a shrink group masks a rank that goes
    # once it runs; before every rank attached it cannot start without it)

    async def run():
        waiting.append(asyncio.ensure_future(coord.rendezvous(_request(spec, 0))))
        await asyncio.sleep(0.05)
        with pytest.raises(EpdError) as ei:
            await coord.rendezvous(_request(spec, 1))  # forms it
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
        assert "rank 0 went away" in ei.value.message
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
    asyncio.run(run())
    assert not coord.by_id and not coord.by_name


@pytest.mark.parametrize("how", ["engine_lost", "node_lost", "attach failed"])
def test_a_shrink_groups_rank_lost_before_the_attach_barrier_aborts_it(tmp_path,
                                                                        how: str) -> None:
    """A shrink group masks a rank that goes away once it runs; one lost after it formed but
    before every rank attached (its engine exits, its node's lease ends, its attach fails)
    aborts it: the rank waiting at the attach barrier learns it at once, naming why, instead
    of waiting out its deadline to be told rank 1 "did not attach". Once all attached, a
    rank that goes is masked and the others go on."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))
    spec = _proto(2, 2, name=f"shrinking-{how.replace(' ', '-')}")
    spec.shrink = spec.low_latency_mode = True

    def barrier(rank: int, gid: str) -> epd_pb2.RendezvousRequest:
        req = _request(spec, rank, engine=rank)
        req.attached, req.group_id = True, gid
        return req

    async def run():
        formed = await asyncio.gather(*(coord.rendezvous(_request(spec, r, engine=r))
                                        for r in range(2)))
        gid = formed[0].group_id
        rank0 = asyncio.ensure_future(coord.rendezvous(barrier(0, gid)))
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if how == "engine_lost":
            coord.engine_lost(1)
        elif how == "node_lost":
            coord.by_id[gid].nodes[1] = 1  # (rank 1 on node 1)
            coord.node_lost(1, "its lease ended")
        else:
            coord.release(gid, 1, "attach failed: OSError()")
        with pytest.raises(EpdError) as ei:
            await rank0
        assert loop.time() - t0 < 2.0
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
        assert "aborted while forming" in ei.value.message
        coord.release(gid, 0, "")
        assert gid not in coord.by_id

        # all attached: a rank that goes is masked, the group stays for the other
        spec.name = spec.name + "-running"
        formed = await asyncio.gather(*(coord.rendezvous(_request(spec, r, engine=r))
                                        for r in range(2)))
        gid = formed[0].group_id
        await asyncio.gather(*(coord.rendezvous(barrier(r, gid)) for r in range(2)))
        coord.engine_lost(1)
        g = coord.by_id[gid]
        assert g.aborted is None and g.released == {1}
        coord.release(gid, 0, "")
    asyncio.run(run())
    assert not coord.by_id and not coord.by_name


def test_only_the_session_holding_a_rank_attaches_or_another_node_releases_it(tmp_path) -> None:
    """The attach barrier counts a rank only from the session that joined it, on its engine and
    node: an attach naming another rank (or one out of range) is PERMISSION_DENIED and opens
    nothing (it would let the group start before that rank's control blocks are clean). A
    release forwarded by another node for a rank it does not hold is ignored."""
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)))
    spec = _proto(2, 2, name="attach-owners")

    def barrier(rank: int, gid: str, *, engine: int | None = None,
                session: str | None = None) -> epd_pb2.RendezvousRequest:
        req = _request(spec, rank, engine=rank if engine is None else engine)
        req.attached, req.group_id = True, gid
        if session is not None:
            req.session_id = session
        return req

    async def run():
        formed = await asyncio.gather(*(coord.rendezvous(_request(spec, r, engine=r))
                                        for r in range(2)))
        gid = formed[0].group_id
        g = coord.by_id[gid]
        for bad, node in ((barrier(1, gid, session="s0"), 0), (barrier(1, gid, engine=0), 0),
                          (barrier(5, gid), 0), (barrier(1, gid), 1)):
            with pytest.raises(EpdError) as ei:
                await coord.rendezvous(bad, node=node)
            assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED, ei.value
            assert "is not held by session" in ei.value.message
        assert not g.attached and not g.all_attached.is_set()
        coord.release(gid, 1, "evil", node=1)  # (rank 1 lives on node 0)
        coord.release(gid, 7, "evil", node=0)
        assert g.aborted is None and not g.released
        await asyncio.gather(*(coord.rendezvous(barrier(r, gid)) for r in range(2)))
        assert g.all_attached.is_set() and g.aborted is None
        for r in range(2):
            coord.release(gid, r, "", node=0)
    asyncio.run(run())
    assert not coord.by_id and not coord.by_name


@pytest.mark.parametrize("routing", ["is_token_in_rank", "topk_idx"])
def test_routing_changed_by_the_client_during_a_dispatch_changes_nothing(routing) -> None:
    """The cpu backend copies a rank's routing into its slot (what its peers read) and waits
    for them; the client's memory may change meanwhile. The handle takes the slot's copy, as
    the counts did: the call's combine is exact for the routing the call sent and the group
    keeps working (the live memory's routing made combine fail INTERNAL, leave the rank's
    arrival word short and time the peer's next collective out; or add wrong rows)."""
    import threading
    import time

    from epd.server.backends.base import CombineArgs, DispatchArgs, Membership
    from epd.server.backends.cpu import CpuBackend
    from epd.server.backends.cpu_memory import ShmCounterPage

    b = CpuBackend()
    spec = GroupSpec("toctou", 2, 2, 128, 8, 1, epd_pb2.FLOAT32)
    plan = b.planner.plan_group("gtoctou", spec)
    comms = [b.attach(spec, Membership("gtoctou", r, (0, 0), plan)) for r in range(2)]
    pages = [ShmCounterPage() for _ in range(2)]
    t = 4
    xs = [np.full((t, 128), r + 1, np.float32) for r in range(2)]
    in_rank = [np.zeros((t, 2), bool) for _ in range(2)]  # every token to its own rank
    in_rank[0][:, 0] = in_rank[1][:, 1] = True
    per_expert = [np.array([t, 0], np.int32), np.array([0, t], np.int32)]
    idx = [np.full((t, 1), r, np.int64) for r in range(2)]
    w = [np.ones((t, 1), np.float32) for _ in range(2)]

    def args(r: int) -> DispatchArgs:
        if routing == "is_token_in_rank":
            return DispatchArgs(xs[r], None, None, None, 1, 0, None, in_rank[r], per_expert[r])
        return DispatchArgs(xs[r], None, idx[r], w[r], 1, 0, None)
    try:
        for seq in (1, 2):  # (the second round: the group still works)
            res: dict[int, object] = {}

            def dispatch(r: int, seq: int = seq, res: dict = res) -> None:
                try:
                    res[r] = comms[r].dispatch(args(r), pages[r].slot(0), seq,
                                               time.monotonic() + 5)
                except Exception as e:  # (reported below)
                    res[r] = e
            first = threading.Thread(target=dispatch, args=(0,))
            first.start()
            time.sleep(0.3)  # rank 0 has written its slot and waits for rank 1
            original = (in_rank[0].copy(), idx[0].copy())
            in_rank[0][:, 1] = True  # the client rewrites its routing meanwhile
            idx[0][:] = 1  # (expert 1: rank 1's)
            dispatch(1)
            first.join(10)
            in_rank[0][:], idx[0][:] = original
            out: dict[int, object] = {}

            def combine(r: int, res: dict = res, out: dict = out) -> None:
                try:
                    d = res[r]
                    y = np.full((d.num_recv_tokens, 128), 10 * (r + 1), np.float32)
                    wts = None if routing == "is_token_in_rank" else d.recv_topk_weights
                    out[r] = comms[r].combine(CombineArgs(y, d.handle, wts, None, None),
                                              time.monotonic() + 5)
                except Exception as e:
                    out[r] = e
            threads = [threading.Thread(target=combine, args=(r,)) for r in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(10)
            for r in range(2):
                assert not isinstance(res[r], Exception), res[r]
                assert res[r].num_recv_tokens == t  # its own tokens only, as sent
                assert not isinstance(out[r], Exception), out[r]
                # every token went to its own rank, whose expert output is 10 * (rank + 1)
                np.testing.assert_array_equal(out[r].combined_x, np.full((t, 128), 10 * (r + 1)))
    finally:
        for c in comms:
            c.close()
        for p in pages:
            p.close()
        b.planner.free_group(plan)


def test_a_taken_rank_names_its_session_only_to_its_own_uid(tmp_path) -> None:
    """In a shared pool's namespace, "rank 0 is already taken (by session ...)" named the
    holder's session id to a member of another uid (a session id is half of what a request
    of another tenant would need); the holder's own uid still learns which of its sessions."""
    holder, member = 4000, 4001
    coord = Coordinator(cpu_plan.CpuPlanner(str(tmp_path)),
                        allow_uids=frozenset({holder, member}))
    spec = _proto(2, 2, name="pool")

    def req(uid: int, sid: str) -> epd_pb2.RendezvousRequest:
        return epd_pb2.RendezvousRequest(spec=spec, rank=0, engine_index=0, session_id=sid,
                                         timeout_seconds=0.5, peer_uid=uid, peer_gid=uid,
                                         has_peer=True)

    async def run():
        first = asyncio.ensure_future(coord.rendezvous(req(holder, "held-session")))
        await asyncio.sleep(0.05)
        errors = []
        for uid in (member, holder):
            with pytest.raises(EpdError) as ei:
                await coord.rendezvous(req(uid, "second"))
            errors.append(ei.value)
        with pytest.raises(EpdError):  # (rank 1 never came)
            await first
        return errors
    other, own = asyncio.run(run())
    for e in (other, own):
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "already taken" in e.message
    assert "held-session" not in other.message and "another uid" in other.message
    assert "held-session" in own.message
