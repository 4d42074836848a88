"""CUDA backend: the engine side of the intranode kernels (cuda/, cuda_kernels.py).

One engine drives one GPU. At start it joins the node's NVSHMEM world (unique id from the
supervisor's Node.GetBootstrap), allocates one symmetric heap and learns every peer's heap base
(`nvshmem.core.get_peer_array`, NVLink peer pointers). A group's rank buffers live at the
heap offset of the group's plan (cuda_plan.CudaPlanner), one slot per rank of the group, so a
rank's buffer is `peer_base[engine of rank] + heap_offset + rank * slot_bytes` on every engine.

Client tensors arrive as CUDA IPC allocations (opened once per region, extent checked with
cuMemGetAddressRange, device checked). Outputs stay in the heap; clients map the heap once per
session through its CUDA IPC handle, which needs NVSHMEM_DISABLE_CUDA_VMM=1 (the supervisor sets
it). The session's counter page is registered as mapped pinned memory so notify writes the
receive counts straight into the client-visible page.

CuPy has no bfloat16 or float8 dtype: such arrays are handled as uint16 / uint8 bit patterns
(the kernels move and round bits exactly); the engine keeps the logical dtype in descriptors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...proto import abi, counter_page, cuda_driver, dtypes, spin
from ...proto.errors import (
    Aborted,
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
)
from ...proto.v1 import epd_pb2
from .. import metrics, service_classes
from ..config import chain_limit
from . import cuda_chain, cuda_rejoin, cuda_stages
from . import cuda_kernels as ck
from .base import (
    Backend,
    CombineArgs,
    CombineOutputs,
    CounterPage,
    DispatchArgs,
    DispatchOutputs,
    GroupSpec,
    Hierarchy,
    LayoutOutputs,
    LowLatencyCombineArgs,
    LowLatencyCombineOutputs,
    LowLatencyDispatchArgs,
    LowLatencyDispatchOutputs,
    Membership,
    NotFilled,
    RankComm,
    Region,
    check_combine_routing,
    ll_overwritten,
)
from .cuda_chain import LowLatencyChain
from .cuda_memory import (
    CounterSlot,
    DeviceRegion,
    DeviceWords,
    HostControlWords,
    MappedCounterPage,
    storage_dtype,
)
from .cuda_plan import (
    CudaPlanner,
    decode_plan,
    group_bytes,
    hierarchical_mode,
    membership_layout,
    peer_table,
    stage_layouts,
    two_stage_hierarchy,
)
from .cuda_quiet import QuietCloser
from .cuda_stages import Placement, StagedRunner, drive

log = logging.getLogger("epd.cuda")
cp = ck.cp


def _launches(method: Callable[..., Any]) -> Callable[..., Any]:
    """A CudaRankComm method that launches GPU work: IPC mappings are not closed meanwhile
    (cuda_quiet.py). One that fails other than with an EpdError (a CUDA error at a launch, a
    kernel limit) leaves its collective half launched: it aborts the group, so that the peers
    stop at once naming this rank and the error instead of waiting out their deadline."""
    @functools.wraps(method)
    def wrapper(self: CudaRankComm, *args: Any, **kwargs: Any) -> Any:
        with self.backend.closer.launching():
            try:
                return method(self, *args, **kwargs)
            except EpdError:
                raise
            except Exception as e:
                why = f"rank {self.rank}: {method.__name__} failed in the engine ({e})"
                log.error("group %r: %s; aborting the group", self.spec.name, why)
                try:
                    self.abort(why)
                except Exception as again:  # (a broken context fails the abort kernel too)
                    log.error("group %r: the abort failed as well: %s", self.spec.name, again)
                raise
    return wrapper


def _copy_prefix(prefix: Any, rank_prefix: Any, stream: Any) -> None:
    """The rank prefix matrix into its output view, on the rank's stream. A copy rather than
    CuPy's `prefix[...] = ...`: that is an elementwise kernel, compiled and loaded at its first
    use, and a load can wait for the context's running kernels (cuda_driver.load_function)."""
    cp.cuda.runtime.memcpyAsync(prefix.data.ptr, rank_prefix.data.ptr, prefix.nbytes,
                                cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)


def _routing(args: DispatchArgs) -> tuple[Any, Any] | None:
    """A dispatch without top-k routes by (is_token_in_rank, num_tokens_per_expert)."""
    if args.topk_idx is not None or args.cached is not None:
        return None
    return args.is_token_in_rank, args.num_tokens_per_expert


@dataclass
class _Handle:
    result: Any  # cuda_runtime.DispatchResult
    num_recv: int
    num_tokens: int


@dataclass
class _LowLatencyHandle:
    sequence: int  # the runner's low-latency dispatch sequence
    num_tokens: int
    num_max: int
    topk_idx: np.ndarray  # host copy: combine entries are checked against it
    buffer: int = 0  # the receive buffer it filled


@dataclass
class _PreparedDispatch:
    """An armed low-latency dispatch: launches packed once (cuda_kernels.Launch)."""

    args: Any  # LowLatencyDispatchArgs (keeps the packed arrays alive)
    launch: Any
    done: tuple[Any, Any]  # the done kernel of a trigger into each receive buffer (its verdict)
    stats: Any
    counts: tuple[Any, Any]  # recv_count views of both receive buffers (for stats)
    # the sequence of the latest trigger into each receive buffer (0: none yet)
    sequences: list[int] = field(default_factory=lambda: [0] * abi.LL_BUFFERS)


@dataclass
class _PreparedCombine:
    args: Any
    launches: tuple[Any, Any]
    done: tuple[Any, ...]  # by receive buffer
    dispatch: _PreparedDispatch
    out: Any


