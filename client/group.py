"""A `Group`: this process's rank of one EP group a `Session` joined (client/session.py), and what
its calls return: the handles of dispatches (combine and cached dispatch take them), the
results, and a dispatch in flight. A group's class (latency or throughput) is the daemon's
answer to the join."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
from google.protobuf.message import Message

from ..proto import abi, counter_page
from ..proto.errors import EpdError, FailedPrecondition, Internal, InvalidArgument
from ..proto.v1 import epd_pb2
from . import captured_calls, cuda_ipc, stream_calls
from . import tensors as T
from .tensors import Array
from .transport import PendingCall

if TYPE_CHECKING:
    from .local_layout import LocalLayout
    from .session import Session
    from .stream_calls import StreamSlot
    from .stream_ops import StreamOp

RPC_MARGIN = 5.0  # the engine's own deadline fires first and names the missing rank

_F = TypeVar("_F", bound=Callable[..., Any])


def _staged_call(*, answered_on_cuda: bool = False) -> Callable[[_F], _F]:
    """A call that stages its inputs: from their description to its answer it is inside the
    session memory's call scope, so no other thread's call reuses that staging meanwhile
    (Memory.call_scope); and it holds the group's answered-call lock, since the engine writes
    every answered call's outputs into the membership's one output region and the client
    copies them out after the answer: another thread's call of the same group in between
    overwrote them (one thread got another's recv_x). `answered_on_cuda`: the call stays
    answered on the CUDA engine too (its outputs are copied out of the membership's buffers
    after the answer), where the others are stream-ordered there and take no lock."""

    def decorate(method: _F) -> _F:
        @functools.wraps(method)
        def call(self: Group, *args: Any, **kwargs: Any) -> Any:
            # (first: a forked child, whose copies of these locks another thread of the parent
            # may have held at the fork, is refused before it waits on one)
            self._session._check_open()
            if self._ordered:  # (CUDA IPC memory stages nothing: the scope is for staging)
                if not answered_on_cuda:  # (stream-ordered: new outputs per call; and a lock
                    # held across its wait for the receive count could wait on another
                    # thread's work)
                    return method(self, *args, **kwargs)
                with self._answered:
                    return method(self, *args, **kwargs)
            with self._answered, self._session.memory.call_scope():
                return method(self, *args, **kwargs)
        return cast(_F, call)
    return decorate


@dataclass
class Handle:
    """What a dispatch leaves for combine and cached dispatch (state stays in the engine)."""

    group: Group
    handle_id: int
    num_tokens: int
    num_recv_tokens: int
    rows: int  # rows of recv_x (num_worst_tokens when set)
    op: StreamOp | None = None  # a dispatch captured in a CUDA graph: its armed op


@dataclass
class DispatchResult:
    recv_x: Array
    recv_x_scales: Array | None  # [N, H/128] in x_scales' dtype (float32 or int32) with FP8
    recv_topk_idx: Array | None
    recv_topk_weights: Array | None
    num_recv_tokens_per_expert: list[int]
    handle: Handle
    recv_src_idx: Array
    rank_prefix_matrix: Array
    num_recv_tokens: int


@dataclass
class LowLatencyHandle:
    """What a low-latency dispatch leaves for low-latency combine (state stays in the engine)."""

    group: Group
    handle_id: int
    num_tokens: int
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    hidden: int


@dataclass
class LowLatencyDispatchResult:
    recv_x: Array  # [L, R*num_max, H]: bf16, or e4m3 with use_fp8 (rows beyond recv_count:
    # zero on the cpu backend, unspecified on cuda)
    recv_x_scales: Array | None  # [L, R*num_max, H/128] float32 with use_fp8
    recv_count: Array  # [L] int32: valid rows per local expert
    handle: LowLatencyHandle | StreamOp | None  # the armed op for a stream-ordered dispatch
    recv_src_rank: Array  # [L, R*num_max] int32: source rank of each row (-1 beyond the count)
    recv_src_idx: Array  # [L, R*num_max] int32: source token of each row (-1 beyond the count)


class PendingDispatch:
    """A dispatch in flight. `counts()` returns as soon as the engine's notify step has published
    the receive counts in the counter page, before the data has arrived."""

    def __init__(self, group: Group, future: PendingCall, sequence: int, copy: bool,
                 x_template: Array, released: list[int]) -> None:
        self._group, self._future, self._sequence = group, future, sequence
        self._copy, self._template = copy, x_template
        self._released = released  # the handle releases it carries (sent again if it failed)
        self._taken = False  # result() read the answer (its handle is the caller's then)

    def counts(self, timeout: float | None = None) -> tuple[int, list[int]]:
        """(num_recv_tokens, per-expert counts). `timeout` defaults to the session's deadline."""
        s = self._group._session
        s._check_open()
        timeout = s._deadline(timeout)
        words = self._group._counter
        future = self._future
        got = counter_page.wait(words, self._sequence, timeout,
                                stop=lambda: not s.alive or future.done())
        if got is None and future.done():  # (answered: its counts were published before)
            got = counter_page.wait(words, self._sequence, 0)
            if got is None:  # refused before it took part (a bad shape, a full budget):
                future.result()  # the engine's error now, not a wait for counts that never come
        if got is None:
            s._check_open()  # (the lease ended meanwhile: UNAVAILABLE now, not at the deadline)
            raise EpdError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"receive counts not published within {timeout} s")
        if int(words[counter_page.STATUS]):
            raise EpdError(grpc.StatusCode.ABORTED, "the dispatch failed before its counts "
                           "were known; result() has the reason")
        return got

    def result(self) -> DispatchResult:
        s = self._group._session
        try:
            if s._closed:  # (its outputs are unmapped: no answer can be read)
                raise FailedPrecondition("the session is closed")
            try:
                resp = cast(epd_pb2.DispatchResponse, self._future.result())
            except EpdError:
                self._taken = True  # (failed: no handle; its releases go with a later call)
                self._group._requeue(self._released)
                raise
            self._taken = True
        finally:
            if self._future.done():  # (not when an exception cut the wait short: the
                s._dispatch_done(self._future)  # engine may still read the staged inputs)
        with self._group._answered:
            return self._group._dispatch_result(resp, self._copy, self._template)

    def __del__(self) -> None:
        # Dropped unread (counts() raised, the caller gave up): the session's next
        # dispatch_async takes its answer (the ring moves it into the call when it needs the
        # slot), and the group's next dispatch releases the handle that only this answer
        # names (the engine kept it for good before: a fuzzer's 50 dropped calls held 50).
        if not getattr(self, "_taken", True):
            self._group._requeue(self._released)  # (releases are idempotent: if it failed)
            self._group._dropped.append(self._future)


