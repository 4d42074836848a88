"""Stream-ordered, CUDA-graph capturable low-latency calls (client side).

An armed operation (`Group.arm_low_latency_dispatch` / `arm_low_latency_combine`) is validated
by the engine once and has fixed inputs and outputs: the tensors given when arming are read at
every trigger, and the outputs are the views returned then. `launch()` enqueues on the caller's
CUDA stream a trigger and a wait on the op's done word in the session's counter page:

    trigger: done = 0; ring[tail % 64] = entry | b << 8; tail += 1;   wait until done >= 1

The trigger is one single-thread kernel (client/ll_trigger.py) appending to the ring of the
op's group member: the engine runs a member's calls in the order its triggers reached the GPU
(server/engine/stream_ops.py says why the order matters), launches the kernels on its own
stream, and its last kernel writes `done` (1 ok, 2 | code << 8 failed, 3 released: the
session or engine went away). Nothing runs on the client's host, so both can be captured into
a CUDA graph and replayed. `signal()` and `wait()` are the two halves (DeepEP's
`return_recv_hook`: the caller's stream can do other work in between). b is the receive buffer
(0 or 1, DeepEP's double buffer): a dispatch triggered with b fills `results[b]`; a combine
triggered with b brings back the dispatch that buffer holds. Two micro-batches in flight (D0 D1
C0 C1) use one buffer each.

Contract: one trigger of an op in flight at a time (a replay's wait ends before the next
replay's trigger); the same triggers with the same buffers in the same order on every rank;
a member's triggers ordered on the GPU (one stream, or streams ordered by events: two trigger
kernels of one member running at once can take the same ring position, and one call is lost);
inputs must be complete on the stream before `launch()` (stream order gives that); a dispatch's
outputs are valid after it until the next dispatch into the same buffer, a combine's until the
next combine.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from ..proto import abi, counter_page, cuda_driver, host_order
from ..proto.errors import EpdError, FailedPrecondition, Internal
from ..proto.v1 import epd_pb2
from . import cuda_ipc, ll_trigger
from .frameworks import torch_if_loaded
from .tensors import Array

if TYPE_CHECKING:
    from .group import Group

REQUEST, DONE = abi.STREAM_REQUEST, abi.STREAM_DONE
DONE_OK, DONE_FAILED, DONE_RELEASED = abi.DONE_OK, abi.DONE_FAILED, abi.DONE_RELEASED


class StreamOp:
    def __init__(self, group: Group, op_id: int, slot: int, page_device_ptr: int, kind: str,
                 results: list[Any], template: Array,
                 ring: tuple[int, int, float] | None = None, chained: bool = False,
                 record: int = 0) -> None:
        """`slot`, `record`: where the engine put the op's words in the session's counter page
        (ArmStreamOpResponse.counter_slot / counter_record; record 0 is the slot's start);
        `page_device_ptr`: the counter page as this process's streams address it (the
        session's `memory.counter_page_device_ptr()`); `results[b]`: the outputs of a trigger
        with receive buffer b; `ring`: (ring slot, entry, deadline in seconds) when the op
        is triggered through its member's ring (client/ll_trigger.py; None: an engine that
        reads a request word per op, written here with stream memory operations); `chained`:
        the engine runs the ring on the member's GPU chain (--ll-chain), not its poller."""
        s = group._session
        self.group, self.op_id, self.kind, self.results = group, op_id, kind, results
        self.chained = chained
        self._template = template
        self._device = s.device_ordinal
        assert s._counter_file is not None
        slots = s._counter_file.size // counter_page.SLOT_BYTES
        if not (0 <= slot < slots and 0 <= record < abi.OP_RECORDS):
            with contextlib.suppress(EpdError):  # (not left armed in the engine)
                s._call("DisarmStreamOp", epd_pb2.DisarmStreamOpRequest(
                    session_id=s.session_id, op_id=op_id))
            raise Internal(f"the engine put stream op {op_id} at counter slot {slot} record "
                           f"{record}, outside the session's counter page ({slots} slots of "
                           f"{abi.OP_RECORDS} records)")
        self.place = (slot, record)  # (for diagnostics)
        self._words = counter_page.record_words(s._counter_file.mm, slot, record)
        base = page_device_ptr + counter_page.record_offset(slot, record)
        self._request, self._done = base + 4 * REQUEST, base + 4 * DONE
        self._ring: tuple[int, int, float] | None = None
        self._ring_words: np.ndarray | None = None  # (the ring slot as the host maps it)
        if ring is not None:
            ring_slot, entry, timeout = ring
            self._ring = (page_device_ptr + ring_slot * counter_page.SLOT_BYTES, entry, timeout)
            self._ring_words = counter_page.slot_words(s._counter_file.mm,
                                                       ring_slot).view(np.uint32)
        self.armed = True
        # (client/captured_calls.py: the arm's answer, and a captured dispatch whose combine
        # has not been captured since its last use)
        self.response: epd_pb2.ArmStreamOpResponse | None = None
        self.awaiting_combine = False
        # What a caller computes once per op (the facade's copy-out plans, by receive buffer
        # and format: client/received_rows.CopyPlan); it lives and goes with the op.
        self.plans: dict[Any, Any] = {}

    def _stream(self, stream: Any) -> int:  # a torch/CuPy stream, a raw handle, or None
        if not self.armed:
            raise FailedPrecondition(f"stream op {self.op_id} was disarmed")
        # Nothing is enqueued once the session is closed or its lease ended: a trigger clears
        # the done word that the release (Session.close / the lease thread) set, and no engine
        # will write it again, so a stream waiting on it would wait forever.
        self.group._session._check_open()
        return cuda_ipc.stream_handle(stream, self._template, self._device)

    @property
    def result(self) -> Any:
        """The outputs of a trigger with receive buffer 0."""
        return self.results[0]

    def signal(self, stream: Any = None, buffer: int = 0) -> int:
        """The send half: ask the engine to run the op once the stream gets here, with receive
        buffer `buffer`. Returns the stream's handle."""
        h = self._stream(stream)
        if not 0 <= buffer < len(self.results):
            raise FailedPrecondition(f"receive buffer {buffer}: this op has "
                                     f"{len(self.results)} (an engine of one buffer)")
        if self._ring is not None:
            ring, entry, timeout = self._ring
            ll_trigger.trigger(h, self._device, self._done, ring, entry | buffer << 8, timeout)
            return h
        cuda_driver.stream_write(h, self._done, 0)
        cuda_driver.stream_write(h, self._request, abi.REQUEST_BUFFER0 + buffer)
        return h

    def wait(self, stream: Any = None) -> int:
        """The receive half: later work on the stream waits for the op's outputs. Returns the
        stream's handle."""
        h = self._stream(stream)
        cuda_driver.stream_wait_geq(h, self._done, DONE_OK)
        return h

    def launch(self, stream: Any = None, buffer: int = 0) -> Any:
        """signal() then wait(); returns the op's outputs in that buffer (fixed views)."""
        self.signal(stream, buffer)
        self.wait(stream)
        return self.results[buffer]

    def status(self) -> int:
        """The done word as the host sees it now (0 while a trigger is in flight)."""
        return int(self._words[DONE])

    def error(self, status: int | None = None) -> EpdError | None:
        """The failure the done word (`status`, or as the host sees it now) reports, or None."""
        value = self.status() if status is None else status
        if value in (0, DONE_OK):  # (the common case, without building a message)
            return None
        return done_error(value, f"stream op {self.op_id} ({self.kind})", self._words,
                          self.group.spec.num_experts, combine=self.kind == "combine")

    def take_verdict(self) -> EpdError | None:
        """The verdict of the last trigger that one failed since the last take (a dispatch: a
        source's bad ids; a combine: its own top-k's bad entry; sticky: a later trigger's
        success does not clear it), and clear it. Only while no
        trigger of the op is in flight (after a synchronise; a trigger that fails writes it)."""
        value = int(self._words[abi.STREAM_FAIL_DONE])
        if not value:
            return None
        self._words[abi.STREAM_FAIL_DONE] = 0
        return self.error(value)

    def check(self) -> None:
        """Raise if a trigger failed (call after synchronising the stream): the last trigger's
        failure, or a verdict (a dispatch's bad ids, a combine's bad top-k entry) since the
        last check, once."""
        err = self.take_verdict()
        status = self.status()
        if err is None and not is_verdict(status):
            err = self.error(status)
        if err is not None:
            raise err

    def release(self) -> None:
        """Let any stream waiting on this op go on (session closing), and any trigger still to
        run (a graph replayed later) report RELEASED instead of waiting: the ring's released
        word first, then the done word (client/ll_trigger.py reads them in the other order)."""
        if self._ring_words is not None:
            self._ring_words[abi.LL_RING_RELEASED] = 1
            host_order.publish()
        self._words[DONE] = DONE_RELEASED

    def disarm(self) -> None:
        if not self.armed:
            return
        s = self.group._session
        s._call("DisarmStreamOp", epd_pb2.DisarmStreamOpRequest(session_id=s.session_id,
                                                                op_id=self.op_id))
        self.armed = False
        s._stream_ops.pop(self.op_id, None)


