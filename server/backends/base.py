"""The interface between an engine and the device code that moves the data.

An engine process owns exactly one `Backend`. The engine layer (sessions, groups, validation,
handles, metrics) is backend-agnostic: it resolves tensor descriptors into arrays through
`Region.view`, calls a `RankComm` for every collective, and turns the arrays it gets back into
descriptors of the membership's output region. A backend therefore only implements:

* regions: open client memory (a sealed memfd passed by descriptor on the CPU backend, a CUDA IPC
  handle on the CUDA backend) and make strided views of it;
* counter pages: a session's counter page (a sealed memfd the client fetches by descriptor) so
  the notify step can publish receive counts;
* rank communicators: one per (group, rank) held by this engine, implementing the collectives
  of server/reference.py with deadlines and a group-wide abort word.

Arrays are NumPy arrays on the CPU backend and CuPy arrays on the CUDA backend.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...proto import abi, counter_page, dtypes
from ...proto import fd_channel as fdc
from ...proto.errors import FailedPrecondition, InvalidArgument

Array = Any  # numpy.ndarray (cpu) or cupy.ndarray (cuda)


@dataclass(frozen=True)
class GroupSpec:
    name: str
    num_ranks: int
    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    num_topk: int
    x_dtype: int  # epd.proto DType enum value
    low_latency_mode: bool = False  # reserve low-latency buffers (needed by the cuda backend)
    # epd.proto ServiceClass (server/service_classes.py): resolved by the engine at join, the
    # same on every rank; the cuda backend sets its streams' priority and SM budget by it.
    service_class: int = 0
    # Rank masking (DeepEP's shrink mode, low-latency groups only): a rank that goes away is
    # masked instead of aborting the group (RankComm.mask_states / set_mask).
    shrink: bool = False
    # The metrics' `group` label, set by the engine at join (`metrics.owned_label`): the name
    # (less its instance tag), and its owner's uid where that is a tenant's own namespace.
    # Not part of the spec's identity (ranks compare specs).
    metrics_name: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        """What the metrics label this group with (the name where none was set)."""
        return self.metrics_name or self.name

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def x_numpy_dtype(self) -> np.dtype:
        return dtypes.to_numpy(self.x_dtype)

    @property
    def max_recv_tokens(self) -> int:
        return self.num_ranks * self.max_tokens_per_rank


@dataclass(frozen=True)
class Membership:
    """What the supervisor's rendezvous decided for one rank of a group."""

    group_id: str
    rank: int
    rank_engines: tuple[int, ...]
    plan: bytes = b""  # the group's shared resources, from the backend's GroupPlanner
    rank_nodes: tuple[int, ...] = ()  # node rank of each rank (cluster mode)
    rejoining: bool = False  # a replacement for a rank that went away (see RankComm.rejoin)

    @classmethod
    def from_rendezvous(cls, rank: int, resp: Any) -> Membership:
        """From a Node.Rendezvous answer (epd_pb2.RendezvousResponse)."""
        return cls(resp.group_id, rank, tuple(resp.rank_engines), bytes(resp.plan),
                   tuple(resp.rank_nodes), bool(resp.rejoining))


@dataclass(frozen=True)
class Hierarchy:
    """A normal-mode group over `num_nodes` nodes of `per_node` ranks, placed node-major (rank
    = node * L + local index): it runs DeepEP's hierarchical semantics on every backend
    (`reference.hierarchical_dispatch` / `hierarchical_combine`; docs/DESIGN_NOTES.md)."""

    num_nodes: int
    per_node: int

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.per_node

    @classmethod
    def of(cls, rank_nodes: Sequence[int]) -> Hierarchy | None:
        """The hierarchy of a group from the node of each rank; None (flat semantics) when the
        group is on one node or is not node-major: node ranks not ascending with the rank, or
        not the same number of ranks on every node. The group's node b is its b-th node in
        ascending node rank (node ranks need not start at 0 nor be contiguous)."""
        nodes = list(rank_nodes)
        distinct = sorted(set(nodes))
        if len(distinct) < 2 or nodes != sorted(nodes):
            return None
        per_node = len(nodes) // len(distinct)
        if any(nodes.count(n) != per_node for n in distinct):
            return None
        return cls(len(distinct), per_node)

    def no_topk_error(self, group: str) -> InvalidArgument:
        """The refusal of a dispatch without top-k (is_token_in_rank routing) in such a group:
        its node stage routes by top-k ids."""
        return InvalidArgument(
            f"group {group!r} runs hierarchical normal mode over {self.num_nodes} nodes, whose "
            f"node stage routes by top-k ids: dispatch without top-k (is_token_in_rank only) "
            f"is not supported there")

    def source_order(self) -> list[int]:
        """The order in which every destination receives its sources' rows: by local index,
        then node (forwarder i carries the rows of sources (a, i), a ascending)."""
        return [a * self.per_node + i for i in range(self.per_node)
                for a in range(self.num_nodes)]


