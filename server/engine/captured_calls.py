"""Normal-mode dispatch and combine captured in a CUDA graph, engine side.

An eager stream-ordered call (stream_calls.py) has its kernels enqueued once, when the engine
answers it; a graph replays the caller's stream work without asking the engine again. So a
call made under capture is armed instead, like a low-latency one (stream_ops.py): the client's
graph holds a trigger (the op's entry appended to the member's ring) and a wait for the op's
done word, and each time the poller reads the entry it runs the stored request as a
stream-ordered call of its own: the same checks, the member's next sequences, a new handle
(the previous trigger's released), the kernels enqueued at once, then the done word written
on the rank's stream after them. The poller reads the ring in the order the triggers reached
the GPU, so every rank numbers the calls alike.

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
counter slot, which the engine copies into the op's slot once it resolves the count (the next
trigger of the op, or any dispatch of the member), raised by the client's next call or check().
A failure before the launch (a region unregistered since) fails the op's done word; the peers'
kernels then wait out their deadline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...proto import abi, counter_page, host_order
from ...proto.errors import FailedPrecondition, InvalidArgument, NotFound
from ...proto.v1 import epd_pb2
from ..backends.base import DispatchArgs
from . import tensors
from .ops import dispatch_response
from .state import GroupMember, HandleInfo, Session

if TYPE_CHECKING:
    from .core import Engine
    from .stream_ops import StreamOp

KIND_DISPATCH, KIND_COMBINE = "Dispatch", "Combine"  # (StreamOp.kind; the metrics' method)
PATH = "graph"  # the calls' path label in the latency histograms


def arm_dispatch(e: Engine, session: Session, req: epd_pb2.DispatchRequest
                 ) -> tuple[GroupMember, DispatchArgs, epd_pb2.DispatchResponse]:
    """Check a dispatch to arm (as a call's checks: nothing changes on bad input) and answer
    its fixed output views; takes no sequence."""
    member = e.member(session, req.group_id)
    e._check_ordered(member)
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
    return member, args, dispatch_response(member, req, out, 0, 0, 0)


def arm_combine(e: Engine, session: Session, req: epd_pb2.CombineRequest,
                src: StreamOp | None) -> GroupMember:
    """Check the combine of an armed dispatch `src` (its shapes against that dispatch's)."""
    if src is None or src.kind != KIND_DISPATCH:
        raise NotFound("dispatch_op is not an armed normal-mode dispatch of this session")
    member = e.member(session, req.group_id)
    if member is not src.member:
        raise FailedPrecondition("the combine and its dispatch_op belong to different groups")
    spec, d = member.spec, src.args
    rows, t = d.num_worst_tokens, int(d.x.shape[0])
    regions = session.regions
    x = tensors.resolve(req.x, regions, "x", ndim=2, dtype=spec.x_dtype)
    if tuple(x.shape) != (rows, spec.hidden):
        raise InvalidArgument(f"combine x has shape {list(x.shape)}, expected [{rows}, "
                              f"{spec.hidden}] (num_worst_tokens rows of its dispatch)")
    if tensors.is_set(req.topk_weights):
        w = tensors.resolve(req.topk_weights, regions, "topk_weights", ndim=2,
                            dtype=epd_pb2.FLOAT32)
        if tuple(w.shape) != (rows, spec.num_topk):
            raise InvalidArgument(f"combine topk_weights has shape {list(w.shape)}, expected "
                                  f"[{rows}, {spec.num_topk}]")
        e._stream_output(session, req.out_topk_weights, "out_topk_weights",
                         (t, spec.num_topk), epd_pb2.FLOAT32)
    elif tensors.is_set(req.out_topk_weights):
        raise InvalidArgument("out_topk_weights is only for a combine with topk_weights")
    for name, desc in (("bias_0", req.bias_0), ("bias_1", req.bias_1)):
        if tensors.is_set(desc):
            b = tensors.resolve(desc, regions, name, ndim=2, dtype=spec.x_dtype)
            if tuple(b.shape) != (t, spec.hidden):
                raise InvalidArgument(f"{name} has shape {list(b.shape)}, expected "
                                      f"[{t}, {spec.hidden}]")
    e._stream_output(session, req.out, "out", (t, spec.hidden), spec.x_dtype)
    e._num_sms(member, req.num_sms)
    req.stream_ordered = True
    return member


def fire(e: Engine, op: StreamOp) -> None:
    """Run one trigger of an armed normal-mode op as a stream-ordered call (the poller holds
    the op's session's operation lock). Raises where nothing was launched: the caller fails
    the op's done word."""
    session, member = op.session, op.member
    if op.kind == KIND_DISPATCH:
        req = op.request
        del req.release_handles[:]
        if op.handle:  # (the previous trigger's, freed once this one is checked)
            req.release_handles.append(op.handle)
        resp = e.dispatch_op(session, req, PATH)
        op.handle = resp.handle
        info = member.handles.get(resp.handle)
        if info is not None:
            info.on_failed = op.words
        seq = resp.stream_seq
    else:
        src = op.dispatch_op
        assert src is not None
        if not src.handle:
            raise FailedPrecondition(f"stream op {op.op_id}: the combine of dispatch op "
                                     f"{src.op_id}, which has not run yet")
        op.request.handle = src.handle
        seq = e.combine_op(session, op.request, PATH).stream_seq
    # The trigger is the client's READY: its stream has produced the inputs.
    ready = session.counter_page.slot(member.counter_slot).view(np.int32)
    ready[abi.SLOT32_READY + seq % abi.READY_RING] = np.int32(np.uint32(seq))
    for later in session.executor.take_after():  # (the launch; it handles its own failure)
        later()
    member.comm.signal_after(int(session.counter_page.slot(op.slot).device_ptr)
                             + 4 * abi.STREAM_DONE, abi.DONE_OK)


def record_failure(words: np.ndarray, slot: np.ndarray) -> None:
    """A triggered dispatch failed alike on every rank (notify's verdict in the member's
    counter slot `slot`): copy what failed it into its op's slot (`words`, int32), where the
    client finds it (client/captured_calls.py)."""
    w64 = words.view(np.int64)
    w64[abi.CAPTURED_FAIL_RANK] = int(slot[abi.SLOT_ERR_RANK])
    w64[abi.CAPTURED_FAIL_VALUE] = int(slot[counter_page.NUM_RECV])
    w64[abi.CAPTURED_FAIL_SEQ] = int(slot[counter_page.SEQ])
    host_order.publish()  # (the words before the status the client reads first)
    w64[abi.CAPTURED_FAIL_STATUS] = int(slot[counter_page.STATUS])


def resolved(info: HandleInfo, slot: np.ndarray) -> None:
    """(stream_calls._resolve) A captured dispatch's count came back failed."""
    if info.on_failed is not None and int(slot[counter_page.STATUS]):
        record_failure(info.on_failed, slot)