def is_verdict(value: int) -> bool:
    """Whether a done word reports a low-latency call's verdict (the group goes on): a dispatch
    that a source's bad ids failed on every rank alike (raised at the same call on every
    rank), or a combine whose own top-k had a bad entry (this rank's alone)."""
    return (value & 0xFF == DONE_FAILED and (value >> abi.DONE_RANK_SHIFT) & 0xFF != 0
            and (value >> abi.DONE_CODE_SHIFT) & 0xFF in counter_page.LL_VERDICTS)


def done_error(value: int, what: str, words: np.ndarray | None = None,
               num_experts: int | None = None, combine: bool = False) -> EpdError | None:
    """The error a done word reports (None: completed, or still in flight when 0); `words`:
    the op's slot (int32), where a low-latency call's verdict leaves the id and its token
    (`combine`: a combine's)."""
    if value == DONE_RELEASED:
        return EpdError(grpc.StatusCode.UNAVAILABLE, f"{what}: the session or engine went away")
    if is_verdict(value):
        host_order.consume()  # (the done word before the words written ahead of it)
        token = int(words[abi.STREAM_FAIL_TOKEN]) if words is not None else -1
        bad = int(words.view(np.int64)[abi.STREAM_FAIL_VALUE]) if words is not None else 0
        return counter_page.ll_verdict_error(
            what, (value >> abi.DONE_CODE_SHIFT) & 0xFF,
            ((value >> abi.DONE_RANK_SHIFT) & 0xFF) - 1,
            token, bad, num_experts, combine)
    if value & 0xFF == DONE_FAILED:
        code = (value >> abi.DONE_CODE_SHIFT) & 0xFF
        reason = {abi.ERR_DEADLINE: "a peer did not arrive before the deadline",
                  abi.ERR_ABORTED: "the group was aborted",
                  abi.ERR_BAD_INPUT: "its kernels found a bad expert id and aborted the group",
                  abi.ERR_NOT_FILLED: "its receive buffer holds another dispatch (trigger "
                                      "the dispatch into that buffer first)",
                  abi.ERR_RING_FULL: "the engine ran none of its member's calls for the "
                                     "whole deadline (64 triggers pending)",
                  255: "the engine could not launch it (see its log)"}.get(code, f"code {code}")
        return EpdError(grpc.StatusCode.ABORTED, f"{what} failed: {reason}")
    return None