class GroupPlanner(abc.ABC):
    """The node-side half of a backend, used by the supervisor and its coordinator: device-free
    (no CuPy, no GPU), chosen once by name (`backends.make_planner`). It says which group specs
    the backend can run, plans a forming group's shared resources into an opaque `plan` that
    travels to every engine of the group (`Membership.plan`), and gives the node-level hooks
    (engine environment, bootstrap of a node-wide world, the engine-loss policy)."""

    name: str
    proto_kind: int  # epd_pb2.CPU / epd_pb2.CUDA
    # An engine that exits takes every engine down with it (a world that cannot take a new
    # member): the supervisor then restarts all engines after `new_world()`.
    restart_all_on_engine_loss: bool = False
    # Cluster mode (--num-nodes > 1): node 0 plans every group and the other nodes adopt the
    # plan (`adopt_plan`). Only the CPU backend on logical nodes (one host) can; the CUDA path
    # needs NVSHMEM's internode transport, not built yet.
    cluster_capable: bool = False
    # Cluster mode: the engines of every node form one world (cluster_world.py), formed by node
    # 0 (`form_world`) and adopted by the others (`adopt_world`); engines start only in one.
    world_spans_nodes: bool = False

    def form_world(self, world: Any) -> Any:
        """Node 0: the backend's part of a new world over all nodes (cluster_world.World),
        as the epd_pb2.ClusterWorld the other nodes adopt."""
        raise NotImplementedError

    def adopt_world(self, world: Any) -> None:
        """Every node: the engines it starts from now on join `world` (epd_pb2.ClusterWorld)."""
        raise NotImplementedError

    def leave_world(self) -> None:  # noqa: B027  (optional hook)
        """The world is lost: engines may not start until the next one."""

    @abc.abstractmethod
    def validate_spec(self, spec: GroupSpec) -> None:
        """Raise InvalidArgument naming the backend limit the spec exceeds."""

    @abc.abstractmethod
    def plan_group(self, group_id: str, spec: GroupSpec, rank_nodes: Sequence[int] = (),
                   world: int | None = None) -> bytes:
        """Allocate a forming group's shared resources; raises an EpdError when it cannot.
        `rank_nodes`: the node of each rank (cluster mode; empty on one node), for backends
        whose memory depends on placement (the cuda engine's two-stage hierarchical mode).
        `world`: the world of the engines its ranks joined on (engine_slots.py), where the
        engines form several; None: the backend's own rule (one world, or by class)."""

    @abc.abstractmethod
    def free_group(self, plan: bytes) -> None:
        """The group is gone: release what plan_group allocated."""

    def abort_group(self, plan: bytes, reason: str) -> None:  # noqa: B027  (optional hook)
        """Tell the group's ranks it failed, where the backend's shared state can say so."""

    # Rank masking: a rank of a shrink group that goes away is masked for good (`mark_gone`)
    # instead of aborting the group. Backends without it abort such groups as any other.
    supports_rank_masking: bool = False

    def mark_gone(self, plan: bytes, rank: int, reason: str) -> None:
        """A rank of a shrink group went away: mask it for good in the group's shared state, so
        its peers' pending and later low-latency calls go on without it."""
        raise NotImplementedError

    # Rejoin: a replacement may take a gone rank's place in its shrink group (RankComm.rejoin
    # brings it in at a collective all ranks make). Backends without it refuse the join.
    supports_rejoin: bool = False
    # The replacement must come to the engine of the rank it replaces (its peers reach that
    # rank's buffers there: the CUDA engines' peer tables).
    rejoin_on_same_engine: bool = False

    def adopt_plan(self, group_id: str, plan: bytes) -> bytes:
        """Cluster mode, on a node other than 0: take a group planned by node 0 into this
        node's keeping (so that it outlives node 0) and return the plan this node's engines
        use; `free_group`/`abort_group` then take the returned plan."""
        from ...proto.errors import FailedPrecondition
        raise FailedPrecondition(f"groups spanning nodes are not supported by the {self.name} "
                                 f"backend")

    def engine_env(self, world: int = 0) -> dict[str, str]:
        """Environment defaults for the engine processes of `world` (engine_slots.py)."""
        return {}

    def new_world(self, world: int = 0) -> None:  # noqa: B027  (optional hook)
        """Before the engines of `world` (engine_slots.py) (re)start: create the world they
        join, if any."""

    def bootstrap(self, engine_index: int, num_engines: int, world: int = 0) -> Any:
        """The Node.GetBootstrap answer for the engine of place `engine_index` among the
        `num_engines` of `world` (epd_pb2.GetBootstrapResponse)."""
        from ...proto.errors import FailedPrecondition
        raise FailedPrecondition(f"bootstrap is not used by the {self.name} backend")

    def detect_engines(self) -> int:
        """Engine processes to start when the configuration does not say."""
        return 2


