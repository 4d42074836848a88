"""Stream-ordered normal-mode calls: layout, dispatch, cached dispatch and combine without a host
round trip on the data path (cuda backend; docs/DESIGN_NOTES.md "Stream-ordered normal mode").

The engine validates a call's descriptors (shapes, dtypes, regions) as for a synchronous call,
but reads no tensor data and never waits for the GPU: it enqueues, on the rank's stream, a
GPU-side wait for the client's READY word, the kernels, and a last kernel that writes the
call's failure words and DONE (proto/counter_page.py), then answers with the call's stream
sequence. The client's stream writes READY after the answer and waits for DONE. Values are
checked on the GPU (an expert id out of range fails a dispatch on every rank alike, through
notify; a layout's is that rank's alone). The one host wait is the one DeepEP has: a
dispatch's receive count, which the notify kernel writes into the client's counter page; the
engine learns it from the same page when it needs it (combine's shape check, the next
dispatch).

The answer goes out before the kernels are enqueued (`_launch_after_answer`, run by the session's
executor under its operation lock once the transport has answered): the client's stream
operations overlap the engine's launches. A launch that fails after the answer aborts the group
and fails the call through the counter slot (`_launch_failed`).

Outputs: layout and combine write the caller's own tensors (named in the request), so they live
as long as the caller holds them; dispatch answers the receive buffers at their largest shape,
which the client copies out on its stream (or views, with copy=False, until its next dispatch).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...proto import abi, counter_page
from ...proto.errors import Aborted, FailedPrecondition, InvalidArgument
from ...proto.v1 import epd_pb2
from .. import metrics, service_classes
from ..backends.base import CombineArgs, DispatchArgs, DispatchOutputs
from . import captured_calls, tensors
from .ops import dispatch_response
from .state import GroupMember, HandleInfo, Session

if TYPE_CHECKING:
    from ..backends.base import Array

log = logging.getLogger("epd.engine")
SEQ_MASK = 0xFFFFFFFF  # stream sequences are the 32-bit words the stream operations compare


def _contiguous(desc: epd_pb2.TensorDesc) -> bool:
    """Whether a (resolved: checked) descriptor is dense row-major; no strides say so, as
    tensors.resolve reads them."""
    return not desc.strides or tensors.is_dense(tuple(desc.shape), tuple(desc.strides))


class StreamCalls:
    """Mixed into Engine (with ops.DataPlane): needs `config`, `backend`, `_timeout()`,
    `_store_handle()`, `_count_traffic()`, `_new_handle_bytes()`, `_check_handle_budget()` and
    `_queued()`."""

    @staticmethod
    def _next_stream_seq(member: GroupMember) -> int:
        """The member's next stream sequence, not yet taken: the caller takes it
        (`member.stream_seq = seq`) once the backend accepted the call, so a call the backend
        refuses (a normal-mode call on a group beyond the kernels' ranks) changes nothing."""
        return (member.stream_seq % SEQ_MASK) + 1

    @staticmethod
    def _num_sms(member: GroupMember, requested: int) -> int:
        """A client's SM request, bounded by what its group may use: the class's SM budget,
        else the daemon's --num-sms (it may only ask for fewer; 0 takes that)."""
        if requested < 0:
            raise InvalidArgument(f"num_sms must be >= 0 (0: the daemon's), got {requested}")
        limit = member.comm.num_sms
        return min(requested, limit) if requested and limit else requested

    def _stream_output(self, session: Session, desc: epd_pb2.TensorDesc, what: str,
                       shape: tuple[int, ...], dtype: int) -> Array:
        if not tensors.is_set(desc):
            raise InvalidArgument(f"a stream-ordered call writes the caller's {what}: name it "
                                  f"({list(shape)} {epd_pb2.DType.Name(dtype).lower()})")
        out = tensors.resolve(desc, session.regions, what, ndim=len(shape), dtype=dtype)
        if tuple(out.shape) != shape:
            raise InvalidArgument(f"{what} has shape {list(out.shape)}, expected {list(shape)}")
        if not _contiguous(desc):
            raise InvalidArgument(f"{what} must be contiguous")
        return out

    def _check_stream_alive(self, member: GroupMember, slot) -> None:
        """Refuse a call on a group that failed: known to this host, or reported by a kernel
        in the counter slot (the peers are told through the abort word)."""
        reason = member.comm.known_abort_reason()
        if reason is not None:
            raise Aborted(f"group {member.spec.name!r} is aborted: {reason}")
        f = counter_page.stream_failure(slot)
        if f is not None and f.fatal:
            err = f.error(member.spec.name, member.spec.num_experts)
            member.comm.abort(err.message)
            raise err

    def _check_ordered(self, member: GroupMember) -> None:
        if not member.comm.stream_ordered:
            raise FailedPrecondition(f"stream-ordered calls need the cuda backend; this engine "
                                     f"runs {self.backend.name}")

    # -- launching after the answer ----------------------------------------------------------
    def _launch_after_answer(self, session: Session, member: GroupMember, slot, seq: int,
                             what: str, metric, path: str, launch: Callable[[], None],
                             dispatch_sequence: int = 0) -> None:
        """Enqueue the call's kernels once its answer is on its way to the client (the
        client's stream operations and next request overlap the launches). Everything that
        could refuse the call has been checked; a launch that still fails is `_launch_failed`.
        `dispatch_sequence`: a dispatch whose receive count the notify kernel would publish."""
        name = member.spec.label  # (the metrics' group label)
        pacer = getattr(self, "pacer", None)
        latency = (pacer.latency() if pacer is not None and pacer.enabled
                   and member.service_class == service_classes.LATENCY
                   else contextlib.nullcontext())

        def run() -> None:
            t0 = time.perf_counter()
            try:
                with latency:  # (still latency work in flight for the pacer: pacing.py)
                    launch()
            except Exception as e:
                self._launch_failed(member, slot, seq, what, e, dispatch_sequence)
                return
            metrics.observe(metric, (name, path, self.backend.name), time.perf_counter() - t0)
        session.executor.after_answer(run)

    def _launch_failed(self, member: GroupMember, slot, seq: int, what: str,
                       e: Exception, dispatch_sequence: int = 0) -> None:
        """The client holds call `seq` and its stream waits for DONE, which no kernel will
        write: abort the group (its later calls fail, the peers stop at once), let the rank's
        stream run out what it holds (an earlier call's last kernel would write an older
        DONE after ours), then write the failure words and DONE from the host; a dispatch's
        client, waiting for its receive count, gets a failed count at once."""
        why = f"rank {member.rank}: {what} #{seq} could not be launched ({e})"
        log.error("group %r: %s; aborting the group", member.spec.name, why)
        if member.comm.known_abort_reason() is None:
            try:
                member.comm.abort(why)
            except Exception as again:  # (a broken context fails the abort kernel too)
                log.error("group %r: the abort failed as well: %s", member.spec.name, again)
        if not member.comm.drain_stream(self._timeout(0.0)):
            log.error("group %r: rank %d's stream did not drain; releasing call #%d anyway",
                      member.spec.name, member.rank, seq)
        counter_page.fail_stream(slot, seq, abi.ERR_ABORTED, member.rank)
        if dispatch_sequence:
            slot[abi.SLOT_ERR_RANK] = -1
            counter_page.publish(slot, dispatch_sequence, 0, [], status=abi.ERR_ABORTED)

    # -- handles whose receive count is still on its way -------------------------------------
    def _resolve(self, session: Session, member: GroupMember, info: HandleInfo,
                 wait: bool = True) -> bool:
        """Learn a stream-ordered dispatch's receive count from the counter slot (the client
        has normally read it already; else wait for notify, with the call's deadline).
        `wait=False`: only if notify has published it by now. Whether the count is known."""
        if not info.sequence:
            return True
        slot = session.counter_page.slot(member.counter_slot)
        if not wait and not counter_page.published(slot, info.sequence):
            return False
        got = counter_page.wait(slot, info.sequence, self._timeout(0.0))
        stale = int(slot[counter_page.SEQ]) != info.sequence
        info.sequence = 0
        if member.pending is info:
            member.pending = None
        spec = member.spec
        status = int(slot[counter_page.STATUS])  # (a failed call's NUM_RECV is its cause)
        implausible = got is not None and not status and not counter_page.counts_in_range(
            *got, spec.max_recv_tokens, spec.num_local_experts)
        if implausible:
            log.warning("%s: group %r's dispatch counts in its counter page are not ones a "
                        "notify writes (%d rows); the call is marked failed",
                        session.describe(), spec.name, got[0])
        if got is None or stale or status or implausible:
            if status and not stale and member.failure_words is not None:
                captured_calls.record_failure(member.failure_words, slot,
                                              max(info.rows_out, 0))
            info.failed = True
            info.num_recv_tokens = 0
            info.rows_out = info.rows_out if info.rows_out >= 0 else 0
            return True
        n, per_expert = got
        info.num_recv_tokens = n
        if info.rows_out < 0:
            info.rows_out = n
        info.backend_handle.num_recv = n
        nbytes = n * spec.hidden * spec.x_numpy_dtype.itemsize
        member.bytes_received += nbytes
        metrics.inc(metrics.BYTES_RECEIVED, (spec.label, self.backend.peer_class), nbytes)
        if info.unresolved_combines:  # (combines launched before the count was known)
            sent = info.unresolved_combines * nbytes
            info.unresolved_combines = 0
            member.bytes_sent += sent
            metrics.inc(metrics.BYTES_SENT, (spec.label, self.backend.peer_class), sent)
        metrics.inc(metrics.RECV_TOKENS, (spec.label,), n)
        if self.config.per_expert_metrics and per_expert:
            base = member.rank * spec.num_local_experts
            for i, c in enumerate(per_expert):
                metrics.inc(metrics.EXPERT_RECV_TOKENS, (spec.label, str(base + i)), c)
        return True

    def _resolve_all(self, session: Session, member: GroupMember) -> None:
        """Before the counter slot takes another dispatch's counts."""
        if member.pending is not None:
            self._resolve(session, member, member.pending)

    # -- the calls ---------------------------------------------------------------------------
    def layout_stream(self, session: Session, member: GroupMember,
                      req: epd_pb2.GetDispatchLayoutRequest, idx: Array,
                      path: str) -> epd_pb2.GetDispatchLayoutResponse:
        self._check_ordered(member)
        spec = member.spec
        t, r, e = int(idx.shape[0]), spec.num_ranks, spec.num_experts
        outs = (self._stream_output(session, req.num_tokens_per_rank_out,
                                    "num_tokens_per_rank_out", (r,), epd_pb2.INT32),
                self._stream_output(session, req.num_tokens_per_expert_out,
                                    "num_tokens_per_expert_out", (e,), epd_pb2.INT32),
                self._stream_output(session, req.is_token_in_rank_out, "is_token_in_rank_out",
                                    (t, r), epd_pb2.BOOL))
        slot = session.counter_page.slot(member.counter_slot)
        self._check_stream_alive(member, slot)
        seq = self._next_stream_seq(member)
        launch = member.comm.stream_layout(idx, outs, slot, seq)
        member.stream_seq = seq  # (taken once the backend accepted the call)
        self._launch_after_answer(session, member, slot, seq, "layout", metrics.LAYOUT_SECONDS,
                                  path, launch)
        return epd_pb2.GetDispatchLayoutResponse(
            num_tokens_per_rank=req.num_tokens_per_rank_out,
            num_tokens_per_expert=req.num_tokens_per_expert_out,
            is_token_in_rank=req.is_token_in_rank_out, stream_seq=seq)

    def dispatch_stream(self, session: Session, member: GroupMember,
                        req: epd_pb2.DispatchRequest, args: DispatchArgs, cached: HandleInfo | None,
                        timeout: float, path: str) -> epd_pb2.DispatchResponse:
        out, handle_id, sequence, seq = self.launch_stream_dispatch(
            session, member, req, args, cached, timeout, path)
        return dispatch_response(member, req, out, handle_id, sequence, seq)

    def launch_stream_dispatch(self, session: Session, member: GroupMember,
                               req: epd_pb2.DispatchRequest, args: DispatchArgs,
                               cached: HandleInfo | None, timeout: float, path: str
                               ) -> tuple[DispatchOutputs, int, int, int]:
        """A checked stream-ordered dispatch taken and its launch queued after the answer:
        its outputs, handle id, counter sequence and stream sequence (a captured call's
        trigger needs no response: captured_calls.fire)."""
        # (dispatch_op refused routing without top-k and a failed cached handle already)
        self._check_ordered(member)
        spec = member.spec
        slot = session.counter_page.slot(member.counter_slot)
        self._check_stream_alive(member, slot)
        num_sms = self._num_sms(member, req.num_sms)
        self._queued(session, member)
        nbytes = self._new_handle_bytes(member, args, cached)
        self._check_handle_budget(session, member, req.release_handles, nbytes)
        self._resolve_all(session, member)  # the slot is about to take this call's counts
        sequence = member.dispatch_sequence + 1
        seq = self._next_stream_seq(member)
        out, launch = member.comm.stream_dispatch(args, slot, sequence,
                                                  time.monotonic() + timeout, seq, num_sms)
        # Both sequences are taken only now: a dispatch the backend refuses (beyond the
        # kernels' ranks, without top-k over nodes) leaves the member's counters as they were.
        # (The backend refuses before it publishes a cached dispatch's count; a failure after
        # that is no refusal but a broken launch, which aborts the group (cuda.py `_launches`),
        # so no live call of the group reuses a published number.)
        member.dispatch_sequence, member.stream_seq = sequence, seq
        if member.failure_words is not None and args.num_worst_tokens:
            captured_calls.note_worst_case(member.failure_words, sequence, args.num_worst_tokens)
        self._launch_after_answer(session, member, slot, seq, "dispatch",
                                  metrics.DISPATCH_SECONDS, path, launch,
                                  dispatch_sequence=sequence if out.num_recv_tokens < 0 else 0)
        member.bytes_sent += out.bytes_sent
        metrics.inc(metrics.BYTES_SENT, (spec.label, self.backend.peer_class), out.bytes_sent)
        t = int(args.x.shape[0])
        pending = out.num_recv_tokens < 0
        info = HandleInfo(out.handle, t, out.num_recv_tokens,
                          req.num_worst_tokens or out.num_recv_tokens,
                          sequence=sequence if pending else 0, nbytes=nbytes)
        handle_id = self._store_handle(member, info)
        if pending:
            member.pending = info
        member.dispatches += 1
        return out, handle_id, sequence, seq

    def combine_stream(self, session: Session, member: GroupMember,
                       req: epd_pb2.CombineRequest, info: HandleInfo, args: CombineArgs,
                       timeout: float, path: str) -> epd_pb2.CombineResponse:
        self._check_ordered(member)
        out, out_w = self.combine_outputs(session, member, req, info.num_tokens,
                                          args.topk_weights is not None)
        seq = self.launch_stream_combine(session, member, info, args, out, out_w, timeout, path,
                                         req.num_sms)
        resp = epd_pb2.CombineResponse(combined_x=req.out, stream_seq=seq)
        if out_w is not None:
            resp.combined_topk_weights.CopyFrom(req.out_topk_weights)
        return resp

    def combine_outputs(self, session: Session, member: GroupMember, req: epd_pb2.CombineRequest,
                        num_tokens: int, with_weights: bool) -> tuple[Array, Array | None]:
        """A stream-ordered combine's outputs, the caller's: out, and out_topk_weights for a
        combine with topk_weights."""
        spec = member.spec
        out = self._stream_output(session, req.out, "out", (num_tokens, spec.hidden),
                                  spec.x_dtype)
        out_w = None
        if with_weights:
            out_w = self._stream_output(session, req.out_topk_weights, "out_topk_weights",
                                        (num_tokens, spec.num_topk), epd_pb2.FLOAT32)
        elif tensors.is_set(req.out_topk_weights):
            raise InvalidArgument("out_topk_weights is only for a combine with topk_weights")
        return out, out_w

    def launch_stream_combine(self, session: Session, member: GroupMember, info: HandleInfo,
                              args: CombineArgs, out: Array, out_w: Array | None,
                              timeout: float, path: str, num_sms: int) -> int:
        """A checked stream-ordered combine taken and its launch queued after the answer: its
        stream sequence (its callers checked the member's calls are stream-ordered: the
        eager combine first of all, an armed one when its dispatch was armed)."""
        spec = member.spec
        slot = session.counter_page.slot(member.counter_slot)
        self._check_stream_alive(member, slot)
        num_sms = self._num_sms(member, num_sms)
        self._queued(session, member)
        seq = self._next_stream_seq(member)
        launch = member.comm.stream_combine(args, out, out_w, slot, time.monotonic() + timeout,
                                            seq, num_sms)
        member.stream_seq = seq  # (taken once the backend accepted the call)
        self._launch_after_answer(session, member, slot, seq, "combine",
                                  metrics.COMBINE_SECONDS, path, launch)
        if info.sequence:  # (its count not published yet: counted once it is, _resolve)
            info.unresolved_combines += 1
        else:
            nbytes = info.num_recv_tokens * spec.hidden * spec.x_numpy_dtype.itemsize
            member.bytes_sent += nbytes
            metrics.inc(metrics.BYTES_SENT, (spec.label, self.backend.peer_class), nbytes)
        member.combines += 1
        return seq
