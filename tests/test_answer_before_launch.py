"""Work an operation leaves for after its answer (SessionExecutor.after_answer): stream-ordered
layout and combine answer the client first and enqueue their kernels then, under the session's
operation lock; a launch that fails after the answer fails the call through the counter slot.

The CUDA launches themselves run in tests/gpu (test_stream_ordered.py, test_deep_ep_facade.py);
these tests hold the ordering and failure rules the engine relies on."""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest

from epd.proto import abi, counter_page
from epd.proto.errors import InvalidArgument
from epd.server.engine.executor import EngineState, SessionExecutor
from epd.server.engine.stream_calls import StreamCalls


@pytest.fixture
def ex():
    e = SessionExecutor(EngineState(0), "s0abcde")
    yield e
    e.worker.shutdown(wait=True)


def test_deferred_work_runs_after_the_answer_under_the_lock(ex) -> None:
    events: list[str] = []

    def op() -> str:
        ex.after_answer(lambda: events.append(f"launch locked={ex.op_lock.locked()}"))
        events.append("op")
        return "resp"

    assert ex.call(op, answer=lambda r: events.append(f"answer {r}")) == "resp"
    assert events == ["op", "answer resp", "launch locked=True"]
    assert not ex.op_lock.locked()


def test_the_next_operation_waits_for_the_previous_ones_launches(ex) -> None:
    """A second transport's call of the same session cannot slip between an answer and the
    launches behind it (the ranks' collectives would pair in different orders)."""
    answered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> str:
        def launch() -> None:
            release.wait(5)
            order.append("first launched")
        ex.after_answer(launch)
        return "first"

    t = threading.Thread(target=lambda: ex.call(first, answer=lambda _: answered.set()))
    t.start()
    assert answered.wait(5)
    second = threading.Thread(target=lambda: ex.call(lambda: order.append("second ran")))
    second.start()
    second.join(0.2)
    assert order == []  # the second call waits for the lock
    release.set()
    t.join(5)
    second.join(5)
    assert order == ["first launched", "second ran"]


def test_a_failed_operation_leaves_nothing_to_run(ex) -> None:
    ran: list[str] = []

    def op() -> None:
        ex.after_answer(lambda: ran.append("launch"))
        raise InvalidArgument("bad")

    with pytest.raises(InvalidArgument):
        ex.call(op, answer=lambda _: ran.append("answer"))
    assert ran == []
    assert ex.call(lambda: "next") == "next"  # and nothing is left over for the next call
    assert ran == []


def test_failing_deferred_work_is_logged_and_the_result_stands(ex, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="epd.engine")
    ran: list[str] = []

    def op() -> int:
        ex.after_answer(lambda: 1 / 0)
        ex.after_answer(lambda: ran.append("second"))
        return 5

    assert ex.call(op) == 5
    assert ran == ["second"]
    assert "work after an answer failed" in caplog.text


def test_the_grpc_worker_runs_deferred_work_before_returning(ex) -> None:
    ran: list[str] = []

    def op() -> str:
        ex.after_answer(lambda: ran.append("launch"))
        return "resp"

    async def go() -> str:
        return await ex.run(op)

    assert asyncio.run(go()) == "resp"
    assert ran == ["launch"]


class _Comm:
    """A rank's comm as `_launch_failed` uses it (the CUDA one needs a GPU)."""

    def __init__(self, drains: bool) -> None:
        self.aborted: str | None = None
        self.drains = drains

    def known_abort_reason(self) -> str | None:
        return self.aborted

    def abort(self, why: str) -> None:
        self.aborted = why

    def drain_stream(self, timeout: float) -> bool:
        return self.drains


class _Spec:
    name = "g"
    num_experts = 8


class _Member:
    def __init__(self, comm: _Comm) -> None:
        self.comm, self.spec, self.rank = comm, _Spec(), 3


class _Engine(StreamCalls):
    def _timeout(self, seconds: float) -> float:
        return 0.1