class CudaRankComm(RankComm):
    backend_name = "cuda"
    stream_ordered = True  # layout/dispatch/combine may be stream-ordered (stream_calls.py)

    @property
    def combine_skips_failed_dispatch(self) -> bool:
        # The flat kernels read the handle's status (epd_combine_push, epd_combine_reduce);
        # a two-stage group's stage handles are not all checked so.
        return self.stages is None

    def __init__(self, backend: CudaBackend, spec: GroupSpec, membership: Membership) -> None:
        from . import cuda_runtime as rt

        self.spec, self.membership, self.backend = spec, membership, backend
        self.rank = membership.rank
        # Normal mode over nodes placed node-major: the hierarchical semantics, as on the CPU
        # backend; with --cuda-hierarchical stages its traffic too, in two stages
        # (cuda_stages.py; up to MAX_RANKS nodes x MAX_RANKS ranks); any other placement stays
        # flat.
        self.hierarchy = Hierarchy.of(membership.rank_nodes)
        stages = two_stage_hierarchy(spec, membership.rank_nodes,
                                     hierarchical_mode(backend.cfg),
                                     backend.multi_node)
        self.two_stage = stages is not None
        # A world over several nodes sizes every group with the staging of puts to other nodes
        # (the planner does the same), so that a group's layout does not depend on placement.
        self.mlayout = membership_layout(spec, remote=backend.multi_node,
                                         two_stage=self.two_stage)
        slot = self.mlayout.slot_bytes
        base, planned = decode_plan(membership.plan)  # the group's range of every heap
        need = group_bytes(spec, remote=backend.multi_node, hierarchy=stages)
        if need > planned:  # (node 0 planned it: a node laying it out larger would write
            # into the next group's range, e.g. nodes with different --cuda-hierarchical)
            raise FailedPrecondition(
                f"group {spec.name!r}: this engine lays the group out in {need} bytes, more "
                f"than the {planned} its plan reserved (do the nodes' --cuda-hierarchical "
                f"and versions differ?)")
        if base + need > backend.heap_bytes:
            raise ResourceExhausted("group buffers do not fit in the symmetric heap")
        peers, remote = peer_table(membership.rank_nodes, membership.rank_engines,
                                   backend.node_rank, base, slot, backend.peer_bases,
                                   backend.heap_base, backend.node_first_pe)
        # Ranks on other nodes: the kernels' NVSHMEM build (no pointer to their buffers).
        self.spans_nodes = bool(remote)
        kernels = backend.kernels
        if remote:
            from .cuda_remote import remote_kernels_for_device
            kernels = remote_kernels_for_device(backend.device)
        self.slot_offset = base + self.rank * slot  # in this engine's heap
        sd = storage_dtype(spec.x_numpy_dtype)
        # The group's service class: its SM budget caps the blocks of the data kernels (normal
        # mode uses it instead of --num-sms, low-latency at most it), and its rank stream runs
        # at the class's priority, so the GPU's block scheduler serves latency groups' kernels
        # first while throughput groups' run.
        self.num_sms, self.ll_num_sms = service_classes.kernel_blocks(
            backend.cfg, spec.service_class, backend.num_sms, backend.ll_num_sms)
        priority = backend.stream_priority(spec.service_class)
        with cp.cuda.Device(backend.device):
            self.runner = rt.RankRunner(kernels, self.mlayout.kernel, self.rank, peers,
                                        backend.device, sd, sd, owner=backend.heap,
                                        ll_layout=self.mlayout.low_latency,
                                        stream_priority=priority, remote=remote,
                                        num_nodes=(self.hierarchy.num_nodes
                                                   if self.hierarchy is not None
                                                   and not self.two_stage else 1))
            # A two-stage group's rail and node stage runners (their slots after the flat ones).
            self.stages = (self._stage_runner(stages, base, kernels, priority)
                           if stages is not None else None)
        self.stream_priority = self.runner.stream_priority
        # Clean control blocks before the attach barrier: a previous group at this offset may
        # have left flags or an abort word behind; then the address of this rank's host words.
        self.group_key = base
        self.host_slot = backend.host_words.acquire(base)
        word = np.array([backend.host_words.device_ptr(self.host_slot)], np.uint64)
        with cp.cuda.Device(backend.device):
            for runner in self._runners():
                runner.reset_ctrl()  # (low-latency histograms are read only under its flags)
                cp.cuda.runtime.memcpy(runner.base + abi.CTRL_HOST_WORDS * 8,
                                       word.ctypes.data, 8, cp.cuda.runtime.memcpyHostToDevice)
        cp.cuda.Stream.null.synchronize()
        self.output_region = backend.heap_region  # clients map the heap once, per session
        self._reason: str | None = None
        self._written = False  # this rank already raised the group's abort word
        self._stream_issued = 0  # the latest stream-ordered call's sequence (0: none)
        self._stream_slot: CounterSlot | None = None  # its counter slot (the READY ring)
        self._stream_ready_seen = 0  # the latest of them seen ready (no look again)
        self._done_launch: ck.Launch | None = None  # epd_call_done, packed for one slot
        self._done_slot = 0
        # A stream-ordered dispatch's output views by (rows, with top-k): fixed places of this
        # rank's buffers, made once (a CuPy view costs microseconds; rows do not change
        # between calls of one shape, since the count is not known when the engine answers).
        self._stream_views: dict[tuple[int, bool], dict[str, Any]] = {}
        self._prefix: Any = None  # the copy of a dispatch's rank prefix matrix (an extra)
        self.chain: LowLatencyChain | None = None  # armed ops run by the GPU (cuda_chain.py)
        self._closed_chain: LowLatencyChain | None = None  # the last one closed (may linger)
        # A chain's close (the member's last op went) and the next open (its next first op)
        # run on different threads: the open waits for the drain and makes a new chain.
        self._chain_lock = threading.Lock()
        self.peer_bases = peers  # where each rank's buffer (control block first) is
        if self.stages is None:
            self._stage_abort_tables: list[Any] = []
        # A replacement for a rank that went away takes part from the Rejoin collective on.
        self.rejoining = membership.rejoining
        backend.comms.add(self)

    def _stage_runner(self, h: Hierarchy, base: int, kernels: Any,
                      priority: int) -> StagedRunner:
        """This rank's rail and node stage runners (cuda_stages.py), the forwarder's combine
        partials at the end of its node slot."""
        b, m = self.backend, self.membership
        lays = stage_layouts(self.spec, h)
        region = b.heap_region  # (the output region: views of the heap by offset)
        slot = b.heap_base - region.ptr + base + lays.node_at(self.rank)
        rows = h.num_nodes * self.spec.max_tokens_per_rank
        partials = (region.typed(slot + lays.partial_x, (rows, self.spec.hidden),
                                 self.spec.x_numpy_dtype),
                    region.typed(slot + lays.partial_w, (rows, self.spec.num_topk), np.float32))
        place = Placement(m.rank_nodes, m.rank_engines, b.node_rank, b.peer_bases, b.heap_base,
                          b.node_first_pe)
        staged, self._stage_abort_tables = cuda_stages.build(
            self.runner, self.spec, h, place, base, b.kernels, kernels, b.heap, priority,
            partials)
        self._stage_bytes = lays.rail_bytes + lays.node_bytes
        return staged

    def _runners(self) -> tuple[Any, ...]:
        """This rank's runners: the group's, and a two-stage group's stage runners."""
        return (self.runner,) if self.stages is None else self.stages.runners

    def quiet(self) -> bool:
        """No kernel of this rank in flight or queued (an armed chain always has some)."""
        return (self.chain is None and self.runner.side_stream.done
                and all(r.stream.done for r in self._runners()))

    def _extra(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        # The output region starts at the IPC allocation, before our heap array: translate.
        start = self.backend.heap_base - self.output_region.ptr + self.slot_offset
        return self.output_region.typed(start + self.mlayout.extras[name], shape, dtype)

    def _prefix_view(self) -> Any:
        """Where a dispatch's rank prefix matrix is copied for the caller (an extra of the
        membership's slot; the view is made once)."""
        if self._prefix is None:
            r = self.spec.num_ranks
            self._prefix = self._extra("prefix", (r, r), np.int32)
        return self._prefix

    def _timeout_ns(self, deadline: float) -> int:
        return max(int((deadline - time.monotonic()) * 1e9), 1)

    def _raise_if_failed(self, runner: Any = None) -> None:
        runner = runner or self.runner
        err = runner.error()
        if err is None:
            return
        code, missing, phase, seq = err
        if self.stages is not None and runner is not self.runner:  # name group ranks
            missing = self.stages.group_rank(runner, missing)
            phase = f"{phase} of the {self.stages.stage_names[id(runner)]}"
        if code == ck.ERR_DEADLINE:
            self.abort(f"rank {missing} did not arrive at {phase} #{seq} before the deadline")
            raise DeadlineExceeded(f"group {self.spec.name!r}: rank(s) [{missing}] did not "
                                   f"arrive at {phase} (collective #{seq}) before the deadline")
        if code == ck.ERR_WORST_OVERFLOW:
            raise ResourceExhausted("received more tokens than num_worst_tokens")
        if code == ck.ERR_BAD_INPUT:
            # Peers already exchanged data with this rank: the group cannot go on consistently.
            self.abort(f"rank {self.rank} passed an invalid expert id to {phase} #{seq}")
            raise InvalidArgument(f"an expert id in {phase} #{seq} was out of range or never "
                                  f"dispatched; group {self.spec.name!r} is aborted")
        raise Aborted(f"group {self.spec.name!r} aborted: {self.abort_reason() or phase}")

    @_launches
    def layout(self, topk_idx: Any) -> LayoutOutputs:
        self._normal_mode("layout")
        r, e, t = self.spec.num_ranks, self.spec.num_experts, topk_idx.shape[0]
        out = LayoutOutputs(self._extra("ntpr", (r,), np.int32),
                            self._extra("ntpe", (e,), np.int32),
                            self._extra("itr", (t, r), np.bool_))
        with cp.cuda.Device(self.backend.device), self.runner.stream as s:
            self.backend.kernels.layout(topk_idx, e, r, stream=s, out=(
                out.num_tokens_per_rank, out.num_tokens_per_expert, out.is_token_in_rank))
            s.synchronize()
        return out

    def _normal_mode(self, what: str) -> None:
        """Normal-mode kernels take at most MAX_RANKS ranks (a token's destinations are one
        byte), on one node or across nodes (ranks on other nodes through NVSHMEM's device API:
        the NVSHMEM build, cuda_remote.py), and a two-stage group up to MAX_RANKS nodes of
        MAX_RANKS ranks (its stage groups are within the limit); a low-latency group may have
        more, for its low-latency calls."""
        from ...proto.errors import FailedPrecondition
        if self.spec.num_ranks > abi.MAX_RANKS and not self.two_stage:
            raise FailedPrecondition(f"group {self.spec.name!r} has {self.spec.num_ranks} ranks: "
                                     f"normal-mode {what} takes at most {abi.MAX_RANKS} on the "
                                     f"cuda engine; low-latency calls work")

    def _no_topk_refused(self, args: DispatchArgs) -> None:
        """As on the CPU backend: a hierarchical group's node stage routes by top-k ids, so a
        dispatch without top-k is refused there (before any kernel: peers that called with
        top-k wait for this rank until their deadline, which names it; a stream-ordered one
        of a direct-puts group takes part as refused instead, ops._refused_takes_part)."""
        if self.hierarchy is not None and _routing(args) is not None:
            raise self.hierarchy.no_topk_error(self.spec.name)

    @_launches
    def dispatch(self, args: DispatchArgs, counter_slot: CounterSlot, sequence: int,
                 deadline: float) -> DispatchOutputs:
        self._normal_mode("dispatch")
        self._no_topk_refused(args)
        if self.stages is not None:
            return self._staged_dispatch(args, counter_slot, sequence, deadline)
        spec, runner = self.spec, self.runner
        cached: _Handle | None = args.cached
        with cp.cuda.Device(self.backend.device):
            res = runner.dispatch(
                args.x, args.x_scales, args.topk_idx, args.topk_weights,
                alignment=args.expert_alignment, num_worst_tokens=args.num_worst_tokens,
                cached=cached.result if cached else None,
                counter_slot_ptr=0 if cached else counter_slot.device_ptr, counter_seq=sequence,
                timeout_ns=self._timeout_ns(deadline), num_sms=self.num_sms,
                routing=_routing(args), whole_group=True)
            if cached is None:
                num_recv, per_expert = self._counts(counter_slot, sequence, deadline,
                                                    args.num_worst_tokens)
            else:
                num_recv, per_expert = cached.num_recv, []
                counter_page.publish(counter_slot, sequence, num_recv, [])
            runner.stream.synchronize()
            self._raise_if_failed()
            if counter_slot[counter_page.STATUS]:
                raise Aborted(f"group {spec.name!r}: notify failed")
            rows = args.num_worst_tokens or num_recv
            outs = runner.output_views(res, rows)
            prefix = self._prefix_view()
            _copy_prefix(prefix, res.handle.rank_prefix, runner.stream)
            runner.stream.synchronize()
        item = args.x.dtype.itemsize
        return self._dispatch_outputs(args, res, outs, rows, prefix, num_recv, per_expert,
                                      bytes_received=num_recv * spec.hidden * item)

    def _counts(self, counter_slot: CounterSlot, sequence: int, deadline: float,
                num_worst: int = 0) -> tuple[int, list[int]]:
        """The receive counts notify publishes in the mapped page (the host learns them while
        the GPU goes on); a call every rank fails alike (capacity, `num_worst` receive rows
        exceeded, a rank's bad expert id or count) raises here."""
        spec = self.spec
        got = counter_page.wait(counter_slot, sequence, max(deadline - time.monotonic(), 0) + 1.0)
        if got is None:
            self.abort("notify did not publish counts before the deadline")
            raise DeadlineExceeded(f"group {spec.name!r}: notify did not publish its counts "
                                   f"before the deadline")
        num_recv, per_expert = got
        err = counter_page.alike_failure(counter_slot, spec.name, f"dispatch #{sequence}",
                                         spec.max_tokens_per_rank, num_worst, spec.num_experts)
        if err is not None:
            self.runner.stream.synchronize()  # (the data kernels skip the call)
            raise err
        if not counter_page.counts_in_range(num_recv, per_expert, spec.max_recv_tokens,
                                            spec.num_local_experts):
            raise Aborted(f"group {spec.name!r}: dispatch #{sequence}'s count in the counter "
                          f"page ({num_recv}) is not one the notify kernel writes")
        return num_recv, per_expert

    def _staged_dispatch(self, args: DispatchArgs, counter_slot: CounterSlot, sequence: int,
                         deadline: float) -> DispatchOutputs:
        """A two-stage group's dispatch: the whole group's notify (the counts reach the page
        first, as on one node), then the rail and node stages (cuda_stages.py)."""
        assert self.stages is not None
        spec, st, cached = self.spec, self.stages, args.cached
        counts: list[Any] = []

        def wait(runner: Any) -> None:
            if runner is st.flat:
                counts.append(self._counts(counter_slot, sequence, deadline))  # (alike: raised)
                status = int(counter_slot[counter_page.STATUS])
                if status:
                    # Notify failed (a rank missing, an abort): abort and raise now (the stage
                    # kernels queued behind it stop on the abort word), not after they have
                    # waited out their own deadlines.
                    self._raise_if_failed(st.flat)  # (names the missing rank)
                    self.abort(f"rank {self.rank}: the whole group's notify failed ({status})")
                    raise Aborted(f"group {spec.name!r}: notify failed")
            self._finish(runner)

        with cp.cuda.Device(self.backend.device):
            if cached is not None:
                counts.append((cached.num_recv, []))
                counter_page.publish(counter_slot, sequence, cached.num_recv, [])
            res = drive(st.dispatch(
                args.x, args.x_scales, args.topk_idx, args.topk_weights,
                alignment=args.expert_alignment, num_worst_tokens=args.num_worst_tokens,
                cached=cached.result if cached is not None else None,
                counter_slot_ptr=0 if cached is not None else counter_slot.device_ptr,
                counter_seq=sequence, timeout_ns=self._timeout_ns(deadline),
                num_sms=self.num_sms), wait)
            num_recv, per_expert = counts[0]
            got = st.node.recv_info(res.node)[0]
            if got != num_recv:  # the two stages and the whole group's notify disagree
                self.abort(f"rank {self.rank}: the node stage received {got} rows, notify "
                           f"counted {num_recv}")
                raise Internal(f"group {spec.name!r}: the node stage received {got} rows, "
                               f"notify counted {num_recv}; the group is aborted")
            rows = args.num_worst_tokens or num_recv
            outs = st.node.output_views(res.node, rows)
            prefix = self._prefix_view()
            _copy_prefix(prefix, res.flat.handle.rank_prefix, st.flat.stream)
            st.flat.stream.synchronize()
        item = args.x.dtype.itemsize
        return self._dispatch_outputs(args, res, outs, rows, prefix, num_recv, per_expert,
                                      bytes_received=num_recv * spec.hidden * item)

    def _finish(self, runner: Any) -> None:
        """One step of a staged call: the runner's stream done, its error raised."""
        runner.stream.synchronize()
        self._raise_if_failed(runner)

    def _dispatch_outputs(self, args: DispatchArgs, res: Any, outs: dict[str, Any], rows: int,
                          prefix: Any, num_recv: int, per_expert: list[int],
                          bytes_received: int = 0) -> DispatchOutputs:
        """The outputs of a dispatch as the engine describes them (both call paths)."""
        spec = self.spec
        recv_x = outs["recv_x"]
        if args.x.dtype == np.uint8 and spec.x_numpy_dtype.itemsize != 1:
            # FP8 payload: the same bytes, viewed as one byte per element
            recv_x = cp.ndarray((rows, spec.hidden), np.uint8, memptr=recv_x.data)
        recv_scales = outs.get("recv_x_scales") if args.x_scales is not None else None
        if recv_scales is not None:
            # epd_dispatch copies scale rows as bytes, packed at the call's row width (S
            # columns of 4 bytes, S <= hidden/128: every rank's the same, as DeepEP's): int32
            # words (packed UE8M0) arrive bit for bit; the view follows the call's S and dtype
            # (made anew only where they differ from the buffer's [rows, hidden/128] float32).
            cols, sdt = int(args.x_scales.shape[1]), np.dtype(args.x_scales.dtype)
            if cols != recv_scales.shape[1] or sdt != recv_scales.dtype:
                recv_scales = cp.ndarray((recv_scales.shape[0], cols), sdt,
                                         memptr=recv_scales.data)
        t = int(args.x.shape[0])
        no_topk = args.cached is None and args.topk_idx is None  # DeepEP returns None for them
        return DispatchOutputs(
            recv_x=recv_x, recv_x_scales=recv_scales,
            recv_topk_idx=None if no_topk else outs.get("recv_topk_idx"),
            recv_topk_weights=None if no_topk else outs.get("recv_topk_weights"),
            recv_src_idx=outs["recv_src_idx"],
            rank_prefix_matrix=prefix, num_recv_tokens=num_recv,
            num_recv_tokens_per_expert=per_expert, handle=_Handle(res, num_recv, t),
            # upper bound: rows sent per rank
            bytes_sent=t * spec.hidden * args.x.dtype.itemsize, bytes_received=bytes_received)

    @_launches
    def combine(self, args: CombineArgs, deadline: float) -> CombineOutputs:
        self._normal_mode("combine")
        spec, h = self.spec, args.handle
        t, k = h.num_tokens, spec.num_topk
        out = self._extra("combined_x", (t, spec.hidden), spec.x_numpy_dtype)
        out_w = self._extra("combined_w", (t, k), np.float32) \
            if args.topk_weights is not None else None
        with cp.cuda.Device(self.backend.device):
            if self.stages is not None:
                drive(self.stages.combine(
                    args.x, h.result, out, recv_topk_weights=args.topk_weights,
                    out_weights=out_w, bias_0=args.bias_0, bias_1=args.bias_1,
                    timeout_ns=self._timeout_ns(deadline), num_sms=self.num_sms), self._finish)
            else:
                self.runner.combine(args.x, h.result, out, recv_topk_weights=args.topk_weights,
                                    out_weights=out_w, bias_0=args.bias_0, bias_1=args.bias_1,
                                    timeout_ns=self._timeout_ns(deadline),
                                    num_sms=self.num_sms)
                self._finish(self.runner)
                self._raise_if_refused()
        nbytes = h.num_recv * spec.hidden * spec.x_numpy_dtype.itemsize
        return CombineOutputs(out, out_w, bytes_sent=nbytes, bytes_received=nbytes)

    # -- low-latency mode --------------------------------------------------------------------
    def _check_taking_part(self) -> None:
        from ...proto.errors import FailedPrecondition
        if self.rejoining:
            raise FailedPrecondition(
                f"rank {self.rank} rejoins group {self.spec.name!r}: it takes part from the "
                f"group's Rejoin collective on (Group.rejoin(), made by every rank)")

    def _ll_layout(self) -> ck.LowLatencyLayout:
        from ...proto.errors import FailedPrecondition
        self._check_taking_part()
        if self.mlayout.low_latency is None:
            raise FailedPrecondition(f"group {self.spec.name!r} was created without "
                                     f"low_latency_mode, so it has no low-latency buffers")
        return self.mlayout.low_latency

    @_launches
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs,
                             deadline: float) -> LowLatencyDispatchOutputs:
        from ...proto.errors import FailedPrecondition
        spec, runner = self.spec, self.runner
        self._ll_layout()
        if args.use_fp8 and spec.x_numpy_dtype != dtypes.BFLOAT16:
            raise FailedPrecondition("FP8 low-latency dispatch quantises bf16 inputs; the "
                                     f"group's dtype is {spec.x_numpy_dtype}")
        m, t = args.num_max_dispatch_tokens_per_rank, int(args.x.shape[0])
        self._no_chain()
        with cp.cuda.Device(self.backend.device):
            idx_host = (args.topk_idx_host if args.topk_idx_host is not None
                        else cp.asnumpy(args.topk_idx))
            seq = runner.ll_dispatch(args.x, args.topk_idx, m, fp8=args.use_fp8,
                                     round_scale=args.round_scale,
                                     timeout_ns=self._timeout_ns(deadline),
                                     num_sms=self.ll_num_sms, buffer=args.buffer)
            runner.stream.synchronize()
            self._raise_if_failed()
            # (the engine checked this rank's ids; another source's verdict fails it alike)
            code, source, token, value = counter_page.ll_header_verdict(
                cp.asnumpy(runner.ll_view("topk", (3,), np.uint64, args.buffer)))
            if code:
                raise counter_page.ll_verdict_error(
                    f"group {spec.name!r}, low-latency dispatch #{seq}", code, source, token,
                    value, spec.num_experts)
            outs = runner.ll_outputs(m, args.use_fp8, args.buffer)
            counts = cp.asnumpy(outs["recv_count"])
        row = spec.hidden * (1 if args.use_fp8 else spec.x_numpy_dtype.itemsize) + (
            spec.hidden // dtypes.FP8_BLOCK * 4 if args.use_fp8 else 0)
        n = int(counts.sum())
        return LowLatencyDispatchOutputs(
            recv_x=outs["recv_x"], recv_x_scales=outs.get("recv_x_scales"),
            recv_count=outs["recv_count"], recv_src_rank=outs["recv_src_rank"],
            recv_src_idx=outs["recv_src_idx"], num_recv_rows=n,
            handle=_LowLatencyHandle(seq, t, m, idx_host, args.buffer),
            bytes_sent=int((idx_host >= 0).sum()) * row, bytes_received=n * row)

    @_launches
    def low_latency_combine(self, args: LowLatencyCombineArgs,
                            deadline: float) -> LowLatencyCombineOutputs:
        from ...proto.errors import FailedPrecondition
        spec, runner = self.spec, self.runner
        self._ll_layout()
        h: _LowLatencyHandle = args.handle
        self._no_chain()
        if runner.ll_filled[h.buffer] != h.sequence:
            raise FailedPrecondition(ll_overwritten(h.sequence, h.buffer,
                                                  runner.ll_filled[h.buffer]))
        with cp.cuda.Device(self.backend.device):
            check_combine_routing(h.topk_idx, args.topk_idx_host if args.topk_idx_host is not None
                                  else cp.asnumpy(args.topk_idx))
            out = args.out
            if out is None:
                out = runner.ll_view("combined_x", (h.num_tokens, spec.hidden),
                                     storage_dtype(spec.x_numpy_dtype))
            runner.ll_combine(args.x, args.topk_idx, args.topk_weights, out, h.num_max,
                              timeout_ns=self._timeout_ns(deadline),
                              num_sms=self.ll_num_sms, buffer=h.buffer)
            runner.stream.synchronize()
            self._raise_if_failed()
        nbytes = int((h.topk_idx >= 0).sum()) * spec.hidden * spec.x_numpy_dtype.itemsize
        return LowLatencyCombineOutputs(out, bytes_sent=nbytes, bytes_received=nbytes)

    # -- stream-ordered low-latency calls ------------------------------------------------------
    def low_latency_outputs(self, num_max: int, use_fp8: bool,
                            buffer: int = 0) -> LowLatencyDispatchOutputs:
        from ...proto.errors import FailedPrecondition
        self._ll_layout()
        if use_fp8 and self.spec.x_numpy_dtype != dtypes.BFLOAT16:
            raise FailedPrecondition("FP8 low-latency dispatch quantises bf16 inputs; the "
                                     f"group's dtype is {self.spec.x_numpy_dtype}")
        outs = self.runner.ll_outputs(num_max, use_fp8, buffer)
        return LowLatencyDispatchOutputs(
            recv_x=outs["recv_x"], recv_x_scales=outs.get("recv_x_scales"),
            recv_count=outs["recv_count"], recv_src_rank=outs["recv_src_rank"],
            recv_src_idx=outs["recv_src_idx"], num_recv_rows=0, handle=None)

    def low_latency_combine_view(self, num_tokens: int) -> Any:
        self._ll_layout()
        return self.runner.ll_view("combined_x", (num_tokens, self.spec.hidden),
                                   storage_dtype(self.spec.x_numpy_dtype))

    def prepare_low_latency_dispatch(self, args: LowLatencyDispatchArgs, stats: Any,
                                     done_ptr: int, timeout: float) -> _PreparedDispatch:
        self._check_taking_part()
        # No host checks of the data at trigger time (the inputs are only ready once the
        # client's stream got there): every rank's kernel reads every source's verdict on its
        # ids (out of range, or an expert twice in a token), fails the call alike and moves
        # nothing, and the done word carries the verdict (the group goes on).
        runner = self.runner
        with cp.cuda.Device(self.backend.device):
            try:
                launch = runner.k.ll_dispatch_launch(
                    args.x, args.topk_idx, runner.ll, self.rank, runner.peers,
                    args.num_max_dispatch_tokens_per_rank, fp8=args.use_fp8,
                    round_scale=args.round_scale, timeout_ns=int(timeout * 1e9),
                    num_sms=self.ll_num_sms)
            except ValueError as e:
                raise InvalidArgument(f"stream-ordered dispatch: {e}") from None
            done = tuple(runner.k.stream_done_launch(
                runner.peers, self.rank, done_ptr,
                runner.ll_view("topk", (4,), np.uint64, b).data.ptr)
                for b in range(abi.LL_BUFFERS))
            counts = tuple(runner.ll_view("recv_count", (self.spec.num_local_experts,),
                                          np.int32, b) for b in range(abi.LL_BUFFERS))
        return _PreparedDispatch(args, launch, done, stats, counts)

    def prepare_low_latency_combine(self, args: LowLatencyCombineArgs, dispatch: Any,
                                    done_ptr: int, timeout: float) -> _PreparedCombine:
        self._check_taking_part()
        runner, d = self.runner, dispatch.args
        t, m = int(d.x.shape[0]), d.num_max_dispatch_tokens_per_rank
        with cp.cuda.Device(self.backend.device):
            out = args.out if args.out is not None else self.low_latency_combine_view(t)
            try:
                launches = runner.k.ll_combine_launches(
                    args.x, args.topk_idx, args.topk_weights, out, runner.ll, self.rank,
                    runner.peers, m, timeout_ns=int(timeout * 1e9),
                    num_sms=self.ll_num_sms)
            except ValueError as e:
                raise InvalidArgument(f"stream-ordered combine: {e}") from None
            # (per receive buffer: the verdict words of the combine of its dispatch)
            done = tuple(runner.k.stream_done_launch(
                runner.peers, self.rank, done_ptr,
                runner.ll_view("topk", (abi.LL_TOPK_HEADER // 8,), np.uint64, b).data.ptr
                + 8 * abi.LL_COMBINE_VERDICT, combine=True)
                for b in range(abi.LL_BUFFERS))
        return _PreparedCombine(args, launches, done, dispatch, out)

    @_launches
    def launch_prepared(self, prepared: Any, buffer: int = 0) -> None:
        # (Not under `enqueue`: the poller serves latency-class ops, which must not wait for
        # a throughput group's enqueue; with it, decode under prefill went 454 -> 696 µs p50.)
        if not cuda_chain.TIMELINE:
            self._launch_prepared(prepared, buffer)
            return
        # The diagnostic timeline: the GPU time of the poller's launches, beside the chain's
        # segments (cuda_chain.py; read back at a later call, off this one's path).
        stream = self.runner.stream
        start = cp.cuda.Event()
        start.record(stream)
        self._launch_prepared(prepared, buffer)
        end = cp.cuda.Event()
        end.record(stream)
        kind = "dispatch" if isinstance(prepared, _PreparedDispatch) else "combine"
        cuda_chain.time_launch(kind, start, end)

    def _launch_prepared(self, prepared: Any, buffer: int) -> None:
        runner = self.runner
        if isinstance(prepared, _PreparedDispatch):
            prepared.sequences[buffer] = runner.ll_dispatch_again(prepared.launch, buffer)
            if prepared.stats is not None:
                with runner.stream:
                    prepared.stats += prepared.counts[buffer]
            prepared.done[buffer](runner.stream)
            return
        mine = prepared.dispatch.sequences[buffer]
        if not mine or runner.ll_filled[buffer] != mine:
            raise NotFilled(
                f"receive buffer {buffer} does not hold the armed dispatch: "
                + (ll_overwritten(mine, buffer, runner.ll_filled[buffer]) if mine else
                   "it was never triggered into that buffer (trigger the dispatch first)"))
        runner.ll_combine_again(prepared.launches, buffer)
        prepared.done[buffer](runner.stream)

    def _no_chain(self) -> None:
        """A synchronous low-latency call launches from the engine's host with the host's
        sequences, on the rank's stream: with a chain parked on the GPU, that stream can sit
        behind the chain's pending wait in a hardware queue (seen on the H200: the call ran
        into its deadline), so it is refused while the member's armed ops are chained."""
        from ...proto.errors import FailedPrecondition
        if self.chain is not None:
            raise FailedPrecondition(
                f"group {self.spec.name!r}: rank {self.rank} runs its armed low-latency ops on "
                f"a GPU chain (--ll-chain on, or auto for a client on the engine's MPS "
                f"server); a synchronous low-latency call is refused while they are armed "
                f"(disarm them, use an armed op, or serve with --ll-chain off)")

    @_launches
    def open_chain(self, ring_words: np.ndarray, ring_ptr: int) -> LowLatencyChain:
        """The member's low-latency chain in the given counter slot (cuda_chain.py)."""
        with self._chain_lock:
            if self.chain is None:
                with cp.cuda.Device(self.backend.device):
                    # The rank's own build: a group over nodes needs the NVSHMEM one, whose
                    # kernels reach the ranks elsewhere (the one-node build has none to them).
                    self.chain = LowLatencyChain(
                        self.runner, self.runner.k, ring_words, ring_ptr, self.ll_num_sms,
                        self.stream_priority, gate=self.backend.cfg.ll_chain_gate,
                        trait=ck._trait_for(storage_dtype(self.spec.x_numpy_dtype)),
                        group=self.spec.label, reserve=self.backend.graph_reserve)
            return self.chain

    def close_chain(self, timeout: float, freed: Callable[[], None] | None = None) -> None:
        with self._chain_lock:
            if self.chain is not None:
                with cp.cuda.Device(self.backend.device):
                    self.chain.close(timeout)
                self._closed_chain, self.chain = self.chain, None
            closed = self._closed_chain  # (closed here or before, drained or lingering)
        if freed is not None:
            if closed is not None:
                closed.on_released(freed)
            else:
                freed()

    # -- stream-ordered normal-mode calls (engine/stream_calls.py) ---------------------------
    def _stream_begin(self, slot: CounterSlot, stream_seq: int) -> None:
        """Order the rank's stream after the client's: a GPU-side wait for READY, no host wait."""
        word = slot.device_ptr + 4 * (abi.SLOT32_READY + stream_seq % abi.READY_RING)
        cuda_driver.stream_wait_geq(self.runner.stream.ptr, word, stream_seq)
        self._stream_issued, self._stream_slot = stream_seq, slot

    def await_stream_ready(self, deadline: float) -> None:
        # A synchronous call synchronises the rank's stream: behind a READY wait the client
        # never satisfies, that would hold the session's worker with no deadline.
        seq, slot = self._stream_issued, self._stream_slot
        if seq == self._stream_ready_seen or slot is None:
            return
        if counter_page.stream_ready(slot, seq):
            self._stream_ready_seen = seq
            return
        if not spin.wait_until(lambda: counter_page.stream_ready(slot, seq),
                               max(deadline - time.monotonic(), 0.0)):
            raise DeadlineExceeded(
                f"group {self.spec.name!r}: stream-ordered call #{seq} has not started by the "
                f"deadline (the client's stream has not reached it: its READY word is "
                f"unwritten), and a synchronous call runs after it on the rank's stream")
        self._stream_ready_seen = seq

    def _stream_end(self, slot: CounterSlot, stream_seq: int) -> None:
        done = self._done_launch
        if done is None or self._done_slot != slot.device_ptr:
            done = self._done_launch = self.backend.kernels.call_done_launch(
                self.runner.peers, self.rank, slot.device_ptr)
            self._done_slot = slot.device_ptr
        done.set(ck.CALL_DONE_SEQ, stream_seq)
        done(self.runner.stream)

    def signal_after(self, ptr: int, value: int) -> None:
        """Write `value` to the 32-bit word at device address `ptr` once the rank's stream has
        run what it holds (a captured normal-mode call's done word, engine/captured_calls.py)."""
        with self.backend.enqueue, cp.cuda.Device(self.backend.device):
            cuda_driver.stream_write(self.runner.stream.ptr, ptr, value)

    def drain_stream(self, timeout: float) -> bool:
        try:
            return spin.wait_until(lambda: self.runner.stream.done, timeout)
        except Exception as e:  # (a broken context: nothing more will run on it)
            log.error("group %r: rank %d's stream cannot be asked: %s", self.spec.name,
                      self.rank, e)
            return False

    def stream_layout(self, topk_idx: Any, out: tuple[Any, Any, Any], counter_slot: CounterSlot,
                      stream_seq: int) -> Callable[[], None]:
        self._normal_mode("layout")
        return functools.partial(self._launch_layout, topk_idx, out, counter_slot, stream_seq)

    @_launches
    def _launch_layout(self, topk_idx: Any, out: tuple[Any, Any, Any], counter_slot: CounterSlot,
                       stream_seq: int) -> None:
        s = self.runner.stream
        with self.backend.enqueue, cp.cuda.Device(self.backend.device):
            self._stream_begin(counter_slot, stream_seq)
            self.backend.kernels.layout(topk_idx, self.spec.num_experts, self.spec.num_ranks,
                                        stream=s, out=out, call_err=self.runner.base)
            self._stream_end(counter_slot, stream_seq)

    @_launches
    def stream_dispatch(self, args: DispatchArgs, counter_slot: CounterSlot, sequence: int,
                        deadline: float, stream_seq: int,
                        num_sms: int) -> tuple[DispatchOutputs, Callable[[], None]]:
        self._normal_mode("dispatch")
        self._no_topk_refused(args)
        cached: _Handle | None = args.cached
        with cp.cuda.Device(self.backend.device):  # (the handle is made now: the outputs name it)
            t, made = int(args.x.shape[0]), cached.result if cached else None
            if self.stages is not None:  # (the node stage's rows are the call's)
                res = self.stages.dispatch_result(t, made, args.num_worst_tokens)
                out_runner, out_res = self.stages.node, res.node
            else:
                res = self.runner.dispatch_result(
                    t, made, args.num_worst_tokens,
                    refill=args.refill.result if args.refill is not None else None)
                out_runner, out_res = self.runner, res
            prefix = self._prefix_view()
        if cached is not None:  # known: the client reads it from the page as for any dispatch
            num_recv = cached.num_recv
            counter_page.publish(counter_slot, sequence, num_recv, [])
        else:
            num_recv = -1
        rows = args.num_worst_tokens or (num_recv if num_recv >= 0 else
                                         self.mlayout.kernel.max_recv)
        views = self._stream_views.get((rows, out_res.with_meta))
        if views is None:
            if len(self._stream_views) >= 64:
                self._stream_views.clear()
            views = self._stream_views[rows, out_res.with_meta] = out_runner.output_views(
                out_res, rows)
        outputs = self._dispatch_outputs(args, res, views, rows, prefix, num_recv, [])
        return outputs, functools.partial(self._launch_dispatch, args, res, counter_slot,
                                          sequence, deadline, stream_seq, num_sms, prefix)

    @_launches
    def _launch_dispatch(self, args: DispatchArgs, res: Any, counter_slot: CounterSlot,
                         sequence: int, deadline: float, stream_seq: int, num_sms: int,
                         prefix: Any) -> None:
        runner = self.runner
        cached: _Handle | None = args.cached
        with self.backend.enqueue, cp.cuda.Device(self.backend.device):
            self._stream_begin(counter_slot, stream_seq)
            common = {"alignment": args.expert_alignment,
                      "num_worst_tokens": args.num_worst_tokens,
                      "cached": cached.result if cached else None,
                      "counter_slot_ptr": 0 if cached else counter_slot.device_ptr,
                      "counter_seq": sequence, "timeout_ns": self._timeout_ns(deadline),
                      "num_sms": num_sms or self.num_sms, "result": res}
            if self.stages is not None:
                self.stages.launch(self.stages.dispatch(args.x, args.x_scales, args.topk_idx,
                                                        args.topk_weights, **common))
                _copy_prefix(prefix, res.flat.handle.rank_prefix, runner.stream)
            else:
                runner.dispatch(args.x, args.x_scales, args.topk_idx, args.topk_weights,
                                routing=_routing(args), whole_group=True, **common)
                _copy_prefix(prefix, res.handle.rank_prefix, runner.stream)
            self._stream_end(counter_slot, stream_seq)

    @_launches
    def refuse_stream_dispatch(self, deadline: float) -> bool:
        spec = self.spec
        if self.stages is None and spec.num_ranks > abi.MAX_RANKS:
            return False  # (no normal mode there: every rank's call is refused alike)
        with self.backend.enqueue, cp.cuda.Device(self.backend.device):
            if self.stages is not None:  # (the whole group's notify, then both stages)
                self.stages.launch(self.stages.refused_dispatch(
                    spec.num_topk, spec.hidden, spec.x_numpy_dtype.itemsize, ck.ERR_REFUSED,
                    self._timeout_ns(deadline)))
            else:
                self.runner.refuse_dispatch(spec.num_topk, self._timeout_ns(deadline))
        return True

    @_launches
    def refuse_stream_combine(self, handle: Any, deadline: float) -> bool:
        if self.stages is not None or self.spec.num_ranks > abi.MAX_RANKS:
            return False  # (its stages' reduces do not read the verdict: not built)
        with self.backend.enqueue, cp.cuda.Device(self.backend.device):
            self.runner.refuse_combine(None if handle is None else handle.result,
                                       self._timeout_ns(deadline))
        return True

    def _raise_if_refused(self) -> None:
        """A synchronous combine whose peer's engine refused its stream-ordered part: the
        reduce wrote nothing and recorded ERR_REFUSED as a call's bad input, which no
        epd_call_done reports on this path. Raised here, the words cleared (else the rank's
        next stream-ordered call would report it as its own)."""
        ctrl = self.runner.views["ctrl"]
        words = cp.asnumpy(ctrl[:abi.CTRL_CALL_ERR_VALUE + 1])
        if int(words[abi.CTRL_CALL_ERR]) != abi.ERR_REFUSED:
            return
        stream = self.runner.stream
        for w in (abi.CTRL_CALL_ERR, abi.CTRL_CALL_ERR_VALUE):  # (not the ticket between)
            cp.cuda.runtime.memsetAsync(ctrl.data.ptr + 8 * w, 0, 8, stream.ptr)
        stream.synchronize()
        raise FailedPrecondition(
            f"group {self.spec.name!r}: rank {int(words[abi.CTRL_CALL_ERR_VALUE])}'s engine "
            f"refused its part of the combine (that rank's caller got the reason); nothing was "
            f"combined and the group goes on")

    def stream_combine(self, args: CombineArgs, out: Any, out_weights: Any | None,
                       counter_slot: CounterSlot, deadline: float, stream_seq: int,
                       num_sms: int) -> Callable[[], None]:
        self._normal_mode("combine")
        return functools.partial(self._launch_combine, args, out, out_weights, counter_slot,
                                 deadline, stream_seq, num_sms)

    @_launches
    def _launch_combine(self, args: CombineArgs, out: Any, out_weights: Any | None,
                        counter_slot: CounterSlot, deadline: float, stream_seq: int,
                        num_sms: int) -> None:
        with self.backend.enqueue, cp.cuda.Device(self.backend.device):
            self._stream_begin(counter_slot, stream_seq)
            common = {"recv_topk_weights": args.topk_weights, "out_weights": out_weights,
                      "bias_0": args.bias_0, "bias_1": args.bias_1,
                      "timeout_ns": self._timeout_ns(deadline), "num_sms": num_sms or self.num_sms}
            if self.stages is not None:
                self.stages.launch(self.stages.combine(args.x, args.handle.result, out, **common))
            else:
                self.runner.combine(args.x, args.handle.result, out, **common)
            self._stream_end(counter_slot, stream_seq)

    def release_stream(self, counter_slot: CounterSlot) -> None:
        """Let the stream pass every READY wait given to it (the client is gone or leaving):
        the host writes the ring itself. Raise the abort word first, or kernels that run then
        wait for peers until their deadline."""
        if not self._stream_issued:
            return
        ring = counter_slot.view(np.int32)[abi.SLOT32_READY:abi.SLOT32_READY + abi.READY_RING]
        for i in range(abi.READY_RING):
            if not counter_page.seq_reached(int(ring[i]) & 0xFFFFFFFF, self._stream_issued):
                ring[i] = np.int32(np.uint32(self._stream_issued))

    def known_abort_reason(self) -> str | None:
        return self._reason

    @property
    def held_bytes(self) -> int:
        # The rank's slot of the heap range: kernel buffers, outputs, low-latency buffers (and
        # a two-stage group's rail and node slots).
        return self.mlayout.slot_bytes + (self._stage_bytes if self.stages is not None else 0)

    def handle_bytes(self, low_latency: bool, num_tokens: int, num_topk: int) -> int:
        if low_latency:  # _LowLatencyHandle: the host copy of topk_idx, [T, K] int64
            return 8 * num_tokens * num_topk
        # _Handle: device arrays (DispatchHandle), one per stage runner (dispatch_result)
        if self.stages is None:
            sized = ((self.runner, num_tokens),)
        else:
            st = self.stages
            sized = ((st.flat, num_tokens), (st.rail, num_tokens),
                     (st.node, st.rail.layout.max_recv))
        return sum(ck.DispatchHandle.nbytes_for(t, run.layout.num_ranks,
                                                run.layout.num_local_experts, run.num_nodes)
                   for run, t in sized)

    @_launches
    def abort(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        if self.abort_reason() is not None and self._written:
            return
        self._written = True
        code = ((self.rank + 1) << abi.ABORT_RANK_SHIFT) | ck.ERR_ABORTED
        # The ranks on this engine see it at once (host words); the kernel writes every rank's
        # control block for the other engines, and is not awaited (HostControlWords).
        self.backend.host_words.abort(self.group_key, code)
        with cp.cuda.Device(self.backend.device):
            self.runner.abort(code)
            for table in self._stage_abort_tables:  # every rank's rail and node blocks
                self.runner.k.abort(table, self.spec.num_ranks, code,
                                    stream=self.runner.side_stream)

    # -- rank masking (shrink groups): the kernels' waits skip a rank that went away --------
    supports_rank_masking = True

    def mask_states(self) -> list[int]:
        with cp.cuda.Device(self.backend.device):
            ctrl = cp.asnumpy(self.runner.views["ctrl"][:abi.CTRL_LIVE_MASK + 1])
        gone = int(ctrl[abi.CTRL_MASK]) | self.backend.host_words.read(self.host_slot)[1]
        live = int(ctrl[abi.CTRL_LIVE_MASK])
        return [self.MASK_GONE if (gone >> r) & 1 else
                self.MASK_MASKED if (live >> r) & 1 else self.MASK_IN
                for r in range(self.spec.num_ranks)]

    @_launches
    def set_mask(self, rank: int, state: int) -> None:
        # Every rank's CTRL_LIVE_MASK; each low-latency dispatch agrees on the set it leaves
        # out from what its sources saw (cuda/epd_low_latency.cu, left_out).
        self.runner.live_mask(rank, state == self.MASK_MASKED)

    # -- rejoin: a replacement takes a gone rank's place (cuda_rejoin.py) ----------------
    device_words = DeviceWords()  # (host reads and writes of control-block words)

    @_launches
    def rejoin(self, rank: int, deadline: float) -> None:
        """The Rejoin collective for `rank` (cuda_rejoin.py): from the next call on every rank
        waits for the replacement; a deadline anywhere leaves the rank masked and the group
        going on without it."""
        from ...proto.errors import FailedPrecondition
        if self.spans_nodes:
            raise FailedPrecondition(f"group {self.spec.name!r} spans nodes: a rank cannot "
                                     f"rejoin it on the cuda engine (not built across nodes)")
        if self.chain is not None:
            raise FailedPrecondition(f"rank {self.rank} of group {self.spec.name!r} has an "
                                     f"armed low-latency chain (--ll-chain): no rejoin")
        with cp.cuda.Device(self.backend.device):
            if rank == self.rank:
                if not self.rejoining:
                    raise FailedPrecondition(f"rank {rank} of group {self.spec.name!r} takes "
                                             f"part already: only a replacement rejoins")
                cuda_rejoin.as_replacement(self, deadline)
            else:
                self._check_taking_part()
                if self.mask_states()[rank] != self.MASK_GONE:
                    raise FailedPrecondition(f"rank {rank} of group {self.spec.name!r} has not "
                                             f"gone away: there is nothing to rejoin")
                cuda_rejoin.as_peer(self, rank, deadline)

    @_launches
    def stop(self, reason: str) -> None:
        # This rank's own kernels in flight finish (or meet their deadline): stopping them
        # half-way would publish part of its rows as if complete.
        log.info("group %r: rank %d masked for its peers: %s", self.spec.name, self.rank, reason)
        # As abort: the host words at once, the control blocks by a kernel not awaited.
        self.backend.host_words.mark_gone(self.group_key, self.rank)
        self.runner.mask_rank(self.rank)

    def abort_reason(self) -> str | None:
        if self._reason is not None:
            return self._reason
        with cp.cuda.Device(self.backend.device):
            words = cp.asnumpy(self.runner.views["ctrl"][:8]).astype(np.int64)
        word = int(words[abi.CTRL_ABORT]) or self.backend.host_words.read(self.host_slot)[0]
        if word == 0:
            return None
        who = (word >> abi.ABORT_RANK_SHIFT) - 1
        if who == self.rank and int(words[abi.CTRL_ERR_CODE]) == abi.ERR_BAD_INPUT:
            # this rank's own kernels aborted the group: say on what
            value = int(words[abi.CTRL_CALL_ERR_VALUE])
            what = (f"expert id {value}" if value > abi.LL_ROW_OVERFLOW // 2 else
                    f"row {abi.LL_ROW_OVERFLOW - value} of one source's rows for an expert, "
                    f"past num_max_dispatch_tokens_per_rank (an expert id twice in a token)")
            phase = abi.PHASE_NAMES.get(int(words[abi.CTRL_ERR_PHASE]), "?")
            return (f"rank {who} passed bad input to {phase} #{int(words[abi.CTRL_ERR_SEQ])}: "
                    f"{what}")
        return (f"rank {who} left the group or failed" if who >= 0
                else "the group was aborted")

    @_launches
    def close(self) -> None:
        self.close_chain(self.backend.cfg.timeout_seconds)
        with cp.cuda.Device(self.backend.device):
            for runner in self._runners():
                runner.stream.synchronize()
            self.runner.side_stream.synchronize()  # an abort or mask write not awaited
            for runner in self._runners():
                runner.reset_ctrl()  # the next group at this offset starts clean
            self.backend.host_words.release(self.group_key, self.host_slot)
            # Only the legacy stream the memset ran on: a device-wide sync would wait for
            # other ranks' kernels, which may be spinning on this GPU.
            cp.cuda.Stream.null.synchronize()


class CudaBackend(Backend):
    name = "cuda"
    proto_kind = epd_pb2.CUDA
    peer_class = "nvlink"
    supports_dispatch_without_topk = True  # epd_notify routes by is_token_in_rank
    agrees_on_capacity = True  # epd_notify fails a call over capacity on every rank
    dense_routing = True  # (the kernels take topk_idx / weights / is_token_in_rank by address)

    def __init__(self, cfg: Any, index: int, device: int | None = None) -> None:
        if cp is None:
            raise RuntimeError("the cuda backend needs CuPy (pip install 'epd[cuda]')")
        import nvshmem.core as nc
        from cuda.core import Device

        device = index if device is None else device  # (class engines share one)
        self.cfg, self.index, self.device, self._nc = cfg, index, device, nc
        self.planner = CudaPlanner(cfg)
        self.num_sms = cfg.num_sms or abi.DEFAULT_NUM_SMS
        # Held around a stream-ordered call's launches by the sessions' threads: the driver
        # and the GIL serve one enqueuer at a time faster than several at once (the poller's
        # armed launches stay outside it, see launch_prepared).
        self.enqueue: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if cfg.serial_enqueue else contextlib.nullcontext())
        self.ll_num_sms = cfg.ll_num_sms or abi.DEFAULT_LL_NUM_SMS
        sms = int(cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
        service_classes.check_blocks(cfg, sms, device, abi.DEFAULT_LL_NUM_SMS)
        self.ll_num_sms = min(self.ll_num_sms, sms)  # (the default on a GPU of fewer SMs)
        boot = _bootstrap(cfg, index)
        dev = Device(device)
        dev.set_current()
        cp.cuda.Device(device).use()
        # Stream priorities of the service classes: latency the greatest (numerically lowest),
        # throughput the least (the default streams' priority).
        from cuda.bindings import runtime as cudart
        err, least, greatest = cudart.cudaDeviceGetStreamPriorityRange()
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaDeviceGetStreamPriorityRange failed: {err}")
        self.priority_range = (int(least), int(greatest))
        uid = nc.get_unique_id(empty=True)
        uid._data.view(np.uint8)[:] = np.frombuffer(boot.nvshmem_uid, np.uint8)
        nc.init(device=dev, uid=uid, rank=boot.pe, nranks=boot.num_pes,
                initializer_method="uid")
        self.comms: weakref.WeakSet[CudaRankComm] = weakref.WeakSet()
        self.closer = QuietCloser(
            self._quiet, metrics.CUDA_CLOSES_PENDING.labels(str(index)).set, self.thread_init)
        self.heap_bytes = boot.heap_bytes or cfg.nvshmem_heap_bytes  # (latency engines' own)
        self.heap = nc.array((self.heap_bytes,), dtype="uint8")  # collective, same order
        self.heap.fill(0)
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device(device).synchronize()
        nc.barrier_all(stream=stream)
        stream.synchronize()
        base = self.heap_base = int(self.heap.data.ptr)
        # This node's engines by pointer (NVLink); PEs of other nodes only through NVSHMEM's
        # device API (cuda_remote.py), so no peer pointer is asked for them.
        self.node_rank = cfg.node_rank
        self.node_first_pe = tuple(boot.node_first_pe)
        self.multi_node = bool(self.node_first_pe)
        first = self.node_first_pe[self.node_rank] if self.multi_node else 0
        ends = (*self.node_first_pe[1:], boot.num_pes)
        last = ends[self.node_rank] if self.multi_node else boot.num_pes
        # Keyed by engine index (the coordinator's rank_engines): with class engines the
        # latency engines' world numbers its PEs from 0 while their indices follow the others'.
        shift = index - (boot.pe - first)
        self.peer_bases = {p - first + shift: base if p == boot.pe else
                           int(nc.get_peer_array(self.heap, p).data.ptr)
                           for p in range(first, last)}
        try:
            ipc = cp.cuda.runtime.ipcGetMemHandle(base)
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise RuntimeError("the symmetric heap cannot be exported over CUDA IPC; start the "
                               "engines with NVSHMEM_DISABLE_CUDA_VMM=1") from e
        # The handle names the whole allocation NVSHMEM made, which a client maps from its
        # start: output offsets are relative to that start, not to our array inside it.
        from cuda.bindings import driver
        err, alloc_base, alloc_size = driver.cuMemGetAddressRange(driver.CUdeviceptr(base))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemGetAddressRange on the heap failed: {err}")
        self.heap_region = DeviceRegion(f"heap{index}", int(alloc_base), int(alloc_size), device,
                                        ipc_handle=bytes(ipc))
        self.heap_region.borrowed = True  # shared by all sessions; never closed by one
        self.host_words = HostControlWords(device)
        self.kernels = ck.kernels_for_device(device)  # compiled and loaded before serving
        self.graph_reserve = self._graph_reserve(cfg)
        if self.multi_node:  # the NVSHMEM build too, loaded before any stream waits on a client
            from .cuda_remote import remote_kernels_for_device
            remote_kernels_for_device(device)
        props = cp.cuda.runtime.getDeviceProperties(device)
        self._name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        raw = props.get("uuid", b"")
        self._uuid = "GPU-" + bytes(raw).hex() if raw else f"GPU{index}"
        log.info("engine %d: device %d, NVSHMEM PE %d/%d, heap %.1f GiB, %s", index, device,
                 boot.pe, boot.num_pes, self.heap_bytes / 2**30, self._name)

    def _graph_reserve(self, cfg: Any) -> cuda_chain.GraphReserve | None:
        """Room for the chains' graphs, made now: later, growing it would wait for running
        kernels (cuda_chain.GraphReserve). None where no chain can use graphs (no chain on
        this engine, the timeline's or the gate kernel's launches), or where making the room
        failed: the chains then enqueue by launches."""
        chains = chain_limit(cfg)
        if (not cfg.ll_chain_graphs or cfg.ll_chain == "off" or chains <= 0
                or cfg.ll_chain_gate or cuda_chain.TIMELINE):
            return None
        try:
            return cuda_chain.GraphReserve(self.kernels, self.ll_num_sms, chains)
        except Exception as e:  # (a driver or memory error: launches still work)
            log.warning("engine %d: no room for the low-latency chains' CUDA graphs (%s); "
                        "the chains enqueue their instances by launches", self.index, e)
            return None

    def thread_init(self) -> None:
        cp.cuda.Device(self.device).use()

    def stream_priority(self, service_class: int) -> int:
        """The CUDA priority of a rank stream of this class (lower is more urgent)."""
        return service_classes.stream_priority(service_class, *self.priority_range)

    def device_info(self) -> dict[str, Any]:
        return {"name": self._name, "uuid": self._uuid, "ordinal": self.device}

    def open_region(self, region_id: str, *, ipc_handle: bytes = b"",
                    size: int, device_ordinal: int = 0) -> Region:
        from cuda.bindings import driver

        if not ipc_handle:
            raise InvalidArgument("the cuda backend takes CUDA IPC handles (cuda_ipc_handle)")
        if len(ipc_handle) != 64:
            raise InvalidArgument(f"a CUDA IPC memory handle has 64 bytes, got {len(ipc_handle)}")
        with cp.cuda.Device(self.device):
            try:
                ptr = cp.cuda.runtime.ipcOpenMemHandle(ipc_handle, 1)
            except cp.cuda.runtime.CUDARuntimeError as e:
                raise InvalidArgument(f"cannot open the CUDA IPC handle: {e}") from None
            region = DeviceRegion(region_id, ptr, size, self.device, closer=self.closer)
            try:
                attrs = cp.cuda.runtime.pointerGetAttributes(ptr)
                if attrs.device != self.device:
                    raise InvalidArgument(f"the region lives on GPU {attrs.device}; this engine "
                                          f"serves GPU {self.device}")
                err, _base, extent = driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr))
                if err != driver.CUresult.CUDA_SUCCESS:
                    raise InvalidArgument(f"cuMemGetAddressRange failed: {err}")
                if size > int(extent):
                    raise InvalidArgument(f"the region declares {size} bytes but its "
                                          f"allocation has {int(extent)}")
            except EpdError:
                region.close()
                raise
        return region

    def open_counter_page(self) -> CounterPage:
        return MappedCounterPage(self.device, self.closer)

    def _quiet(self) -> bool:
        return all(c.quiet() for c in list(self.comms))

    def attach(self, spec: GroupSpec, membership: Membership) -> RankComm:
        return CudaRankComm(self, spec, membership)

    def to_host(self, array: Any) -> np.ndarray:
        with cp.cuda.Device(self.device):
            return cp.asnumpy(array)

    def check_event(self, handle: bytes) -> None:
        pass  # (a handle is opened, and checked, by the wait)

    def settle(self) -> None:
        with cp.cuda.Device(self.device):
            cp.cuda.get_current_stream().synchronize()

    def wait_event(self, cache: dict[bytes, Any], handle: bytes) -> None:
        if not handle:
            return
        ev = cache.get(handle)
        with cp.cuda.Device(self.device):
            if ev is None:
                try:
                    ev = cp.cuda.runtime.ipcOpenEventHandle(handle)
                except cp.cuda.runtime.CUDARuntimeError as e:
                    raise InvalidArgument(f"cannot open the ready_event handle: {e}") from None
                cache[handle] = ev
            cp.cuda.runtime.eventSynchronize(ev)

    def close_events(self, cache: dict[bytes, Any]) -> None:
        with cp.cuda.Device(self.device):
            for ev in cache.values():
                with contextlib.suppress(Exception):
                    cp.cuda.runtime.eventDestroy(ev)
        cache.clear()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            cp.cuda.Device(self.device).synchronize()
            self.closer.stop()
            self._nc.free_array(self.heap)
            self._nc.finalize()
        with contextlib.suppress(Exception):
            self.host_words.close()  # (after the device's last kernel)


def _bootstrap(cfg: Any, index: int):
    import grpc

    from ...proto.v1 import epd_pb2, epd_pb2_grpc
    from ..config import node_metadata

    with grpc.insecure_channel(f"unix://{cfg.node_socket}") as ch:
        return epd_pb2_grpc.NodeStub(ch).GetBootstrap(
            epd_pb2.GetBootstrapRequest(engine_index=index), timeout=30,
            metadata=node_metadata())
