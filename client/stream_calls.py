"""Stream-ordered normal-mode calls, client side (cuda backend): layout, dispatch, cached
dispatch and combine ordered on the caller's current CUDA stream without synchronising it.

Per call: the engine validates the descriptors, enqueues its kernels behind a GPU-side wait
and answers with the call's stream sequence n; this process's stream then writes READY[n] and
waits for DONE >= n (stream memory operations on the membership's counter slot,
proto/counter_page.py). The host waits only where DeepEP's does: a dispatch needs its receive
count to shape recv_x, which the notify kernel writes into the counter page this process maps.

Errors found on the GPU (a peer missing its deadline; an aborted group) are written by the
call's last kernel; they raise `EpdError` at this membership's next call, or at `Group.check()`
once the stream has passed the call (CUDA's asynchronous-error model). A dispatch's bad expert
id or count fails that dispatch on every rank alike (its notify carries each source's verdict):
at the call, or for a worst-case dispatch at the next dispatch. A layout's bad id is this rank's
alone (layout is no collective) and raises at `Group.check()` only: raised at a later
collective, before it is sent, it would leave this rank one collective behind its peers, and a
dispatch of the same ids fails alike anyway. A stream never waits forever: when the session or
engine goes away the client releases DONE itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import grpc
import numpy as np

from ..proto import abi, counter_page, cuda_driver, spin
from ..proto.errors import EpdError, FailedPrecondition, TokenCapacityExceeded
from ..proto.v1 import epd_pb2
from . import call_outputs, captured_calls, cuda_ipc, host_cpu
from .tensors import Array

if TYPE_CHECKING:
    from .group import Group, Handle
    from .stream_ops import StreamOp

log = logging.getLogger("epd.client")
RING = abi.READY_RING
_I32, _BOOL = np.dtype(np.int32), np.dtype(np.bool_)
# A dispatch's outputs with one row per received token (rank_prefix_matrix is whole).
_DISPATCH_ROWS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                  "recv_src_idx")


@dataclass(frozen=True)
class UnwaitedDispatch:
    """A worst-case dispatch (`num_worst_tokens`) whose receive count the host did not wait
    for, as DeepEP's does not: the membership's next dispatch waits for that count (its own
    notify overwrites it) and raises its failure, before it is sent."""

    sequence: int  # the counter sequence notify publishes
    seq: int  # the call's stream sequence
    timeout: float  # the call's deadline, seconds
    num_worst: int  # its num_worst_tokens (for the message of a receive count above it)


class StreamSlot:
    """A membership's counter-slot words, as the host and this process's streams see them."""

    def __init__(self, group: Group) -> None:
        s = group._session
        self.group = group
        self.words = group._counter  # int64 host view
        base = s.memory.counter_page_device_ptr() + group._counter_slot * abi.SLOT_BYTES
        self.done_ptr = base + 4 * abi.SLOT32_DONE
        self.ready_ptr = base + 4 * abi.SLOT32_READY
        self.issued = 0  # the latest sequence the engine answered
        f = counter_page.stream_failure(self.words)
        self.reported = f.seq if f is not None else 0  # failures already raised (or older)
        self.layouts: set[int] = set()  # layouts' stream sequences: rank-local calls
        self.unwaited: UnwaitedDispatch | None = None
        self.released = False
        # A check-only failure seen (logged once, at a call) and kept for check()
        self.held: counter_page.StreamFailure | None = None

    def begin(self, stream: int, seq: int) -> None:
        """Our stream has produced the call's inputs: let the engine's stream go."""
        self.issued = seq
        cuda_driver.stream_write(stream, self.ready_ptr + 4 * (seq % RING), seq)

    def end(self, stream: int, seq: int) -> None:
        """Later work on our stream waits for the call's last kernel."""
        cuda_driver.stream_wait_geq(stream, self.done_ptr, seq)

    def settle(self, seq: int, timeout: float) -> None:
        """Wait (at most `timeout` seconds) on the host until call `seq`'s last kernel has run:
        a failed dispatch's count arrives before that kernel records the cause (which rank
        left or missed the deadline) in the failure words."""
        spin.wait_until(lambda: counter_page.seq_reached(counter_page.stream_done(self.words),
                                                         seq), timeout)

    def layout_sent(self, seq: int) -> None:
        if len(self.layouts) >= 256:  # (those the stream has passed, but not a failure's
            done = counter_page.stream_done(self.words)  # not yet raised: check() needs it)
            f = counter_page.stream_failure(self.words)
            keep = f.seq if f is not None and f.seq != self.reported else None
            self.layouts = {n for n in self.layouts
                            if n == keep or not counter_page.seq_reached(done, n)}
        self.layouts.add(seq)

    def check(self, explicit: bool = False) -> None:
        """Raise a failure the GPU reported for an earlier call, once; a layout's bad input
        only when `explicit` (Group.check: see the module docstring; a fatal failure written
        at a layout's sequence, an abort or release, raises at any call)."""
        f = counter_page.stream_failure(self.words)
        if f is None and self.held is None:  # (every call: nothing failed)
            return
        spec = self.group.spec
        if (f is not None and f.check_only and f.seq != self.reported
                and (self.held is None or self.held.seq != f.seq)):
            # Kept for check() (the slot holds only the latest failure, which a later call's
            # may replace) and, seen at a call, logged: a serving loop that never calls
            # check() is not left silent (a log line needs no rank to agree).
            self.held = f
            if not explicit:
                log.warning("%s (raised by Group.check() / Buffer.check())",
                            f.error(spec.name, spec.num_experts).message)
        if explicit and self.held is not None and (f is None or self.held.seq != f.seq):
            held, self.held = self.held, None  # (replaced in the slot since: raised first)
            raise held.error(spec.name, spec.num_experts)
        if f is None or f.seq == self.reported or (
                not explicit and (f.check_only or (not f.fatal and f.seq in self.layouts))):
            return
        self.reported = f.seq
        if self.held is not None and self.held.seq == f.seq:
            self.held = None
        self.layouts = {n for n in self.layouts if not counter_page.seq_reached(f.seq, n)}
        raise f.error(spec.name, spec.num_experts)

    def drop_layout_failure(self) -> None:
        """A layout's failure not yet raised is not raised (_drop_layout_failures)."""
        f = counter_page.stream_failure(self.words)
        if f is not None and not f.fatal and f.seq in self.layouts:
            self.reported = f.seq

    def release(self) -> None:
        """The session or engine is gone: no stream may wait for DONE forever (nor the host
        for an unwaited count: the release is the failure the next call raises)."""
        self.released = True
        counter_page.release_stream(self.words, self.issued)