SERVICE_CLASSES = ("latency", "throughput")  # epd.proto ServiceClass, by name


def service_class_value(name: str | None) -> int:
    """The ServiceClass of "latency" / "throughput" (None: unspecified, the daemon decides)."""
    if name is None:
        return epd_pb2.SERVICE_CLASS_UNSPECIFIED
    if not isinstance(name, str) or name.lower() not in SERVICE_CLASSES:
        raise InvalidArgument(f"service_class must be one of {list(SERVICE_CLASSES)} or None "
                              f"(the daemon's policy default), got {name!r}")
    return epd_pb2.ServiceClass.Value(name.upper())


def service_class_name(value: int) -> str:
    """"latency" / "throughput" ("" when the daemon did not say: an older daemon)."""
    if value and value not in epd_pb2.ServiceClass.values():  # (a newer or broken daemon)
        raise EpdError(grpc.StatusCode.INTERNAL,
                       f"the engine answered an unknown service class ({value})")
    return epd_pb2.ServiceClass.Name(value).lower() if value else ""


def _ring(resp: epd_pb2.ArmStreamOpResponse, timeout: float) -> tuple[int, int, float] | None:
    """(ring slot, entry, deadline) of an op triggered through its member's ring (None: an
    engine that reads a request word per op instead)."""
    ringed = resp.chained or resp.ordered
    return (resp.chain_slot, resp.chain_entry, timeout) if ringed else None


