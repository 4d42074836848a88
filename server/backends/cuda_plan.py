"""The CUDA backend's node side, without a GPU: the one buffer layout of a group-rank's heap
slot (used by the engines, the kernel tests and the benchmarks), the limits a group spec must
satisfy, and the supervisor's planner (heap ranges from a first-fit allocator, NVSHMEM world).

Importable without CuPy: everything here is sizes and offsets.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...proto import abi
from ...proto.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from ...proto.v1 import epd_pb2
from ..engine_slots import world_is_latency
from .base import GroupPlanner, GroupSpec, Hierarchy
from .cuda_kernels import LowLatencyLayout, RankBufferLayout


def hierarchical_mode(cfg: Any) -> str:
    """How a normal-mode group placed node-major over several nodes moves its rows
    (--cuda-hierarchical of `cfg`; Config's default for a namespace without it, as tests pass):
    "stages", DeepEP's traffic, a token once per destination node to the rank with the same
    local index, then forwarded inside the node (cuda_stages.py); "direct", a put to every
    destination rank (the intranode kernels' NVSHMEM build), up to MAX_RANKS ranks; "auto",
    direct up to MAX_RANKS ranks and stages beyond (`stages_possible`); the same results. The
    planner and the engines read it alike."""
    from ..config import Config

    return getattr(cfg, "cuda_hierarchical", Config.cuda_hierarchical)


@dataclass(frozen=True)
class MembershipLayout:
    kernel: RankBufferLayout
    extras: dict[str, int]  # byte offsets after the kernel buffers
    slot_bytes: int
    low_latency: LowLatencyLayout | None = None  # groups with low_latency_mode


def membership_layout(spec: GroupSpec, *, remote: bool = False,
                      two_stage: bool = False) -> MembershipLayout:
    """THE per-rank heap slot of a group: the kernels' buffers (recv_x sized for the group's
    dtype, which FP8 payloads fit; scales whenever FP8 dispatch is possible), then the outputs
    the engine hands back (layout results, combine results, the prefix matrix), then the
    low-latency buffers of groups that ask; `remote` (a world over several nodes): with the
    staging of puts to other nodes, normal mode's and low latency's; `two_stage`: normal
    mode's rows move in the stage slots (`stage_layouts`), this slot holds the whole group's
    notify alone. Raises ValueError naming a kernel limit."""
    item = spec.x_numpy_dtype.itemsize
    kernel = RankBufferLayout.build(
        num_ranks=spec.num_ranks, num_experts=spec.num_experts, hidden=spec.hidden,
        num_topk=spec.num_topk, max_tokens_per_rank=spec.max_tokens_per_rank, x_itemsize=item,
        y_itemsize=item, with_scales=spec.hidden % abi.FP8_BLOCK == 0,
        low_latency_only=(spec.low_latency_mode and spec.num_ranks > abi.MAX_RANKS
                          and not two_stage),
        remote=remote and not two_stage, notify_only=two_stage)
    t, h, k, r, e = (spec.max_tokens_per_rank, spec.hidden, spec.num_topk, spec.num_ranks,
                     spec.num_experts)
    off = kernel.total_bytes
    extras = {}
    for name, nbytes in (("combined_x", t * h * item), ("combined_w", t * k * 4),
                         ("ntpr", r * 4), ("ntpe", e * 4), ("itr", t * r),
                         ("prefix", r * r * 4)):
        extras[name] = off
        off += -(-max(nbytes, 16) // abi.ALIGN) * abi.ALIGN
    if not spec.low_latency_mode:
        return MembershipLayout(kernel, extras, off)
    ll = LowLatencyLayout.build(off, num_ranks=r, num_local_experts=spec.num_local_experts,
                                hidden=h, num_topk=k, max_tokens=t, itemsize=item,
                                remote=remote)
    return MembershipLayout(kernel, extras, ll.end, ll)


@dataclass(frozen=True)
class StageLayouts:
    """The two stage groups of a two-stage hierarchical group (N nodes x L ranks, node-major):
    every rank has a rail slot (a flat group of the N ranks with its local index, one per node,
    rank b holding node b's E / N experts; T tokens per rank; puts to other nodes) and a node
    slot (a flat group of its node's L ranks holding E / N experts; up to N x T tokens per
    rank, what a forwarder received; by pointer), placed after the group's flat slots: rank
    r's at `rail_at(r)` and `node_at(r)` from the group's heap offset. The node slot ends with
    a forwarder's combine partials (`partial_x`, `partial_w`: N x T rows)."""

    hierarchy: Hierarchy
    rail: RankBufferLayout
    node: RankBufferLayout
    flat_bytes: int   # the group's flat slots, before the stage slots
    rail_bytes: int
    node_bytes: int
    partial_x: int    # offsets in the node slot
    partial_w: int

    def rail_at(self, rank: int) -> int:
        return self.flat_bytes + rank * self.rail_bytes

    def node_at(self, rank: int) -> int:
        return self.flat_bytes + self.hierarchy.num_ranks * self.rail_bytes \
            + rank * self.node_bytes

    @property
    def total_bytes(self) -> int:
        return self.node_at(self.hierarchy.num_ranks)


def stage_layouts(spec: GroupSpec, hierarchy: Hierarchy) -> StageLayouts:
    item = spec.x_numpy_dtype.itemsize
    n, t, h, k = hierarchy.num_nodes, spec.max_tokens_per_rank, spec.hidden, spec.num_topk
    common = {"hidden": h, "num_topk": k, "x_itemsize": item, "y_itemsize": item,
              "with_scales": h % abi.FP8_BLOCK == 0}
    rail = RankBufferLayout.build(num_ranks=n, num_experts=spec.num_experts,
                                  max_tokens_per_rank=t, remote=True, **common)
    node = RankBufferLayout.build(num_ranks=hierarchy.per_node,
                                  num_experts=spec.num_experts // n,
                                  max_tokens_per_rank=n * t, **common)

    def aligned(nbytes: int) -> int:
        return -(-max(nbytes, 16) // abi.ALIGN) * abi.ALIGN
    partial_x = node.total_bytes
    partial_w = partial_x + aligned(n * t * h * item)
    node_bytes = partial_w + aligned(n * t * k * 4)
    flat = membership_layout(spec, remote=True, two_stage=True).slot_bytes * spec.num_ranks
    return StageLayouts(hierarchy, rail, node, flat, aligned(rail.total_bytes), node_bytes,
                        partial_x, partial_w)


def two_stage_hierarchy(spec: GroupSpec, rank_nodes: tuple[int, ...] | list[int],
                        mode: str, multi_node: bool) -> Hierarchy | None:
    """The hierarchy of a group that runs normal mode in two stages: in a world over several
    nodes, with --cuda-hierarchical stages (auto: beyond MAX_RANKS ranks), a group placed
    node-major (`Hierarchy.of`) whose
    stage groups are within the flat kernels' limit: at most MAX_RANKS nodes (a rail) of at
    most MAX_RANKS ranks (a node). Up to MAX_RANKS ranks the whole-group notify is the flat
    one, beyond it epd_wide_notify (up to LL_MAX_RANKS). Planner and engines decide alike."""
    if not multi_node or not rank_nodes or not stages_possible(spec, mode):
        return None
    h = Hierarchy.of(rank_nodes)
    if h is None or h.num_nodes > abi.MAX_RANKS or h.per_node > abi.MAX_RANKS:
        return None
    return h


def needs_stages(spec: GroupSpec) -> bool:
    """A normal-mode group of more than MAX_RANKS ranks: it runs only in two stages (a
    low-latency group of as many ranks keeps its low-latency-only slots)."""
    return not spec.low_latency_mode and spec.num_ranks > abi.MAX_RANKS


def stages_possible(spec: GroupSpec, mode: str) -> bool:
    """Whether --cuda-hierarchical `mode` runs the group's normal mode in two stages where its
    placement allows. stages: always. direct: never. auto: a normal-mode group of more than
    MAX_RANKS ranks, which direct puts cannot run; not a low-latency group, which keeps its
    low-latency-only slots (the stage slots of every rank are in every engine's heap: at
    8 x 8 ranks many GiB that a decode group would hold for calls it does not make)."""
    return mode == "stages" or (mode == "auto" and needs_stages(spec))


def wide_normal_mode_error(spec: GroupSpec, rank_nodes: Sequence[int] = ()) -> InvalidArgument:
    """The refusal of a normal-mode group of more than MAX_RANKS ranks that cannot run in two
    stages (where its ranks are says why)."""
    where = (f"its ranks are on nodes {list(rank_nodes)}" if rank_nodes
             else "this daemon's world is on one node or in --cuda-hierarchical direct")
    return InvalidArgument(
        f"group {spec.name!r} has {spec.num_ranks} ranks: normal mode on the cuda engine takes "
        f"at most {abi.MAX_RANKS} ranks (MAX_RANKS), or up to {abi.MAX_RANKS} nodes x "
        f"{abi.MAX_RANKS} ranks in two stages (a world over several nodes with "
        f"--cuda-hierarchical auto or stages, the group placed node-major with as many ranks "
        f"on every node); {where}. A "
        f"low-latency group (low_latency_mode) may have up to {abi.LL_MAX_RANKS} ranks")


def group_bytes(spec: GroupSpec, *, remote: bool = False,
                hierarchy: Hierarchy | None = None) -> int:
    """Heap bytes of a whole group: one slot per rank, whichever engine holds it, and the
    stage slots of a two-stage group (`hierarchy`)."""
    if hierarchy is not None:
        return stage_layouts(spec, hierarchy).total_bytes
    return membership_layout(spec, remote=remote).slot_bytes * spec.num_ranks


def peer_table(rank_nodes: tuple[int, ...], rank_engines: tuple[int, ...], node: int,
               offset: int, slot_bytes: int, engine_bases: dict[int, int], heap_base: int,
               node_first_pe: tuple[int, ...]) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """Where each rank's buffer is, for the kernels of an engine on `node` (cuda_runtime's
    `peer_bases` and `remote`): a rank of this node by pointer (its engine's heap base, from
    `engine_bases`, + the group's offset + rank * slot); a rank of another node as 0, with the
    symmetric address of its buffer in this engine's own heap (the same offset on every PE)
    and its PE, `node_first_pe[its node] + its engine`. On one node `rank_nodes` is empty."""
    nodes = rank_nodes or (node,) * len(rank_engines)
    bases: list[int] = []
    remote: dict[int, tuple[int, int]] = {}
    for r, (n, e) in enumerate(zip(nodes, rank_engines, strict=True)):
        at = offset + r * slot_bytes
        if n == node:
            bases.append(engine_bases[e] + at)
        else:
            bases.append(0)
            remote[r] = (heap_base + at, node_first_pe[n] + e)
    return bases, remote


def check_spec(spec: GroupSpec, heap_bytes: int | None = None, *,
               remote: bool = False, stages: bool = False,
               heap_flag: str = "--nvshmem-heap-bytes") -> None:
    """The CUDA kernels' limits on a group (InvalidArgument names the one exceeded).
    `stages`: normal mode may run in two stages (a world over several nodes with
    --cuda-hierarchical auto or stages), so a normal-mode group of up to LL_MAX_RANKS ranks is taken
    here and its placement decided when its ranks join (CudaPlanner.plan_group)."""
    if needs_stages(spec) and not stages:
        raise wide_normal_mode_error(spec)
    if spec.num_ranks > abi.LL_MAX_RANKS:
        raise InvalidArgument(f"num_ranks={spec.num_ranks} exceeds the cuda backend's limit "
                              f"of {abi.LL_MAX_RANKS} ranks per group (LL_MAX_RANKS)")
    if spec.num_topk > abi.MAX_TOPK:
        raise InvalidArgument(f"num_topk={spec.num_topk} exceeds the cuda backend's limit of "
                              f"{abi.MAX_TOPK} (MAX_TOPK)")
    if needs_stages(spec):
        return  # (its size depends on its placement: plan_group)
    try:
        size = group_bytes(spec, remote=remote)
    except ValueError as e:  # any other kernel limit the layout enforces
        raise InvalidArgument(f"the cuda backend cannot hold this group: {e}") from None
    if heap_bytes is not None and size > heap_bytes:
        raise InvalidArgument(f"the group needs {size} bytes of symmetric heap, more than the "
                              f"{heap_bytes} of an engine (raise {heap_flag} or lower "
                              f"max_tokens_per_rank)")


def encode_plan(offset: int, nbytes: int, world: int = 0) -> bytes:
    return struct.pack("<QQQ", offset, nbytes, world)


def decode_plan(plan: bytes) -> tuple[int, int]:
    """(heap offset, bytes) of a group's range."""
    offset, nbytes, _ = struct.unpack("<QQQ", plan)
    return offset, nbytes


def plan_world(plan: bytes) -> int:
    """The NVSHMEM world whose heaps hold the group (engine_slots.py: 0 the shared engines'
    or their throughput class's, 1 their latency class's with class engines, then the tenant
    pools')."""
    return struct.unpack("<QQQ", plan)[2]


class HeapAllocator:
    """First-fit allocation of group buffers in the engines' symmetric heaps (ALIGN-aligned).
    Decided in the supervisor, once, so that every engine uses the same offsets."""

    ALIGN = abi.ALIGN

    def __init__(self, size: int) -> None:
        self.size = size
        self.used: dict[int, int] = {}  # offset -> bytes

    def alloc(self, nbytes: int) -> int | None:
        nbytes = -(-nbytes // self.ALIGN) * self.ALIGN
        cur = 0
        for off in sorted(self.used):
            if off - cur >= nbytes:
                break
            cur = off + self.used[off]
        if cur + nbytes > self.size:
            return None
        self.used[cur] = nbytes
        return cur

    def free(self, offset: int) -> None:
        self.used.pop(offset, None)


class CudaPlanner(GroupPlanner):
    """One NVSHMEM world per node (every engine a PE; with class engines or tenant pools, one
    per set of engines: engine_slots.py); groups get a range of every engine's symmetric heap
    of their world at the same offset."""

    name = "cuda"
    proto_kind = epd_pb2.CUDA
    restart_all_on_engine_loss = True  # an NVSHMEM world cannot take a replacement PE
    supports_rejoin = True  # CudaRankComm.rejoin (one node)
    rejoin_on_same_engine = True  # its peers reach the rank's buffers on its engine

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        # Experimental: the engines of every node in one NVSHMEM world (--cuda-cluster); every
        # group's layout then has the staging of puts to other nodes (as the engines lay it
        # out, CudaRankComm).
        self.cluster_capable = self.world_spans_nodes = (
            getattr(cfg, "num_nodes", 1) > 1 and bool(getattr(cfg, "cuda_cluster", False)))
        self.hierarchical_mode = hierarchical_mode(cfg)
        self.world: epd_pb2.ClusterWorld | None = None
        self.heap_bytes = cfg.nvshmem_heap_bytes
        self.heap = HeapAllocator(self.heap_bytes)
        self.uid = b""
        self.generation = 0
        # Class engines and tenant pools (engine_slots.py): every other set of engines forms a
        # world of its own (1: the latency engines with class engines), with its own heaps,
        # unique id and generation; world 0 is the shared (throughput) engines'. One node.
        self.class_engines = getattr(cfg, "class_engines", "off") == "on"
        self.latency_heap_bytes = getattr(cfg, "latency_heap_bytes", 0) or self.heap_bytes
        self.side_heaps: dict[int, HeapAllocator] = {}  # world > 0 -> its heap's allocator
        self.side_worlds: dict[int, tuple[bytes, int]] = {}  # world > 0 -> (unique id, generation)

    def validate_spec(self, spec: GroupSpec) -> None:
        heap, flag = self._heap_limit(spec)
        check_spec(spec, heap, remote=self.world_spans_nodes,
                   stages=self.world_spans_nodes and self.hierarchical_mode != "direct",
                   heap_flag=flag)

    def _heap_limit(self, spec: GroupSpec) -> tuple[int, str]:
        """The heap a group must fit and the flag that sizes it: with class engines, its
        class's world's (an engine checks before the class is resolved: the larger one)."""
        if not self.class_engines or spec.service_class == epd_pb2.THROUGHPUT:
            return self.heap_bytes, "--nvshmem-heap-bytes"
        if spec.service_class == epd_pb2.LATENCY:
            return self.latency_heap_bytes, "--latency-heap-bytes"
        return (max(self.heap_bytes, self.latency_heap_bytes),
                "--nvshmem-heap-bytes or --latency-heap-bytes")

    def plan_group(self, group_id: str, spec: GroupSpec, rank_nodes: Sequence[int] = (),
                   world: int | None = None) -> bytes:
        stages = two_stage_hierarchy(spec, list(rank_nodes), self.hierarchical_mode,
                                     self.world_spans_nodes)
        if stages is None and needs_stages(spec):
            raise wide_normal_mode_error(spec, rank_nodes)
        try:
            size = group_bytes(spec, remote=self.world_spans_nodes, hierarchy=stages)
        except ValueError as e:  # a kernel limit of a stage group
            raise InvalidArgument(f"group {spec.name!r}: the cuda engine cannot run its two "
                                  f"stages: {e}") from None
        if world is None:  # (a coordinator that does not say: by the class)
            world = int(self.class_engines and spec.service_class == epd_pb2.LATENCY)
        offset = self.heap_of(world).alloc(size)
        if offset is None:
            flag = "--latency-heap-bytes" if self._latency(world) else "--nvshmem-heap-bytes"
            raise ResourceExhausted(f"group {spec.name!r}: the symmetric heap has no room for "
                                    f"{size} bytes (raise {flag} or lower "
                                    f"max_tokens_per_rank)")
        return encode_plan(offset, size, world)

    def heap_of(self, world: int) -> HeapAllocator:
        """The allocator of `world`'s heaps."""
        if not world:
            return self.heap
        heap = self.side_heaps.get(world)
        if heap is None:
            heap = self.side_heaps[world] = HeapAllocator(self.world_heap_bytes(world))
        return heap

    def _latency(self, world: int) -> bool:
        return world_is_latency(world, self.class_engines)

    def free_group(self, plan: bytes) -> None:
        self.heap_of(plan_world(plan)).free(decode_plan(plan)[0])

    # A rank of a shrink group that goes away is masked by its own engine (CudaRankComm.stop
    # sets its bit in every rank's control block, which only an engine of the world can
    # reach); an engine loss restarts every engine, so there is nothing left to do here.
    supports_rank_masking = True

    def mark_gone(self, plan: bytes, rank: int, reason: str) -> None:
        return None

    def engine_env(self, world: int = 0) -> dict[str, str]:
        # One node: no IB probing, loopback bootstrap (a world over several nodes keeps
        # NVSHMEM's own defaults, or what the node's environment sets for its fabric); a heap
        # clients can map over CUDA IPC. No host proxy thread: over NVLink alone it serves only
        # device-side global exit and device wait timeouts, which EPD does not use, and it
        # spins a core the whole time (the engine's process CPU per low-latency call fell from
        # 200-225 to 11-14 µs without it, latency the same; docs/BENCHMARKS.md, thirty-third
        # session).
        one_node = {} if self.world_spans_nodes else {
            "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
            "NVSHMEM_DISABLE_LOCAL_ONLY_PROXY": "1"}
        return {**one_node,
                "NVSHMEM_DISABLE_CUDA_VMM": "1",
                # Stream-ordered calls park each rank's stream in a GPU-side wait for its
                # client: many hardware queues, so one rank's wait stalls no other stream
                # (under MPS taken from the GPU's one pool: --cuda-max-connections).
                "CUDA_DEVICE_MAX_CONNECTIONS": str(self.cfg.cuda_max_connections),
                "NVSHMEM_SYMMETRIC_SIZE": str(self.world_heap_bytes(world) + (1 << 30))}

    def world_heap_bytes(self, world: int) -> int:
        """The heap each engine of `world` reserves (a latency class world's its own size)."""
        return self.latency_heap_bytes if self._latency(world) else self.heap_bytes

    def new_world(self, world: int = 0) -> None:
        import nvshmem.core  # the [cuda] extra

        self.start_world(world, nvshmem.core.get_unique_id()._data.tobytes())

    def start_world(self, world: int, uid: bytes) -> None:
        """`world`'s engines (re)start in a new NVSHMEM world of unique id `uid`."""
        if world:
            self.side_worlds[world] = (uid, self.side_worlds.get(world, (b"", 0))[1] + 1)
            return
        self.uid = uid
        self.generation += 1

    def bootstrap(self, engine_index: int, num_engines: int,
                  world: int = 0) -> epd_pb2.GetBootstrapResponse:
        if not 0 <= engine_index < num_engines:
            raise InvalidArgument(f"engine index {engine_index} out of range")
        if world:  # a class's or a tenant pool's own world (one node)
            uid, generation = self.side_worlds.get(world, (b"", 0))
            if not uid:
                raise FailedPrecondition(f"the NVSHMEM world {world} of the engines is not "
                                         f"created yet")
            return epd_pb2.GetBootstrapResponse(nvshmem_uid=uid, pe=engine_index,
                                                num_pes=num_engines, generation=generation,
                                                heap_bytes=self.world_heap_bytes(world))
        if self.world_spans_nodes:  # PE = the node's first PE + the engine's index
            w = self.world
            if w is None:
                raise FailedPrecondition("the NVSHMEM world over the cluster's nodes is not "
                                         "formed yet (node 0 forms it once every node holds "
                                         "a lease)")
            return epd_pb2.GetBootstrapResponse(
                nvshmem_uid=w.nvshmem_uid, pe=w.node_first_pe[self.cfg.node_rank] + engine_index,
                num_pes=w.num_pes, generation=w.generation, node_first_pe=w.node_first_pe)
        if not self.uid:
            raise FailedPrecondition("the NVSHMEM world is not created yet")
        return epd_pb2.GetBootstrapResponse(nvshmem_uid=self.uid, pe=engine_index,
                                            num_pes=num_engines, generation=self.generation)

    # -- a world over all nodes (cluster_world.py) ----------------------------------------------
    def form_world(self, world: Any) -> epd_pb2.ClusterWorld:
        self.new_world()
        msg = epd_pb2.ClusterWorld(nvshmem_uid=self.uid, generation=world.generation,
                                   node_first_pe=list(world.node_first_pe),
                                   num_pes=world.num_pes)
        self.adopt_world(msg)
        return msg

    def adopt_world(self, world: epd_pb2.ClusterWorld) -> None:
        self.world = world
        self.heap = HeapAllocator(self.heap_bytes)  # a new world: every heap is empty again

    def leave_world(self) -> None:
        self.world = None

    def adopt_plan(self, group_id: str, plan: bytes) -> bytes:
        # Node 0 planned it in the world's symmetric heap: the same offsets on every PE.
        return plan

    def detect_engines(self) -> int:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
