"""Waits of the client and of proto/ that a peer could make endless (a review of every blocking
wait: "every wait has a deadline").

- An armed stream op launched after its session closed or lost its lease: the trigger clears the
  done word the release had set, and no engine writes it again, so the caller's stream waited on
  the GPU forever. Now nothing is enqueued: the call raises.
- Session.close() / Buffer.destroy() with an engine that does not answer (stopped, wedged): every
  group's leave waited out its own deadline, one after the other. Now the first that runs out
  ends the clean leaves; the lease's end aborts the rest.
- A NaN deadline (an engine's default_timeout_seconds that says NaN): spin.wait_until compared
  against it, never true, and a counter-page wait spun forever.

The stream-op test runs without CUDA: the trigger and the stream wait are stand-ins that record
what would be enqueued (the trigger's effect on the done word included)."""

from __future__ import annotations

import os
import threading
import time
import types

import grpc
import numpy as np
import pytest

from epd.client import Session, fork_guard
from epd.client import session as S
from epd.client import stream_ops as SO
from epd.client.buffer import Buffer
from epd.client.transport import GrpcTransport
from epd.proto import abi, counter_page, spin
from epd.proto.errors import EpdError, FailedPrecondition, Unavailable

pytestmark = pytest.mark.timeout(120)
DAEMON_ENGINES = 1  # (the tests below use engine 0 only)

ONE_RANK = dict(rank=0, num_ranks=1, num_experts=4, hidden=64, max_tokens_per_rank=8,
                num_topk=2)


def _in_thread(fn, seconds: float):
    """fn()'s result, or AssertionError if it has not returned within `seconds` (the thread is a
    daemon: a hang fails the test instead of freezing the run)."""
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"still waiting after {seconds} s"
    return out[0]


# -- 1. a stream op launched after its session ended ----------------------------------------------

@pytest.fixture
def stream_op(monkeypatch):
    """(an armed StreamOp of a session without an engine, its session, what was enqueued)."""
    s = object.__new__(Session)
    s._closed, s._lost, s.device_ordinal = False, None, 0
    s._pid, s._fork_generation = os.getpid(), fork_guard.generation()
    s._counter_file = types.SimpleNamespace(mm=bytearray(counter_page.PAGE_BYTES),
                                            size=counter_page.PAGE_BYTES)
    group = types.SimpleNamespace(_session=s)
    op = SO.StreamOp(group, 7, 3, 0x10000, "dispatch", [None, None], None, ring=(5, 2, 1.0))
    enqueued: list[str] = []

    def trigger(*a) -> None:  # (what the trigger kernel does first: done = 0)
        enqueued.append("trigger")
        op._words[SO.DONE] = 0

    monkeypatch.setattr(SO.cuda_ipc, "stream_handle", lambda *a: 99)
    monkeypatch.setattr(SO.ll_trigger, "trigger", trigger)
    monkeypatch.setattr(SO.cuda_driver, "stream_wait_geq", lambda *a: enqueued.append("wait"))
    monkeypatch.setattr(SO.cuda_driver, "stream_write", lambda *a: enqueued.append("write"))
    return op, s, enqueued


def test_a_stream_op_enqueues_nothing_after_the_lease_ended(stream_op) -> None:
    op, s, enqueued = stream_op
    op.launch()
    assert enqueued == ["trigger", "wait"]
    enqueued.clear()
    s._lost = "UNAVAILABLE: the engine died"  # what the lease thread does, then the release
    op.release()
    for call in (op.launch, op.signal, op.wait):
        with pytest.raises(Unavailable, match="session lost"):
            call()
    assert enqueued == []  # a trigger would have cleared the released done word for good
    assert op.status() == SO.DONE_RELEASED


def test_a_stream_op_enqueues_nothing_after_the_session_closed(stream_op) -> None:
    op, s, enqueued = stream_op
    s._closed = True  # (Session.close releases its ops and forgets them, armed)
    op.release()
    with pytest.raises(FailedPrecondition, match="session is closed"):
        op.launch()
    assert enqueued == [] and op.status() == SO.DONE_RELEASED


def test_a_release_marks_the_ring_for_triggers_still_to_run(stream_op) -> None:
    """A trigger enqueued earlier (or a CUDA graph replayed later) runs after the release: the
    released word of the member's ring slot, set before the done word, makes the trigger
    kernel report RELEASED instead of clearing the done word (client/ll_trigger.py; its GPU
    side: tests/gpu/test_ll_plain.py::test_graph_replayed_after_the_session_ended)."""
    op, s, _ = stream_op
    ring = counter_page.slot_words(s._counter_file.mm, 5).view(np.uint32)
    assert ring[abi.LL_RING_RELEASED] == 0
    assert abi.LL_RING_RELEASED > abi.LL_RING_HEAD  # (a word of its own in the slot)
    op.release()
    assert ring[abi.LL_RING_RELEASED] == 1 and op.status() == SO.DONE_RELEASED