@dataclass
class DispatchArgs:
    x: Array
    # FP8 scales [T, H/128]: float32, or int32 words (packed UE8M0, vLLM's MXFP8); 4-byte
    # columns carried bit-exactly, recv_x_scales in the same dtype
    x_scales: Array | None
    topk_idx: Array | None  # None in cached mode
    topk_weights: Array | None
    expert_alignment: int = 1
    num_worst_tokens: int = 0
    cached: Any = None  # a handle state returned by an earlier dispatch of this RankComm
    # Dispatch without top-k (topk_idx None, not cached): bool [T, R] routing and int32 [E]
    # tokens per expert (DeepEP's is_token_in_rank / num_tokens_per_expert).
    is_token_in_rank: Array | None = None
    num_tokens_per_expert: Array | None = None
    # A released handle of this RankComm whose device state this dispatch (fresh, of as many
    # tokens) may overwrite instead of allocating its own: an armed dispatch's previous
    # trigger's, whose last reader (its combine) is queued before it on the rank's stream.
    refill: Any = None


@dataclass
class DispatchOutputs:
    recv_x: Array
    recv_x_scales: Array | None
    recv_topk_idx: Array | None  # None in cached mode
    recv_topk_weights: Array | None
    recv_src_idx: Array
    rank_prefix_matrix: Array  # [R, R] int32, DeepEP's: rows from sources <= s received by d
    num_recv_tokens: int
    num_recv_tokens_per_expert: list[int]
    handle: Any  # backend state needed by combine and cached dispatch
    bytes_sent: int = 0
    bytes_received: int = 0
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class CombineArgs:
    x: Array
    handle: Any
    topk_weights: Array | None = None
    bias_0: Array | None = None
    bias_1: Array | None = None


@dataclass
class CombineOutputs:
    combined_x: Array
    combined_topk_weights: Array | None
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class LayoutOutputs:
    num_tokens_per_rank: Array
    num_tokens_per_expert: Array
    is_token_in_rank: Array


@dataclass
class LowLatencyDispatchArgs:
    """DeepEP low_latency_dispatch, validated by the engine (shapes, dtypes, ids, distinct
    experts per token, T <= num_max_dispatch_tokens_per_rank <= max_tokens_per_rank)."""

    x: Array  # [T, H] in the group's dtype
    topk_idx: Array  # [T, K] int64
    num_max_dispatch_tokens_per_rank: int
    use_fp8: bool = False
    round_scale: bool = False  # use_ue8m0 arrives here as round_scale=True
    topk_idx_host: np.ndarray | None = None  # host copy (the engine's checks made one)
    buffer: int = 0  # receive buffer 0 or 1 (two micro-batches in flight); cuda backend