class Group:
    """This process's rank of one group. Outputs are views into the engine's output region for
    this rank unless copy=True (the default): a view stays valid until the next call of the
    same kind (dispatch, combine, layout) on this group."""

    def __init__(self, session: Session, spec: epd_pb2.GroupSpec,
                 resp: epd_pb2.JoinGroupResponse) -> None:
        self._session = session
        self.spec = spec
        self.name = spec.name
        self.group_id = resp.group_id
        self.rank = resp.rank
        self.num_ranks = spec.num_ranks
        # The class the daemon gave the group ("latency" / "throughput").
        self.service_class = service_class_name(resp.service_class)
        # Node rank of each rank when the group spans nodes (cluster mode), else empty.
        self.rank_nodes: tuple[int, ...] = tuple(resp.rank_nodes)
        # Normal mode runs DeepEP's hierarchical semantics (a group over several nodes placed
        # node-major, on the cpu backend): rows ordered by forwarder, then source node, then
        # token; recv_src_idx names the forwarder's row; combine rounds a partial sum per node.
        self.hierarchical: bool = bool(resp.hierarchical)
        # ... with DeepEP's traffic, in two stages (the cuda engine across nodes; every call
        # stream-ordered as on one node: a stage's failure reaches the stream's done word).
        self.two_stage: bool = bool(resp.two_stage)
        self._answered = threading.RLock()  # (_staged_call)
        self._outputs = session.memory.outputs(resp)
        try:
            self._init_rest(session, spec, resp)
        except BaseException:
            self._outputs.close()  # (the session leaves the membership: Session.join)
            raise

    def _init_rest(self, session: Session, spec: epd_pb2.GroupSpec,
                   resp: epd_pb2.JoinGroupResponse) -> None:
        assert session._counter_file is not None
        page = session._counter_file.size
        if not 0 <= resp.counter_slot < page // counter_page.SLOT_BYTES:
            raise Internal(f"the engine gave group {resp.group_id} counter slot "
                           f"{resp.counter_slot}, outside the session's counter page "
                           f"({page // counter_page.SLOT_BYTES} slots)")
        self._counter_slot = resp.counter_slot
        self._counter = counter_page.slot_words(session._counter_file.mm, resp.counter_slot)
        self._left = False
        # cuda: the counter-slot words of stream-ordered calls (client/stream_calls.py).
        self._stream_slot: StreamSlot | None = None
        # Tokens per rank an earlier worst-case dispatch needed, found after the call returned
        # (its TokenCapacityExceeded raised at the next dispatch): the facade grows first.
        self.capacity_owed = 0
        # Normal-mode calls captured in CUDA graphs (client/captured_calls.py), and the latest
        # dispatch sequence whose failure was raised (or is an eager call's own)
        self._captured: list[StreamOp] = []
        self._captured_by_key: dict[tuple, StreamOp] = {}
        self._captured_seen = 0
        self._ordered = session.memory.supports_stream_ops
        # cuda: layouts on the caller's stream (client/local_layout.py; EPD_LOCAL_LAYOUT=0: not).
        self._local_layout: LocalLayout | None = None
        if self._ordered:  # run-time kernels compiled here, not mid-call or in a capture:
            # dispatch's copy-out, and the trigger of armed low-latency ops
            from . import call_outputs, ll_trigger, local_layout
            call_outputs.load(session.device_ordinal)
            ll_trigger.load(session.device_ordinal)
            if local_layout.enabled() and spec.num_ranks <= abi.LL_MAX_RANKS:
                self._local_layout = local_layout.build(self)
        # Ids of handles whose objects were collected (weakref.finalize appends, on any
        # thread): the next dispatch of this group carries them (release_handles), or
        # release_handles() sends them now. The engine keeps a handle until then.
        self._released: list[int] = []
        self._unanswered: list[PendingCall] = []  # interrupted dispatches (_answered_dispatch)
        self._dropped: list[PendingCall] = []  # dispatch_async calls dropped unread (appended
        # by PendingDispatch.__del__, on any thread)
        self._live: set[int] = set()  # ids of the handle objects not yet collected

    def _track(self, handle: Handle | LowLatencyHandle) -> None:
        """Release `handle` in the engine once its object is garbage collected."""
        self._live.add(handle.handle_id)
        f = weakref.finalize(handle, self._collected, handle.handle_id)
        f.atexit = False

    def _collected(self, handle_id: int) -> None:
        self._live.discard(handle_id)  # (set and list operations are atomic: any thread)
        self._released.append(handle_id)

    @property
    def live_handles(self) -> int:
        """Handle objects of this group that this process still holds."""
        return len(self._live)

    def _take_released(self) -> list[int]:
        """The pending releases, taken off the queue (list.pop is atomic)."""
        out = []
        while self._released:
            try:
                out.append(self._released.pop())
            except IndexError:
                break
        return out

    def _requeue(self, ids: list[int]) -> None:
        """A call that carried releases failed: send them with a later one (idempotent)."""
        self._released.extend(ids)

    def release_handles(self) -> int:
        """Free now, in the engine, the handles whose objects were collected (a dispatch does
        it anyway, piggybacked); returns how many handles this rank still holds there."""
        ids = self._take_released()
        s = self._session
        try:
            resp = cast(epd_pb2.ReleaseHandlesResponse, s._call(
                "ReleaseHandles", epd_pb2.ReleaseHandlesRequest(
                    session_id=s.session_id, group_id=self.group_id, handles=ids)))
        except BaseException:
            self._requeue(ids)
            raise
        return resp.handles

    def _view(self, d: epd_pb2.TensorDesc, copy: bool, template: Array = None) -> Array:
        """An output as the caller's array type (NumPy/torch CPU, or CuPy/torch CUDA)."""
        if d.region_id != self._outputs.region_id:
            raise EpdError(grpc.StatusCode.INTERNAL, f"output in unknown region {d.region_id}")
        return self._outputs.view(d, copy, template)

    def _timeout(self, timeout: float | None) -> float:
        return self._session._deadline(timeout)

    @_staged_call()
    def get_dispatch_layout(self, topk_idx: Array, *,
                            copy: bool = True) -> tuple[Array, Array, Array]:
        """(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool), as the caller's array type. On the cuda backend the call
        is stream-ordered on the caller's current stream and the outputs are new tensors."""
        if self._ordered:
            return stream_calls.layout(self, topk_idx)
        d = self._session._descs({"topk_idx": topk_idx})
        resp = cast(epd_pb2.GetDispatchLayoutResponse, self._session._call(
            "GetDispatchLayout", epd_pb2.GetDispatchLayoutRequest(
                session_id=self._session.session_id, group_id=self.group_id, **d)))
        return tuple(self._view(x, copy, topk_idx) for x in
                     (resp.num_tokens_per_rank, resp.num_tokens_per_expert,
                      resp.is_token_in_rank))

    def _dispatch_request(self, x: Array, topk_idx: Array, topk_weights: Array,
                          x_scales: Array, expert_alignment: int, num_worst_tokens: int,
                          handle: Handle | None, timeout: float | None,
                          is_token_in_rank: Array = None, num_tokens_per_expert: Array = None,
                          event: bool = True) -> tuple[epd_pb2.DispatchRequest, float]:
        if handle is not None and handle.group is not self:
            raise InvalidArgument("the handle belongs to another group")
        for name, v in (("expert_alignment", expert_alignment),
                        ("num_worst_tokens", num_worst_tokens)):
            if not -2**31 <= int(v) < 2**31:  # (the wire's int32: protobuf's ValueError else)
                raise InvalidArgument(f"{name}={v} does not fit in 32 bits")
        arrays = {"x": x, "x_scales": x_scales, "topk_idx": topk_idx,
                  "topk_weights": topk_weights}
        if topk_idx is None and topk_weights is None and handle is None:
            # Dispatch without top-k: routed by is_token_in_rank (with topk_idx the engine
            # computes the layout itself, so these are not sent).
            arrays.update(is_token_in_rank=is_token_in_rank,
                          num_tokens_per_expert=num_tokens_per_expert)
        d = self._session._descs(arrays, event)
        t = self._timeout(timeout)
        req = epd_pb2.DispatchRequest(
            session_id=self._session.session_id, group_id=self.group_id,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
            cached_handle=handle.handle_id if handle is not None else 0, timeout_seconds=t,
            **d)
        return req, t + RPC_MARGIN

    @_staged_call()
    def dispatch(self, x: Array, topk_idx: Array = None, topk_weights: Array = None, *,
                 x_scales: Array = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 handle: Handle | None = None, timeout: float | None = None,
                 copy: bool = True, is_token_in_rank: Array = None,
                 num_tokens_per_expert: Array = None, num_sms: int = 0) -> DispatchResult:
        """Send each token to the ranks holding its experts (as server/reference.py). With
        `handle`, the cached mode: the routing of that earlier dispatch is reused and no counts
        travel. Without top-k (topk_idx and topk_weights None, DeepEP's V1 form), the tokens
        go where `is_token_in_rank` (bool [T, R]) says, `num_tokens_per_expert` (int32 [E])
        gives the receive counts, recv_topk_idx/weights are None and combine sums the rows
        without weights.
        The engine keeps the dispatch's handle until the returned handle object is garbage
        collected (then the next dispatch of this group releases it).
        On the cuda backend the call is stream-ordered on the caller's current stream (the host
        waits only for the receive count, and not for that with num_worst_tokens: then
        num_recv_tokens is -1, the per-expert list empty, and a failure raises at this
        group's next dispatch); with copy=True (default) the outputs are new
        tensors, with copy=False views of the engine's receive buffers, valid until this rank's
        next dispatch. `num_sms`: blocks of the data kernel (0: the daemon's; at most that)."""
        req, rpc_timeout = self._dispatch_request(x, topk_idx, topk_weights, x_scales,
                                                  expert_alignment, num_worst_tokens, handle,
                                                  timeout, is_token_in_rank,
                                                  num_tokens_per_expert,
                                                  not self._ordered)
        if self._ordered:
            resp, n, per_expert, rows, outs, op = stream_calls.dispatch(
                self, req, rpc_timeout, x, copy, num_sms)
            h = Handle(self, resp.handle, int(req.x.shape[0]), n, rows, op)
            if op is None:  # (a captured dispatch's handle is its op's, in the engine)
                self._track(h)
            return DispatchResult(num_recv_tokens_per_expert=per_expert, handle=h,
                                  num_recv_tokens=n, **outs)
        if num_sms:
            raise InvalidArgument("num_sms is for stream-ordered calls (the cuda backend; "
                                  "not a two-stage group's dispatch and combine)")
        self._settle_unanswered(wait=False)
        released = self._take_released()
        req.release_handles.extend(released)
        try:
            resp = cast(epd_pb2.DispatchResponse, self._answered_dispatch("Dispatch", req,
                                                                          rpc_timeout))
        except BaseException:
            self._requeue(released)
            raise
        return self._dispatch_result(resp, copy, x)

    def _answered_dispatch(self, method: str, req: Message, timeout: float) -> Message:
        """A dispatch's answer. One whose wait an exception other than the engine's cut
        short (a KeyboardInterrupt) still runs in the engine: it is kept, so that the handle
        only its answer names is released at this group's next dispatch, and a
        dispatch_async's counts are read after it (_settle_unanswered)."""
        fut = self._session._call_async(method, req, timeout)
        try:
            return fut.result()
        except EpdError:
            raise
        except BaseException:
            self._session.memory.hold_staging()  # (the engine may still read its inputs)
            self._unanswered.append(fut)
            raise

    def _settle_unanswered(self, wait: bool) -> None:
        """Queue the release of the handles of interrupted dispatches, and of dispatch_async
        calls dropped unread, answered by now (`wait`: of all of them, each waited for within
        its own deadline)."""
        self._settle(self._dropped, wait, holds_staging=False)
        self._settle(self._unanswered, wait, holds_staging=True)

    def _settle(self, futures: list[PendingCall], wait: bool, holds_staging: bool) -> None:
        """Settle the answered `futures` (all with `wait`), in place: each one's handle queued
        for release (and, where `holds_staging`, its hold on the staged inputs let go), then
        it leaves the list; one an exception cut short stays for the next pass. (In place:
        PendingDispatch.__del__ may append to the list meanwhile, on any thread.)"""
        for fut in [f for f in futures if wait or f.done()]:
            futures.remove(fut)
            try:
                with contextlib.suppress(EpdError):
                    handle = getattr(fut.result(), "handle", 0)
                    if handle:
                        self._released.append(handle)
                if holds_staging and not self._session._closed:
                    self._session.memory.release_staging()
            except BaseException:
                futures.append(fut)
                raise

    @_staged_call()
    def dispatch_async(self, x: Array, topk_idx: Array = None, topk_weights: Array = None, *,
                       x_scales: Array = None, expert_alignment: int = 1,
                       num_worst_tokens: int = 0, handle: Handle | None = None,
                       timeout: float | None = None, copy: bool = True,
                       is_token_in_rank: Array = None,
                       num_tokens_per_expert: Array = None) -> PendingDispatch:
        """Start a dispatch; read the receive counts with `.counts()` while it runs."""
        s = self._session
        with s._flight_lock:  # (two threads' checks must not both find none in flight)
            if s._in_flight is not None:
                pending, future = s._in_flight
                if pending() is not None:
                    raise FailedPrecondition("a dispatch of this session is still in flight "
                                             "(its PendingDispatch.result() was not taken yet)")
                # Its PendingDispatch was dropped unread: let it finish first (within its own
                # deadline; its outcome is nobody's), so that the counts read next are ours.
                with contextlib.suppress(EpdError):
                    future.result()
                s._dispatch_done(future)
            req, rpc_timeout = self._dispatch_request(x, topk_idx, topk_weights, x_scales,
                                                      expert_alignment, num_worst_tokens,
                                                      handle, timeout, is_token_in_rank,
                                                      num_tokens_per_expert)
            # One dispatch in flight per session, and the engine publishes every dispatch it
            # runs (failures too, with a status): ours is the first sequence after the current
            # once this group's interrupted dispatches have theirs, and an unwaited worst-case
            # dispatch its own (its failure raises here, as at any next dispatch).
            if self._captured:  # (the engine's worker waits for our ready event holding the
                # session's lock, which a replay ahead of it needs: client/captured_calls.py)
                captured_calls.settle(self, cuda_ipc.stream_handle(None, x, s.device_ordinal),
                                      req.timeout_seconds, dispatching=True)
            self._settle_unanswered(wait=True)
            self.settle_dispatches()
            expected = int(self._counter[counter_page.SEQ]) + 1
            # (its failure is its own to raise, from its counts: not captured_calls.check's)
            self._captured_seen = max(self._captured_seen, expected)
            released = self._take_released()  # (a code that only dispatch_asyncs frees too)
            req.release_handles.extend(released)
            try:
                fut = s._transport.call_async("Dispatch", req, rpc_timeout)
            except BaseException:
                self._requeue(released)
                raise
            pending = PendingDispatch(self, fut, expected, copy, x, released)
            s._dispatch_started(pending, fut)  # (its inputs may be staged copies read later)
        return pending

    def _dispatch_result(self, resp: epd_pb2.DispatchResponse, copy: bool,
                         template: Array) -> DispatchResult:
        v = self._view

        def opt(d: epd_pb2.TensorDesc) -> Array | None:
            return v(d, copy, template) if d.region_id else None
        recv_x = v(resp.recv_x, copy, template)
        rows = recv_x.shape[0]
        h = Handle(self, resp.handle, 0, resp.num_recv_tokens, rows)
        self._track(h)
        return DispatchResult(
            recv_x=recv_x, recv_x_scales=opt(resp.recv_x_scales),
            recv_topk_idx=opt(resp.recv_topk_idx), recv_topk_weights=opt(resp.recv_topk_weights),
            num_recv_tokens_per_expert=list(resp.num_recv_tokens_per_expert), handle=h,
            recv_src_idx=v(resp.recv_src_idx, copy, template),
            rank_prefix_matrix=v(resp.rank_prefix_matrix, copy, template),
            num_recv_tokens=resp.num_recv_tokens)

    @_staged_call()
    def combine(self, x: Array, handle: Handle, topk_weights: Array = None, bias_0: Array = None,
                bias_1: Array = None, *, timeout: float | None = None,
                copy: bool = True, num_sms: int = 0) -> tuple[Array, Array | None]:
        """Bring expert outputs back to their tokens and sum them in fp32 (server/reference.py).
        Returns (combined_x, combined_topk_weights or None). On the cuda backend the call is
        stream-ordered on the caller's current stream and returns new tensors at once."""
        if not isinstance(handle, Handle) or handle.group is not self:
            raise InvalidArgument("the handle belongs to another group")
        if self._ordered:
            t = self._timeout(timeout)
            return stream_calls.combine(self, x, handle, topk_weights, bias_0, bias_1, t,
                                        t + RPC_MARGIN, num_sms)
        if num_sms:
            raise InvalidArgument("num_sms is for stream-ordered calls (the cuda backend; "
                                  "not a two-stage group's dispatch and combine)")
        d = self._session._descs({"x": x, "topk_weights": topk_weights, "bias_0": bias_0,
                                  "bias_1": bias_1})
        t = self._timeout(timeout)
        resp = cast(epd_pb2.CombineResponse, self._session._call("Combine", epd_pb2.CombineRequest(
            session_id=self._session.session_id, group_id=self.group_id,
            handle=handle.handle_id, timeout_seconds=t, **d), t + RPC_MARGIN))
        cx = self._view(resp.combined_x, copy, x)
        cw = (self._view(resp.combined_topk_weights, copy, x)
              if resp.combined_topk_weights.region_id else None)
        return cx, cw

    # -- low-latency mode (DeepEP low_latency_dispatch / low_latency_combine) ------------------
    @_staged_call(answered_on_cuda=True)
    def low_latency_dispatch(self, x: Array, topk_idx: Array, num_max_dispatch_tokens_per_rank: int,
                             *, num_experts: int | None = None, use_fp8: bool = False,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             cumulative_local_expert_recv_stats: Array = None,
                             timeout: float | None = None,
                             copy: bool = True, buffer: int = 0) -> LowLatencyDispatchResult:
        """Send each (token, expert) pair to the rank of that expert; every rank receives
        `[local experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` plus the counts
        (server/reference.py). `num_max_dispatch_tokens_per_rank` must be the same on every rank and
        at most the group's max_tokens_per_rank; `num_experts` defaults to the group's.
        With use_fp8 the tokens are quantised on the source (e4m3 + float32 scales per 128
        channels); round_scale / use_ue8m0 make the scales powers of two (float32 here).
        `cumulative_local_expert_recv_stats` (int32 [local experts]) gets recv_count added in
        place. Views (copy=False) stay valid on the cuda backend until the next low-latency
        dispatch into the same receive `buffer` (0 or 1, the same on every rank: two
        micro-batches in flight use one each, as DeepEP's double buffer); on the cpu backend,
        whose engine keeps one output area, until the next low-latency dispatch (copy=True, the
        default, gives arrays of the caller's own on both)."""
        s = self._session
        stats = cumulative_local_expert_recv_stats
        d = s._descs({"x": x, "topk_idx": topk_idx,
                      "cumulative_local_expert_recv_stats": stats})
        t = self._timeout(timeout)
        self._settle_unanswered(wait=False)
        released = self._take_released()
        try:
            resp = cast(epd_pb2.LowLatencyDispatchResponse, self._answered_dispatch(
                "LowLatencyDispatch", epd_pb2.LowLatencyDispatchRequest(
                    session_id=s.session_id, group_id=self.group_id,
                    num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                    num_experts=self.spec.num_experts if num_experts is None else num_experts,
                    use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                    timeout_seconds=t, release_handles=released, buffer=buffer, **d),
                t + RPC_MARGIN))
        except BaseException:
            self._requeue(released)
            raise
        if stats is not None:
            s._write_back("cumulative_local_expert_recv_stats", stats)
        v = self._view
        shape, _ = T.meta(x, "x")
        handle = LowLatencyHandle(self, resp.handle, shape[0], num_max_dispatch_tokens_per_rank,
                                  self.spec.num_experts, self.spec.hidden)
        self._track(handle)
        return LowLatencyDispatchResult(
            recv_x=v(resp.recv_x, copy, x),
            recv_x_scales=v(resp.recv_x_scales, copy, x) if resp.recv_x_scales.region_id
            else None,
            recv_count=v(resp.recv_count, copy, x), handle=handle,
            recv_src_rank=v(resp.recv_src_rank, copy, x),
            recv_src_idx=v(resp.recv_src_idx, copy, x))

    @_staged_call(answered_on_cuda=True)
    def low_latency_combine(self, x: Array, topk_idx: Array, topk_weights: Array,
                            handle: LowLatencyHandle, *, out: Array = None,
                            timeout: float | None = None, copy: bool = True) -> Array:
        """Bring the expert outputs `x` ([local experts, num_ranks * num_max, hidden], rows as
        dispatched) back and reduce them with the weights:
        out[t] = sum_k w[t, k] * y[e_k][row of t], in fp32, k order, skipping -1. Returns
        [T, hidden]; with `out=` the result is written into that array, which is returned."""
        if not isinstance(handle, LowLatencyHandle) or handle.group is not self:
            raise InvalidArgument("the handle is not a low-latency handle of this group")
        s = self._session
        d = s._descs({"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "out": out})
        t = self._timeout(timeout)
        resp = cast(epd_pb2.LowLatencyCombineResponse, s._call(
            "LowLatencyCombine", epd_pb2.LowLatencyCombineRequest(
                session_id=s.session_id, group_id=self.group_id, handle=handle.handle_id,
                timeout_seconds=t, **d), t + RPC_MARGIN))
        if out is not None:
            s._write_back("out", out)
            return out
        return self._view(resp.combined_x, copy, x)

    # -- stream-ordered (CUDA-graph capturable) low-latency calls: client/stream_ops.py ------
    def arm_low_latency_dispatch(self, x: Array, topk_idx: Array,
                                 num_max_dispatch_tokens_per_rank: int, *,
                                 use_fp8: bool = False, round_scale: bool = False,
                                 use_ue8m0: bool = False,
                                 cumulative_local_expert_recv_stats: Array = None,
                                 timeout: float | None = None) -> StreamOp:
        """Arm a low-latency dispatch that reads `x` and `topk_idx` (fixed tensors) each time
        it is launched from a CUDA stream; `op.results[b]` holds the fixed output views in
        receive buffer b (`op.result`: buffer 0), valid after the stream passes
        `op.launch(buffer=b)`."""
        from .stream_ops import StreamOp

        s = self._session
        page = s.memory.counter_page_device_ptr()  # FAILED_PRECONDITION on the cpu backend
        d = s._descs({"x": x, "topk_idx": topk_idx,
                      "cumulative_local_expert_recv_stats": cumulative_local_expert_recv_stats},
                     event=False)
        inner = epd_pb2.LowLatencyDispatchRequest(
            session_id=s.session_id, group_id=self.group_id,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=self.spec.num_experts, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, timeout_seconds=self._timeout(timeout), **d)
        resp = cast(epd_pb2.ArmStreamOpResponse, s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
            session_id=s.session_id, group_id=self.group_id, low_latency_dispatch=inner,
            ring_trigger=True, op_records=True)))
        def result(r: epd_pb2.LowLatencyDispatchResponse) -> LowLatencyDispatchResult:
            return LowLatencyDispatchResult(
                recv_x=self._view(r.recv_x, False, x),
                recv_x_scales=self._view(r.recv_x_scales, False, x)
                if r.recv_x_scales.region_id else None,
                recv_count=self._view(r.recv_count, False, x), handle=None,
                recv_src_rank=self._view(r.recv_src_rank, False, x),
                recv_src_idx=self._view(r.recv_src_idx, False, x))

        results = [result(resp.low_latency_dispatch)]
        if resp.HasField("low_latency_dispatch_buffer1"):  # (an engine of one buffer: no)
            results.append(result(resp.low_latency_dispatch_buffer1))
        op = StreamOp(self, resp.op_id, resp.counter_slot, page, "dispatch", results, x,
                      _ring(resp, self._timeout(timeout)), chained=resp.chained,
                      record=resp.counter_record)
        for r in results:
            r.handle = op
        s._stream_ops[op.op_id] = op
        return op

    def arm_low_latency_combine(self, x: Array, topk_idx: Array, topk_weights: Array,
                                dispatch_op: StreamOp, *, out: Array = None,
                                timeout: float | None = None) -> StreamOp:
        """Arm the combine of an armed dispatch: each launch brings back the expert outputs
        in `x` for the dispatch's latest launch; `op.result` is `out` (or a fixed view)."""
        from .stream_ops import StreamOp

        s = self._session
        page = s.memory.counter_page_device_ptr()  # FAILED_PRECONDITION on the cpu backend
        d = s._descs({"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "out": out},
                     event=False)
        inner = epd_pb2.LowLatencyCombineRequest(
            session_id=s.session_id, group_id=self.group_id,
            timeout_seconds=self._timeout(timeout), **d)
        resp = cast(epd_pb2.ArmStreamOpResponse, s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
            session_id=s.session_id, group_id=self.group_id, low_latency_combine=inner,
            dispatch_op=dispatch_op.op_id, ring_trigger=True, op_records=True)))
        result = out if out is not None else self._view(resp.combined_x, False, x)
        op = StreamOp(self, resp.op_id, resp.counter_slot, page, "combine",
                      [result] * len(dispatch_op.results), x, _ring(resp, self._timeout(timeout)),
                      chained=resp.chained, record=resp.counter_record)
        s._stream_ops[op.op_id] = op
        return op

    def rank_mask(self, *, mask: int | None = None, unmask: int | None = None,
                  clean: bool = False) -> list[int]:
        """Rank masking of a group joined with `shrink` (DeepEP's shrink mode): mask a rank,
        unmask one, or unmask every rank that has not gone away (at most one of them), then
        return every rank's state: 0 taking part, 1 masked, 2 gone (masked for good: it went
        away). The mask is the group's, shared by its ranks: a masked rank still makes its
        calls (they return nothing for it) and the others' low-latency calls leave it out,
        dropping the tokens routed to its experts. A change takes effect from the next
        collective every rank that takes part has seen it in."""
        if sum(x is not None and x is not False for x in (mask, unmask, clean or None)) > 1:
            raise InvalidArgument("rank_mask takes at most one of mask, unmask and clean")
        req = epd_pb2.RankMaskRequest(session_id=self._session.session_id,
                                      group_id=self.group_id)
        if mask is not None:
            req.mask = mask
        elif unmask is not None:
            req.unmask = unmask
        elif clean:
            req.clean = True
        resp = cast(epd_pb2.RankMaskResponse, self._session._call("RankMask", req))
        return list(resp.state)

    def rejoin(self, rank: int | None = None, timeout: float | None = None) -> list[int]:
        """Bring back a rank that went away from this shrink group (issue 11): a replacement
        joins under the same name, rank and spec (it is still gone for its peers), then every
        rank that takes part calls `rejoin(rank)` and the replacement calls `rejoin()`, a
        collective: from the next collective on the replacement takes part. Returns every
        rank's mask state. On the cuda engine the replacement joins on the engine (GPU) of the
        rank it replaces, and the group may not span nodes."""
        req = epd_pb2.RejoinRequest(session_id=self._session.session_id,
                                    group_id=self.group_id,
                                    rank=self.rank if rank is None else rank,
                                    timeout_seconds=self._timeout(timeout))
        resp = cast(epd_pb2.RejoinResponse, self._session._call(
            "Rejoin", req, req.timeout_seconds + RPC_MARGIN))
        return list(resp.state)

    def check(self) -> None:
        """Raise the failure the GPU reported for an earlier stream-ordered call of this rank
        (once the stream has passed it: e.g. after synchronising), if any not raised yet. Calls
        check too, so a failure surfaces at the next call at the latest; a worst-case
        dispatch's (num_worst_tokens) at the next dispatch, on every rank alike; a layout's bad
        expert id here only (this rank's alone: stream_calls.py)."""
        if self._ordered:
            stream_calls._slot(self, explicit=True)
            if self._captured:  # (after the caller's stream and the replays in it have run:
                # every rank then finds the same failures, whatever its GPU's pace)
                captured_calls.settle(self, cuda_ipc.current_stream(self._session.device_ordinal),
                                      self._timeout(None), dispatching=True)

    def settle_dispatches(self) -> None:
        """What a dispatch does first: wait (within its deadline) for the receive count of an
        earlier worst-case dispatch, and raise its failure. For a caller about to dispatch on
        another group (the facade's growth) instead, so that the failure is not lost."""
        if self._ordered:
            stream_calls._slot(self, dispatching=True)

    def leave(self) -> None:
        """Leave the group. Its other ranks' later collectives fail with ABORTED."""
        if self._left:
            return
        self._session._call("LeaveGroup", epd_pb2.LeaveGroupRequest(
            session_id=self._session.session_id, group_id=self.group_id))
        self._release()

    def _release_stream(self) -> None:
        """No stream of ours may wait for DONE of a call the engine will never finish."""
        if self._stream_slot is not None:
            self._stream_slot.release()

    def _release(self) -> None:
        self._left = True
        self._release_stream()
        s = self._session
        for op_id, op in list(s._stream_ops.items()):
            if op.group is self:  # (the engine released them with the membership: their
                op.armed = False  # records may be another op's by now, so no trigger may
                del s._stream_ops[op_id]  # clear them)
        self._session._groups.pop(self.group_id, None)
        self._outputs.close()
