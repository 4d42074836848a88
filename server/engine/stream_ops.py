"""Stream-ordered (CUDA-graph capturable) low-latency calls, engine side.

A client arms an operation once over gRPC (validated like the call itself, apart from the
values of topk_idx, which are only ready when the client's stream gets there). Each armed op owns
a slot of the session's counter page, which the client's CUDA context maps too; int32 word 0 is
the request doorbell, word 1 the done word. The client's stream writes `done = 0`,
`request = 1 + b` and waits for `done >= 1` (stream memory operations, capturable); b is the
receive buffer (0 or 1) a dispatch fills, or whose dispatch a combine brings back. One poller
thread per engine watches the doorbells of every armed op: it clears the doorbell, launches the
op's kernels on the rank's stream without any host synchronisation, and a last kernel writes
`done` (1 ok, 2 | code << 8 failed). A GPU cannot wake a futex, so the poller spins for
`stream_op_spin_us` after the last trigger, then polls every `stream_op_poll_us`.

With `--ll-chain` (experimental, off by default) a member's armed ops run on its GPU chain
instead (server/backends/cuda_chain.py): arming writes a descriptor, the client's trigger kernel
publishes each call in the member's ring, and this thread only keeps the chain's instances
enqueued (`_top_up`). All of a member's armed ops take one path, fixed by its first arming.

The poller launches under the session executor's operation lock (`Session.op_lock`), like any
other operation of the session; a session's teardown releases its ops (`armed = False`) under
that lock before anything they use is closed, so a trigger seen later launches nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...proto import abi, counter_page, spin
from ...proto.errors import (
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from ...proto.v1 import epd_pb2
from .. import metrics, service_classes
from . import tensors
from .executor import as_epd_error
from .ops import ll_dispatch_response
from .state import GroupMember, Session

if TYPE_CHECKING:
    from .core import Engine

log = logging.getLogger("epd.engine")
REQUEST, DONE = abi.STREAM_REQUEST, abi.STREAM_DONE  # int32 words of the op's counter slot
DONE_OK, DONE_FAILED, DONE_RELEASED = abi.DONE_OK, abi.DONE_FAILED, abi.DONE_RELEASED
KIND_DISPATCH, KIND_COMBINE = "LowLatencyDispatch", "LowLatencyCombine"
IDLE_WAIT_SECONDS = 1.0  # the poller's sleep with nothing armed (arming wakes it)
FLUSH_EVERY = 256  # launches between metric flushes while busy
STOP_SECONDS = 10.0  # stop(): longest wait for the poller thread


@dataclass
class StreamOp:
    op_id: int
    kind: str
    session: Session
    member: GroupMember
    args: Any  # LowLatencyDispatchArgs / LowLatencyCombineArgs (a combine reads its dispatch's)
    slot: int
    words: np.ndarray  # int32 view of the slot (host)
    prepared: Any  # the backend's packed launches (prepared at arm time)
    dispatch_op: StreamOp | None = None  # combine: whose result it brings back
    armed: bool = field(default=True)
    latency: bool = False  # of a latency-class group: the pacer holds throughput calls for it
    chained: Any = None  # its descriptor in the member's chain (cuda_chain.ChainOp), or None


@dataclass
class Chain:
    """A member's low-latency chain (the backend's) and the session's counter slot of its
    ring."""

    member: GroupMember
    chain: Any  # cuda_chain.LowLatencyChain
    slot: int


class StreamOps:
    """Arming, disarming and the poller thread of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ops: dict[int, StreamOp] = {}
        self.chains: dict[int, Chain] = {}  # by id(member)
        self._batch: metrics.Batch | None = None  # the poller thread's metric updates
        self._next_id = 1
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- arming (on the session's worker, under its operation lock) --------------------------
    def arm(self, session: Session, req: epd_pb2.ArmStreamOpRequest) -> epd_pb2.ArmStreamOpResponse:
        e = self.engine
        which = req.WhichOneof("op")
        if which is None:
            raise InvalidArgument("ArmStreamOp needs low_latency_dispatch or "
                                  "low_latency_combine")
        if not session.free_slots:
            raise ResourceExhausted(f"{session.describe()} has no free counter slot (at most "
                                    f"{counter_page.NUM_SLOTS} groups and armed ops together)")
        if which == "low_latency_dispatch":
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
        slot = session.free_slots[0]
        page = session.counter_page.slot(slot)
        done_ptr = int(page.device_ptr) + 4 * DONE
        timeout = e._timeout(inner.timeout_seconds)
        if kind == KIND_DISPATCH:
            prepared = member.comm.prepare_low_latency_dispatch(args, stats, done_ptr, timeout)
        else:
            prepared = member.comm.prepare_low_latency_combine(args, src.prepared, done_ptr,
                                                               timeout)
        session.free_slots.pop(0)  # everything checked: now the slot is taken
        words = page.view(np.int32)
        words[REQUEST] = 0
        words[DONE] = DONE_OK
        chain = self._chain_for(session, member)
        chained = None
        if chain is not None:
            try:
                chained = chain.chain.add(prepared, done_ptr,
                                          src.chained if src is not None else None)
            except BaseException:
                session.free_slots.append(slot)
                raise
            resp.chained, resp.chain_slot, resp.chain_entry = True, chain.slot, chained.entry
        with self._lock:
            op = StreamOp(self._next_id, kind, session, member, args, slot, words, prepared,
                          dispatch_op=src,
                          latency=member.service_class == service_classes.LATENCY,
                          chained=chained)
            self._next_id += 1
            self.ops[op.op_id] = op
        session.stream_ops[op.op_id] = op
        self._ensure_thread()
        resp.op_id, resp.counter_slot = op.op_id, slot
        log.info("%s armed %s op %d (slot %d)", session.describe(), kind, op.op_id, slot)
        return resp

    def disarm(self, session: Session, op_id: int) -> None:
        op = session.stream_ops.get(op_id)
        if op is None:
            raise NotFound(f"stream op {op_id} is not armed by {session.describe()}")
        if any(o.dispatch_op is op for o in session.stream_ops.values()):
            raise FailedPrecondition(f"stream op {op_id} still has an armed combine; disarm "
                                     f"that first")
        self._remove(op)

    def release_session(self, session: Session) -> None:
        """The session is closing: release any stream waiting on its ops, free the slots."""
        for op in list(session.stream_ops.values()):
            op.words[DONE] = DONE_RELEASED
            self._remove(op)

    def release_member(self, session: Session, member: GroupMember) -> None:
        """The member leaves its group: its ops go (combines first) and release their streams."""
        ops = [o for o in session.stream_ops.values() if o.member is member]
        for op in sorted(ops, key=lambda o: o.kind != KIND_COMBINE):
            op.words[DONE] = DONE_RELEASED
            self._remove(op)

    def _remove(self, op: StreamOp) -> None:
        with op.session.op_lock, self._lock:  # never while the poller launches it
            op.armed = False
            self.ops.pop(op.op_id, None)
            chain = self.chains.get(id(op.member))
            if chain is not None and op.chained is not None:
                chain.chain.remove(op.chained)
            last = chain is not None and not any(o.member is op.member
                                                 for o in self.ops.values())
            if last:
                self.chains.pop(id(op.member), None)
        op.session.stream_ops.pop(op.op_id, None)
        op.session.free_slots.append(op.slot)
        if last:  # the member's last op: drain its chain (outside the locks: it may wait)
            assert chain is not None
            op.member.comm.close_chain(self.engine.config.timeout_seconds)
            op.session.free_slots.append(chain.slot)

    def _chain_for(self, session: Session, member: GroupMember) -> Chain | None:
        """The member's chain: made with its first armed op (all of a member's armed ops run
        on the chain or all on the poller, since the two keep their sequences apart), when
        the engine allows one more and the session has a slot for its ring."""
        with self._lock:
            chain = self.chains.get(id(member))
            if chain is not None or any(o.member is member for o in self.ops.values()):
                return chain
            cfg = self.engine.config
            if (not cfg.ll_chain or len(self.chains) >= cfg.ll_chain_members
                    or not session.free_slots):
                return None
        slot = session.free_slots.pop(0)
        page = session.counter_page.slot(slot)
        try:
            backend_chain = member.comm.open_chain(page.view(np.int32), int(page.device_ptr))
        except BaseException:
            session.free_slots.append(slot)
            raise
        if backend_chain is None:
            session.free_slots.append(slot)
            return None
        chain = Chain(member, backend_chain, slot)
        with self._lock:
            self.chains[id(member)] = chain
        log.info("%s: group %r runs its armed low-latency ops on a GPU chain (slot %d)",
                 session.describe(), member.spec.name, slot)
        return chain

    def latency_rung(self) -> bool:
        """Whether an armed op of a latency group waits for its launch (the pacer asks)."""
        return any(op.words[REQUEST] != 0 for op in list(self.ops.values())
                   if op.latency) or any(
            c.chain.busy() for c in list(self.chains.values())
            if c.member.service_class == service_classes.LATENCY)

    # -- the poller ---------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, daemon=True,
                                            name=f"epd-streamops-{self.engine.index}")
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
            self._poll_loop()

    def _poll_loop(self) -> None:
        self.engine.backend.thread_init()
        cfg = self.engine.config
        launched = 0
        spin_s, period = cfg.stream_op_spin_us * 1e-6, max(cfg.stream_op_poll_us, 1) * 1e-6
        last = looked = time.perf_counter()
        while not self._stop:
            ops = list(self.ops.values())
            if not ops:  # nothing armed: sleep until an op is armed
                self._flush_metrics()
                self._wake.wait(timeout=IDLE_WAIT_SECONDS)
                self._wake.clear()
                looked = time.perf_counter()
                continue
            fired = self._top_up()
            start = time.perf_counter()
            gap, looked = start - looked, start  # a doorbell seen now rang at most `gap` ago
            for op in ops:
                if op.chained is not None:
                    continue
                request = int(op.words[REQUEST])
                if request != 0:
                    op.words[REQUEST] = 0
                    self._fire(op, request, gap)
                    fired = True
            now = time.perf_counter()
            if fired:
                last = now
                launched += 1
                if launched % FLUSH_EVERY == 0:
                    self._flush_metrics()
            elif now - last > spin_s:
                self._flush_metrics()
                time.sleep(period)
            else:
                spin.relax()  # without the GIL (the sessions' threads need it), no timer

    def _flush_metrics(self) -> None:
        """Apply the poller's metric updates (launch counts, CPU, times) once idle or every
        FLUSH_EVERY launches (a multiprocess update costs several µs: not on a call's path)."""
        if self._batch is not None:
            self._batch.flush()

    def _top_up(self) -> bool:
        """Keep every chain's instances enqueued; count the calls the chains ran."""
        ran = False
        for c in list(self.chains.values()):
            try:
                kinds = c.chain.top_up()
            except Exception:  # (a chain closing under it, a dead context): keep polling
                log.exception("topping up the low-latency chain of %r failed",
                              c.member.spec.name)
                continue
            for kind in kinds:
                name = KIND_DISPATCH if kind == abi.LLX_DISPATCH else KIND_COMBINE
                metrics.inc(metrics.REQUESTS, (f"Stream{name}", "OK"))
                if kind == abi.LLX_DISPATCH:
                    c.member.dispatches += 1
                else:
                    c.member.combines += 1
            ran = ran or bool(kinds)
        return ran

    def _fire(self, op: StreamOp, request: int, gap: float = 0.0) -> None:
        """Launch an op whose doorbell rang with `request` (REQUEST_BUFFER0 + receive buffer),
        seen `gap` seconds after the poller's previous look."""
        code = "OK"
        t0, cpu0 = time.perf_counter(), time.thread_time()
        latency = (self.engine.pacer.latency() if op.latency and self.engine.pacer.enabled
                   else contextlib.nullcontext())
        try:
            buffer = request - abi.REQUEST_BUFFER0
            if not 0 <= buffer < abi.LL_BUFFERS:
                raise InvalidArgument(f"request word {request}: a trigger writes "
                                      f"{abi.REQUEST_BUFFER0} + the receive buffer (0 or 1)")
            with latency, op.session.op_lock:
                if not op.armed:
                    return
                op.member.comm.launch_prepared(op.prepared, buffer)
                if op.kind == KIND_DISPATCH:
                    op.member.dispatches += 1
                else:
                    op.member.combines += 1
            metrics.observe(metrics.STREAM_OP_LAUNCH_SECONDS, (op.member.spec.name, op.kind),
                            time.perf_counter() - t0)
            metrics.observe(metrics.STREAM_OP_DETECT_SECONDS, (op.member.spec.name, op.kind), gap)
        except Exception as e:  # answer through the done word, keep polling
            err = as_epd_error(f"stream op {op.op_id} ({op.kind})", e)
            code = err.code.name
            op.words[DONE] = DONE_FAILED | (0xFF << 8)
            if isinstance(e, EpdError):
                log.warning("stream op %d (%s) failed: %s", op.op_id, op.kind, e)
        finally:
            method = f"Stream{op.kind}"
            metrics.inc(metrics.REQUESTS, (method, code))
            metrics.inc(metrics.REQUEST_CPU_SECONDS, (method, "poller"), time.thread_time() - cpu0)
