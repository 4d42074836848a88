"""The data-plane operations: layout, dispatch and combine, normal and low-latency mode.

Each is one synchronous function `(session, request, path) -> response` that runs on the
session's executor (executor.py) under its operation lock, on the session's worker for gRPC or on
the fast-path thread: it validates (nothing changes on bad input), runs the rank's collective on
the backend and returns the proto response. Every transport executes this code; `Engine.OPERATIONS`
binds the registry's operation names to these functions.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import numpy as np

from ...proto import abi, counter_page, dtypes
from ...proto.errors import (
    Aborted,
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from ...proto.v1 import epd_pb2
from .. import metrics
from ..backends.base import (
    Array,
    CombineArgs,
    DispatchArgs,
    GroupSpec,
    LowLatencyCombineArgs,
    LowLatencyDispatchArgs,
)
from . import tensors
from .state import LOW_LATENCY, NORMAL, GroupMember, HandleInfo, Session

# Handle ids are unique in the engine, not per membership: a raw request naming another
# group's handle (one session may hold several groups) then finds no handle, where per-group
# numbers would have matched that group's handle of the same number and run on its routing.
# (next() on a count is atomic under the GIL: the sessions' threads share it.)
_HANDLE_IDS = itertools.count(1)

INDEX_DTYPES = (epd_pb2.INT64,)
# A stream-ordered dispatch refused for these still takes part, failing alike on every rank
# (`_refused_takes_part`); not for a failed group or a deadline, which no part can mend.
_CALLER_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.OUT_OF_RANGE)
log = logging.getLogger("epd.engine")
T = TypeVar("T")


class DataPlane:
    """Mixed into Engine: needs `config`, `backend`, `member()` and `_timeout()`, and the
    stream-ordered variants of the calls (stream_calls.StreamCalls)."""

    # -- collectives -------------------------------------------------------------------------
    def _timed(self, member: GroupMember, histogram, path: str, run, on_error=None):
        """Run one collective: its latency into `histogram`, a deadline into the timeout
        counter, its bytes into the traffic counters."""
        t0 = time.perf_counter()
        try:
            out = run()
        except Exception as e:
            if on_error is not None:
                on_error()
            if isinstance(e, DeadlineExceeded):
                metrics.TIMEOUTS.labels(member.spec.label).inc()
            raise
        metrics.observe(histogram, (member.spec.label, path, self.backend.name),
                        time.perf_counter() - t0)
        self._count_traffic(member, out)
        return out

    def _count_traffic(self, member: GroupMember, out) -> None:
        """Per-membership counters and the byte metrics of one collective."""
        member.bytes_sent += out.bytes_sent
        member.bytes_received += out.bytes_received
        peer = self.backend.peer_class
        metrics.inc(metrics.BYTES_SENT, (member.spec.label, peer), out.bytes_sent)
        metrics.inc(metrics.BYTES_RECEIVED, (member.spec.label, peer), out.bytes_received)

    @staticmethod
    def _queued(session: Session, member: GroupMember) -> None:
        """Account the time this call waited for the session's executor to its group (the
        per-group queueing delay, by service class): once its request passed its argument
        checks, so a call they refuse is not counted (GetStats' queued_calls)."""
        waited = session.executor.waited
        member.queued_calls += 1
        member.queue_wait_seconds += waited
        metrics.observe(metrics.QUEUE_WAIT_SECONDS, (member.spec.label, member.service_class),
                        waited)

    def _check_alive(self, member: GroupMember, stream_ordered: bool = False) -> None:
        """Refuse a call on an aborted group. A stream-ordered call asks only what this host
        knows: reading the device's abort word is a copy that waits for the engine's queued
        work (hundreds of µs, and a serialisation point); its kernels see the word anyway
        and report through the call's done word."""
        reason = (member.comm.known_abort_reason() if stream_ordered
                  else member.comm.abort_reason())
        if reason is not None:
            raise Aborted(f"group {member.spec.name!r} is aborted: {reason}")

    def _routing(self, desc: epd_pb2.TensorDesc, regions: dict, what: str, dtype) -> Array:
        """A routing tensor (topk_idx, topk_weights, is_token_in_rank: 2-D): dense where the
        backend's kernels read it by address (Backend.dense_routing)."""
        return tensors.resolve(desc, regions, what, ndim=2, dtype=dtype,
                               dense=self.backend.dense_routing)

    def _check_routing(self, spec: GroupSpec, topk_idx, topk_weights, num_tokens: int) -> None:
        if topk_idx.shape != (num_tokens, spec.num_topk):
            raise InvalidArgument(f"topk_idx has shape {list(topk_idx.shape)}, expected "
                                  f"[{num_tokens}, {spec.num_topk}]")
        if topk_weights is not None and topk_weights.shape != topk_idx.shape:
            raise InvalidArgument(f"topk_weights has shape {list(topk_weights.shape)}, expected "
                                  f"{list(topk_idx.shape)}")

    def _check_values(self, session: Session, ready_event: bytes, member: GroupMember,
                      topk_idx, timeout: float) -> np.ndarray | None:
        """Wait for the client's inputs, then check what needs reading them (before the rank
        takes part in the collective). Returns the host copy of topk_idx: one device-to-host
        copy serves every check (each synchronisation costs more than the bytes)."""
        spec = member.spec
        member.comm.await_stream_ready(time.monotonic() + timeout)
        self.backend.wait_event(session.events, ready_event)
        if topk_idx is None:
            return None
        host = self.backend.to_host(topk_idx)
        if host.size:
            lo, hi = int(host.min()), int(host.max())
            if lo < -1 or hi >= spec.num_experts:
                raise InvalidArgument(f"topk_idx holds expert ids in [{lo}, {hi}]; valid ids are "
                                      f"-1 (none) and [0, {spec.num_experts})")
        return host

    def layout_op(self, session: Session, req: epd_pb2.GetDispatchLayoutRequest,
                  path: str) -> epd_pb2.GetDispatchLayoutResponse:
        member = self.member(session, req.group_id)
        spec = member.spec
        idx = self._routing(req.topk_idx, session.regions, "topk_idx", INDEX_DTYPES)
        if idx.shape[0] > spec.max_tokens_per_rank:
            raise InvalidArgument(f"{idx.shape[0]} tokens exceed the group's "
                                  f"max_tokens_per_rank={spec.max_tokens_per_rank}")
        self._check_routing(spec, idx, None, idx.shape[0])
        self._queued(session, member)
        if req.stream_ordered:
            return self.layout_stream(session, member, req, idx, path)
        t0 = time.perf_counter()
        host = self._check_values(session, req.ready_event, member, idx,
                                  self.config.timeout_seconds)
        out = member.comm.layout(host if self.backend.inputs_on_host else idx)
        metrics.observe(metrics.LAYOUT_SECONDS, (spec.label, path, self.backend.name),
                        time.perf_counter() - t0)
        per_expert = self.backend.to_host(out.num_tokens_per_expert)
        if per_expert.size and per_expert.mean() > 0:
            metrics.LOAD_IMBALANCE.labels(spec.label).set(float(per_expert.max() /
                                                               per_expert.mean()))
        r = member.comm.output_region
        return epd_pb2.GetDispatchLayoutResponse(
            num_tokens_per_rank=tensors.describe(out.num_tokens_per_rank, r),
            num_tokens_per_expert=tensors.describe(out.num_tokens_per_expert, r),
            is_token_in_rank=tensors.describe(out.is_token_in_rank, r))

    def dispatch_op(self, session: Session, req: epd_pb2.DispatchRequest,
                    path: str) -> epd_pb2.DispatchResponse:
        """Validate (nothing changes on bad input), then notify + dispatch."""
        member = self.member(session, req.group_id)
        taken = member.dispatch_sequence
        try:
            return self._dispatch(session, member, req, path)
        except EpdError as e:
            # Not a cached dispatch (no payload exchange before its data moves) nor a
            # worst-case one: its peers' callers go on to the combine of a handle this caller
            # never got, and the combine sequences would part.
            self._refused_takes_part(
                member, req, e, "dispatch", member.comm.refuse_stream_dispatch,
                fresh=(not req.cached_handle and not req.num_worst_tokens
                       and member.dispatch_sequence == taken))
            raise

    def _refused_takes_part(self, member: GroupMember,
                            req: epd_pb2.DispatchRequest | epd_pb2.CombineRequest,
                            err: EpdError, what: str, take_part: Callable[[float], bool],
                            fresh: bool) -> None:
        """A stream-ordered call this engine refused for its caller's input (`fresh`: before it
        took its sequence; `take_part(deadline)` the backend's) takes part all the same,
        moving nothing: a dispatch with no tokens and the verdict ERR_REFUSED in its notify
        payload (every peer fails it at once, FAILED_PRECONDITION naming this rank), a combine
        pushing nothing (every peer's reduce fails it, raised by the peer's Group.check(): a
        combine's failure raised at a later call, before it is sent, would leave that rank one
        collective behind this one). Not for a failed group, nor a shrink group's (normal mode
        is refused on every rank there). The peers do not wait out their deadline and the
        group goes on; this caller gets the reason. A backend that cannot leaves the peers
        waiting, as for a synchronous call refused before taking part."""
        if not (req.stream_ordered and fresh
                and err.code in _CALLER_ERRORS and not member.spec.shrink
                and member.comm.known_abort_reason() is None):
            return
        try:
            timeout = self._timeout(req.timeout_seconds)
        except EpdError:
            timeout = self._timeout(0.0)
        try:
            if take_part(time.monotonic() + timeout):
                log.info("group %r: rank %d's %s refused (%s); it took part as refused",
                         member.spec.name, member.rank, what, err.message)
        except Exception as again:  # (the call's own error is what the caller needs)
            log.error("group %r: rank %d could not take part in its refused %s: %s",
                      member.spec.name, member.rank, what, again)

    def _dispatch(self, session: Session, member: GroupMember, req: epd_pb2.DispatchRequest,
                  path: str) -> epd_pb2.DispatchResponse:
        args, cached, timeout = self.dispatch_args(session, member, req)
        if req.stream_ordered:  # (it releases req.release_handles once it checked the call,
            # and counts it as queued once its arguments are checked)
            return self.dispatch_stream(session, member, req, args, cached, timeout, path)
        return self._dispatch_sync(session, member, req, args, cached, timeout, path)

    def dispatch_args(self, session: Session, member: GroupMember, req: epd_pb2.DispatchRequest
                      ) -> tuple[DispatchArgs, HandleInfo | None, float]:
        """A dispatch request checked (nothing changes on bad input): its arguments, the handle
        it reuses (a cached dispatch) and its timeout, seconds."""
        spec = member.spec
        self._check_normal_mode(member, "dispatch")
        self._check_alive(member, req.stream_ordered)
        regions = session.regions
        x = tensors.resolve(req.x, regions, "x", ndim=2,
                            dtype=(spec.x_dtype, epd_pb2.FLOAT8_E4M3))
        fp8 = req.x.dtype == epd_pb2.FLOAT8_E4M3
        t = x.shape[0]
        if x.shape[1] != spec.hidden:
            raise InvalidArgument(f"x has hidden size {x.shape[1]}, the group's is {spec.hidden}")
        if t > spec.max_tokens_per_rank and (req.cached_handle or
                                             not self.backend.agrees_on_capacity):
            raise InvalidArgument(f"{t} tokens exceed the group's max_tokens_per_rank="
                                  f"{spec.max_tokens_per_rank}")
        # (A new dispatch with more tokens goes into the collective, which every rank then
        # fails with TokenCapacityExceeded naming the largest call: see RankComm.dispatch.)
        scales = None
        if fp8:
            if spec.hidden % dtypes.FP8_BLOCK:
                raise InvalidArgument(f"FP8 dispatch needs hidden % {dtypes.FP8_BLOCK} == 0, "
                                      f"the group's hidden is {spec.hidden}")
            if not tensors.is_set(req.x_scales):
                raise InvalidArgument("FP8 dispatch needs x_scales (float32 or int32 "
                                      "[T, S], S <= hidden/128)")
            # float32 scales, or int32 words (e.g. 4 packed UE8M0 exponents, vLLM's MXFP8):
            # either way 4-byte columns carried bit-exactly, returned in the same dtype. Any
            # width, as DeepEP's: per token [T, 1], per 128 channels [T, H/128], packed
            # [T, H/512]; the receive buffers hold H/128 columns a row.
            scales = tensors.resolve(req.x_scales, regions, "x_scales", ndim=2,
                                     dtype=(epd_pb2.FLOAT32, epd_pb2.INT32))
            most = spec.hidden // dtypes.FP8_BLOCK
            if scales.shape[0] != t or not 1 <= scales.shape[1] <= most:
                raise InvalidArgument(f"x_scales has shape {list(scales.shape)}, expected "
                                      f"[{t}, S] with 1 <= S <= hidden/128 = {most} (the "
                                      f"receive buffers' scale columns a row)")
        elif tensors.is_set(req.x_scales):
            raise InvalidArgument(f"x_scales is only for FP8 payloads; x is "
                                  f"{dtypes.name(req.x.dtype)}")
        if req.expert_alignment < 0 or req.num_worst_tokens < 0:
            raise InvalidArgument("expert_alignment and num_worst_tokens must be >= 0")
        if req.num_worst_tokens > spec.max_recv_tokens:
            raise InvalidArgument(f"num_worst_tokens={req.num_worst_tokens} exceeds "
                                  f"num_ranks * max_tokens_per_rank={spec.max_recv_tokens}")
        cached = None
        idx = weights = in_rank = per_expert = None
        if req.cached_handle:
            cached = self._handle(member, req.cached_handle, NORMAL)
            self._resolve(session, member, cached)
            if cached.failed:
                raise FailedPrecondition(f"handle {req.cached_handle} belongs to a dispatch "
                                         f"that failed")
            if cached.captured:  # (its arrays are the op's, rewritten by its next replay)
                raise FailedPrecondition(f"handle {req.cached_handle} belongs to a dispatch "
                                         f"captured in a CUDA graph; a cached dispatch takes "
                                         f"an eager dispatch's handle")
            if cached.num_tokens != t:
                raise InvalidArgument(f"cached dispatch with {t} tokens, but handle "
                                      f"{req.cached_handle} was made for {cached.num_tokens}")
            if tensors.is_set(req.topk_idx) or tensors.is_set(req.topk_weights):
                raise InvalidArgument("cached dispatch takes no topk_idx/topk_weights")
            if tensors.is_set(req.is_token_in_rank) or tensors.is_set(req.num_tokens_per_expert):
                raise InvalidArgument("cached dispatch takes no is_token_in_rank/"
                                      "num_tokens_per_expert (the handle's routing is reused)")
        elif tensors.is_set(req.topk_idx) or tensors.is_set(req.topk_weights):
            if not tensors.is_set(req.topk_idx) or not tensors.is_set(req.topk_weights):
                raise InvalidArgument("dispatch needs topk_idx and topk_weights together "
                                      "(or neither: is_token_in_rank routes without top-k)")
            if tensors.is_set(req.is_token_in_rank) or tensors.is_set(req.num_tokens_per_expert):
                raise InvalidArgument("is_token_in_rank/num_tokens_per_expert are only for "
                                      "dispatch without top-k; with topk_idx the engine "
                                      "computes the layout")
            idx = self._routing(req.topk_idx, regions, "topk_idx", INDEX_DTYPES)
            weights = self._routing(req.topk_weights, regions, "topk_weights", epd_pb2.FLOAT32)
            self._check_routing(spec, idx, weights, t)
        else:
            in_rank, per_expert = self._no_topk_routing(session, spec, req, t)
        timeout = self._timeout(req.timeout_seconds)
        args = DispatchArgs(x, scales, idx, weights, max(req.expert_alignment, 1),
                            req.num_worst_tokens,
                            cached.backend_handle if cached is not None else None,
                            in_rank, per_expert)
        return args, cached, timeout

    def _dispatch_sync(self, session: Session, member: GroupMember,
                       req: epd_pb2.DispatchRequest, args: DispatchArgs,
                       cached: HandleInfo | None, timeout: float,
                       path: str) -> epd_pb2.DispatchResponse:
        spec = member.spec
        idx, per_expert, t = args.topk_idx, args.num_tokens_per_expert, int(args.x.shape[0])
        if req.num_sms:
            raise InvalidArgument("num_sms is for stream-ordered calls")
        self.backend.check_event(req.ready_event)
        self._queued(session, member)
        nbytes = self._new_handle_bytes(member, args, cached)
        self._check_handle_budget(session, member, req.release_handles, nbytes)
        self._resolve_all(session, member)  # the slot is about to take this call's counts
        member.dispatch_sequence += 1
        sequence = member.dispatch_sequence
        slot = session.counter_page.slot(member.counter_slot)
        def run():
            host = self._check_values(session, req.ready_event, member, idx, timeout)
            if host is not None and self.backend.inputs_on_host:
                args.topk_idx = host
            if per_expert is not None:
                host = self.backend.to_host(per_expert)
                if host.size and int(host.min()) < 0:
                    raise InvalidArgument(f"num_tokens_per_expert holds a negative count "
                                          f"({int(host.min())})")
                if self.backend.inputs_on_host:
                    args.num_tokens_per_expert = host
            return member.comm.dispatch(args, slot, sequence, time.monotonic() + timeout)

        def failed():
            if int(slot[counter_page.SEQ]) < sequence:  # keep the page in step with requests
                counter_page.publish(slot, sequence, 0, [], status=1)

        out = self._timed(member, metrics.DISPATCH_SECONDS, path, run, failed)
        rows_out = req.num_worst_tokens or out.num_recv_tokens
        handle_id = self._store_handle(member, HandleInfo(out.handle, t, out.num_recv_tokens,
                                                          rows_out, nbytes=nbytes))
        member.dispatches += 1
        metrics.inc(metrics.RECV_TOKENS, (spec.label,), out.num_recv_tokens)
        if self.config.per_expert_metrics and out.num_recv_tokens_per_expert:
            base = member.rank * spec.num_local_experts
            for i, c in enumerate(out.num_recv_tokens_per_expert):
                metrics.inc(metrics.EXPERT_RECV_TOKENS, (spec.label, str(base + i)), c)
        return dispatch_response(member, req, out, handle_id, sequence)

    def _no_topk_routing(self, session: Session, spec: GroupSpec, req: epd_pb2.DispatchRequest,
                         t: int) -> tuple[object, object]:
        """Dispatch without top-k (DeepEP's topk_idx=None): the routing is is_token_in_rank
        (bool [T, R]) and the receive counts come from num_tokens_per_expert (int32 [E])."""
        if not tensors.is_set(req.is_token_in_rank):
            raise InvalidArgument("dispatch needs topk_idx and topk_weights, or "
                                  "is_token_in_rank (and num_tokens_per_expert) to route "
                                  "without top-k, or cached_handle")
        if not self.backend.supports_dispatch_without_topk:
            raise FailedPrecondition(f"dispatch without top-k is not implemented on the "
                                     f"{self.backend.name} backend yet")
        if not tensors.is_set(req.num_tokens_per_expert):
            raise InvalidArgument("dispatch without top-k needs num_tokens_per_expert (int32 "
                                  "[num_experts]: the receive counts per expert come from it)")
        if req.num_worst_tokens:
            raise InvalidArgument("num_worst_tokens needs topk_idx (as in DeepEP, dispatch "
                                  "without top-k has no worst-case mode)")
        in_rank = self._routing(req.is_token_in_rank, session.regions, "is_token_in_rank",
                                epd_pb2.BOOL)
        if in_rank.shape != (t, spec.num_ranks):
            raise InvalidArgument(f"is_token_in_rank has shape {list(in_rank.shape)}, expected "
                                  f"[{t}, {spec.num_ranks}]")
        per_expert = tensors.resolve(req.num_tokens_per_expert, session.regions,
                                     "num_tokens_per_expert", ndim=1, dtype=epd_pb2.INT32)
        if per_expert.shape != (spec.num_experts,):
            raise InvalidArgument(f"num_tokens_per_expert has shape {list(per_expert.shape)}, "
                                  f"expected [{spec.num_experts}]")
        return in_rank, per_expert

    def _unknown_handle(self, member: GroupMember, handle: int) -> str:
        return (f"handle {handle} is not known to rank {member.rank} of group "
                f"{member.spec.name!r}: it was released (the client dropped its handle "
                f"object) or came from another group")

    def _check_handle_budget(self, session: Session, member: GroupMember,
                             releases, nbytes: int) -> None:
        """A dispatch stores one more handle of at most `nbytes` of engine memory: first free
        those it carries (`releases`; only once the call is checked, so a refused call frees
        nothing), then refuse it (before the collective) when the session would hold more
        than --max-handles-per-session handles or --max-handle-bytes-per-session bytes of them.
        Handles are never dropped silently."""
        self._release(member, releases)
        members = list(session.members.values())  # (a join on the event loop may add one
        # meanwhile: iterate a copy)
        held = sum(len(m.handles) for m in members)
        limit = self.config.max_handles_per_session
        if held >= limit:
            raise ResourceExhausted(f"{session.describe()} holds {held} dispatch handles, the "
                                    f"maximum (--max-handles-per-session={limit}); a handle is "
                                    f"freed when the client drops its handle object")
        held = sum(m.handle_bytes for m in members)
        limit = self.config.max_handle_bytes_per_session
        if held + nbytes > limit:
            raise ResourceExhausted(f"{session.describe()} holds {held} bytes of dispatch "
                                    f"handles; this dispatch's handle ({nbytes} bytes for "
                                    f"its tokens) would exceed the maximum of {limit} "
                                    f"(--max-handle-bytes-per-session); a handle is freed "
                                    f"when the client drops its handle object")

    @staticmethod
    def _new_handle_bytes(member: GroupMember, args: DispatchArgs,
                          cached: HandleInfo | None) -> int:
        """What a normal-mode dispatch's handle is charged. A cached dispatch's shares the
        arrays of the handle it reuses, and is charged as much again: it keeps them alive
        once that one is released."""
        if cached is not None:
            return cached.nbytes
        k = int(args.topk_idx.shape[1]) if args.topk_idx is not None else 0
        return member.comm.handle_bytes(False, int(args.x.shape[0]), k)

    def _release(self, member: GroupMember, handles) -> None:
        """Free handles the client no longer holds (unknown ids: already freed, ignored). A list
        far longer than a session can hold is refused before any is freed: freeing runs on the
        session's worker under the interpreter lock, which every tenant's calls share (a review:
        one request of millions of ids)."""
        most = max(4 * self.config.max_handles_per_session, 65536)
        if len(handles) > most:
            raise InvalidArgument(f"{len(handles)} handle ids to release in one request; at most "
                                  f"{most} (a session holds at most --max-handles-per-session="
                                  f"{self.config.max_handles_per_session} handles)")
        for h in handles:
            info = member.handles.pop(h, None)
            if info is not None:
                member.handle_bytes -= info.nbytes

    @staticmethod
    def _check_normal_mode(member: GroupMember, what: str) -> None:
        if member.spec.shrink:
            raise FailedPrecondition(f"group {member.spec.name!r} was joined with shrink (rank "
                                     f"masking): it takes low-latency calls only, not {what} "
                                     f"(normal mode needs every rank; as DeepEP's shrink mode)")

    @staticmethod
    def _check_shrink(spec: GroupSpec) -> None:
        if not spec.shrink:
            raise FailedPrecondition(f"group {spec.name!r} was not joined with shrink (rank "
                                     f"masking; the DeepEP facade's Buffer(enable_shrink=True))")

    @staticmethod
    def _check_rank(spec: GroupSpec, rank: int, what: str) -> None:
        if not 0 <= rank < spec.num_ranks:
            raise InvalidArgument(f"{what}={rank}: group {spec.name!r} has ranks 0.."
                                  f"{spec.num_ranks - 1}")

    def rank_mask_op(self, session: Session, req: epd_pb2.RankMaskRequest,
                     path: str) -> epd_pb2.RankMaskResponse:
        """Read, and optionally change, the mask of a shrink group (DeepEP's
        low_latency_update_mask_buffer / query / clean): the group's, shared by its ranks."""
        member = self.member(session, req.group_id)
        spec, comm = member.spec, member.comm
        which = req.WhichOneof("change")
        if which is not None:
            self._check_shrink(spec)
        if which in ("mask", "unmask"):
            rank = getattr(req, which)
            self._check_rank(spec, rank, which)
            states = comm.mask_states()
            if states[rank] == comm.MASK_GONE:
                if which == "unmask":
                    raise FailedPrecondition(f"rank {rank} of group {spec.name!r} went away: it "
                                             f"stays masked until a replacement rejoins "
                                             f"(Group.rejoin)")
            elif states[rank] != (want := comm.MASK_MASKED if which == "mask" else comm.MASK_IN):
                comm.set_mask(rank, want)  # (unchanged: nothing to do, on any backend)
                if want == comm.MASK_MASKED:
                    metrics.RANKS_MASKED.labels("call").inc()
        elif which == "clean":
            for rank, state in enumerate(comm.mask_states()):
                if state == comm.MASK_MASKED:
                    comm.set_mask(rank, comm.MASK_IN)
        return epd_pb2.RankMaskResponse(state=comm.mask_states())

    def rejoin_op(self, session: Session, req: epd_pb2.RejoinRequest,
                  path: str) -> epd_pb2.RejoinResponse:
        """The Rejoin collective of a shrink group: a replacement for a rank that went away
        comes back (every rank that takes part and the replacement call it)."""
        member = self.member(session, req.group_id)
        self._check_shrink(member.spec)
        self._check_rank(member.spec, req.rank, "rank")
        deadline = time.monotonic() + self._timeout(req.timeout_seconds)
        member.comm.rejoin(req.rank, deadline)
        return epd_pb2.RejoinResponse(state=member.comm.mask_states())

    def release_handles_op(self, session: Session, req: epd_pb2.ReleaseHandlesRequest,
                           path: str) -> epd_pb2.ReleaseHandlesResponse:
        member = self.member(session, req.group_id)
        self._release(member, req.handles)
        return epd_pb2.ReleaseHandlesResponse(handles=len(member.handles))

    @staticmethod
    def _check_kind(info: HandleInfo, handle: int, want: str) -> None:
        if info.kind != want:
            use = "LowLatencyCombine" if info.kind == LOW_LATENCY else "Combine (or a cached " \
                                                                      "Dispatch)"
            raise FailedPrecondition(f"handle {handle} comes from a {info.kind} dispatch; "
                                     f"pass it to {use}")

    def _handle(self, member: GroupMember, handle: int, kind: str) -> HandleInfo:
        """The stored handle, of the kind this operation takes (FailedPrecondition if not)."""
        info = member.handles.get(handle)
        if info is None:
            raise FailedPrecondition(self._unknown_handle(member, handle))
        self._check_kind(info, handle, kind)
        return info

    def _store_handle(self, member: GroupMember, info: HandleInfo) -> int:
        hid = next(_HANDLE_IDS)
        member.handles[hid] = info
        member.handle_bytes += info.nbytes
        return hid

    def combine_op(self, session: Session, req: epd_pb2.CombineRequest,
                   path: str) -> epd_pb2.CombineResponse:
        member = self.member(session, req.group_id)
        return self.combine_taking_part(member, req,
                                        lambda: self._combine(session, member, req, path))

    def combine_taking_part(self, member: GroupMember, req: epd_pb2.CombineRequest,
                            run: Callable[[], T]) -> T:
        """Run a combine of `req.handle`; refused by this engine before it took its sequence,
        it takes part all the same (`_refused_takes_part`)."""
        taken = member.stream_seq
        try:
            return run()
        except EpdError as e:
            self._refused_takes_part(
                member, req, e, "combine",
                lambda deadline: member.comm.refuse_stream_combine(
                    self._known_handle(member, req.handle), deadline),
                fresh=member.stream_seq == taken)
            raise

    def _known_handle(self, member: GroupMember, handle_id: int) -> Any:
        """The backend handle of a refused combine, where this engine knows it (its kernel
        skips the combine of a dispatch that failed alike); None: it waits at the combine's
        entry barrier."""
        try:
            return self._handle(member, handle_id, NORMAL).backend_handle
        except EpdError:
            return None

    def combine_inputs(self, session: Session, member: GroupMember,
                       req: epd_pb2.CombineRequest, rows: int, num_tokens: int,
                       rows_are: str) -> tuple[Array, Array | None, list[Array | None]]:
        """A combine's inputs checked against its dispatch's `rows` received and `num_tokens`
        sent (`rows_are` says what those rows are, for the message): x, topk_weights, and the
        two biases."""
        spec, regions = member.spec, session.regions
        x = tensors.resolve(req.x, regions, "x", ndim=2, dtype=spec.x_dtype)
        if x.shape != (rows, spec.hidden):
            raise InvalidArgument(f"combine x has shape {list(x.shape)}, expected "
                                  f"[{rows}, {spec.hidden}] ({rows_are})")
        weights = None
        if tensors.is_set(req.topk_weights):
            weights = self._routing(req.topk_weights, regions, "topk_weights", epd_pb2.FLOAT32)
            if weights.shape != (rows, spec.num_topk):
                raise InvalidArgument(f"combine topk_weights has shape {list(weights.shape)}, "
                                      f"expected [{rows}, {spec.num_topk}]")
        biases: list[Array | None] = []
        for name, desc in (("bias_0", req.bias_0), ("bias_1", req.bias_1)):
            if not tensors.is_set(desc):
                biases.append(None)
                continue
            b = tensors.resolve(desc, regions, name, ndim=2, dtype=spec.x_dtype)
            if b.shape != (num_tokens, spec.hidden):
                raise InvalidArgument(f"{name} has shape {list(b.shape)}, expected "
                                      f"[{num_tokens}, {spec.hidden}]")
            biases.append(b)
        return x, weights, biases

    def _combine(self, session: Session, member: GroupMember, req: epd_pb2.CombineRequest,
                 path: str) -> epd_pb2.CombineResponse:
        spec = member.spec
        self._check_normal_mode(member, "combine")
        self._check_alive(member, req.stream_ordered)
        info = self._handle(member, req.handle, NORMAL)
        # A worst-case dispatch's client goes on without its count (its rows are known): its
        # combine does not wait for notify either where the kernels skip a failed dispatch,
        # and is launched even if the count came back failed: whether this host saw it yet
        # differs from rank to rank, and every rank must make the same calls (the kernels
        # skip it alike; the client raises the failure at its next dispatch).
        skips = (req.stream_ordered and info.rows_out >= 0
                 and member.comm.combine_skips_failed_dispatch)
        self._resolve(session, member, info, wait=not skips)
        if info.failed and not skips:
            raise FailedPrecondition(f"handle {req.handle} belongs to a dispatch that failed")
        x, weights, biases = self.combine_inputs(
            session, member, req, info.rows_out, info.num_tokens,
            f"rows received by the dispatch of handle {req.handle}")
        timeout = self._timeout(req.timeout_seconds)
        args = CombineArgs(x, info.backend_handle, weights, biases[0], biases[1])
        if req.stream_ordered:  # (it counts the call as queued once its outputs are checked)
            return self.combine_stream(session, member, req, info, args, timeout, path)
        if req.num_sms or tensors.is_set(req.out):
            raise InvalidArgument("num_sms and out are for stream-ordered calls")
        self._queued(session, member)

        def run():
            self._check_values(session, req.ready_event, member, None, timeout)
            return member.comm.combine(args, time.monotonic() + timeout)

        out = self._timed(member, metrics.COMBINE_SECONDS, path, run)
        member.combines += 1
        r = member.comm.output_region
        resp = epd_pb2.CombineResponse(
            combined_x=tensors.describe(out.combined_x, r, spec.x_dtype))
        if out.combined_topk_weights is not None:
            resp.combined_topk_weights.CopyFrom(tensors.describe(out.combined_topk_weights, r))
        return resp

    # -- low-latency mode --------------------------------------------------------------------
    def _check_distinct(self, topk_idx) -> None:
        """Low-latency mode sends one row per (token, expert): a token may not name an expert
        twice."""
        if not topk_idx.shape[0] or topk_idx.shape[1] < 2:
            return
        srt = np.sort(topk_idx, axis=1)  # (a host copy)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            t, j = (int(v) for v in np.argwhere(dup)[0])
            raise InvalidArgument(f"topk_idx[{t}] names expert {int(srt[t, j + 1])} twice; "
                                  f"low-latency mode needs distinct experts per token")

    def ll_dispatch_args(self, session: Session, req: epd_pb2.LowLatencyDispatchRequest
                         ) -> tuple[GroupMember, LowLatencyDispatchArgs, object]:
        """Validate a low-latency dispatch as far as the request itself allows (everything but
        the values of topk_idx); returns the member, the backend args and the optional
        cumulative stats tensor. Shared by the call and by stream-ordered arming."""
        member = self.member(session, req.group_id)
        spec = member.spec
        self._check_alive(member)
        regions = session.regions
        m = req.num_max_dispatch_tokens_per_rank
        if m <= 0:
            raise InvalidArgument(f"num_max_dispatch_tokens_per_rank must be positive, got {m}")
        if m > spec.max_tokens_per_rank:
            raise InvalidArgument(f"num_max_dispatch_tokens_per_rank={m} exceeds the group's "
                                  f"max_tokens_per_rank={spec.max_tokens_per_rank} (its "
                                  f"low-latency buffers are sized by it)")
        if req.num_experts != spec.num_experts:
            raise InvalidArgument(f"num_experts={req.num_experts} does not match the group's "
                                  f"num_experts={spec.num_experts}")
        x = tensors.resolve(req.x, regions, "x", ndim=2, dtype=spec.x_dtype)
        t = x.shape[0]
        if x.shape[1] != spec.hidden:
            raise InvalidArgument(f"x has hidden size {x.shape[1]}, the group's is {spec.hidden}")
        if t > m:
            raise InvalidArgument(f"{t} tokens exceed num_max_dispatch_tokens_per_rank={m}")
        if req.use_fp8 and spec.hidden % dtypes.FP8_BLOCK:
            raise InvalidArgument(f"FP8 dispatch needs hidden % {dtypes.FP8_BLOCK} == 0, the "
                                  f"group's hidden is {spec.hidden}")
        if (req.round_scale or req.use_ue8m0) and not req.use_fp8:
            raise InvalidArgument("round_scale and use_ue8m0 shape FP8 scales; they need "
                                  "use_fp8")
        if not tensors.is_set(req.topk_idx):
            raise InvalidArgument("low-latency dispatch needs topk_idx")
        idx = self._routing(req.topk_idx, regions, "topk_idx", INDEX_DTYPES)
        self._check_routing(spec, idx, None, t)
        stats = None
        if tensors.is_set(req.cumulative_local_expert_recv_stats):
            stats = tensors.resolve(req.cumulative_local_expert_recv_stats, regions,
                                    "cumulative_local_expert_recv_stats", ndim=1,
                                    dtype=epd_pb2.INT32)
            if stats.shape != (spec.num_local_experts,):
                raise InvalidArgument(f"cumulative_local_expert_recv_stats has shape "
                                      f"{list(stats.shape)}, expected "
                                      f"[{spec.num_local_experts}] (local experts)")
        if req.buffer >= abi.LL_BUFFERS:
            raise InvalidArgument(f"buffer={req.buffer}: a rank has receive buffers 0 and 1")
        # use_ue8m0: power-of-two scales, i.e. round_scale (carried as float32 here).
        args = LowLatencyDispatchArgs(x, idx, m, req.use_fp8, req.round_scale or req.use_ue8m0,
                                      buffer=req.buffer)
        return member, args, stats

    def ll_dispatch_op(self, session: Session, req: epd_pb2.LowLatencyDispatchRequest,
                       path: str) -> epd_pb2.LowLatencyDispatchResponse:
        """DeepEP low_latency_dispatch. Validate (nothing changes on bad input), then run."""
        member, args, stats = self.ll_dispatch_args(session, req)
        spec, idx, t, m = member.spec, args.topk_idx, args.x.shape[0], \
            args.num_max_dispatch_tokens_per_rank
        timeout = self._timeout(req.timeout_seconds)
        # A ready event this backend cannot wait for is known from the request alone: refused
        # before the handles the call carries are released (as a normal dispatch does).
        self.backend.check_event(req.ready_event)
        self._queued(session, member)
        nbytes = member.comm.handle_bytes(True, int(t), int(idx.shape[1]))
        self._check_handle_budget(session, member, req.release_handles,  # (but the ids' values)
                                  nbytes)

        def run():
            args.topk_idx_host = self._check_values(session, req.ready_event, member, idx,
                                                    timeout)
            self._check_distinct(args.topk_idx_host)
            if self.backend.inputs_on_host:
                args.topk_idx = args.topk_idx_host
            return member.comm.low_latency_dispatch(args, time.monotonic() + timeout)

        out = self._timed(member, metrics.DISPATCH_SECONDS, path, run)
        if stats is not None:
            stats += out.recv_count
            self.backend.settle()  # (the client reads them once answered)
        handle_id = self._store_handle(member, HandleInfo(out.handle, t, out.num_recv_rows, 0,
                                                          kind=LOW_LATENCY, num_max=m,
                                                          nbytes=nbytes))
        member.dispatches += 1
        metrics.inc(metrics.RECV_TOKENS, (spec.label,), out.num_recv_rows)
        if self.config.per_expert_metrics and out.num_recv_rows:
            base = member.rank * spec.num_local_experts
            for i, c in enumerate(self.backend.to_host(out.recv_count)):
                metrics.inc(metrics.EXPERT_RECV_TOKENS, (spec.label, str(base + i)), int(c))
        return ll_dispatch_response(member, out, req.use_fp8, handle_id)

    def ll_combine_args(self, session: Session, member: GroupMember,
                        req: epd_pb2.LowLatencyCombineRequest, num_tokens: int, num_max: int,
                        backend_handle) -> LowLatencyCombineArgs:
        """Validate a low-latency combine of a dispatch of `num_tokens` tokens and
        `num_max` rows per source block (all but the values of topk_idx)."""
        spec = member.spec
        regions = session.regions
        x = tensors.resolve(req.x, regions, "x", ndim=3, dtype=spec.x_dtype)
        want = (spec.num_local_experts, spec.num_ranks * num_max, spec.hidden)
        if x.shape != want:
            raise InvalidArgument(f"low-latency combine x has shape {list(x.shape)}, expected "
                                  f"{list(want)} ([local experts, num_ranks * "
                                  f"num_max_dispatch_tokens_per_rank, hidden] of the dispatch)")
        if not tensors.is_set(req.topk_idx) or not tensors.is_set(req.topk_weights):
            raise InvalidArgument("low-latency combine needs topk_idx and topk_weights")
        idx = self._routing(req.topk_idx, regions, "topk_idx", INDEX_DTYPES)
        weights = self._routing(req.topk_weights, regions, "topk_weights", epd_pb2.FLOAT32)
        self._check_routing(spec, idx, weights, num_tokens)
        out = None
        if tensors.is_set(req.out):
            out = tensors.resolve(req.out, regions, "out", ndim=2, dtype=spec.x_dtype)
            if out.shape != (num_tokens, spec.hidden):
                raise InvalidArgument(f"out has shape {list(out.shape)}, expected "
                                      f"[{num_tokens}, {spec.hidden}]")
        return LowLatencyCombineArgs(x, idx, weights, backend_handle, out)

    def ll_combine_op(self, session: Session, req: epd_pb2.LowLatencyCombineRequest,
                      path: str) -> epd_pb2.LowLatencyCombineResponse:
        """DeepEP low_latency_combine (weighted). Validate, then run."""
        member = self.member(session, req.group_id)
        spec = member.spec
        self._check_alive(member)
        info = self._handle(member, req.handle, LOW_LATENCY)
        args = self.ll_combine_args(session, member, req, info.num_tokens, info.num_max,
                                    info.backend_handle)
        idx, out = args.topk_idx, args.out
        timeout = self._timeout(req.timeout_seconds)
        self._queued(session, member)

        def run():
            args.topk_idx_host = self._check_values(session, req.ready_event, member, idx,
                                                    timeout)
            self._check_distinct(args.topk_idx_host)  # (as the dispatch: a row per expert)
            if self.backend.inputs_on_host:
                args.topk_idx = args.topk_idx_host
            return member.comm.low_latency_combine(args, time.monotonic() + timeout)

        res = self._timed(member, metrics.COMBINE_SECONDS, path, run)
        member.combines += 1
        if out is not None:  # written in place: the caller's own tensor
            return epd_pb2.LowLatencyCombineResponse(combined_x=req.out)
        return epd_pb2.LowLatencyCombineResponse(
            combined_x=tensors.describe(res.combined_x, member.comm.output_region,
                                        spec.x_dtype))


def dispatch_response(member: GroupMember, req: epd_pb2.DispatchRequest, out,
                      handle_id: int, sequence: int,
                      stream_seq: int = 0) -> epd_pb2.DispatchResponse:
    """Describe dispatch outputs (views of the engine's output region). A stream-ordered
    dispatch's output views are the same objects for every call of one shape (the backend makes
    them once), so their descriptors are made once too (GroupMember.described) and each call
    copies them: describing six CuPy views cost the engine ~30 µs of a call's critical path."""
    if not stream_seq:
        resp = _describe_dispatch(member, req, out)
    else:
        arrays = (member.comm.output_region, out.recv_x, out.recv_x_scales, out.recv_topk_idx,
                  out.recv_topk_weights, out.recv_src_idx, out.rank_prefix_matrix)
        key = (*map(id, arrays), req.x.dtype, req.x_scales.dtype)
        # The entry holds the arrays, so no id in its key can name another object while the
        # entry stays: a hit is these very views.
        hit = member.described.get(key)
        if hit is None:
            if len(member.described) >= MAX_DESCRIBED:
                member.described.clear()
            hit = member.described[key] = (arrays, _describe_dispatch(member, req, out))
        resp = epd_pb2.DispatchResponse()
        resp.CopyFrom(hit[1])
    resp.num_recv_tokens_per_expert.extend(out.num_recv_tokens_per_expert)
    resp.handle, resp.num_recv_tokens = handle_id, out.num_recv_tokens
    resp.counter_sequence, resp.stream_seq = sequence, stream_seq
    return resp


MAX_DESCRIBED = 16  # dispatch output layouts remembered per membership (cleared when full)


def _describe_dispatch(member: GroupMember, req: epd_pb2.DispatchRequest,
                       out) -> epd_pb2.DispatchResponse:
    r = member.comm.output_region
    resp = epd_pb2.DispatchResponse(
        recv_x=tensors.describe(out.recv_x, r, req.x.dtype),
        recv_src_idx=tensors.describe(out.recv_src_idx, r),
        rank_prefix_matrix=tensors.describe(out.rank_prefix_matrix, r))
    if out.recv_x_scales is not None:  # in the call's scale dtype (float32 or int32)
        resp.recv_x_scales.CopyFrom(tensors.describe(out.recv_x_scales, r, req.x_scales.dtype))
    if out.recv_topk_idx is not None:
        resp.recv_topk_idx.CopyFrom(tensors.describe(out.recv_topk_idx, r))
        resp.recv_topk_weights.CopyFrom(tensors.describe(out.recv_topk_weights, r))
    return resp


def ll_dispatch_response(member: GroupMember, out, use_fp8: bool,
                         handle_id: int) -> epd_pb2.LowLatencyDispatchResponse:
    """Describe low-latency dispatch outputs (views of the engine's output region)."""
    spec, r = member.spec, member.comm.output_region
    resp = epd_pb2.LowLatencyDispatchResponse(
        recv_x=tensors.describe(out.recv_x, r, epd_pb2.FLOAT8_E4M3 if use_fp8 else spec.x_dtype),
        recv_count=tensors.describe(out.recv_count, r), handle=handle_id,
        recv_src_rank=tensors.describe(out.recv_src_rank, r),
        recv_src_idx=tensors.describe(out.recv_src_idx, r))
    if out.recv_x_scales is not None:
        resp.recv_x_scales.CopyFrom(tensors.describe(out.recv_x_scales, r))
    return resp