def _slot(group: Group, dispatching: bool = False, explicit: bool = False) -> StreamSlot:
    """The membership's slot, once the failures the GPU reported for earlier calls are
    raised. `dispatching`: also an earlier worst-case dispatch's, its count waited for first
    (within its deadline). Only a dispatch raises that one: every rank reaches its next
    dispatch after the same calls, so every rank fails the same call and none sends it (one
    rank raising at a combine that another sent would leave their collectives one apart).
    `explicit` (Group.check): also a layout's, which is this rank's alone."""
    if group._stream_slot is None:
        group._stream_slot = StreamSlot(group)
    if dispatching:
        _settle_unwaited(group, group._stream_slot)
    group._stream_slot.check(explicit)
    if explicit and group._local_layout is not None:
        group._local_layout.check()
    return group._stream_slot


def _not_capturable(group: Group, what: str) -> FailedPrecondition:
    """The engine launches an eager call's kernels once, when it answers, so a replay of the
    caller's graph would write READY and wait for DONE with no kernels behind them; a
    worst-case dispatch and its combine are armed instead (client/captured_calls.py)."""
    return FailedPrecondition(
        f"group {group.name!r}: normal-mode {what} cannot be captured in a CUDA graph (the "
        f"engine runs an eager call's kernels once, not per replay): in a graph, EPD runs a "
        f"worst-case dispatch (num_worst_tokens, as DeepEP captures) and the combine of its "
        f"handle, and the layout on the caller's stream (EPD_LOCAL_LAYOUT on); call {what} "
        f"outside the graph otherwise")


def _eager_stream(group: Group, template: Array, timeout: float, dispatching: bool) -> int:
    """The caller's current stream (not capturing: the caller checked), once the replays of
    the group's captured calls ahead of this call have run (client/captured_calls.py)."""
    stream = cuda_ipc.stream_handle(None, template, group._session.device_ordinal)
    if group._captured:
        captured_calls.settle(group, stream, timeout, dispatching)
    return stream