@pytest.mark.parametrize("drains", [True, False])
def test_a_launch_failing_after_the_answer_fails_the_call_and_the_group(drains, caplog) -> None:
    slot = np.zeros(abi.SLOT_BYTES // 8, dtype=np.int64)
    member = _Member(_Comm(drains))
    _Engine()._launch_failed(member, slot, 17, "layout", RuntimeError("launch failed"))
    assert counter_page.stream_done(slot) == 17  # the client's stream goes on
    f = counter_page.stream_failure(slot)
    assert f is not None and (f.seq, f.code, f.rank) == (17, abi.ERR_ABORTED, 3) and f.fatal
    err = f.error("g", 8)
    assert "call #17" in err.message and "rank 3" in err.message
    assert member.comm.aborted is not None and "layout #17" in member.comm.aborted
    assert "launch failed" in member.comm.aborted
    assert ("did not drain" in caplog.text) is (not drains)


def test_a_dispatch_failing_after_the_answer_ends_its_clients_count_wait() -> None:
    """The dispatch's client waits for its receive count first: it gets a failed count at once
    (not its deadline), and the stream failure above names the cause."""
    slot = np.zeros(abi.SLOT_BYTES // 8, dtype=np.int64)
    slot[abi.SLOT_ERR_RANK] = 2  # (left by an earlier failure)
    _Engine()._launch_failed(_Member(_Comm(True)), slot, 4, "dispatch", RuntimeError("x"),
                             dispatch_sequence=11)
    assert counter_page.wait(slot, 11, 0.01) == (0, [])
    assert int(slot[abi.SLOT_STATUS]) == abi.ERR_ABORTED
    assert int(slot[abi.SLOT_ERR_RANK]) == -1  # the client's message: aborted, not a deadline
    assert counter_page.stream_done(slot) == 4


def test_release_stream_keeps_its_meaning() -> None:
    slot = np.zeros(abi.SLOT_BYTES // 8, dtype=np.int64)
    counter_page.release_stream(slot, 0)  # nothing issued: nothing written
    assert counter_page.stream_failure(slot) is None
    counter_page.release_stream(slot, 9)
    f = counter_page.stream_failure(slot)
    assert f is not None and (f.seq, f.code, f.rank) == (9, counter_page.RELEASED, -1)
    assert counter_page.stream_done(slot) == 9


@pytest.mark.parametrize(("n", "per_expert", "ok"), [
    (7, [3, 4], True), (-1, [], False), (10**9, [], False), (5, [-2, 7], False)])
def test_a_count_no_notify_writes_marks_the_dispatch_failed(n, per_expert, ok) -> None:
    """A stream-ordered dispatch's receive count comes back from the session's counter page,
    which its client can write: a count outside the group's receive buffer (or a negative
    one) is not trusted to size anything; the handle is marked failed instead."""
    import types

    from epd.proto import abi, counter_page
    from epd.server.engine.stream_calls import StreamCalls

    words = np.zeros(abi.SLOT_BYTES // 8, np.int64)
    counter_page.publish(words, 5, n, per_expert)
    info = types.SimpleNamespace(sequence=5, failed=False, num_recv_tokens=-1, rows_out=-1,
                                 backend_handle=types.SimpleNamespace(num_recv=-1),
                                 unresolved_combines=0)
    member = types.SimpleNamespace(
        counter_slot=0, pending=info, rank=0, bytes_received=0,
        spec=types.SimpleNamespace(name="g", label="g", max_recv_tokens=64, hidden=8,
                                   x_numpy_dtype=np.dtype(np.float32), num_local_experts=2))
    session = types.SimpleNamespace(counter_page=types.SimpleNamespace(slot=lambda i: words),
                                    describe=lambda: "session")
    engine = types.SimpleNamespace(_timeout=lambda t: 1.0, backend=types.SimpleNamespace(
        peer_class="shm"), config=types.SimpleNamespace(per_expert_metrics=False))
    StreamCalls._resolve(engine, session, member, info)
    assert info.failed is (not ok) and member.pending is None
    assert info.num_recv_tokens == (n if ok else 0) and info.rows_out == (n if ok else 0)