@dataclass
class LowLatencyDispatchOutputs:
    recv_x: Array  # [L, R*num_max, H]: group dtype, or e4m3 with use_fp8
    recv_x_scales: Array | None  # [L, R*num_max, H/128] float32 with use_fp8
    recv_count: Array  # [L] int32
    recv_src_rank: Array  # [L, R*num_max] int32, -1 beyond the count
    recv_src_idx: Array  # [L, R*num_max] int32, -1 beyond the count
    num_recv_rows: int  # sum of recv_count
    handle: Any  # backend state needed by low_latency_combine
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass
class LowLatencyCombineArgs:
    x: Array  # [L, R*num_max, H] in the group's dtype
    topk_idx: Array  # [T, K] int64 (as dispatched; entries may be -1)
    topk_weights: Array  # [T, K] float32
    handle: Any
    out: Array | None = None  # [T, H]: write the result here
    topk_idx_host: np.ndarray | None = None  # host copy (the engine's checks made one)


@dataclass
class LowLatencyCombineOutputs:
    combined_x: Array  # [T, H]
    bytes_sent: int = 0
    bytes_received: int = 0


class NotFilled(FailedPrecondition):
    """An armed low-latency combine whose receive buffer does not hold its dispatch: the
    poller reports it in the op's done word with the code the GPU chain's kernel writes for
    the same case (ERR_NOT_FILLED), so the client's message does not depend on the path."""

    done_code = abi.ERR_NOT_FILLED


def ll_overwritten(sequence: int, buffer: int, latest: int) -> str:
    """Why a low-latency combine is refused (FAILED_PRECONDITION, before taking part): its
    dispatch's receive buffer holds a later dispatch now (both backends)."""
    return (f"low-latency dispatch #{sequence} in receive buffer {buffer} was overwritten by "
            f"dispatch #{latest}; two dispatches can be in flight, one per buffer (DeepEP's "
            f"double buffer): combine each before a third dispatch reuses its buffer")


COMBINE_CHECK_ELEMENTS = 1 << 22  # check_combine_routing compares this many pairs at a time


def check_combine_routing(dispatched: np.ndarray, combine: np.ndarray) -> np.ndarray:
    """Low-latency combine entries must each name one of the token's dispatched experts (any k
    position, -1 allowed). Returns, per entry, the k position in the dispatch."""
    from ...proto.errors import InvalidArgument
    t, k = combine.shape
    # The comparison is [rows, K, K]: by chunks of rows, so that its memory stays bounded
    # (whole, T = 2^20 and K = 64 made 8 GiB of temporaries that no budget counted: a tenant
    # could have the engine OOM-killed with every other tenant's sessions).
    rows = max(1, COMBINE_CHECK_ELEMENTS // max(1, k * dispatched.shape[1]))
    out = np.empty((t, k), dtype=np.int64)
    for start in range(0, t, rows):
        c, d = combine[start:start + rows], dispatched[start:start + rows]
        eq = (d[:, None, :] == c[:, :, None]) & (c[:, :, None] >= 0)
        missing = (c >= 0) & ~eq.any(axis=2)
        if missing.any():
            tok, kk = (int(v) for v in np.argwhere(missing)[0])
            tok += start
            raise InvalidArgument(f"topk_idx[{tok}, {kk}] = {int(combine[tok, kk])}: token "
                                  f"{tok} was not dispatched to that expert by the dispatch of "
                                  f"this handle")
        out[start:start + rows] = eq.argmax(axis=2)
    return out


class Region(abc.ABC):
    """Client memory opened in the engine. Bounds are checked by the engine before `view`."""

    # True for an engine-owned region that a session may also pass back as an input (the CUDA
    # heap holding outputs): the session resolves it but never closes it.
    borrowed: bool = False

    def __init__(self, region_id: str, size: int) -> None:
        self.region_id = region_id
        self.size = size
        # Descriptors already checked and viewed (engine/tensors.py resolve): a repeated call
        # with the same tensors costs a dict lookup, not the checks and a new view.
        self.resolved: dict[tuple, Array] = {}

    @abc.abstractmethod
    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype,
             strides: tuple[int, ...]) -> Array:
        """A view (no copy) of `shape` elements at byte `offset`, strides in elements."""

    def offset_of(self, array: Array) -> int:
        """Byte offset of an array that lives in this region (engine-owned output regions)."""
        raise NotImplementedError

    @abc.abstractmethod
    def close(self) -> None:
        """Release the mapping; called exactly once."""