def layout(group: Group, topk_idx: Array) -> tuple[Array, Array, Array]:
    if group._local_layout is not None:  # on the caller's stream, no round trip
        _slot(group)  # (earlier failures surface here, as below)
        return group._local_layout(topk_idx)
    s, spec = group._session, group.spec
    if s.memory.is_capturing(topk_idx):
        raise _not_capturable(group, "get_dispatch_layout")
    # (its stream waits for READY: a replay's trigger behind it would never run)
    stream = _eager_stream(group, topk_idx, group._timeout(None), dispatching=False)
    slot = _slot(group)
    t = int(topk_idx.shape[0])  # a device array (torch or CuPy): _descs checks it below
    outs = tuple(call_outputs.empty(
        (((spec.num_ranks,), _I32), ((spec.num_experts,), _I32), ((t, spec.num_ranks), _BOOL)),
        s.device_ordinal, call_outputs.uses_torch(topk_idx)))
    d = s._descs({"topk_idx": topk_idx, "num_tokens_per_rank_out": outs[0],
                  "num_tokens_per_expert_out": outs[1], "is_token_in_rank_out": outs[2]},
                 event=False)
    resp = cast(epd_pb2.GetDispatchLayoutResponse, s._call(
        "GetDispatchLayout", epd_pb2.GetDispatchLayoutRequest(
            session_id=s.session_id, group_id=group.group_id, stream_ordered=True, **d)))
    slot.layout_sent(resp.stream_seq)
    slot.begin(stream, resp.stream_seq)
    slot.end(stream, resp.stream_seq)
    return outs


def _failed(group: Group, got: tuple[int, list[int]] | None) -> bool:
    """Whether the dispatch whose count wait gave `got` failed (None: no count by its
    deadline)."""
    return got is None or int(group._counter[counter_page.STATUS]) != 0


def _count_failure(group: Group, slot: StreamSlot, got: tuple[int, list[int]] | None,
                   sequence: int, seq: int, timeout: float, earlier: bool,
                   num_worst: int = 0) -> EpdError:
    """The error of failed dispatch `sequence` (stream sequence `seq`) by its count `got`
    (None: none came by its deadline); raises the GPU's own report of it where that comes
    first. `earlier`: a worst-case dispatch the caller went on from."""
    words = group._counter
    name = f"dispatch #{sequence}"
    lost = (" (num_worst_tokens: the call returned without waiting for its count, as "
            "DeepEP's; its outputs and the combine of its handle hold no data)" if earlier else "")
    err = None if got is None else counter_page.alike_failure(
        words, group.name, name + lost, group.spec.max_tokens_per_rank, num_worst,
        group.spec.num_experts, earlier)
    if err is not None:
        status = int(words[counter_page.STATUS])
        if isinstance(err, TokenCapacityExceeded) and earlier:
            group.capacity_owed = max(group.capacity_owed, err.tokens_needed)
        if (status in (abi.ERR_BAD_INPUT, abi.ERR_BAD_COUNT)
                and int(words[abi.SLOT_ERR_RANK]) == group.rank):
            _drop_layout_failures(group)
        return err
    if got is not None:  # failed on the GPU: its last kernel names the cause, shortly
        slot.settle(seq, timeout)
    slot.check()
    missing = int(words[abi.SLOT_ERR_RANK]) if got is not None else -1
    who = f": rank {missing} did not arrive" if missing >= 0 else ""
    return EpdError(grpc.StatusCode.DEADLINE_EXCEEDED if got is None or missing >= 0 else
                    grpc.StatusCode.ABORTED,
                    f"group {group.name!r}: {name} got no receive counts{who}{lost}")


def _drop_layout_failures(group: Group) -> None:
    """A dispatch failed on every rank for this rank's bad input: the failure a layout of the
    same ids reported (layout, then dispatch) is not raised again at Group.check(), in this
    group or another of this session with the same routing (the DeepEP facade lays out on one
    group and dispatches on another)."""
    spec = group.spec
    same = [g for g in list(group._session._groups.values())
            if g.spec.num_experts == spec.num_experts and g.spec.num_topk == spec.num_topk]
    for g in {id(g): g for g in [group, *same]}.values():
        if g._stream_slot is not None:
            g._stream_slot.drop_layout_failure()
        if g._local_layout is not None:
            g._local_layout.drop()


def _settle_unwaited(group: Group, slot: StreamSlot) -> None:
    """Wait (within its deadline) for the count of the worst-case dispatch the host did not
    wait for, and raise its failure, once. A released slot stops the wait: its failure (the
    session or engine gone) is what raises then."""
    u = slot.unwaited
    if u is None:
        return
    slot.unwaited = None
    if group._captured:  # a replay's count may have replaced it in the slot: its failure is
        return  # captured_calls.check's to raise (the engine's record of it, or the slot's)
    with host_cpu.waiting():
        got = counter_page.wait(group._counter, u.sequence, u.timeout,
                                stop=lambda: slot.released)
    if _failed(group, got):
        raise _count_failure(group, slot, got, u.sequence, u.seq, u.timeout, earlier=True,
                             num_worst=u.num_worst)