def test_leaving_a_group_disarms_its_ops_in_the_client(stream_op) -> None:
    """The engine releases a member's ops when it leaves, and their counter records may be
    another op's at once: the client forgets the group's ops (a trigger now would clear that
    op's done word), and keeps the other groups'."""
    from epd.client.group import Group

    op, s, enqueued = stream_op
    group = object.__new__(Group)
    group._session, group._stream_slot, group.group_id = s, None, "left"
    group._outputs = types.SimpleNamespace(close=lambda: None)
    s._groups, s._stream_ops = {"left": group}, {}
    op.group = group
    other = SO.StreamOp(types.SimpleNamespace(_session=s), 8, 3, 0x10000, "dispatch", [None],
                        None, ring=(5, 3, 1.0), record=1)
    s._stream_ops.update({7: op, 8: other})
    group._release()
    assert not op.armed and s._stream_ops == {8: other} and other.armed
    with pytest.raises(FailedPrecondition, match="disarmed"):
        op.launch()
    assert enqueued == []


# -- 2. closing against an engine that does not answer --------------------------------------------

class _SilentLeaves(GrpcTransport):
    """gRPC, except that LeaveGroup finds an engine that does not answer: it waits out its
    deadline (at most `cap` seconds here) and fails DEADLINE_EXCEEDED."""

    def __init__(self, target: str, cap: float) -> None:
        super().__init__(target)
        self.cap, self.leaves, self.silent = cap, 0, False

    def call(self, method, request, timeout):
        if method == "LeaveGroup" and self.silent:
            self.leaves += 1
            time.sleep(min(timeout, self.cap))
            raise EpdError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return super().call(method, request, timeout)


def test_close_asks_a_silent_engine_once(daemon, monkeypatch) -> None:
    monkeypatch.setattr(S, "CLOSE_LEAVE_TIMEOUT", 0.4)
    inner = _SilentLeaves(daemon.socket(0), cap=1.0)
    s = Session(daemon.socket(0), transport=inner, fast_path=False)
    try:
        for i in range(6):
            s.join(f"silent-close-{i}", **ONE_RANK)
    finally:
        inner.silent = True
        t0 = time.monotonic()
        s.close()
        took = time.monotonic() - t0
    assert inner.leaves == 1, f"{inner.leaves} leaves waited out their deadline"
    assert took < 2.0, f"close took {took:.1f} s"
    assert s._groups == {}


def test_destroy_asks_a_silent_engine_once(daemon) -> None:
    inner = _SilentLeaves(daemon.socket(0), cap=0.3)  # (a leave's deadline: CONTROL_TIMEOUT)
    s = Session(daemon.socket(0), transport=inner, fast_path=False)
    try:
        buf = Buffer(rank=0, num_ranks=1, session=s, group_name="silent-destroy")
        for i in range(5):
            buf._groups[i] = s.join(f"silent-destroy-{i}", **ONE_RANK)
        inner.silent = True
        with pytest.raises(EpdError, match="Deadline"):
            buf.destroy()
        assert inner.leaves == 1, f"{inner.leaves} leaves waited out their deadline"
    finally:
        s.close()


# -- 3. a NaN deadline ----------------------------------------------------------------------------

def test_a_nan_timeout_ends_a_spin_wait() -> None:
    assert _in_thread(lambda: spin.wait_until(lambda: False, float("nan")), 5.0) is False
    assert _in_thread(lambda: counter_page.wait(
        counter_page.slot_words(bytearray(counter_page.PAGE_BYTES), 0), 1, float("nan")),
        5.0) is None


class _Opening(GrpcTransport):
    """gRPC, with the SessionOpened's default deadline replaced by `value`."""

    def __init__(self, target: str, value: float) -> None:
        super().__init__(target)
        self.value = value

    def open_stream(self, request):
        inner, value = super().open_stream(request), self.value

        class Stream:
            def __iter__(self):
                for event in inner:
                    if event.HasField("opened"):
                        event.opened.default_timeout_seconds = value
                    yield event

            def cancel(self) -> bool:
                return inner.cancel()
        return Stream()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_the_engines_default_deadline_is_checked(daemon, value: float) -> None:
    with Session(daemon.socket(0), transport=_Opening(daemon.socket(0), value),
                 fast_path=False) as s:
        assert s._deadline(None) == S.DEFAULT_TIMEOUT
