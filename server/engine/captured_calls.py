"""Normal-mode dispatch and combine captured in a CUDA graph, engine side.

An eager stream-ordered call (stream_calls.py) has its kernels enqueued once, when the engine
answers it; a graph replays the caller's stream work without asking the engine again. So a
call made under capture is armed instead, like a low-latency one (stream_ops.py): the client's
graph holds a trigger (the op's entry appended to the member's ring) and a wait for the op's
done word, and each time the poller reads the entry it runs the stored request as a
stream-ordered call of its own: the checks of its first run (kept: `_dispatch` below) and
the group's state each time, the member's next sequences, a new handle (the previous
trigger's released, its arrays refilled), the kernels enqueued at once, then the done word
written on the rank's stream after them. The poller reads the ring in the order the triggers
reached the GPU, so every rank numbers the calls alike.

What can be armed: a worst-case dispatch (`num_worst_tokens`, not cached; DeepEP captures
exactly that, its receive count never reaching the host) and the combine of such an armed
dispatch, which brings back the dispatch op's latest trigger. The outputs are fixed: the
dispatch's are views of the receive buffers at num_worst_tokens rows (the client's captured
copy-out reads them after the wait), the combine's the caller's own `out`.

The host does not see these calls coming, so an eager normal-mode call of the same member is
numbered when its request arrives while a trigger the caller's GPU has not reached yet is
numbered later; a rank whose GPU was faster would number them the other way round. The client
therefore synchronises its stream before an eager dispatch or combine of a group holding armed
normal-mode ops (client/captured_calls.py): every earlier trigger has fired by then.

A trigger's failure after its launch (a deadline, a peer's bad input in notify, capacity) is
reported as an eager call's is: the stream failure words or, for notify's verdicts, the
counter slot, which the engine copies into the member's ring slot once it resolves the count
(at the member's next dispatch: `record_failure`), raised by the client's next eager
dispatch or check(). A trigger the engine refuses (its checks: a handle budget, an aborted
group) fails the op's done word, kept in its sticky word for the client's check(); the peers'
kernels then wait out their deadline. The poller never waits for a receive count: a trigger
whose run would (`ready`) stays in the ring until notify has published it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...proto import abi, counter_page, host_order
from ...proto.errors import FailedPrecondition, InvalidArgument, NotFound
from ...proto.v1 import epd_pb2
from ..backends.base import CombineArgs
from . import tensors
from .ops import dispatch_response
from .state import NORMAL, GroupMember, Session

if TYPE_CHECKING:
    from .core import Engine
    from .stream_ops import StreamOp

KIND_DISPATCH, KIND_COMBINE = "Dispatch", "Combine"  # (StreamOp.kind; the metrics' method)
PATH = "graph"  # the calls' path label in the latency histograms


def arm_dispatch(e: Engine, session: Session, req: epd_pb2.DispatchRequest
                 ) -> tuple[GroupMember, epd_pb2.DispatchResponse]:
    """Check a dispatch to arm (as a call's checks: nothing changes on bad input) and answer
    its fixed output views; takes no sequence."""
    member = e.member(session, req.group_id)
    e._check_ordered(member)
    if not member.comm.combine_skips_failed_dispatch:
        raise FailedPrecondition(
            f"group {member.spec.name!r}: its combine does not skip a dispatch that failed on "
            f"every rank (a two-stage group), which a replayed pair needs: capture is not "
            f"built for it; call dispatch and combine outside the graph")
    if req.num_worst_tokens <= 0 or req.cached_handle:
        raise FailedPrecondition(
            f"group {member.spec.name!r}: only a worst-case dispatch (num_worst_tokens > 0, "
            f"not cached) runs in a CUDA graph: its outputs have a fixed shape and its host "
            f"waits for no receive count (DeepEP captures the same)")
    if req.release_handles:
        raise InvalidArgument("an armed dispatch carries no handle releases")
    req.stream_ordered = True
    args, _cached, _timeout = e.dispatch_args(session, member, req)
    num_sms = e._num_sms(member, req.num_sms)
    slot = session.counter_page.slot(member.counter_slot)
    # (the views only: sequence 0 publishes nothing and the launch is dropped)
    out, _launch = member.comm.stream_dispatch(args, slot, 0, 0.0, 0, num_sms)
    return member, dispatch_response(member, req, out, 0, 0, 0)


def arm_combine(e: Engine, session: Session, req: epd_pb2.CombineRequest,
                src: StreamOp | None) -> GroupMember:
    """Check the combine of an armed dispatch `src` (its shapes against that dispatch's)."""
    if src is None or src.kind != KIND_DISPATCH:
        raise NotFound("dispatch_op is not an armed normal-mode dispatch of this session")
    member = e.member(session, req.group_id)
    if member is not src.member:
        raise FailedPrecondition("the combine and its dispatch_op belong to different groups")
    spec, d = member.spec, src.request
    rows, t = d.num_worst_tokens, int(d.x.shape[0])
    e.combine_inputs(session, member, req, rows, t, "num_worst_tokens rows of its dispatch")
    if tensors.is_set(req.topk_weights):
        e._stream_output(session, req.out_topk_weights, "out_topk_weights",
                         (t, spec.num_topk), epd_pb2.FLOAT32)
    elif tensors.is_set(req.out_topk_weights):
        raise InvalidArgument("out_topk_weights is only for a combine with topk_weights")
    e._stream_output(session, req.out, "out", (t, spec.hidden), spec.x_dtype)
    e._num_sms(member, req.num_sms)
    req.stream_ordered = True
    return member


def ready(op: StreamOp) -> bool:
    """Whether a trigger of `op` can run without waiting on the host: the receive count of the
    member's latest dispatch (which its run reads first), and of the dispatch a combine brings
    back, published. A trigger that is not ready stays in the ring: one poller serves every
    session, so it never waits for a count (a client that triggers a dispatch again before
    its previous trigger's notify ran, or a peer that never comes, only delays its own
    member's ring; the kernel's deadline publishes a failed count at the latest)."""
    member = op.member
    slot = op.session.counter_page.slot(member.counter_slot)
    waiting = [member.pending]
    if op.dispatch_op is not None and op.dispatch_op.handle:
        waiting.append(member.handles.get(op.dispatch_op.handle))
    return all(info is None or not info.sequence or counter_page.published(slot, info.sequence)
               for info in waiting)


def fire(e: Engine, op: StreamOp) -> None:
    """Run one trigger of an armed normal-mode op as a stream-ordered call (the poller holds
    the op's session's operation lock and saw it `ready`). Raises where nothing was launched:
    the caller fails the op's done word."""
    session, member = op.session, op.member
    try:
        if op.kind == KIND_DISPATCH:
            prev, op.handle = op.handle, 0
            try:
                op.handle, seq = _dispatch(e, op, prev)
            except BaseException:
                if prev:  # (refused before its checks freed it: a combine must not read it)
                    e._release(member, [prev])
                raise
        else:
            seq = _combine(e, op)
    except BaseException:
        session.executor.take_after()  # (as an operation that fails: nothing queued runs)
        raise
    # The trigger is the client's READY: its stream has produced the inputs.
    ready32 = session.counter_page.slot(member.counter_slot).view(np.int32)
    ready32[abi.SLOT32_READY + seq % abi.READY_RING] = np.int32(np.uint32(seq))
    for later in session.executor.take_after():  # (the launch; it handles its own failure)
        later()
    member.comm.signal_after(op.done_ptr, abi.DONE_OK)


# A trigger runs the checks of its call's first run only where their answer can change: the
# request is fixed, and the regions its tensors view stay registered while the op is armed
# (core.unregister_region refuses), so the checked arguments are kept in `op.plan` and each
# trigger checks the group's state (aborted, failed stream, handle budget) and takes its
# sequences. No response is built: nobody reads one.

def _dispatch(e: Engine, op: StreamOp, prev: int) -> tuple[int, int]:
    """One trigger of an armed dispatch (the previous trigger's handle `prev` freed with
    its checks): its handle id and stream sequence."""
    session, member, req = op.session, op.member, op.request
    if op.plan is None:
        op.plan = e.dispatch_args(session, member, req)
    else:
        e._check_alive(member, stream_ordered=True)
    args, _cached, timeout = op.plan
    del req.release_handles[:]
    old = member.handles.get(prev) if prev else None
    if old is not None:
        req.release_handles.append(prev)
    # (only a captured handle's arrays: no cached dispatch shares them, ops.dispatch_args)
    args.refill = old.backend_handle if old is not None and old.captured else None
    try:
        _out, handle, _sequence, seq = e.launch_stream_dispatch(session, member, req, args,
                                                                None, timeout, PATH)
    finally:
        args.refill = None  # (the plan keeps no released handle alive)
    member.handles[handle].captured = True
    return handle, seq


def _combine(e: Engine, op: StreamOp) -> int:
    """One trigger of an armed combine, of its dispatch op's latest trigger: its stream
    sequence. Its dispatch's failure does not stop it (the kernels skip a dispatch that
    failed on every rank alike, and every rank must make the same calls)."""
    session, member, req, src = op.session, op.member, op.request, op.dispatch_op
    assert src is not None
    if not src.handle:
        raise FailedPrecondition(f"stream op {op.op_id}: the combine of dispatch op "
                                 f"{src.op_id}, whose latest trigger did not run")
    req.handle = src.handle

    def run() -> int:
        e._check_alive(member, stream_ordered=True)
        info = e._handle(member, req.handle, NORMAL)
        e._resolve(session, member, info, wait=False)
        if op.plan is None:
            x, weights, biases = e.combine_inputs(
                session, member, req, info.rows_out, info.num_tokens,
                f"rows received by the dispatch of handle {req.handle}")
            out, out_w = e.combine_outputs(session, member, req, info.num_tokens,
                                           weights is not None)
            op.plan = (x, weights, biases, out, out_w, e._timeout(req.timeout_seconds))
        x, weights, biases, out, out_w, timeout = op.plan
        args = CombineArgs(x, info.backend_handle, weights, biases[0], biases[1])
        return e.launch_stream_combine(session, member, info, args, out, out_w, timeout, PATH,
                                       req.num_sms)
    return e.combine_taking_part(member, req, run)


def note_worst_case(words: np.ndarray, sequence: int, num_worst: int) -> None:
    """A worst-case dispatch of a member holding captured calls, replayed or eager, taken now:
    its counter sequence and num_worst_tokens into its ring slot, which the client reads when
    it finds that dispatch failed in the counter slot (to name its num_worst_tokens)."""
    w64 = words.view(np.int64)
    w64[abi.RING_FIRED_WORST] = num_worst
    host_order.publish()
    w64[abi.RING_FIRED_SEQ] = sequence


def record_failure(words: np.ndarray, slot: np.ndarray, num_worst: int) -> None:
    """A dispatch of a member holding captured calls failed alike on every rank (notify's
    verdict in the member's counter slot `slot`): what failed it, into its ring slot
    (`words`), where the client finds it (client/captured_calls.py) even after later
    dispatches overwrote the counter slot."""
    w64 = words.view(np.int64)
    w64[abi.RING_FAIL_STATUS] = int(slot[counter_page.STATUS])
    w64[abi.RING_FAIL_RANK] = int(slot[abi.SLOT_ERR_RANK])
    w64[abi.RING_FAIL_VALUE] = int(slot[counter_page.NUM_RECV])
    w64[abi.RING_FAIL_WORST] = num_worst
    host_order.publish()  # (the words before the sequence the client reads first)
    w64[abi.RING_FAIL_SEQ] = int(slot[counter_page.SEQ])