def dispatch(group: Group, req: epd_pb2.DispatchRequest, rpc_timeout: float, template: Array,
             copy: bool, num_sms: int) -> tuple[epd_pb2.DispatchResponse, int, list[int], int,
                                                dict[str, Any], StreamOp | None]:
    """(response, num_recv_tokens, per-expert counts, rows, outputs by response field name,
    the armed op of a dispatch captured in a CUDA graph); the Group makes its DispatchResult
    and Handle of them. A worst-case dispatch
    (num_worst_tokens) does not wait for its count, as DeepEP's does not: its count is -1
    and its per-expert counts empty, and a failure raises at the membership's next dispatch."""
    s = group._session
    if s.memory.is_capturing(template):
        if req.cached_handle:
            raise _not_capturable(group, "cached dispatch")
        captured_calls.capturable(group, req)
        # (an earlier worst-case dispatch's failure first, as at any dispatch: a replay would
        # replace its count in the slot; a host wait for the count, no CUDA call)
        _slot(group, dispatching=True)
        resp, outs, op = captured_calls.dispatch(group, req, template, copy, num_sms)
        return resp, -1, [], req.num_worst_tokens, outs, op
    stream = _eager_stream(group, template, max(req.timeout_seconds, 1.0), dispatching=True)
    slot = _slot(group, dispatching=True)  # (its notify overwrites an unwaited count)
    req.stream_ordered = True
    req.num_sms = num_sms
    released = group._take_released()
    req.release_handles.extend(released)
    try:
        resp = cast(epd_pb2.DispatchResponse, s._call("Dispatch", req, rpc_timeout))
    except BaseException:
        group._requeue(released)
        raise
    seq = resp.stream_seq
    slot.begin(stream, seq)
    timeout = max(req.timeout_seconds, 1.0)  # the call's deadline, >= 1 s
    if req.num_worst_tokens and not req.cached_handle:  # (a cached count is known at once)
        slot.end(stream, seq)
        slot.unwaited = UnwaitedDispatch(resp.counter_sequence, seq, timeout,
                                         req.num_worst_tokens)
        n, per_expert, rows = -1, [], req.num_worst_tokens
    else:
        # The receive count, published by the notify kernel (by the engine for a cached one):
        # the host wait DeepEP's dispatch has too, counted as waiting, not work (host_cpu)
        with host_cpu.waiting():
            got = counter_page.wait(group._counter, resp.counter_sequence, timeout)
        slot.end(stream, seq)  # the stream passes the call either way
        # (its failure is this call's to raise, not captured_calls.check's)
        group._captured_seen = max(group._captured_seen, resp.counter_sequence)
        if _failed(group, got):  # (every rank failed it; the engine's handle of it goes back)
            group._requeue([resp.handle])
            raise _count_failure(group, slot, got, resp.counter_sequence, seq, timeout,
                                 earlier=False)
        assert got is not None
        n, per_expert = got
        rows = req.num_worst_tokens or n

    names = [name for name in _DISPATCH_ROWS if getattr(resp, name).region_id]
    parts: list[tuple[epd_pb2.TensorDesc, int | None]] = [
        (getattr(resp, name), rows) for name in names]
    names.append("rank_prefix_matrix")
    parts.append((resp.rank_prefix_matrix, None))
    outs: dict[str, Any] = dict.fromkeys(_DISPATCH_ROWS)
    outs.update(zip(names, group._outputs.rows(parts, copy, template, stream), strict=True))
    return resp, n, per_expert, rows, outs, None


def combine(group: Group, x: Array, handle: Handle, topk_weights: Array, bias_0: Array,
            bias_1: Array, timeout: float, rpc_timeout: float,
            num_sms: int) -> tuple[Array, Array | None]:
    s = group._session
    if handle.op is not None or s.memory.is_capturing(x):
        return captured_calls.combine(group, x, handle, topk_weights, bias_0, bias_1, timeout,
                                      num_sms)
    stream = _eager_stream(group, x, timeout, dispatching=False)
    slot = _slot(group)
    req, out, out_w = call_outputs.combine_request(group, x, handle, topk_weights, bias_0,
                                                   bias_1, timeout, num_sms)
    resp = cast(epd_pb2.CombineResponse, s._call("Combine", req, rpc_timeout))
    slot.begin(stream, resp.stream_seq)
    slot.end(stream, resp.stream_seq)
    return out, out_w
