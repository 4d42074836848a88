"""Stream-ordered (CUDA-graph capturable) low-latency calls, engine side.

A client arms an operation once over gRPC (validated like the call itself, apart from the
values of topk_idx, which are only ready when the client's stream gets there). Each armed op owns
a record (abi.OP_RECORD_BYTES, many to a slot) of the session's counter page, which the client's
CUDA context maps too; int32 word 1 is its done word. Each member with armed ops also owns a
**trigger ring** in a slot of its own (uint32 `ring[LL_RING]`, tail, head): a trigger is the
client's one-thread kernel (client/ll_trigger.py) on the caller's stream, which writes
`done = 0`, appends `entry | b << 8` (the op's entry, b the receive buffer, 0 or 1) and
publishes the new tail; the stream then waits for `done >= 1`. One
poller thread per engine reads every ring from its head to its tail, **in the order the
member's calls reached the GPU**, advances the head past each entry as it reads it, and
launches the op's kernels on the rank's stream without any host synchronisation; a last kernel
writes `done` (1 ok, 2 | code << 8 failed). A GPU cannot wake a futex, so the poller spins for
`stream_op_spin_us` after the last trigger (`stream_op_busy_spin_us` while the engine's sessions
also serve calls: `spin_window`), then polls every `stream_op_poll_us`, and less often as its
rings stay idle, up to `stream_op_idle_poll_us` (`idle_period`).

Why a ring and not a doorbell word per op (the first design): two triggers can land between
two looks of the poller (D0 D1 of DeepEP's two micro-batches in a replayed CUDA graph are
written microseconds apart), and a poller scanning doorbells cannot tell which came first. The
ranks of a group must launch their calls in the same order, since each call's kernels pair with
the peers' calls of the same sequence number: a rank that launched D1 before D0 paired its
buffer-1 dispatch with its peers' buffer-0 one (receive counts of one micro-batch mixed with
the other's; seen on an H200). The ring keeps the stream's order, as the GPU chain always did.

With `--ll-chain` (auto by default: clients on the engine's MPS server, `chain_wanted`) a
member's armed ops run on its GPU chain instead (server/backends/cuda_chain.py): the same ring,
read by kernels enqueued ahead, and this thread only keeps the chain's instances enqueued
(`_top_up`). All of a member's armed ops take one path, fixed by its first arming.

The poller launches under the session executor's operation lock (`Session.op_lock`), like any
other operation of the session; a session's teardown releases its ops (`armed = False`) under
that lock before anything they use is closed, so a trigger seen later launches nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...proto import abi, counter_page, host_order, spin
from ...proto.errors import (
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from ...proto.thread_names import NamedThread
from ...proto.v1 import epd_pb2
from .. import metrics, service_classes
from ..config import chain_limit
from . import captured_calls, tensors
from .executor import as_epd_error
from .ops import ll_dispatch_response
from .profiling import run_profiled
from .stall_probe import StallProbe
from .state import GroupMember, Session

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("epd.engine")
REQUEST, DONE = abi.STREAM_REQUEST, abi.STREAM_DONE  # int32 words of the op's record
MASK32 = 0xFFFFFFFF  # ring positions are uint32 and wrap
DONE_OK, DONE_FAILED, DONE_RELEASED = abi.DONE_OK, abi.DONE_FAILED, abi.DONE_RELEASED
KIND_DISPATCH, KIND_COMBINE = "LowLatencyDispatch", "LowLatencyCombine"
IDLE_WAIT_SECONDS = 1.0  # the poller's sleep with nothing armed (arming wakes it)
FLUSH_EVERY = 256  # launches between metric flushes while busy
STOP_SECONDS = 10.0  # stop(): longest wait for the poller thread
RELEASE_WAIT_SECONDS = 5.0  # releasing an op: longest wait for the session's running operation
# A poller round longer than this is broken down in epd_stream_poller_slow_seconds{part}: the
# chains' top-ups, the rings' launches, the sleep or yield (with the wait for the interpreter
# after it). A chain runs dry, and a poller-path call waits, when rounds are this slow.
SLOW_POLL_SECONDS = 1e-3
# A chain this deep (instances enqueued ahead of its head) outlasts the poller's nap
# (--ll-chain-poll-us): at one instance per ~100 µs call, 16 hold 1.6 ms.
CHAIN_NAP_DEPTH = 16
_NO_WATCH = contextlib.nullcontext()  # (reusable)
TOP_UP_METHOD = "LowLatencyChainTopUp"  # epd_request_cpu_seconds{method}: the chains' top-ups


def spin_window(config: Any, last_call: float, inflight: int, now: float) -> float:
    """Seconds the poller keeps looking after a trigger before it sleeps: the long spin
    (stream_op_spin_us) spans a decode loop's gaps while only triggers come; while the engine's
    sessions also serve calls (one in flight, or one left within that spin), the short one
    (stream_op_busy_spin_us): each of the poller's looks takes the GIL from their threads, and
    on one H200 a long-spinning poller in an engine serving a prefill pool as well made decode
    under prefill 1.3x slower (docs/DESIGN_NOTES.md)."""
    spin = config.stream_op_spin_us * 1e-6
    if inflight or now - last_call < spin:
        return min(spin, config.stream_op_busy_spin_us * 1e-6)
    return spin


# An idle ring's look period grows by a sixteenth of the time it has been idle beyond the long
# spin: a trigger after an idle stretch waits at most ~6% of that stretch more (capped).
IDLE_BACKOFF = 16


def idle_period(config: Any, idle_for: float) -> float:
    """Seconds between the poller's looks at rings that saw no trigger for `idle_for` seconds:
    `stream_op_poll_us` for `stream_op_spin_us` past the spin (a decode loop's steps come
    milliseconds apart; the busy spin is much shorter), then a sixteenth of the time idle
    beyond that, at most `stream_op_idle_poll_us` (below `stream_op_poll_us`: no back-off).
    A look costs the engine ~20-30 µs of CPU (a timed sleep and a round of Python): looked at
    every 50 µs, one captured normal-mode call armed kept a fifth of a core busy for good,
    and its idle ring's looks were most of the engine's CPU per low-latency call beside it
    (docs/DESIGN_NOTES.md, "An idle poller ring beside busy chains")."""
    period = max(config.stream_op_poll_us, 1) * 1e-6
    cap = config.stream_op_idle_poll_us * 1e-6
    if cap <= period:
        return period
    return min(cap, max(period, (idle_for - config.stream_op_spin_us * 1e-6) / IDLE_BACKOFF))


def count_chain_calls(member: GroupMember, kinds: list[int]) -> None:
    """The calls a member's chain ran (their kinds, abi.LLX_*): requests and the member's
    counters (GetStats)."""
    for kind in kinds:
        name = KIND_DISPATCH if kind == abi.LLX_DISPATCH else KIND_COMBINE
        metrics.inc(metrics.REQUESTS, (f"Stream{name}", "OK"))
        if kind == abi.LLX_DISPATCH:
            member.dispatches += 1
        else:
            member.combines += 1


def chain_nap(config: Any, rings: list[Ring]) -> float:
    """Seconds the poller may stay away after a look, 0 to go on as for the poller's own
    rings (spin after a trigger, poll when idle). While every armed ring is chained with at
    least CHAIN_NAP_DEPTH instances enqueued ahead, no call waits for the poller (it only
    tops the chains up), so spinning would cost a core per engine for nothing (the engine's
    CPU per graph-replayed low-latency pair was the pair's whole time, ~240 µs, on one H100;
    docs/BENCHMARKS.md, thirty-second session)."""
    if config.ll_chain_poll_us <= 0 or not all(
            r.chain is not None and r.chain.depth >= CHAIN_NAP_DEPTH for r in rings):
        return 0.0
    return config.ll_chain_poll_us * 1e-6


def chain_wanted(config: Any, session: Session, member: GroupMember) -> bool:
    """Whether a member's armed ops should run on a GPU chain (`--ll-chain` on, off or auto).
    auto: only for a client on the engine's MPS server (without MPS the client's and the
    engine's contexts time-slice the GPU and a chained pair took 3.7 ms against the poller's
    1 ms), not in a shrink group (a rejoin reads the ranks' low-latency sequences from the
    engines' hosts; a chain keeps them on the GPU), and not in a group over nodes (the chain's
    NVSHMEM build has not run on a GPU)."""
    if config.ll_chain != "auto":
        return config.ll_chain == "on"
    return (session.on_engine_mps is True and not member.spec.shrink
            and not getattr(member.comm, "spans_nodes", False))


@dataclass
class StreamOp:
    op_id: int
    kind: str
    session: Session
    member: GroupMember
    args: Any  # LowLatencyDispatchArgs / LowLatencyCombineArgs (a combine reads its dispatch's)
    slot: int
    words: np.ndarray  # int32 view of its record in the slot (host)
    prepared: Any  # the backend's packed launches (prepared at arm time)
    done_ptr: int = 0  # its done word as the device addresses it
    record: int = 0  # its record in the slot (abi.OP_RECORD_BYTES each)
    dispatch_op: StreamOp | None = None  # combine: whose result it brings back
    armed: bool = field(default=True)
    latency: bool = False  # of a latency-class group: the pacer holds throughput calls for it
    regions: frozenset[str] = frozenset()  # the client regions its launches address
    chained: Any = None  # its descriptor in the member's chain (cuda_chain.ChainOp), or None
    entry: int = 0  # its entry in the member's ring (the trigger adds the buffer)
    # A captured normal-mode call (engine/captured_calls.py): its request, run per trigger, and
    # a dispatch's latest trigger's handle (0: not run yet)
    request: Any = None
    handle: int = 0
    plan: Any = None  # its checked arguments, kept from its first trigger (captured_calls.py)


@dataclass
class Ring:
    """A member's trigger ring (uint32 words of the session's counter slot `slot`): entries are
    `index | buffer << 8 | generation << 16`, appended by the client's trigger kernels in its
    stream's order. Read by the member's GPU chain (`chain`), or by the poller, which keeps the
    ops by entry index here."""

    member: GroupMember
    slot: int
    words: np.ndarray  # uint32 view of the slot (host)
    chain: Any = None  # cuda_chain.LowLatencyChain, or None: the poller runs the entries
    ops: dict[int, StreamOp] = field(default_factory=dict)  # poller: by entry index
    gens: list[int] = field(default_factory=lambda: [0] * abi.LL_CHAIN_OPS)  # by index
    free: list[int] = field(default_factory=lambda: list(range(abi.LL_CHAIN_OPS)))
    head: int = 0  # poller: the next position to run

    def take(self, op: StreamOp, gen: int) -> int:
        """A poller op's entry, with generation `gen` (1..0xFFFF, from the engine's counter, so
        that a stale entry of an earlier op at the same index, in this ring or in an earlier
        ring of the member, runs nothing: its generation differs)."""
        if not self.free:
            raise ResourceExhausted(f"a member holds at most {abi.LL_CHAIN_OPS} armed ops")
        index = self.free.pop()
        self.gens[index] = gen
        self.ops[index] = op
        return index | gen << 16

    def release(self, op: StreamOp) -> None:
        if self.chain is not None:
            if op.chained is not None:
                # (its calls the chain ran since the poller's last look, counted while the
                # log can still name them)
                count_chain_calls(self.member, self.chain.finished())
                self.chain.remove(op.chained)
            return
        index = op.entry & 0xFF
        if self.ops.get(index) is op:
            del self.ops[index]
            self.free.append(index)

    def op_of(self, entry: int) -> StreamOp | None:
        """The armed op an entry names (None: released, stale, or not an entry at all)."""
        index = entry & 0xFF
        op = self.ops.get(index)
        if op is None or entry >> 16 != self.gens[index]:
            return None
        return op

    def pending(self) -> bool:
        """Whether a trigger waits for its launch."""
        if self.chain is not None:
            return bool(self.chain.busy())
        return int(self.words[abi.LL_RING_TAIL]) != self.head


class StreamOps:
    """Arming, disarming and the poller thread of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ops: dict[int, StreamOp] = {}
        self.rings: dict[int, Ring] = {}  # by id(member)
        self._batch: metrics.Batch | None = None  # the poller thread's metric updates
        self._next_id = 1
        self._gen = 0  # the last ring entry generation handed out (engine-wide, wraps)
        self._lock = threading.Lock()
        self._opening = 0  # chains being opened (_ring_for), counted against chain_limit
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- arming (on the session's worker, under its operation lock) --------------------------
    def arm(self, session: Session, req: epd_pb2.ArmStreamOpRequest) -> epd_pb2.ArmStreamOpResponse:
        e = self.engine
        which = req.WhichOneof("op")
        if which is None:
            raise InvalidArgument("ArmStreamOp needs low_latency_dispatch, "
                                  "low_latency_combine, dispatch or combine")
        if len(session.stream_ops) >= e.config.max_stream_ops_per_session:
            raise ResourceExhausted(f"{session.describe()} has {len(session.stream_ops)} armed "
                                    f"stream ops, the maximum (--max-stream-ops-per-session)")
        whole = not req.op_records  # (a client that reads its op's words at its slot's start)
        if not session.free_slots and (whole or not session.free_record()):
            raise ResourceExhausted(
                f"{session.describe()} has no free counter slot (at most "
                f"{counter_page.NUM_SLOTS} groups, rings and slots of armed ops together, "
                f"{abi.OP_RECORDS} ops to a slot)")
        request = None  # a captured normal-mode call's (engine/captured_calls.py)
        if which == "dispatch":
            request = inner = req.dispatch
            inner.group_id = inner.group_id or req.group_id
            member, view = captured_calls.arm_dispatch(e, session, inner)
            kind, src, args, resp = captured_calls.KIND_DISPATCH, None, None, \
                epd_pb2.ArmStreamOpResponse(dispatch=view)
        elif which == "combine":
            request = inner = req.combine
            inner.group_id = inner.group_id or req.group_id
            src = session.stream_ops.get(req.dispatch_op)
            member = captured_calls.arm_combine(e, session, inner, src)
            kind, args, resp = captured_calls.KIND_COMBINE, None, epd_pb2.ArmStreamOpResponse(
                combined_x=inner.out)
        elif which == "low_latency_dispatch":
            inner = req.low_latency_dispatch
            inner.group_id = inner.group_id or req.group_id
            member, args, stats = e.ll_dispatch_args(session, inner)
            views = [ll_dispatch_response(member, member.comm.low_latency_outputs(
                args.num_max_dispatch_tokens_per_rank, args.use_fp8, b), args.use_fp8, 0)
                for b in range(abi.LL_BUFFERS)]  # the trigger's request word picks one
            kind, src, resp = KIND_DISPATCH, None, epd_pb2.ArmStreamOpResponse(
                low_latency_dispatch=views[0], low_latency_dispatch_buffer1=views[1])
        else:
            inner = req.low_latency_combine
            inner.group_id = inner.group_id or req.group_id
            src = session.stream_ops.get(req.dispatch_op)
            if src is None or src.kind != KIND_DISPATCH:
                raise NotFound(f"dispatch_op {req.dispatch_op} is not an armed low-latency "
                               f"dispatch of {session.describe()}")
            member = e.member(session, inner.group_id)
            if member is not src.member:
                raise FailedPrecondition("the combine and its dispatch_op belong to different "
                                         "groups")
            d = src.args
            args = e.ll_combine_args(session, member, inner, int(d.x.shape[0]),
                                     d.num_max_dispatch_tokens_per_rank, None)
            kind, stats, resp = KIND_COMBINE, None, epd_pb2.ArmStreamOpResponse()
            if args.out is not None:
                resp.combined_x.CopyFrom(inner.out)
            else:
                view = member.comm.low_latency_combine_view(int(d.x.shape[0]))
                resp.combined_x.CopyFrom(tensors.describe(view, member.comm.output_region,
                                                          member.spec.x_dtype))
        # (the session's own ops: a member is one session's, and its arms and removals run
        # under that session's lock, so no engine-wide scan under the poller's lock)
        held = sum(o.member is member for o in session.stream_ops.values())
        if held >= abi.LL_CHAIN_OPS:
            raise ResourceExhausted(
                f"group {member.spec.name!r} holds {held} armed calls, the most a group may "
                f"(each call captured in a CUDA graph with tensors or shapes of its own is one, "
                f"kept while a graph may replay it): capture fewer batch sizes, or let layers "
                f"share their tensors")
        needed = (id(member) not in self.rings) + (whole or not session.free_record())
        if len(session.free_slots) < needed:
            raise ResourceExhausted(
                f"{session.describe()} has no free counter slot for the trigger ring of group "
                f"{member.spec.name!r} and its first armed op (at most "
                f"{counter_page.NUM_SLOTS} groups, rings and slots of armed ops together)")
        # Taken now, and given back if the arm fails: a join on the event loop takes slots of
        # the same list while this runs on the session's worker.
        slot, record = session.take_record(f"{session.describe()} has no free counter slot",
                                           whole)
        try:
            page = session.counter_page.slot(slot)
            at = record * abi.OP_RECORD_BYTES
            done_ptr = int(page.device_ptr) + at + 4 * DONE
            timeout = e._timeout(inner.timeout_seconds)
            if request is not None:
                prepared = None
            elif kind == KIND_DISPATCH:
                prepared = member.comm.prepare_low_latency_dispatch(args, stats, done_ptr,
                                                                    timeout)
            else:
                prepared = member.comm.prepare_low_latency_combine(args, src.prepared, done_ptr,
                                                                   timeout)
            if not req.ring_trigger:  # (a client of the doorbell design: its triggers write a
                # request word no one reads any more, so its stream and its peers would wait)
                raise FailedPrecondition(
                    "this client triggers armed ops by a request word, which this engine no "
                    "longer reads (ArmStreamOpRequest.ring_trigger unset): upgrade epd on the "
                    "client")
        except BaseException:
            session.give_record(slot, record, refused=True)
            raise
        words = page.view(np.int32)[at // 4:(at + abi.OP_RECORD_BYTES) // 4]
        if request is not None:  # (not a failure an earlier op of the slot left: the
            words[abi.STREAM_FAIL_DONE] = 0  # client's check() raises what it finds there)
        words[DONE] = DONE_OK
        op = StreamOp(0, kind, session, member, args, slot, words, prepared,
                      done_ptr=done_ptr, record=record, dispatch_op=src,
                      request=request,
                      latency=member.service_class == service_classes.LATENCY,
                      regions=tensors.region_ids(inner) | (src.regions if src else frozenset()))
        try:
            ring = self._ring_for(session, member, chain_ok=request is None)
            if ring.chain is not None:
                op.chained = ring.chain.add(prepared, done_ptr, self._next_gen(),
                                            src.chained if src is not None else None)
                op.entry = op.chained.entry
            else:
                op.entry = self._take(ring, op)
        except BaseException:
            session.give_record(slot, record, refused=True)
            self._drop_unused_ring(session, member)  # (one made for this op)
            raise
        if request is not None and member.failure_words is None:
            failures = ring.words.view(np.int64)
            failures[abi.RING_FAIL_STATUS:abi.RING_FIRED_WORST + 1] = 0  # (a slot's earlier use)
            member.failure_words = ring.words
        resp.chained, resp.ordered = ring.chain is not None, True
        resp.chain_slot, resp.chain_entry = ring.slot, op.entry
        with self._lock:
            op.op_id = self._next_id
            self._next_id += 1
            self.ops[op.op_id] = op
        session.stream_ops[op.op_id] = op
        self._ensure_thread()
        resp.op_id, resp.counter_slot, resp.counter_record = op.op_id, slot, record
        log.info("%s armed %s op %d (slot %d record %d, ring slot %d)", session.describe(),
                 kind, op.op_id, slot, record, ring.slot)
        return resp

    def disarm(self, session: Session, op_id: int, *, locked: bool = False) -> None:
        """`locked`: the caller holds the session's operation lock (the executor runs it)."""
        op = session.stream_ops.get(op_id)
        if op is None:
            raise NotFound(f"stream op {op_id} is not armed by {session.describe()}")
        if any(o.dispatch_op is op for o in session.stream_ops.values()):
            raise FailedPrecondition(f"stream op {op_id} still has an armed combine; disarm "
                                     f"that first")
        self._remove(op, locked=locked)

    def release_session(self, session: Session, *, locked: bool = False) -> None:
        """The session is closing: release any stream waiting on its ops, free the slots.
        `locked`: the caller holds the session's operation lock (teardown's last step, which
        also catches an op an arm still running during the first pass registered)."""
        self._release(session, None, locked)

    def release_member(self, session: Session, member: GroupMember, *,
                       locked: bool = False) -> None:
        """The member leaves its group: its ops go (combines first) and release their streams."""
        self._release(session, member, locked)

    def _release(self, session: Session, member: GroupMember | None, locked: bool) -> None:
        ops = sorted((o for o in list(session.stream_ops.values())
                      if member is None or o.member is member),
                     key=lambda o: o.dispatch_op is None)  # (combines first)
        with self._lock:  # every waiting stream let go first, then the ops removed (not
            # one removed meanwhile: its record may be another op's by now)
            for op in ops:
                if self.ops.get(op.op_id) is op:
                    op.words[DONE] = DONE_RELEASED
        for op in ops:
            if not self._remove(op, locked=locked):
                return  # (an operation holds the session: the locked pass takes the rest)

    def _next_gen(self) -> int:
        """The engine's next ring entry generation (1..0xFFFF), for poller and chained ops
        alike: a stale trigger landing in a later ring on the same slot, the poller's or a
        chain's, names a generation no op of that ring has, until 65,535 more arms."""
        with self._lock:
            self._gen = self._gen % 0xFFFF + 1
            return self._gen

    def _take(self, ring: Ring, op: StreamOp) -> int:
        """A poller op's entry in its member's ring, of the engine's next generation."""
        gen = self._next_gen()
        with self._lock:  # (the poller reads ring.ops)
            return ring.take(op, gen)

    def _remove(self, op: StreamOp, *, locked: bool = False) -> bool:
        """Disarm `op` (never while the poller launches it: under the session's operation
        lock, which `locked` says the caller holds; waited for at most RELEASE_WAIT_SECONDS,
        after which teardown's locked pass removes it). False: not removed (that wait)."""
        lock = op.session.op_lock
        if not locked and not lock.acquire(timeout=RELEASE_WAIT_SECONDS):
            log.warning("%s: stream op %d not released yet (an operation holds the session "
                        "for %.0f s)", op.session.describe(), op.op_id, RELEASE_WAIT_SECONDS)
            return False
        try:
            last = self._remove_unlocked(op)
            if op.handle:  # (a captured dispatch's latest trigger's handle)
                self.engine._release(op.member, [op.handle])
                op.handle = 0
        finally:
            if not locked:
                lock.release()
        if last is not None:
            self._close_ring(op.session, last)
        return True

    def _remove_unlocked(self, op: StreamOp) -> Ring | None:
        """`_remove`'s work under the operation lock; the member's ring when `op` was its last
        (closed by the caller, outside the lock it may wait)."""
        with self._lock:
            if self.ops.pop(op.op_id, None) is None:
                return None  # (removed already: a disarm and a release of the same op)
            op.armed = False
            ring = self.rings.get(id(op.member))
            if ring is not None:
                ring.release(op)
            # The member's last op: its ring goes now, under the session's lock, so that an
            # arm (which holds it) never takes an entry in a ring being dropped.
            last = ring is not None and not any(o.member is op.member
                                                for o in self.ops.values())
            if last:
                self.rings.pop(id(op.member))
                op.member.failure_words = None  # (its slot goes back)
        op.session.stream_ops.pop(op.op_id, None)
        op.session.give_record(op.slot, op.record)
        return ring if last else None

    def _close_ring(self, session: Session, ring: Ring) -> None:
        """A dropped ring's chain is drained (outside the locks: it may wait); its slot is
        free again once no kernel of the chain can write it (a chain that did not drain
        keeps it until its stream is done)."""
        if ring.chain is not None:
            ring.member.comm.close_chain(self.engine.config.timeout_seconds,
                                         lambda: session.free_slots.append(ring.slot))
        else:
            session.free_slots.append(ring.slot)

    def _drop_unused_ring(self, session: Session, member: GroupMember) -> None:
        """An arm failed (the caller holds the session's lock): drop the member's ring if it
        holds no op, as one made for that arm does."""
        with self._lock:
            ring = self.rings.get(id(member))
            if ring is None or any(o.member is member for o in self.ops.values()):
                return
            self.rings.pop(id(member))
        self._close_ring(session, ring)

    def _ring_for(self, session: Session, member: GroupMember, chain_ok: bool = True) -> Ring:
        """The member's trigger ring, made with its first armed op in a free counter slot (the
        caller checked there is one): run by its GPU chain when the engine allows one more
        (all of a member's armed ops run on the chain or all on the poller, since the two keep
        their sequences apart), else by the poller."""
        with self._lock:
            ring = self.rings.get(id(member))
            if ring is not None:
                if ring.chain is not None and not chain_ok:
                    raise FailedPrecondition(
                        f"group {member.spec.name!r}'s armed ops run on a GPU chain, which "
                        f"runs low-latency calls only: a normal-mode call captured in a CUDA "
                        f"graph needs the poller (--ll-chain off, or capture it on a group "
                        f"with no armed low-latency op)")
                return ring
            cfg = self.engine.config
            # (a chain being opened counts from here: two first arms at once stay within the
            # limit; the reservation ends when its ring is in, or the open failed)
            chained = chain_ok and chain_wanted(cfg, session, member) and self._opening + sum(
                r.chain is not None for r in self.rings.values()) < chain_limit(cfg)
            self._opening += chained
        backend_chain, slot = None, None
        try:
            slot = session.take_slot(f"{session.describe()} has no free counter slot for the "
                                     f"trigger ring of group {member.spec.name!r}")
            page = session.counter_page.slot(slot)
            if chained:
                backend_chain = member.comm.open_chain(page.view(np.int32),
                                                       int(page.device_ptr))
            words = page.view(np.uint32)
            if backend_chain is None:
                words[:abi.LL_RING_RELEASED + 1] = 0  # (the chain clears its own)
            ring = Ring(member, slot, words, backend_chain)
        except BaseException:
            if backend_chain is not None:  # (its slot goes back once the chain cannot write it)
                member.comm.close_chain(self.engine.config.timeout_seconds,
                                        lambda: session.free_slots.append(slot))
            elif slot is not None:
                session.free_slots.append(slot)
            with self._lock:
                self._opening -= chained
            raise
        with self._lock:
            self.rings[id(member)] = ring
            self._opening -= chained
        log.info("%s: group %r's armed low-latency ops run %s (ring in slot %d)",
                 session.describe(), member.spec.name,
                 "on a GPU chain" if backend_chain is not None else "by the poller", slot)
        return ring

    def latency_rung(self) -> bool:
        """Whether an armed op of a latency group waits for its launch (the pacer asks)."""
        return any(r.pending() for r in list(self.rings.values())
                   if r.member.service_class == service_classes.LATENCY)

    # -- the poller ---------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._lock:  # (sessions arm on their own workers: one poller, whoever is first)
            if self._thread is None:
                self._thread = NamedThread(target=self._poll, daemon=True,
                                           name=f"epd-poller-{self.engine.index}")
                self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_SECONDS)
            if not self._thread.is_alive():
                self._flush_metrics()

    def _poll(self) -> None:
        # Its metric updates go in a batch, applied when idle or every FLUSH_EVERY launches
        # (metrics.Batch: a multiprocess update costs microseconds of an op's path).
        with metrics.batched() as self._batch:
            run_profiled("poller", f"poller-{os.getpid()}-{self.engine.index}", self._poll_loop)

    def _poll_loop(self) -> None:
        self.engine.backend.thread_init()
        probe = StallProbe.from_env()  # (a diagnostic; off: one shared no-op context)
        try:
            self._poll_rounds(probe.watch if probe is not None else lambda name: _NO_WATCH)
        finally:
            if probe is not None:
                probe.stop()

    def _poll_rounds(self, watch: Callable[[str], contextlib.AbstractContextManager]) -> None:
        cfg, state = self.engine.config, self.engine.state
        launched = 0
        period = idle_period(cfg, 0.0)  # (between looks once idle: set as idle goes on)
        last = looked = time.perf_counter()
        # While it naps between looks at idle poller rings, the chains are topped up at their
        # own cadence (a nap apart), not at every look: their top-ups were most of each look's
        # host time (an engine holding one captured normal-mode call beside chained ones).
        chains_due = 0.0
        while not self._stop:
            rings = list(self.rings.values())
            if not rings:  # nothing armed: sleep until an op is armed
                self._flush_metrics()
                self._woken(IDLE_WAIT_SECONDS)
                last = looked = time.perf_counter()  # (an arm: as after a trigger, below)
                chains_due = 0.0
                continue
            top = time.perf_counter()
            chains_ran, topped = False, top >= chains_due
            if topped:
                with watch("top_up"):
                    chains_ran = self._top_up(rings)
            start = time.perf_counter()
            gap, looked = start - looked, start  # a trigger seen now came at most `gap` ago
            ran = False
            with watch("launch"):
                for ring in rings:
                    if ring.chain is None and self._run_ring(ring, gap):
                        ran = True
            if ran and not topped:  # (a launch may be long: the chains not a nap plus it)
                with watch("top_up"):
                    chains_ran, topped = self._top_up(rings), True
            now = time.perf_counter()
            fired = ran or chains_ran
            if fired:
                launched += 1
                if launched % FLUSH_EVERY == 0:
                    self._flush_metrics()
            # Chains deep enough to outlast a nap need no spin: only the poller's own rings'
            # calls keep it spinning (a chain's kept it spinning through every chained call of
            # the engine whenever some member had a poller ring, e.g. a normal-mode call
            # captured in a graph: ~120 µs of engine CPU a low-latency call on one H100).
            chained = [r for r in rings if r.chain is not None]
            nap = chain_nap(cfg, chained) if chained else 0.0
            idle = False
            if ran or (chains_ran and not nap):
                last = now
            else:
                window = spin_window(cfg, state.last_call, state.inflight, now)
                if now - last > window:
                    if not fired:
                        self._flush_metrics()
                    idle = True
                    period = self._look_period(rings, now - last - window)
            asked = 0.0  # (a wait asked for: no late look)
            if nap and (idle or len(chained) == len(rings)):
                # (no call waits for this thread's look but an idle poller ring's, which waits
                # as long as when idle without chains; an arm, which may add a poller ring or
                # a chain to fill, or a stop ends the nap at once)
                if len(chained) == len(rings):
                    asked, chains_due = nap, 0.0
                else:
                    asked = min(nap, period)
                    if chains_due <= top:
                        chains_due = top + nap
                if self._woken(asked):
                    chains_due, last = 0.0, time.perf_counter()
            elif idle:
                chains_due = 0.0
                # (an arm ends the wait and counts as a trigger: its op's first trigger, which
                # comes soon after, is looked for at the spin's pace, not a backed-off one)
                asked = period
                if self._woken(asked):
                    last = time.perf_counter()
            else:
                chains_due = 0.0  # (a poller ring's trigger: spinning, every look tops up)
                if not fired:
                    spin.relax()  # without the GIL (the sessions' threads need it), no timer
            end = time.perf_counter()
            if end - top - asked > SLOW_POLL_SECONDS:  # (a late look: where the thread was)
                for part, secs in (("top_up", start - top), ("launch", now - start),
                                   # (beyond the wait asked; an arm may have cut it short)
                                   ("sleep", max(0.0, end - now - asked)),
                                   ("enqueue", sum(r.chain.enqueue_seconds for r in rings
                                                   if r.chain is not None) if topped else 0.0)):
                    metrics.observe(metrics.STREAM_POLLER_SLOW_SECONDS, (part,), secs)

    def _look_period(self, rings: list[Ring], idle_for: float) -> float:
        """The wait before the next look at idle rings: `idle_period`, but the fast pace while
        a poller ring holds a trigger seen but held back (its session busy, its receive count
        not out yet): that call waits for its launch already."""
        held = any(r.chain is None and r.pending() for r in rings)
        return idle_period(self.engine.config, 0.0 if held else idle_for)

    def _woken(self, seconds: float) -> bool:
        """Wait up to `seconds` for an arm or a stop; whether one came. The flag is cleared
        only when seen: an arm between a timed-out wait and a clear would be lost."""
        if self._wake.wait(timeout=seconds):
            self._wake.clear()
            return True
        return False

    def _flush_metrics(self) -> None:
        """Apply the poller's metric updates (launch counts, CPU, times) once idle or every
        FLUSH_EVERY launches (a multiprocess update costs several µs: not on a call's path)."""
        if self._batch is not None:
            self._batch.flush()

    def _run_ring(self, ring: Ring, gap: float) -> bool:
        """Launch the calls appended to a poller ring since the last look, in its order; the
        head goes past each entry as it is read (the trigger kernels wait for room by it).
        At most LL_RING entries per look, so one busy ring cannot hold the others' launches;
        a tail further ahead than LL_RING is not a trigger kernel's (it waits for room) but
        a client writing its counter page: `_corrupt_ring`."""
        ran = False
        for _ in range(abi.LL_RING):
            with self._lock:  # (a disarm frees the ring's slot under it: never write it after)
                if self.rings.get(id(ring.member)) is not ring:
                    return ran
                tail = int(ring.words[abi.LL_RING_TAIL])
                if ring.head == tail:
                    return ran
                if (tail - ring.head) & MASK32 > abi.LL_RING:
                    self._corrupt_ring(ring, tail)
                    return ran
                # (the trigger kernel writes the entry, fences, then the tail: the tail read
                # first, then the entry)
                host_order.consume()
                entry = int(ring.words[ring.head % abi.LL_RING])
                op = ring.op_of(entry)
                # Its session is running an operation (a collective may take up to its
                # deadline): the entry stays, and this ring with it, while the poller goes on
                # with the other rings; one session cannot hold every session's launches.
                if op is not None and not op.session.op_lock.acquire(blocking=False):
                    return ran
                # A captured normal-mode call whose run would wait for a receive count: the
                # entry stays, as above (captured_calls.ready).
                if op is not None and op.request is not None and not captured_calls.ready(op):
                    op.session.op_lock.release()
                    return ran
                ring.head = (ring.head + 1) & MASK32
                host_order.publish()  # (the entry read before the trigger may reuse it)
                ring.words[abi.LL_RING_HEAD] = ring.head
            if op is not None:  # (else released, or a stale entry of a disarmed op)
                try:
                    self._fire(op, entry >> 8 & 0xFF, gap)
                finally:
                    op.session.op_lock.release()
                ran = True
        return ran

    def _corrupt_ring(self, ring: Ring, tail: int) -> None:
        """(Under self._lock.) A ring whose tail is more than LL_RING entries past the head:
        its entries cannot be trusted, so none of them runs; the head catches up with the tail
        and every op of the member fails its waiting stream (the client's own calls only)."""
        log.warning("group %r: a trigger ring's tail (%d) is %d entries past its head (at most "
                    "%d pending); its entries are dropped and its ops fail", ring.member.spec.name,
                    tail, (tail - ring.head) & MASK32, abi.LL_RING)
        ring.head = tail
        ring.words[abi.LL_RING_HEAD] = tail
        for op in ring.ops.values():
            if op.armed:
                op.words[DONE] = DONE_FAILED | (0xFF << 8)

    def _top_up(self, rings: list[Ring]) -> bool:
        """Keep every chain's instances enqueued; count the calls the chains ran. The CPU of
        a top-up that found calls run (it enqueues an instance for each) counts as engine work,
        as the poller's launches do, under method TOP_UP_METHOD: no call waits for it, but the
        engine spends it per call all the same. Looks that found nothing are the poller's
        spin, not counted (as for the poller's own looks)."""
        ran = False
        for c in rings:
            if c.chain is None:
                continue
            cpu0 = time.thread_time()
            try:
                kinds = c.chain.top_up()
            except Exception:  # (a chain closing under it, a dead context): keep polling
                log.exception("topping up the low-latency chain of %r failed",
                              c.member.spec.name)
                continue
            if kinds:
                metrics.inc(metrics.REQUEST_CPU_SECONDS, (TOP_UP_METHOD, "chain"),
                            time.thread_time() - cpu0)
            count_chain_calls(c.member, kinds)
            ran = ran or bool(kinds)
        return ran

    def _fire(self, op: StreamOp, buffer: int, gap: float = 0.0) -> None:
        """Launch an op triggered with receive buffer `buffer` (from its ring entry), seen `gap`
        seconds after the poller's previous look. The caller holds the op's session's operation
        lock (`_run_ring`)."""
        code = "OK"
        t0, cpu0 = time.perf_counter(), time.thread_time()
        latency = (self.engine.pacer.latency() if op.latency and self.engine.pacer.enabled
                   else contextlib.nullcontext())
        try:
            if not 0 <= buffer < abi.LL_BUFFERS:
                raise InvalidArgument(f"receive buffer {buffer} in a ring entry: a trigger "
                                      f"appends 0 or 1")
            with latency:
                if not op.armed:
                    return
                if op.request is not None:  # (counted as the eager calls it runs as)
                    captured_calls.fire(self.engine, op)
                else:
                    op.member.comm.launch_prepared(op.prepared, buffer)
                    if op.kind == KIND_DISPATCH:
                        op.member.dispatches += 1
                    else:
                        op.member.combines += 1
            metrics.observe(metrics.STREAM_OP_LAUNCH_SECONDS, (op.member.spec.label, op.kind),
                            time.perf_counter() - t0)
            metrics.observe(metrics.STREAM_OP_DETECT_SECONDS, (op.member.spec.label, op.kind), gap)
        except Exception as e:  # answer through the done word, keep polling
            err = as_epd_error(f"stream op {op.op_id} ({op.kind})", e)
            code = err.code.name
            if op.armed:  # (not into a slot a release freed, maybe reused; the chain's code
                # where it has one for the case: NotFilled)
                failed = DONE_FAILED | (getattr(e, "done_code", 0xFF) << 8)
                if op.request is not None:  # (kept for the client's check(): a replay goes on)
                    op.words[abi.STREAM_FAIL_DONE] = failed
                op.words[DONE] = failed
            if isinstance(e, EpdError):
                log.warning("stream op %d (%s) failed: %s", op.op_id, op.kind, e)
        finally:
            method = f"Stream{op.kind}"
            metrics.inc(metrics.REQUESTS, (method, code))
            metrics.inc(metrics.REQUEST_CPU_SECONDS, (method, "poller"), time.thread_time() - cpu0)