def stream_place(template: Any) -> tuple[str, Any, int] | None:
    """The current stream of the template's array type, taken at a call: ("torch", stream,
    device) for a torch CUDA tensor, ("cupy", stream, device id) for a CuPy array, None for
    host arrays. (A receive hook keeps this, not the template: it must not keep the caller's
    tensors alive.)"""
    torch = torch_if_loaded()
    if torch is not None and isinstance(template, torch.Tensor):
        if not template.is_cuda:
            return None
        return "torch", torch.cuda.current_stream(template.device), template.device.index
    cupy = sys.modules.get("cupy")  # (a CuPy array: CuPy is loaded)
    if cupy is not None and isinstance(template, cupy.ndarray):
        device = int(template.device.id)
        with cupy.cuda.Device(device):
            return "cupy", cupy.cuda.get_current_stream(), device
    return None


def on_stream(handle: int, place: tuple[str, Any, int] | None) -> contextlib.AbstractContextManager:
    """A context in which the raw CUDA stream `handle` is the current stream of the array type
    of `place` (`stream_place`, taken when `handle` was current: its stream object is used, so
    that torch's allocator sees the stream it knows), so that the work enqueued in it goes where
    a call's receive half went: a receive hook runs whenever its caller calls it, maybe with
    another stream current, and DeepEP orders the receive phase, and the work on its outputs,
    on the stream the call was made on. Nothing changes for host arrays or when `handle` is
    current already."""
    if place is None:
        return contextlib.nullcontext()
    kind, stream, device = place
    if kind == "torch":
        torch = sys.modules["torch"]
        if int(torch.cuda.current_stream(device).cuda_stream) == handle:
            return contextlib.nullcontext()
        if int(stream.cuda_stream) != handle:
            stream = torch.cuda.ExternalStream(handle, device=device)
        return torch.cuda.stream(stream)
    cupy = sys.modules["cupy"]
    if int(stream.ptr) != handle:
        stream = cupy.cuda.ExternalStream(handle)
    return _cupy_stream(cupy, stream, device)


@contextlib.contextmanager
def _cupy_stream(cupy: Any, stream: Any, device: int):
    with cupy.cuda.Device(device), stream:
        yield
