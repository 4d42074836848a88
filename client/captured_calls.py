"""Normal-mode dispatch and combine captured in a CUDA graph, client side (cuda backend).

Under capture, a worst-case dispatch (`num_worst_tokens`, DeepEP's capturable dispatch) and the
combine of its handle are armed in the engine (server/engine/captured_calls.py) instead of
answered once: the graph holds the op's trigger and its wait (client/stream_ops.StreamOp), and
a dispatch's copy-out of the fixed receive-buffer views into tensors allocated at capture. Each
replay runs the calls again with the member's next sequences. As for DeepEP's captured calls, a
replay's outputs are the latest replay's.

Contract (DeepEP's for its captured calls): every rank captures and replays the same calls in
the same order; a captured dispatch's handle is combined in the graph (or a later one), not
eagerly; an eager dispatch or combine of a group holding captured ops synchronises the caller's
stream first (`settle`), so that the replays it follows have run and every rank numbers the
eager call after them (the engine numbers a replayed call when the GPU reaches its trigger, an
eager one when its request arrives); so do a layout through the daemon (EPD_LOCAL_LAYOUT=0:
its engine stream waits for a READY that a replay behind it would never let come),
`dispatch_async` (the engine's worker waits for its ready event holding the lock a replay
needs) and `Group.check()` (every rank then finds the same failures). The ops
live as long as the group; a call captured again with the same tensors reuses its op. Each op
holds a record of the session's counter page (64 to a slot) and one of its group's 255 ring
entries (--max-stream-ops-per-session bounds them too): past those, RESOURCE_EXHAUSTED at
capture.
A grown facade group that holds captured ops is never left (a replay triggers them).

Failures: one found by notify on every rank alike (a bad expert id, capacity, num_worst_tokens
too small) is raised at the group's next eager dispatch (before it is sent) or by
`Group.check()`, once (the newest since the last raise, where several replays failed); the
replay's outputs hold nothing then and its combine gives zeros. A trigger the engine could not
run (refused by its checks, e.g. a handle budget) is raised the same way from its op's done
word; its peers wait out their deadline. Others (a deadline, an abort) are the stream failure
words' (client/stream_calls.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
from google.protobuf.message import Message

from ..proto import abi, counter_page, cuda_driver, host_order, spin
from ..proto.errors import DeadlineExceeded, FailedPrecondition, TokenCapacityExceeded
from ..proto.v1 import epd_pb2
from . import call_outputs, cuda_ipc, host_cpu
from .stream_ops import StreamOp
from .tensors import Array

if TYPE_CHECKING:
    from .group import Group, Handle

_DISPATCH_ROWS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                  "recv_src_idx")


def _ring(resp: epd_pb2.ArmStreamOpResponse, timeout: float) -> tuple[int, int, float]:
    if not resp.ordered or resp.chained:
        raise FailedPrecondition("the engine armed a captured normal-mode call without its "
                                 "poller's ring (an engine of another version?)")
    return resp.chain_slot, resp.chain_entry, timeout


def _arm(group: Group, kind: str, template: Array, timeout: float,
         results: list[Any], **op: Any) -> StreamOp:
    """The armed op of a captured call: the group's op of the same request when one is armed
    (a model's layers often capture the same tensors: each op holds a counter-page record and
    one of its group's 255 ring entries), else a new one."""
    key = (kind, *sorted((name, v.SerializeToString(deterministic=True)
                          if isinstance(v, Message) else v) for name, v in op.items()))
    known = group._captured_by_key.get(key)
    # (a dispatch op brings its latest trigger's handle to its combine: one used again before
    # its combine was captured would give that combine the later dispatch's routing)
    if known is not None and known.armed and not known.awaiting_combine:
        return known
    s = group._session
    page = s.memory.counter_page_device_ptr()
    resp = cast(epd_pb2.ArmStreamOpResponse, s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
        session_id=s.session_id, group_id=group.group_id, ring_trigger=True, op_records=True,
        **op)))
    armed = StreamOp(group, resp.op_id, resp.counter_slot, page, kind, results, template,
                     _ring(resp, timeout), record=resp.counter_record)
    armed.response = resp
    s._stream_ops[armed.op_id] = armed
    group._captured.append(armed)
    group._captured_by_key[key] = armed
    return armed


def dispatch(group: Group, req: epd_pb2.DispatchRequest, template: Array, copy: bool,
             num_sms: int) -> tuple[epd_pb2.DispatchResponse, dict[str, Any], StreamOp]:
    """A dispatch made while the caller's stream captures a CUDA graph: (its fixed output
    descriptors, its outputs by response field name, the armed op its handle names); `req` is
    a worst-case dispatch, not a cached one (the caller checked: `capturable`)."""
    stream = cuda_ipc.stream_handle(None, template, group._session.device_ordinal)
    req.stream_ordered, req.num_sms = True, num_sms
    op = _arm(group, "dispatch", template, req.timeout_seconds, [None], dispatch=req)
    op.awaiting_combine = True
    op.launch(stream)
    resp = op.response.dispatch
    names = [name for name in _DISPATCH_ROWS if getattr(resp, name).region_id]
    parts: list[tuple[epd_pb2.TensorDesc, int | None]] = [
        (getattr(resp, name), req.num_worst_tokens) for name in names]
    names.append("rank_prefix_matrix")
    parts.append((resp.rank_prefix_matrix, None))
    outs: dict[str, Any] = dict.fromkeys(_DISPATCH_ROWS)
    outs.update(zip(names, group._outputs.rows(parts, copy, template, stream), strict=True))
    return resp, outs, op