class CounterPage(abc.ABC):
    """A session's counter page as the engine sees it: a memfd sealed against shrinking and
    growing, mapped; `fd` is kept for the client to fetch ("counters") until `close`."""

    fd: int = -1

    def __init__(self) -> None:
        # A sealed memfd (shmem, like a /dev/shm file), fetched by the client as "counters".
        self.fd = fdc.create_memfd("epd-counters", counter_page.PAGE_BYTES, fdc.ENGINE_SEALS)
        try:
            self._mm = fdc.map_fd(self.fd, counter_page.PAGE_BYTES)
        except BaseException:
            os.close(self.fd)
            raise

    def _unmap(self) -> None:
        """The mapping goes (with its last view) and the descriptor is closed."""
        fdc.close_mapping(self._mm)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @abc.abstractmethod
    def slot(self, index: int) -> Any:
        """The slot handle a RankComm publishes counts through."""

    @abc.abstractmethod
    def close(self) -> None: ...


class RankComm(abc.ABC):
    """One rank of one group, held by this engine. Calls come from one thread at a time (the
    owning session's worker), in the same order on every rank of the group."""

    spec: GroupSpec
    membership: Membership
    output_region: Region
    # How the device schedules this rank, by its group's service class (0: not applicable, the
    # cpu backend): the CUDA priority of its stream (lower is more urgent) and the blocks of its
    # normal-mode and low-latency data kernels. A client's num_sms is bounded by `num_sms`.
    # A normal-mode group over nodes placed node-major runs the hierarchical semantics
    # (reference.hierarchical_dispatch / hierarchical_combine) rather than the flat ones.
    hierarchy: Hierarchy | None = None
    # ... and moves its rows in two stages (rail, then node: the cuda engine's
    # --cuda-hierarchical stages, or auto beyond 8 ranks).
    two_stage: bool = False
    stream_priority: int = 0
    num_sms: int = 0
    ll_num_sms: int = 0

    @property
    def hierarchical(self) -> bool:
        """Reported to the client at join and in its stats."""
        return self.hierarchy is not None

    @abc.abstractmethod
    def layout(self, topk_idx: Array) -> LayoutOutputs: ...

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs, counter_slot: Any, sequence: int,
                 deadline: float) -> DispatchOutputs:
        """Run notify + dispatch. Publishes (sequence, counts) into counter_slot as soon as the
        receive counts are known; raises Aborted / DeadlineExceeded on group failure."""

    @abc.abstractmethod
    def combine(self, args: CombineArgs, deadline: float) -> CombineOutputs: ...

    backend_name: str = "this"

    def low_latency_dispatch(self, args: LowLatencyDispatchArgs,
                             deadline: float) -> LowLatencyDispatchOutputs:
        """DeepEP low-latency dispatch (as server/reference.py): per local expert, one row per
        (token, k) pair routed to it. Raises FailedPrecondition on a backend without it (before
        taking part, so the peers see a missing rank, never a half-done collective)."""
        raise self._no_low_latency()

    def low_latency_combine(self, args: LowLatencyCombineArgs,
                            deadline: float) -> LowLatencyCombineOutputs:
        """DeepEP low-latency combine: out[t] = sum_k w[t,k] * y[e_k][row of t], fp32 in k
        order, skipping -1."""
        raise self._no_low_latency()

    # Stream-ordered low-latency calls (armed once, triggered from the client's CUDA stream):
    # launch without any host synchronisation; a last kernel writes the op's done word.
    def low_latency_outputs(self, num_max: int, use_fp8: bool,
                            buffer: int = 0) -> LowLatencyDispatchOutputs:
        """The fixed output views of low-latency dispatch in receive buffer `buffer` (counts
        not known: num_recv_rows 0)."""
        raise self._no_stream_ops()

    def low_latency_combine_view(self, num_tokens: int) -> Array:
        """Where a stream-ordered combine without `out` writes its [T, H] result."""
        raise self._no_stream_ops()

    def prepare_low_latency_dispatch(self, args: LowLatencyDispatchArgs, stats: Array | None,
                                     done_ptr: int, timeout: float) -> Any:
        """Pack an armed dispatch's launches (dispatch, stats += recv_count, the done write)."""
        raise self._no_stream_ops()

    def prepare_low_latency_combine(self, args: LowLatencyCombineArgs, dispatch: Any,
                                    done_ptr: int, timeout: float) -> Any:
        """Pack an armed combine's launches; `dispatch` is its prepared dispatch."""
        raise self._no_stream_ops()

    def launch_prepared(self, prepared: Any, buffer: int = 0) -> None:
        """Launch a prepared op with the next sequence (no host synchronisation): a dispatch
        into receive buffer `buffer`, a combine of the dispatch that buffer holds."""
        raise self._no_stream_ops()

    def open_chain(self, ring_words: Any, ring_ptr: int) -> Any:
        """The member's low-latency chain in a counter slot (armed ops then run without the
        engine's host; server/backends/cuda_chain.py), or None where the backend has none."""
        return None

    def close_chain(self, timeout: float, freed: Callable[[], None] | None = None) -> None:
        """Drain and free the member's chain; `freed()` once its kernels are done with its
        ring slot (at once without a chain)."""
        if freed is not None:
            freed()

    stream_ordered = False  # whether the stream_* calls below are implemented

    @property
    def combine_skips_failed_dispatch(self) -> bool:
        """Whether a stream-ordered combine may be launched before its dispatch's receive
        count is known: its kernels skip the call, alike on every rank, when that dispatch
        failed without aborting the group (its capacity). Else the engine waits for the count
        first (a worst-case dispatch's client does not)."""
        return False

    # Stream-ordered normal-mode calls (engine/stream_calls.py): the rank's stream waits on the
    # GPU for the client's READY word, the kernels follow, a last kernel writes the failure
    # words and DONE; nothing waits on the host. `stream_seq` is the call's sequence. Each
    # call checks what it would refuse and returns the launch of its kernels, which the engine
    # runs once the client has its answer (the client's side of the call overlaps it).
    def stream_layout(self, topk_idx: Array, out: tuple[Array, Array, Array], counter_slot: Any,
                      stream_seq: int) -> Callable[[], None]:
        """The launch writing num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank
        into `out`."""
        raise self._no_stream_ops()

    def stream_dispatch(self, args: DispatchArgs, counter_slot: Any, sequence: int,
                        deadline: float, stream_seq: int,
                        num_sms: int) -> tuple[DispatchOutputs, Callable[[], None]]:
        """The outputs (the receive buffers at their largest shape; num_recv_tokens is -1,
        not known yet, unless cached) and the launch of notify + dispatch, whose counts reach
        the counter slot from the GPU."""
        raise self._no_stream_ops()

    def stream_combine(self, args: CombineArgs, out: Array, out_weights: Array | None,
                       counter_slot: Any, deadline: float, stream_seq: int,
                       num_sms: int) -> Callable[[], None]:
        """The launch of a combine into the caller's `out` (and `out_weights`)."""
        raise self._no_stream_ops()

    def refuse_stream_combine(self, handle: Any, deadline: float) -> bool:
        """Take part in a stream-ordered combine this engine refused: every peer's combine
        then fails naming this rank (raised at its Group.check()) instead of waiting out its
        deadline, and the group goes on. `handle`: the backend handle named, when it is
        known. False where this group cannot."""
        return False

    def refuse_stream_dispatch(self, deadline: float) -> bool:
        """Take part in a stream-ordered dispatch this engine refused (bad descriptors), so
        that every rank fails it alike at once instead of the peers waiting out their deadline
        for this rank. False where this group cannot (then the peers wait, as for a
        synchronous call refused before taking part)."""
        return False

    def drain_stream(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds, never raising) until the rank's stream has run
        everything enqueued on it; False if it did not (or cannot be asked). The failure path
        of a launch after the answer."""
        return True

    def release_stream(self, counter_slot: Any) -> None:  # noqa: B027  (nothing to release)
        """Teardown: let the rank's stream pass every READY wait it was given."""

    def await_stream_ready(self, deadline: float) -> None:  # noqa: B027  (no stream here)
        """Before a synchronous call: wait (until `deadline`, then DeadlineExceeded) for the
        client's stream to reach the stream-ordered calls given before it, which the call's
        work would queue behind without a deadline."""

    def quiesce(self, deadline: float) -> None:  # noqa: B027  (push designs need nothing)
        """A clean leave is next: wait (until `deadline`, never raising) for the peers to
        finish reading what this rank published in the last collective, so its abort word does
        not fail a peer that is merely slower."""

    @property
    def held_bytes(self) -> int:
        """Engine memory this rank holds for its group (its buffer slot, its outputs)."""
        return 0

    def handle_bytes(self, low_latency: bool, num_tokens: int, num_topk: int) -> int:
        """At most the engine memory (host and device) the handle of one new dispatch of
        `num_tokens` tokens keeps until it is released: the engine charges it to the session's
        --max-handle-bytes-per-session before the collective (a handle's arrays grow with its
        tokens, so a count of handles alone does not bound them)."""
        raise NotImplementedError(f"{type(self).__name__} does not size its handles")

    def known_abort_reason(self) -> str | None:
        """Why the group failed, as far as this engine's host knows (no device read)."""
        return None

    def _no_stream_ops(self) -> Exception:
        from ...proto.errors import FailedPrecondition
        return FailedPrecondition(f"stream-ordered calls need the cuda backend; this engine "
                                  f"runs {self.backend_name}")

    def _no_low_latency(self) -> Exception:
        from ...proto.errors import FailedPrecondition
        return FailedPrecondition(f"low-latency mode is not implemented on the "
                                  f"{self.backend_name} backend")

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Mark the group failed for every rank; pending and later collectives raise Aborted."""

    # -- rank masking (shrink groups; docs/DESIGN_NOTES.md "Rank masking") -------------------
    supports_rank_masking = False
    MASK_IN, MASK_MASKED, MASK_GONE = 0, 1, 2  # per-rank states (RankMaskResponse.state)

    def mask_states(self) -> list[int]:
        """Every rank's mask state: all taking part where the backend masks no rank."""
        return [self.MASK_IN] * self.spec.num_ranks

    def set_mask(self, rank: int, state: int) -> None:
        """Mask (MASK_MASKED) or unmask (MASK_IN) a rank that has not gone away."""
        from ...proto.errors import FailedPrecondition
        raise FailedPrecondition(f"rank masking is not implemented on the {self.backend_name} "
                                 f"backend (a rank that goes away aborts the group)")

    def rejoin(self, rank: int, deadline: float) -> None:
        """The Rejoin collective for `rank` (a replacement of a rank that went away): every
        rank that takes part and the replacement make it; from the next collective on the
        replacement takes part."""
        from ...proto.errors import FailedPrecondition
        raise FailedPrecondition(f"a rank cannot come back into a group on the "
                                 f"{self.backend_name} backend")

    def stop(self, reason: str) -> None:  # noqa: B027  (backends that abort need nothing)
        """This rank goes away from a shrink group: end its own pending waits (the group goes
        on; the supervisor masks the rank once it is released)."""

    @abc.abstractmethod
    def abort_reason(self) -> str | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class Backend(abc.ABC):
    name: str  # "cpu" or "cuda"
    proto_kind: int  # epd_pb2.CPU / epd_pb2.CUDA (the Backend enum of epd.proto)
    peer_class: str  # "shm" / "nvlink": how ranks of a group reach each other
    planner: GroupPlanner  # the same limits the supervisor checks at rendezvous
    # Normal dispatch routed by is_token_in_rank alone (DeepEP's topk_idx=None).
    supports_dispatch_without_topk: bool = False
    # A dispatch with more tokens than max_tokens_per_rank takes part in its collective (writing
    # nothing), and every rank fails it with the same TokenCapacityExceeded, so all ranks can
    # grow alike; a backend without this refuses such a call on its rank alone.
    agrees_on_capacity: bool = False
    # A call's collective runs on the engine's host cores (cpu): a client spinning for the
    # answer would take CPU from it, so clients are not asked to spin longer than the base.
    collectives_on_host: bool = False
    # The backend reads a call's inputs with the host (cpu), from memory the client shares: it
    # must read the values the engine checked, so the engine hands it its checked host copies
    # (a client changing topk_idx after the check would otherwise feed its group unchecked ids).
    inputs_on_host: bool = False
    # The kernels read topk_idx, topk_weights and is_token_in_rank from their base address as
    # dense rows (cuda): a strided or overlapping view is refused (it would be misread, or read
    # past the client's memory).
    dense_routing: bool = False

    def validate_spec(self, spec: GroupSpec) -> None:
        """Raise InvalidArgument naming the backend limit the spec exceeds."""
        self.planner.validate_spec(spec)

    def output_bytes(self, spec: GroupSpec) -> int:
        """Engine memory a membership of `spec` allocates for its outputs (a session's budget
        counts it); 0 where outputs come from a fixed reserve (cuda: the symmetric heap)."""
        return 0

    @abc.abstractmethod
    def device_info(self) -> dict[str, Any]:
        """name, uuid, ordinal of the device this engine drives."""

    @abc.abstractmethod
    def open_region(self, region_id: str, *, ipc_handle: bytes = b"",
                    size: int, device_ordinal: int = 0) -> Region:
        """A region from a CUDA IPC handle (RegisterRegion over gRPC)."""

    def map_memfd(self, region_id: str, fd: int, size: int) -> Region:
        """A region from a client's memfd (the descriptor channel): the backend checks its seals
        (F_SEAL_SHRINK at least) and size and maps it; the caller closes `fd` afterwards."""
        from ...proto.errors import FailedPrecondition
        raise FailedPrecondition(f"the {self.name} backend takes no host memory regions")

    @abc.abstractmethod
    def open_counter_page(self) -> CounterPage:
        """A new session's counter page (a sealed memfd; see CounterPage)."""

    @abc.abstractmethod
    def attach(self, spec: GroupSpec, membership: Membership) -> RankComm:
        """Create this engine's communicator for one rank (after the rendezvous). On the CPU
        backend its output region is a sealed memfd the client fetches as
        "outputs/<group_id>"."""

    def thread_init(self) -> None:  # noqa: B027  (optional hook)
        """Run once on every session worker thread (the CUDA backend selects its device)."""

    def to_host(self, array: Array) -> np.ndarray:
        """A private host copy of a (small) array: a copy on the CPU backend too, since the
        client may change shared memory after the engine checked the copy."""
        return np.array(array, copy=True)

    def settle(self) -> None:  # noqa: B027  (host arrays: done when written)
        """Wait for array work this thread enqueued (cuda: on its current stream), before an
        answer lets the client read the result."""

    def check_event(self, handle: bytes) -> None:
        """Refuse a ready event this backend cannot wait for, before a call takes anything (a
        dispatch's sequence): events are CUDA interprocess events."""
        if handle:
            from ...proto.errors import InvalidArgument
            raise InvalidArgument(f"ready_event is for the cuda backend; this engine runs "
                                  f"{self.name}")

    def wait_event(self, cache: dict[bytes, Any], handle: bytes) -> None:
        """Block the calling worker until the client's interprocess event has completed (its
        inputs are ready). `cache` is per session: open each handle once."""
        self.check_event(handle)

    def close_events(self, cache: dict[bytes, Any]) -> None:  # noqa: B027  (optional hook)
        """Release a session's opened event handles."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release device state at engine exit."""