def capturable(group: Group, req: epd_pb2.DispatchRequest) -> None:
    """Refuse a dispatch under capture that a graph cannot replay."""
    if not req.num_worst_tokens or req.cached_handle:
        raise FailedPrecondition(
            f"group {group.name!r}: a normal-mode dispatch in a CUDA graph needs "
            f"num_worst_tokens (DeepEP's capturable dispatch: fixed output rows, no receive "
            f"count on the host) and is not a cached one; call it outside the graph otherwise")


def combine(group: Group, x: Array, handle: Handle, topk_weights: Array, bias_0: Array,
            bias_1: Array, timeout: float, num_sms: int) -> tuple[Array, Array | None]:
    """The combine of a captured dispatch's handle, itself under capture."""
    s = group._session
    if handle.op is None:
        raise FailedPrecondition(
            f"group {group.name!r}: a combine in a CUDA graph brings back a dispatch captured "
            f"with num_worst_tokens; this handle's dispatch ran outside the graph")
    if not s.memory.is_capturing(x):
        raise FailedPrecondition(
            f"group {group.name!r}: the handle of a dispatch captured in a CUDA graph is "
            f"combined in a graph (each replay refills it); it has no data outside one")
    stream = cuda_ipc.stream_handle(None, x, s.device_ordinal)
    # (its handle, 0, is the engine's: the op brings back its dispatch op's latest trigger)
    req, out, out_w = call_outputs.combine_request(group, x, handle, topk_weights, bias_0,
                                                   bias_1, timeout, num_sms)
    op = _arm(group, "combine", x, timeout, [out], combine=req, dispatch_op=handle.op.op_id)
    handle.op.awaiting_combine = False
    op.launch(stream)
    return out, out_w


def settle(group: Group, stream: int, timeout: float, dispatching: bool) -> None:
    """Before an eager dispatch or combine of a group holding captured ops: wait (within
    `timeout`) until the caller's stream has run what it holds, replays included, and the
    engine has read every trigger of the group's ring; then, for a dispatch, raise a failure
    of a replayed dispatch (every rank does so at the same call)."""
    ring = group._captured[0]._ring_words
    assert ring is not None
    with host_cpu.waiting():
        ok = spin.wait_until(lambda: cuda_driver.stream_idle(stream) and int(
            ring[abi.LL_RING_TAIL]) == int(ring[abi.LL_RING_HEAD]), timeout)
    if not ok:
        raise DeadlineExceeded(
            f"group {group.name!r}: the calls replayed from a CUDA graph ahead of this eager "
            f"call did not run within {timeout:.3g} s (an eager call waits for them, so that "
            f"every rank numbers it after them)")
    if dispatching:
        check(group)


def check(group: Group) -> None:
    """Raise, once, a failure of the group's replayed calls: a trigger the engine could not run
    (its done word), else the newest dispatch that notify failed on every rank, from the
    engine's record in the group's ring slot (written when the engine resolves the count, at
    the group's next dispatch) or the group's counter slot (the latest dispatch, once the
    stream has passed it: settle() waits for that). Each dispatch's failure is raised once
    (Group._captured_seen: the newest counter sequence raised, or an eager dispatch's, which
    raises its own)."""
    for op in group._captured:
        err = op.take_verdict()
        if err is not None:
            raise err
    ring = group._captured[0]._ring_words
    assert ring is not None
    record = ring.view(np.int64)
    found: list[tuple[int, np.ndarray, int]] = []
    sequence = int(record[abi.RING_FAIL_SEQ])
    if sequence:
        host_order.consume()  # (the sequence before the words written ahead of it)
        failed = np.zeros_like(group._counter)
        failed[counter_page.STATUS] = record[abi.RING_FAIL_STATUS]
        failed[abi.SLOT_ERR_RANK] = record[abi.RING_FAIL_RANK]
        failed[counter_page.NUM_RECV] = record[abi.RING_FAIL_VALUE]
        found.append((sequence, failed, int(record[abi.RING_FAIL_WORST])))
    slot = group._counter
    if int(slot[counter_page.STATUS]):  # (the latest dispatch: a captured one's
        # num_worst_tokens is in the ring slot, written when the engine ran it)
        latest = int(slot[counter_page.SEQ])
        found.append((latest, slot.copy(), int(record[abi.RING_FIRED_WORST])
                      if int(record[abi.RING_FIRED_SEQ]) == latest else 0))
    if not found:
        return
    sequence, words, num_worst = max(found, key=lambda f: f[0])
    if sequence <= group._captured_seen:  # (raised already, or an eager dispatch's)
        return
    group._captured_seen = sequence
    err = counter_page.alike_failure(
        words, group.name, f"dispatch #{sequence} (one the host did not wait for: replayed "
        f"from a CUDA graph, or num_worst_tokens)", group.spec.max_tokens_per_rank,
        num_worst, group.spec.num_experts, earlier=True)
    if err is None:
        return
    if isinstance(err, TokenCapacityExceeded):
        group.capacity_owed = max(group.capacity_owed, err.tokens_needed)
    raise err
