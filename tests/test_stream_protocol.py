"""The stream-ordered normal-mode protocol without a GPU (issue 10): the counter-slot words
(proto/counter_page.py, abi.SLOT32_*), how a failure the GPU reports becomes an error, the
client's release when its engine is gone, the engine's descriptor cache, and what the CPU
backend answers to stream-ordered requests. The GPU side is tests/gpu/test_stream_ordered.py."""

from __future__ import annotations

import threading
import time
import types

import grpc
import numpy as np
import pytest
from ranklib import plain_regions

from epd.client import EpdError, Session
from epd.proto import abi, counter_page, dtypes
from epd.proto.errors import DeadlineExceeded, InvalidArgument
from epd.proto.v1 import epd_pb2
from epd.server.backends.cuda import CudaRankComm
from epd.server.engine import tensors

BF16 = dtypes.BFLOAT16


def _slot() -> np.ndarray:
    return np.zeros(abi.SLOT_BYTES // 8, np.int64)


def _gpu_failure(words: np.ndarray, seq: int, code: int, rank: int, value: int,
                 phase: int = 0) -> None:
    """What epd_call_done writes (cuda/epd_intranode.cu): fields, then the failed sequence."""
    w32 = words.view(np.int32)
    words[abi.SLOT_FAIL_VALUE] = value
    w32[abi.SLOT32_FAIL_CODE] = code | phase << 8
    w32[abi.SLOT32_FAIL_RANK] = rank
    w32[abi.SLOT32_FAIL_SEQ] = seq
    w32[abi.SLOT32_DONE] = seq


def test_slot_words_do_not_overlap() -> None:
    """Header, stream words, per-expert counts and the ready ring each have their own bytes."""
    header_end = abi.SLOT_HEADER * 8
    stream32 = [abi.SLOT32_DONE, abi.SLOT32_FAIL_SEQ, abi.SLOT32_FAIL_CODE, abi.SLOT32_FAIL_RANK]
    assert all(4 * abi.SLOT_ERR_RANK + 8 <= 4 * w < header_end for w in stream32)
    assert header_end >= 8 * abi.SLOT_FAIL_VALUE + 8
    assert max(stream32) * 4 + 4 <= 8 * abi.SLOT_FAIL_VALUE
    counts_end = header_end + 8 * counter_page.MAX_LOCAL_EXPERTS
    assert counts_end <= 4 * abi.SLOT32_READY
    assert 4 * (abi.SLOT32_READY + abi.READY_RING) == abi.SLOT_BYTES
    # Publishing the most counts a slot takes leaves the ring alone.
    words = _slot()
    ring = words.view(np.int32)[abi.SLOT32_READY:]
    ring[:] = 7
    counter_page.publish(words, 1, 5, list(range(counter_page.MAX_LOCAL_EXPERTS)))
    assert (ring == 7).all()


def test_an_armed_ops_words_fit_its_record() -> None:
    """An op's int32 and int64 words lie within its record (many records share a slot) and
    records tile a slot; the record of slot s, record r is where the client looks."""
    int32_words = [abi.STREAM_REQUEST, abi.STREAM_DONE, abi.STREAM_FAIL_TOKEN,
                   abi.STREAM_FAIL_DONE]
    assert 4 * (max(int32_words) + 1) <= abi.OP_RECORD_BYTES
    assert 8 * (abi.STREAM_FAIL_VALUE + 1) <= abi.OP_RECORD_BYTES
    assert 4 * abi.STREAM_FAIL_TOKEN + 4 <= 8 * abi.STREAM_FAIL_VALUE  # (disjoint)
    assert abi.OP_RECORDS * abi.OP_RECORD_BYTES == abi.SLOT_BYTES
    page = bytearray(counter_page.PAGE_BYTES)
    counter_page.record_words(page, 3, 5)[abi.STREAM_DONE] = 9
    at = counter_page.record_offset(3, 5) + 4 * abi.STREAM_DONE
    assert at == 3 * abi.SLOT_BYTES + 5 * abi.OP_RECORD_BYTES + 4
    assert np.frombuffer(page, np.int32)[at // 4] == 9 and sum(page) == 9


def test_no_failure_on_a_fresh_slot() -> None:
    assert counter_page.stream_failure(_slot()) is None


@pytest.mark.parametrize(("code", "phase", "status", "words"), [
    (abi.ERR_BAD_INPUT, 0, grpc.StatusCode.INVALID_ARGUMENT, ["rank 1", "expert id 1000"]),
    (abi.ERR_BAD_COUNT, 0, grpc.StatusCode.INVALID_ARGUMENT,
     ["rank 1", "passed 1000 in num_tokens_per_expert", "taken as 0"]),
    (abi.ERR_DEADLINE, abi.PHASE_NOTIFY, grpc.StatusCode.DEADLINE_EXCEEDED,
     ["rank 1", "notify", "aborted"]),
    (abi.ERR_ABORTED, 0, grpc.StatusCode.ABORTED, ["rank 1 left or failed"]),
    (abi.ERR_WORST_OVERFLOW, 0, grpc.StatusCode.RESOURCE_EXHAUSTED, ["num_worst_tokens"]),
    (counter_page.RELEASED, 0, grpc.StatusCode.UNAVAILABLE, ["went away"]),
    (abi.ERR_REFUSED, 0, grpc.StatusCode.FAILED_PRECONDITION,
     ["rank 1's engine refused its part of the combine", "zeros", "goes on"]),
])
def test_gpu_failure_becomes_a_precise_error(code: int, phase: int, status, words) -> None:
    slot = _slot()
    _gpu_failure(slot, 9, code, 1, 1000, phase)
    f = counter_page.stream_failure(slot)
    assert f is not None and f.seq == 9 and f.code == code and f.rank == 1
    # (only its call)
    assert f.fatal == (code not in (abi.ERR_BAD_INPUT, abi.ERR_BAD_COUNT, abi.ERR_REFUSED))
    assert f.check_only == (code == abi.ERR_REFUSED)
    err = f.error("moe", 256)
    assert err.code == status
    assert "group 'moe', call #9" in err.message
    for w in words:
        assert w in err.message, err.message


def test_sequences_compare_cyclically() -> None:
    """As cuStreamWaitValue32's GEQ: 32-bit wrap-around, 0 = never written."""
    reached = counter_page.seq_reached
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert not reached(0, 1)
    assert reached(3, 0xFFFFFFF0)  # wrapped past
    assert not reached(0xFFFFFFF0, 3)


def test_release_lets_waiting_streams_go_once() -> None:
    words = _slot()
    counter_page.release_stream(words, 0)  # nothing issued: nothing to release
    assert counter_page.stream_done(words) == 0
    counter_page.release_stream(words, 12)
    assert counter_page.stream_done(words) == 12
    f = counter_page.stream_failure(words)
    assert f is not None and f.seq == 12 and f.code == counter_page.RELEASED
    assert f.error("g").code == grpc.StatusCode.UNAVAILABLE
    # A call the GPU already finished is not marked failed by a later release.
    words = _slot()
    words.view(np.int32)[abi.SLOT32_DONE] = 12
    counter_page.release_stream(words, 12)
    assert counter_page.stream_failure(words) is None
    # Large sequences survive the int32 words.
    words = _slot()
    counter_page.release_stream(words, 0xFFFFFFFE)
    assert counter_page.stream_done(words) == 0xFFFFFFFE


def _write_ready(words: np.ndarray, seq: int) -> None:
    """What the client's stream writes when it reaches stream call `seq`."""
    words.view(np.int32)[abi.SLOT32_READY + seq % abi.READY_RING] = np.int32(np.uint32(seq))


def test_ready_ring_says_which_calls_the_client_stream_reached() -> None:
    words = _slot()
    assert not counter_page.stream_ready(words, 1)
    _write_ready(words, 1)
    assert counter_page.stream_ready(words, 1) and not counter_page.stream_ready(words, 2)
    _write_ready(words, 33)  # (the entry of 1, one ring later)
    assert counter_page.stream_ready(words, 33) and counter_page.stream_ready(words, 1)
    _write_ready(words, 0xFFFFFFFF)
    assert counter_page.stream_ready(words, 0xFFFFFFFF)


def test_a_synchronous_call_waits_for_ready_words_with_a_deadline() -> None:
    """The cuda engine's check before a synchronous call (its kernels would queue behind the
    stream-ordered calls given before it, and its synchronisation would wait for a READY word
    the client never writes, holding the session's worker): immediate when the client's
    stream reached the latest call, DEADLINE_EXCEEDED naming it when it does not by the
    deadline, and passed once a teardown released the stream (CudaRankComm's own methods on
    a stand-in for the comm: they need no GPU)."""
    words = _slot()
    comm = types.SimpleNamespace(_stream_issued=0, _stream_slot=None, _stream_ready_seen=0,
                                 spec=types.SimpleNamespace(name="g"))
    wait = CudaRankComm.await_stream_ready
    wait(comm, time.monotonic())  # no stream-ordered call yet
    comm._stream_issued, comm._stream_slot = 7, words
    for seq in range(1, 7):
        _write_ready(words, seq)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="stream-ordered call #7 has not started"):
        wait(comm, time.monotonic() + 0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    # written while it waits
    writer = threading.Timer(0.1, _write_ready, (words, 7))
    writer.start()
    wait(comm, time.monotonic() + 10)
    writer.join()
    # a teardown's release passes every READY wait
    comm._stream_issued = 40
    CudaRankComm.release_stream(comm, words)
    wait(comm, time.monotonic())


def test_descriptor_checks_are_cached_per_region_and_never_skipped() -> None:
    cap = tensors.MAX_RESOLVED
    regions = plain_regions(8 * (cap + 8))
    desc = epd_pb2.TensorDesc(region_id="r", offset_bytes=0, shape=[4, 8], strides=[8, 1],
                              dtype=epd_pb2.INT64)
    a = tensors.resolve(desc, regions, "x", ndim=2, dtype=epd_pb2.INT64)
    assert tensors.resolve(desc, regions, "x", ndim=2, dtype=epd_pb2.INT64) is a
    # A different descriptor is checked again: out of the region is refused.
    big = epd_pb2.TensorDesc()
    big.CopyFrom(desc)
    big.shape[0] = 1 << 20
    with pytest.raises(InvalidArgument, match="outside region"):
        tensors.resolve(big, regions, "x", ndim=2, dtype=epd_pb2.INT64)
    # The same descriptor under another dtype rule is checked under that rule.
    with pytest.raises(InvalidArgument, match="dtype"):
        tensors.resolve(desc, regions, "x", ndim=2, dtype=epd_pb2.FLOAT32)
    for i in range(cap + 5):  # bounded
        d = epd_pb2.TensorDesc(region_id="r", offset_bytes=8 * i, shape=[1], dtype=epd_pb2.INT64)
        tensors.resolve(d, regions, "x", ndim=1)
    assert len(regions["r"].resolved) <= cap
    # And over a session's regions (a session of many regions held 512 views each, whatever
    # their number: the fuzzer's refused calls).
    many = {}
    for k in range(8):
        r = plain_regions(8 * (cap + 8))["r"]
        r.region_id = f"r{k}"
        many[r.region_id] = r
    for k in range(8):
        for i in range(2500):
            d = epd_pb2.TensorDesc(region_id=f"r{k}", offset_bytes=8 * i, shape=[1],
                                   dtype=epd_pb2.INT64)
            tensors.resolve(d, many, "x", ndim=1)
            assert sum(len(r.resolved) for r in many.values()) <= tensors.SESSION_RESOLVED
    assert tensors.SESSION_RESOLVED < 8 * 2500


def test_cpu_backend_refuses_stream_ordered_requests(daemon) -> None:
    """The CPU backend's calls are synchronous by nature: a stream-ordered request (a client
    that thinks it talks to the cuda engine) is FAILED_PRECONDITION naming the backend, and
    client SM requests are refused where there are no SMs."""
    with Session(daemon.socket(0), timeout=5) as s:
        g = s.join("stream-cpu", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2, dtype="bfloat16")
        idx = np.array([[0, 1], [2, 3]], np.int64)
        x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
        d = s._descs({"topk_idx": idx})
        with pytest.raises(EpdError) as err:
            s._call("GetDispatchLayout", epd_pb2.GetDispatchLayoutRequest(
                session_id=s.session_id, group_id=g.group_id, stream_ordered=True, **d))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "cuda backend" in err.value.message
        with pytest.raises(InvalidArgument, match="num_sms"):
            g.dispatch(x, idx, w, num_sms=4)
        out = g.dispatch(x, idx, w)  # nothing changed: the group works
        cx, _ = g.combine(out.recv_x, out.handle)
        assert cx.shape == (2, 64)
        with pytest.raises(InvalidArgument, match="num_sms"):
            g.combine(out.recv_x, out.handle, num_sms=2)


def test_routing_tensors_must_be_dense_where_the_kernels_take_an_address() -> None:
    """The cuda kernels read topk_idx (and weights, is_token_in_rank) from their base address as
    dense rows: a row-strided slice (misread) or overlapping rows (read past the client's
    memory, an illegal address that would end the engine's GPU context) are refused under
    `dense`; a dimension of one element may carry any stride (torch gives some)."""
    regions = plain_regions(4096)

    def desc(shape, strides):
        return epd_pb2.TensorDesc(region_id="r", offset_bytes=0, shape=shape, strides=strides,
                                  dtype=epd_pb2.INT64)
    tensors.resolve(desc([4, 8], [16, 1]), regions, "topk_idx", ndim=2)  # (host: fine)
    with pytest.raises(InvalidArgument, match="dense rows"):
        tensors.resolve(desc([4, 8], [16, 1]), regions, "topk_idx", ndim=2, dense=True)
    for shape, strides in (([4, 8], [1, 1]), ([4, 8], [4, 1])):  # overlapping: never a tensor
        for dense in (False, True):
            with pytest.raises(InvalidArgument, match="is not a layout of dense memory"):
                tensors.resolve(desc(shape, strides), regions, "topk_idx", ndim=2, dense=dense)
    for shape, strides in (([4, 8], [8, 1]), ([1, 8], [64, 1]), ([4, 1], [1, 7]), ([0, 8], [3, 1])):
        tensors.resolve(desc(shape, strides), regions, "topk_idx", ndim=2, dense=True)
    assert tensors.is_dense((2, 3, 4), (12, 4, 1)) and not tensors.is_dense((2, 3, 4), (12, 5, 1))


def test_a_region_an_armed_op_reads_is_not_unmapped_under_it() -> None:
    """An armed op's launches carry its tensors' addresses from arm time: UnregisterRegion of a
    region it reads is refused (FAILED_PRECONDITION naming the op) while it is armed (a
    trigger after the unmap would fault the engine's GPU context, every session's); the
    client's CUDA IPC registrations, dropped least recently used, pass over such a region."""
    from collections import OrderedDict

    from epd.client.memory import CudaIpcMemory
    from epd.proto.errors import FailedPrecondition
    from epd.server.engine.core import Engine

    closed: list[str] = []
    region = types.SimpleNamespace(borrowed=False, close=lambda: closed.append("r1"))
    op = types.SimpleNamespace(op_id=7, armed=True, regions=frozenset({"r1", "r3"}))
    session = types.SimpleNamespace(
        regions={"r1": region}, stream_ops={7: op}, describe=lambda: "session s",
        executor=types.SimpleNamespace(later=lambda fn: fn()))
    engine = types.SimpleNamespace(_refresh_gauges=lambda: None)
    with pytest.raises(FailedPrecondition, match=r"armed stream op\(s\) \[7\]"):
        Engine.unregister_region(engine, session, "r1")
    assert "r1" in session.regions and not closed
    op.armed = False
    Engine.unregister_region(engine, session, "r1")
    assert "r1" not in session.regions and closed == ["r1"]

    mem = object.__new__(CudaIpcMemory)
    mem._regions = OrderedDict((f"h{i}", f"r{i}") for i in range(4))
    mem._by_buffer = {}
    gone: list[str] = []

    def unregister(rid: str) -> None:
        if rid in ("r0", "r1"):  # (read by armed ops)
            raise FailedPrecondition(f"region {rid!r} is read by armed low-latency op(s)")
        gone.append(rid)
    mem._unregister = unregister
    mem._drop_oldest(keep={"r3"})
    assert gone == ["r2"] and list(mem._regions.values()) == ["r3", "r0", "r1"]


def test_unregister_region_waits_for_an_arm_running_on_the_worker() -> None:
    """UnregisterRegion runs on the session's worker, in order with its operations: an
    ArmStreamOp there packs its tensors' addresses before it publishes the op, and a check made
    meanwhile on the event loop found no armed user and unmapped a region the op then read
    (a fault in the GPU context every session shares)."""
    import asyncio

    from epd.proto.v1 import epd_pb2
    from epd.server.engine import service
    from epd.server.engine.executor import EngineState, SessionExecutor

    ex = SessionExecutor(EngineState(0), "session-u")
    session = types.SimpleNamespace(executor=ex)
    events: list[str] = []
    arming, release = threading.Event(), threading.Event()

    def arm() -> None:  # (as StreamOps.arm: the op is published at its end)
        arming.set()
        release.wait(5)
        events.append("op armed")
    engine = types.SimpleNamespace(
        session=lambda sid: session,
        unregister_region=lambda s, rid: events.append(f"unregister {rid}"))

    async def run() -> None:
        armed = asyncio.ensure_future(ex.run(arm))
        while not arming.is_set():
            await asyncio.sleep(0.01)
        unreg = asyncio.ensure_future(service._unregister_region(
            engine, epd_pb2.UnregisterRegionRequest(session_id="s", region_id="r1")))
        await asyncio.sleep(0.2)
        assert events == []  # (waits behind the arm)
        release.set()
        await asyncio.wait_for(asyncio.gather(armed, unreg), 5)
    try:
        asyncio.run(run())
    finally:
        release.set()
        ex.worker.shutdown(wait=True)
    assert events == ["op armed", "unregister r1"]


def test_counts_read_back_are_bounded() -> None:
    """Counts an engine reads back from a counter page its client may write: the receive count
    within the buffer, no negative or past-int32 per-expert count, and as many as the rank's
    local experts (or none: a cached dispatch, one refused for capacity); a client writing its
    page made the engine label up to ~500 expert series with any increments."""
    ok = counter_page.counts_in_range
    assert ok(10, [4, 6], 100, 2) and ok(10, [], 100, 2) and ok(0, [0, 0], 0, 2)
    assert not ok(101, [4, 6], 100, 2) and not ok(10, [-1, 6], 100, 2)
    assert not ok(10, [4, 6, 0], 100, 2) and not ok(10, [2**31, 0], 100, 2)
    assert ok(10, [4, 6, 0], 100)  # (no expert count given: not checked)


# -- worst-case dispatches: the host does not wait for the count (as DeepEP's) ----------------
def _fake_group(monkeypatch, answers: list[epd_pb2.DispatchResponse]):
    """A Group as stream_calls sees it, with the driver calls recorded and the engine's
    answers taken from `answers`."""
    from epd.client import stream_calls
    from epd.client.group import Group

    ops: list[tuple] = []
    monkeypatch.setattr(stream_calls.cuda_ipc, "stream_handle", lambda *a: 0)
    monkeypatch.setattr(stream_calls.cuda_driver, "stream_write",
                        lambda s, p, v: ops.append(("write", v)))
    monkeypatch.setattr(stream_calls.cuda_driver, "stream_wait_geq",
                        lambda s, p, v: ops.append(("wait", v)))
    sent: list = []

    def call(method, req, timeout=None):
        sent.append((req, counter_page.published(group._counter, 1)))
        return answers.pop(0)
    memory = types.SimpleNamespace(is_capturing=lambda t: False, device_ordinal=0,
                                   counter_page_device_ptr=lambda: 0x1000)
    session = types.SimpleNamespace(memory=memory, device_ordinal=0, _call=call, _groups={})
    requeued: list[int] = []
    group = types.SimpleNamespace(
        _session=session, name="g", rank=0, _counter=_slot(), _counter_slot=0,
        _stream_slot=None, _captured=[], _captured_seen=0, _timeout=lambda t: 5.0,
        _local_layout=None, capacity_owed=0, _take_released=lambda: [],
        _requeue=requeued.extend, _ordered=True,
        spec=types.SimpleNamespace(name="g", num_experts=8, num_topk=4, max_tokens_per_rank=16),
        _outputs=types.SimpleNamespace(rows=lambda parts, copy, t, s: [p[1] for p in parts]))
    # (the Group methods under test, on the fake)
    group.check = lambda: Group.check(group)
    group.settle_dispatches = lambda: Group.settle_dispatches(group)
    return group, ops, sent, requeued


def _answer(seq: int, sequence: int) -> epd_pb2.DispatchResponse:
    return epd_pb2.DispatchResponse(stream_seq=seq, counter_sequence=sequence, handle=seq,
                                    recv_x=epd_pb2.TensorDesc(region_id="r"))


def test_a_worst_case_dispatch_returns_without_its_count(monkeypatch) -> None:
    """With num_worst_tokens the client neither waits for the receive count nor reads it (as
    DeepEP's, no CPU sync): the rows are the worst case's, the count -1, the per-expert list
    empty. Its failure raises at the next dispatch, before that one is sent, on every rank
    alike (a combine or layout in between does not raise it: one rank raising there while
    another sent the combine would leave their collectives one call apart); once."""
    from epd.client import stream_calls
    from epd.proto.errors import TokenCapacityExceeded

    group, ops, sent, requeued = _fake_group(monkeypatch, [_answer(1, 1), _answer(3, 2)])
    req = epd_pb2.DispatchRequest(num_worst_tokens=32, timeout_seconds=5.0)
    t0 = time.monotonic()
    _, n, per_expert, rows, outs, _ = stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    assert time.monotonic() - t0 < 0.5  # no count came: not waited for
    assert (n, per_expert, rows, outs["recv_x"]) == (-1, [], 32, 32)
    assert ops == [("write", 1), ("wait", 1)]  # READY, then DONE: the stream is ordered
    # Every rank failed it for capacity (notify: count, error rank, status, then sequence).
    counter_page.publish(group._counter, 1, 40, [], status=abi.ERR_CAPACITY)
    group._counter[abi.SLOT_ERR_RANK] = 1
    stream_calls._slot(group)  # a combine's or layout's look: not raised there
    group.check()
    with pytest.raises(TokenCapacityExceeded, match="no data") as e:
        stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    assert e.value.earlier and e.value.tokens_needed == 40 and group.capacity_owed == 40
    assert "rank 1 dispatched 40 tokens" in e.value.message
    assert len(sent) == 1 and requeued == []  # not sent; the caller holds the lost handle
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)  # raised once: this one goes
    assert len(sent) == 2

    # A receive count above num_worst_tokens fails alike in notify: INVALID_ARGUMENT.
    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    counter_page.publish(group._counter, 1, 50, [], status=abi.ERR_WORST_OVERFLOW)
    group._counter[abi.SLOT_ERR_RANK] = 0
    with pytest.raises(InvalidArgument, match=r"rank 0 receives 50 tokens, more than "
                                              r"num_worst_tokens=32; .*goes on"):
        group.settle_dispatches()
    assert group.capacity_owed == 0 and len(sent) == 1

    # The next dispatch waits for an unwaited count before it is sent (a notify publishing it
    # 50 ms later), then goes on.
    group, ops, sent, _ = _fake_group(monkeypatch, [_answer(1, 1), _answer(2, 2)])
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)

    def notify() -> None:
        time.sleep(0.05)
        counter_page.publish(group._counter, 1, 20, [10, 10])
    th = threading.Thread(target=notify)
    th.start()
    _, n, _, _, _, _ = stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    th.join()
    assert [published for _, published in sent] == [False, True] and n == -1


def test_an_unwaited_count_never_holds_a_released_slot(monkeypatch) -> None:
    """The session or engine went away with a worst-case dispatch's count unpublished: the
    next dispatch does not wait out the deadline for it; the release is what it raises."""
    from epd.client import stream_calls

    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    req = epd_pb2.DispatchRequest(num_worst_tokens=32, timeout_seconds=30.0)
    stream_calls.dispatch(group, req, 30.0, object(), True, 0)
    group._stream_slot.release()
    t0 = time.monotonic()
    with pytest.raises(EpdError) as e:
        stream_calls.dispatch(group, req, 30.0, object(), True, 0)
    assert time.monotonic() - t0 < 2.0 and e.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(sent) == 1
    # One whose count did come before the release is no failure: nothing raises.
    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    stream_calls.dispatch(group, req, 30.0, object(), True, 0)
    counter_page.publish(group._counter, 1, 20, [10, 10])
    _gpu_done = group._counter.view(np.int32)
    _gpu_done[abi.SLOT32_DONE] = 1  # (its last kernel ran)
    group._stream_slot.release()
    group.settle_dispatches()


def test_a_dispatch_that_waits_still_fails_at_once_for_capacity(monkeypatch) -> None:
    """Without num_worst_tokens the count is waited for: a capacity failure raises from the
    call itself (the facade grows and calls again) and its handle goes back."""
    from epd.client import stream_calls
    from epd.proto.errors import TokenCapacityExceeded

    group, _, _, requeued = _fake_group(monkeypatch, [_answer(1, 1)])
    counter_page.publish(group._counter, 1, 40, [], status=abi.ERR_CAPACITY)
    with pytest.raises(TokenCapacityExceeded) as e:
        stream_calls.dispatch(group, epd_pb2.DispatchRequest(timeout_seconds=5.0), 5.0,
                              object(), True, 0)
    assert not e.value.earlier and group.capacity_owed == 0 and requeued == [1]


def test_the_engine_counts_a_combine_launched_before_its_dispatch_count() -> None:
    """The engine's combine of a worst-case dispatch does not wait for notify's count
    (`_resolve(wait=False)`: False while unpublished, the handle still pending); once the
    count is published the dispatch's and those combines' bytes are counted, once."""
    from epd.server.engine.state import HandleInfo
    from epd.server.engine.stream_calls import StreamCalls

    words = _slot()
    spec = types.SimpleNamespace(label="g", name="g", hidden=8, max_recv_tokens=64,
                                 num_local_experts=2, x_numpy_dtype=np.dtype(np.float32))
    info = HandleInfo(types.SimpleNamespace(num_recv=-1), 4, -1, 32, sequence=3)
    member = types.SimpleNamespace(spec=spec, counter_slot=0, pending=info, rank=0,
                                   bytes_received=0, bytes_sent=0)
    session = types.SimpleNamespace(counter_page=types.SimpleNamespace(slot=lambda i: words))
    engine = types.SimpleNamespace(_timeout=lambda t: 5.0, backend=types.SimpleNamespace(
        peer_class="nvlink"), config=types.SimpleNamespace(per_expert_metrics=False))
    t0 = time.monotonic()
    assert not StreamCalls._resolve(engine, session, member, info, wait=False)
    assert time.monotonic() - t0 < 0.5 and member.pending is info and info.sequence == 3
    info.unresolved_combines = 2  # (two combines launched meanwhile, combine_stream)
    counter_page.publish(words, 3, 20, [12, 8])
    assert StreamCalls._resolve(engine, session, member, info, wait=False)
    assert (info.num_recv_tokens, info.rows_out, info.sequence, member.pending) == (20, 32, 0,
                                                                                    None)
    assert member.bytes_received == 20 * 8 * 4 and member.bytes_sent == 2 * 20 * 8 * 4
    assert info.unresolved_combines == 0


def test_dispatch_async_settles_an_unwaited_worst_case_dispatch_first(monkeypatch) -> None:
    """`Group.dispatch_async` after a worst-case dispatch whose count the host did not wait
    for: it waits for that count before it reads the slot's sequence (else its counts() would
    be the earlier call's), and raises the earlier call's failure instead of sending, as the
    next stream dispatch does."""
    import threading as th

    from epd.client import stream_calls
    from epd.client.group import Group
    from epd.proto.errors import TokenCapacityExceeded

    group, _, _, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    req = epd_pb2.DispatchRequest(num_worst_tokens=32, timeout_seconds=5.0)
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    started: list[int] = []
    s = group._session
    s._flight_lock, s._in_flight = th.Lock(), None
    s._transport = types.SimpleNamespace(
        call_async=lambda m, r, t: started.append(int(group._counter[counter_page.SEQ])))
    s._dispatch_started = lambda pending, fut: None
    group._unanswered, group._dropped = [], []
    group._dispatch_request = lambda *a: (epd_pb2.DispatchRequest(), 5.0)
    group._settle_unanswered = lambda wait: None

    def notify() -> None:  # the earlier call's notify publishes its count 50 ms later
        time.sleep(0.05)
        counter_page.publish(group._counter, 1, 20, [10, 10])
    t = th.Thread(target=notify)
    t.start()
    pending = Group.dispatch_async.__wrapped__(group, object())  # (the decorator: a session)
    t.join()
    assert started == [1] and pending._sequence == 2  # (its own: after the earlier one)

    # An earlier capacity failure raises here, and nothing is sent.
    group, _, _, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    counter_page.publish(group._counter, 1, 40, [], status=abi.ERR_CAPACITY)
    s = group._session
    s._flight_lock, s._in_flight = th.Lock(), None
    s._transport = types.SimpleNamespace(call_async=lambda *a: started.append(-1))
    group._dispatch_request = lambda *a: (epd_pb2.DispatchRequest(), 5.0)
    group._settle_unanswered = lambda wait: None
    with pytest.raises(TokenCapacityExceeded):
        Group.dispatch_async.__wrapped__(group, object())
    assert started == [1]


# -- bad input: a dispatch fails on every rank alike; a layout's is this rank's alone ---------
def _bad(words: np.ndarray, sequence: int, code: int, rank: int, value: int) -> None:
    """What notify writes when a source's payload carries bad input (notify_publish)."""
    counter_page.publish(words, sequence, value, [], status=code)
    words[abi.SLOT_ERR_RANK] = rank


@pytest.mark.parametrize("code,value,text", [
    (abi.ERR_BAD_INPUT, 1000, "rank 1 passed expert id 1000 in topk_idx; valid ids are -1 "
                              "(none) and [0, 8); no rank's dispatch ran and the group goes on"),
    (abi.ERR_BAD_INPUT, -(2**40), f"expert id {-(2**40)} in topk_idx"),
    (abi.ERR_BAD_COUNT, -3, "rank 1 passed -3 in num_tokens_per_expert (a dispatch without "
                            "top-k); counts must be >= 0; no rank's dispatch ran")])
def test_a_bad_input_fails_the_dispatch_on_every_rank(monkeypatch, code, value, text) -> None:
    """A bad expert id (or count) on one rank: notify fails that dispatch on every rank alike
    (each source's payload carries its verdict), so every rank raises INVALID_ARGUMENT naming
    the rank and the value at the same call: the call itself when it waits for its count, the
    next dispatch for a worst-case one (never a combine or layout in between)."""
    from epd.client import stream_calls

    group, _, sent, requeued = _fake_group(monkeypatch, [_answer(1, 1)])
    _bad(group._counter, 1, code, 1, value)
    with pytest.raises(InvalidArgument) as e:
        stream_calls.dispatch(group, epd_pb2.DispatchRequest(timeout_seconds=5.0), 5.0,
                              object(), True, 0)
    assert text in e.value.message and "dispatch #1" in e.value.message, e.value.message
    assert requeued == [1]  # (its handle goes back)

    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 1), _answer(3, 2)])
    req = epd_pb2.DispatchRequest(num_worst_tokens=32, timeout_seconds=5.0)
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    _bad(group._counter, 1, code, 1, value)
    stream_calls._slot(group)  # a combine's or layout's look: not raised there
    with pytest.raises(InvalidArgument) as e:
        stream_calls.dispatch(group, req, 5.0, object(), True, 0)
    assert text in e.value.message and "num_worst_tokens" in e.value.message
    assert len(sent) == 1  # not sent
    stream_calls.dispatch(group, req, 5.0, object(), True, 0)  # raised once: this one goes
    assert len(sent) == 2


def test_a_layout_failure_raises_at_check_only(monkeypatch) -> None:
    """A layout's bad expert id is this rank's alone (layout is no collective): raised by
    Group.check(), never at the next dispatch or combine, which this rank would then not send
    while its peers do (their collectives one apart). A dispatch that fails on every rank for
    this rank's bad input (the same ids) takes its place: check() does not raise it again. A
    collective's failure still raises at the next call."""
    from epd.client import stream_calls

    group, _, _, _ = _fake_group(monkeypatch, [])
    words = group._counter
    slot = stream_calls._slot(group)
    slot.layout_sent(5)
    _gpu_failure(words, 5, abi.ERR_BAD_INPUT, 0, 77)
    stream_calls._slot(group)  # a combine's look
    stream_calls._slot(group, dispatching=True)  # a dispatch's
    with pytest.raises(InvalidArgument, match="rank 0 passed expert id 77"):
        group.check()
    group.check()  # once

    slot.layout_sent(7)
    _gpu_failure(words, 7, abi.ERR_BAD_INPUT, 0, 78)
    group._stream_slot.drop_layout_failure()  # (a dispatch failed alike for rank 0's ids)
    group.check()

    _gpu_failure(words, 8, abi.ERR_DEADLINE, 1, 3, abi.PHASE_NOTIFY)  # a collective's
    with pytest.raises(DeadlineExceeded, match="rank 1 did not arrive"):
        stream_calls._slot(group)

    # Pruned: layouts the stream passed without a failure are forgotten, pending ones kept.
    w32 = words.view(np.int32)
    w32[abi.SLOT32_DONE] = 300
    for n in range(10, 266):
        slot.layout_sent(n)
    slot.layout_sent(400)
    assert slot.layouts == {400}


def test_dispatch_alike_failure_drops_this_ranks_layout_failure(monkeypatch) -> None:
    """Layout then dispatch of the same bad ids on rank 0: the dispatch raises on every rank;
    rank 0's Group.check() afterwards has nothing left to raise (the same ids' failure)."""
    from epd.client import stream_calls

    group, _, _, _ = _fake_group(monkeypatch, [_answer(2, 1)])
    slot = stream_calls._slot(group)
    slot.layout_sent(1)
    _gpu_failure(group._counter, 1, abi.ERR_BAD_INPUT, 0, 99)
    # (the facade lays out on another group of the session: its layout failure too)
    other, _, _, _ = _fake_group(monkeypatch, [])
    other_slot = stream_calls._slot(other)
    other_slot.layout_sent(3)
    _gpu_failure(other._counter, 3, abi.ERR_BAD_INPUT, 0, 99)
    group._session._groups.update({1: group, 2: other})
    _bad(group._counter, 1, abi.ERR_BAD_INPUT, 0, 99)
    with pytest.raises(InvalidArgument, match="rank 0 passed expert id 99"):
        stream_calls.dispatch(group, epd_pb2.DispatchRequest(timeout_seconds=5.0), 5.0,
                              object(), True, 0)
    group.check()
    other.check()
    # Another rank's bad input leaves this rank's own layout failure to check().
    group, _, _, _ = _fake_group(monkeypatch, [_answer(2, 1)])
    stream_calls._slot(group).layout_sent(1)
    _gpu_failure(group._counter, 1, abi.ERR_BAD_INPUT, 0, 98)
    _bad(group._counter, 1, abi.ERR_BAD_INPUT, 1, 99)
    with pytest.raises(InvalidArgument, match="rank 1 passed expert id 99"):
        stream_calls.dispatch(group, epd_pb2.DispatchRequest(timeout_seconds=5.0), 5.0,
                              object(), True, 0)
    with pytest.raises(InvalidArgument, match="rank 0 passed expert id 98"):
        group.check()


def _refusing_engine(member, **attrs):
    """A stand-in engine for DataPlane's dispatch_op / combine_op: `member`, a 5 s deadline,
    DataPlane's own refusal rule and handle lookup, and `attrs`."""
    from epd.server.engine.ops import DataPlane

    engine = types.SimpleNamespace(member=lambda s, gid: member, _timeout=lambda t: 5.0,
                                   **attrs)
    engine._refused_takes_part = lambda *a, **k: DataPlane._refused_takes_part(engine, *a, **k)
    engine._known_handle = lambda *a: DataPlane._known_handle(engine, *a)
    engine.combine_taking_part = lambda *a: DataPlane.combine_taking_part(engine, *a)
    return engine


def test_a_refused_stream_dispatch_takes_part() -> None:
    """A fresh stream-ordered dispatch the engine refuses (bad descriptors) still takes part,
    with no tokens and the verdict ERR_REFUSED, so that its peers fail at once instead of at
    their deadline; not a cached, synchronous or worst-case one, nor one refused for a failed
    group or on a shrink group, nor one whose call was already taken (its launch
    registered)."""
    from epd.proto.errors import Aborted, FailedPrecondition, ResourceExhausted
    from epd.server.engine.ops import DataPlane

    refused: list[float] = []
    member = types.SimpleNamespace(
        dispatch_sequence=4, rank=1, spec=types.SimpleNamespace(name="g", shrink=False),
        comm=types.SimpleNamespace(refuse_stream_dispatch=lambda d: refused.append(d) or True,
                                   known_abort_reason=lambda: None))
    engine = _refusing_engine(member)

    def run(req, err, take=False):
        def dispatch(*a):
            if take:
                member.dispatch_sequence += 1
            raise err
        engine._dispatch = dispatch
        with pytest.raises(type(err)):
            DataPlane.dispatch_op(engine, None, req, "grpc")

    fresh = epd_pb2.DispatchRequest(stream_ordered=True, timeout_seconds=5.0)
    run(fresh, InvalidArgument("topk_weights: dtype float16"))
    assert len(refused) == 1 and refused[0] > time.monotonic()
    run(epd_pb2.DispatchRequest(stream_ordered=True, cached_handle=3), InvalidArgument("x"))
    run(epd_pb2.DispatchRequest(), InvalidArgument("x"))
    run(fresh, Aborted("group 'g' is aborted"))
    run(fresh, InvalidArgument("after the launch"), take=True)
    # A worst-case one: its peers' callers would combine a handle this caller never got.
    run(epd_pb2.DispatchRequest(stream_ordered=True, num_worst_tokens=64), InvalidArgument("x"))
    member.spec.shrink = True  # (normal mode is refused on every rank of a shrink group)
    run(fresh, FailedPrecondition("shrink"))
    member.spec.shrink = False
    member.comm.known_abort_reason = lambda: "rank 0 left"
    run(fresh, ResourceExhausted("received more than num_worst_tokens"))
    assert len(refused) == 1


def test_a_refused_part_fails_the_peers_dispatch() -> None:
    """The peers' side: notify's ERR_REFUSED names the rank whose engine refused its part;
    their own input was fine, so FAILED_PRECONDITION."""
    from epd.proto.errors import FailedPrecondition

    words = _slot()
    _bad(words, 7, abi.ERR_REFUSED, 1, 0)
    err = counter_page.bad_input_error("g", "dispatch #7", words, 8)
    assert isinstance(err, FailedPrecondition), err
    assert err.message == ("group 'g', dispatch #7: rank 1's engine refused its part of the "
                           "call (that rank's caller got the reason); no rank's dispatch ran "
                           "and the group goes on")


def test_a_refused_stream_combine_takes_part() -> None:
    """A stream-ordered combine the engine refuses (bad descriptors, an unknown handle) still
    takes part, pushing nothing, so that its peers' reduces fail at once instead of at their
    deadline; not a synchronous one, nor one refused for a failed group or on a shrink group,
    nor one whose call was already taken (its launch registered)."""
    from epd.proto.errors import Aborted, FailedPrecondition, NotFound
    from epd.server.engine.ops import DataPlane

    refused: list[tuple] = []
    member = types.SimpleNamespace(
        stream_seq=4, rank=1, spec=types.SimpleNamespace(name="g", shrink=False),
        comm=types.SimpleNamespace(
            refuse_stream_combine=lambda h, d: refused.append((h, d)) or True,
            known_abort_reason=lambda: None))
    known = types.SimpleNamespace(backend_handle="backend handle 3")

    def handle(m, handle_id, kind):
        if handle_id != 3:
            raise NotFound(f"handle {handle_id} is not known")
        return known
    engine = _refusing_engine(member, _handle=handle)

    def run(req, err, take=False):
        def combine(*a):
            if take:
                member.stream_seq += 1
            raise err
        engine._combine = combine
        with pytest.raises(type(err)):
            DataPlane.combine_op(engine, None, req, "grpc")

    ordered = epd_pb2.CombineRequest(stream_ordered=True, handle=3)
    run(ordered, InvalidArgument("combine x has shape [3, 8]"))
    run(epd_pb2.CombineRequest(stream_ordered=True, handle=9), NotFound("handle 9"))
    # The handle's, where the engine knows it (the kernel skips a failed dispatch's combine);
    # the call's deadline for its entry barrier.
    assert [h for h, _ in refused] == ["backend handle 3", None]
    assert all(d > time.monotonic() for _, d in refused)
    run(epd_pb2.CombineRequest(handle=3), InvalidArgument("x"))
    run(ordered, Aborted("group 'g' is aborted"))
    run(ordered, InvalidArgument("after the launch"), take=True)
    member.spec.shrink = True
    run(ordered, FailedPrecondition("shrink"))
    member.spec.shrink = False
    member.comm.known_abort_reason = lambda: "rank 0 left"
    run(ordered, InvalidArgument("x"))
    assert len(refused) == 2
    # A backend that cannot take part (the CPU one, a two-stage group) leaves it at that.
    member.comm = types.SimpleNamespace(refuse_stream_combine=lambda h, d: False,
                                        known_abort_reason=lambda: None)
    run(ordered, InvalidArgument("x"))


def test_a_peers_refused_combine_raises_at_check_only(monkeypatch, caplog) -> None:
    """The peers' side of a refused combine: their reduce reported ERR_REFUSED at the
    combine's sequence (epd_call_done: the refusing rank in FAIL_RANK). Raised by
    Group.check() alone, once: the refusing rank raised at the call itself, so raising at a
    later call, before sending it, would leave this rank one collective behind it."""
    from epd.client import stream_calls
    from epd.proto.errors import FailedPrecondition

    group, _, sent, _ = _fake_group(monkeypatch, [_answer(6, 2)])
    stream_calls._slot(group)
    _gpu_failure(group._counter, 5, abi.ERR_REFUSED, 1, 1)
    with caplog.at_level("WARNING", logger="epd.client"):
        stream_calls._slot(group)  # a combine's or layout's look: logged (once), not raised
        stream_calls._slot(group)
    logged = [r.getMessage() for r in caplog.records if "refused its part" in r.getMessage()]
    assert len(logged) == 1 and "raised by Group.check()" in logged[0], logged
    stream_calls.dispatch(group, epd_pb2.DispatchRequest(num_worst_tokens=8,
                                                         timeout_seconds=5.0),
                          5.0, object(), True, 0)
    assert len(sent) == 1  # sent: not raised at the next dispatch either
    with pytest.raises(FailedPrecondition, match=r"call #5: rank 1's engine refused its part "
                                                 r"of the combine"):
        group.check()
    group.check()  # once
    # Seen at a call, it is kept for check() though a later call's failure replaced it in the
    # slot (which holds only the latest); that one raises at the check after.
    _gpu_failure(group._counter, 7, abi.ERR_REFUSED, 0, 0)
    stream_calls._slot(group)
    _gpu_failure(group._counter, 8, abi.ERR_BAD_INPUT, 1, 99)
    group._stream_slot.layouts.add(8)  # (a layout's bad id: check() only too)
    with pytest.raises(FailedPrecondition, match=r"call #7: rank 0's engine refused"):
        group.check()
    with pytest.raises(InvalidArgument, match=r"call #8: rank 1 passed expert id 99"):
        group.check()
    group.check()


def test_alike_failures_map_to_one_error_each() -> None:
    """counter_page.alike_failure, shared by the client's stream-ordered dispatch and the
    engine's synchronous one: each status notify writes alike names its cause; a deadline or
    an abort is none of them (the failure words say more)."""
    from epd.proto.errors import FailedPrecondition, TokenCapacityExceeded

    want = {abi.ERR_CAPACITY: (TokenCapacityExceeded, "rank 1 dispatched 40 tokens"),
            abi.ERR_WORST_OVERFLOW: (InvalidArgument, "rank 1 receives 40 tokens"),
            abi.ERR_BAD_INPUT: (InvalidArgument, "rank 1 passed expert id 40"),
            abi.ERR_BAD_COUNT: (InvalidArgument, "rank 1 passed 40 in num_tokens_per_expert"),
            abi.ERR_REFUSED: (FailedPrecondition, "rank 1's engine refused its part")}
    for code in (*want, abi.ERR_DEADLINE, abi.ERR_ABORTED):
        words = _slot()
        _bad(words, 3, code, 1, 40)
        err = counter_page.alike_failure(words, "g", "dispatch #3", 16, 32, 8)
        if code not in want:
            assert err is None, code
            continue
        kind, text = want[code]
        assert isinstance(err, kind) and text in err.message, (code, err)


# -- normal-mode calls captured in CUDA graphs (client/captured_calls.py) ----------------------
def _captured_op(group, num_worst: int = 32) -> types.SimpleNamespace:
    """An armed captured dispatch as captured_calls sees it: its done word's sticky failure and
    its member's ring slot (shared by the group's captured ops)."""
    ring = (group._captured[0]._ring_words if group._captured
            else np.zeros(abi.SLOT_BYTES // 4, np.uint32))
    op = types.SimpleNamespace(
        kind="dispatch", _ring_words=ring, verdicts=[], armed=True,
        response=epd_pb2.ArmStreamOpResponse(dispatch=epd_pb2.DispatchResponse(
            recv_x=epd_pb2.TensorDesc(shape=[num_worst, 8]))))
    op.take_verdict = lambda: op.verdicts.pop(0) if op.verdicts else None
    group._captured.append(op)
    return op


def test_a_replayed_dispatchs_failure_is_raised_once(monkeypatch) -> None:
    """A replayed dispatch that notify failed on every rank is raised once, whether the
    client reads it in the group's counter slot (the latest dispatch, whose num_worst_tokens
    the engine noted when it ran it) or in the engine's record in the ring slot (written when
    it resolves the count at a later dispatch); a trigger the engine refused is raised from its
    op's done word; the failure of an eager dispatch, raised by that call's own path, is not
    raised again, and one that a replay's count replaced in the counter slot is raised from
    the engine's record."""
    from epd.client import captured_calls, cuda_ipc
    from epd.proto.errors import TokenCapacityExceeded
    from epd.server.engine import captured_calls as engine_side

    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 5), _answer(2, 7)])
    op = _captured_op(group)
    captured_calls.check(group)  # nothing failed
    # Replay #1 (num_worst_tokens 24) received more rows than that on rank 1; the engine
    # resolved it at replay #2, which went well and is the counter slot's latest.
    slot = np.zeros_like(group._counter)
    counter_page.publish(slot, 1, 50, [], status=abi.ERR_WORST_OVERFLOW)
    slot[abi.SLOT_ERR_RANK] = 1
    engine_side.record_failure(op._ring_words, slot, 24)
    counter_page.publish(group._counter, 2, 20, [10, 10])
    with pytest.raises(InvalidArgument, match=r"dispatch #1 \(one the host did not wait for.*"
                                              r"rank 1 receives 50 tokens, more than "
                                              r"num_worst_tokens=24"):
        captured_calls.check(group)
    captured_calls.check(group)  # once
    # Replay #3 (num_worst_tokens 40, noted when it ran) overflowed: seen in the counter slot
    # first, then in the engine's record once it resolves it: raised once.
    engine_side.note_worst_case(op._ring_words, 3, 40)
    counter_page.publish(group._counter, 3, 41, [], status=abi.ERR_WORST_OVERFLOW)
    group._counter[abi.SLOT_ERR_RANK] = 0
    with pytest.raises(InvalidArgument, match="rank 0 receives 41 tokens, more than "
                                              "num_worst_tokens=40"):
        captured_calls.check(group)
    engine_side.record_failure(op._ring_words, group._counter, 40)
    captured_calls.check(group)
    # Replay #4 failed for capacity: the facade's growth is owed.
    counter_page.publish(group._counter, 4, 70, [], status=abi.ERR_CAPACITY)
    with pytest.raises(TokenCapacityExceeded) as e:
        captured_calls.check(group)
    assert e.value.earlier and group.capacity_owed == 70
    # A trigger the engine refused: raised from its op's done word, once, by Group.check(),
    # which first waits for the caller's stream and the ring (every rank then sees the same).
    monkeypatch.setattr(captured_calls.cuda_driver, "stream_idle", lambda stream: True)
    monkeypatch.setattr(cuda_ipc, "current_stream", lambda device: 0)
    op.verdicts.append(EpdError(grpc.StatusCode.ABORTED, "stream op 3 (dispatch) failed"))
    ring32 = op._ring_words
    ring32[abi.LL_RING_TAIL] = 1  # (a replay's trigger the poller has not read yet)
    threading.Timer(0.05, lambda: ring32.__setitem__(abi.LL_RING_HEAD, 1)).start()
    t0 = time.monotonic()
    with pytest.raises(EpdError, match="stream op 3"):
        group.check()
    assert time.monotonic() - t0 >= 0.04
    group.check()
    # An eager dispatch that waits for its count (sequence 5) raises its own failure; the
    # replays' check does not raise it again.
    call = group._session._call

    def engine(*a):  # (its notify fails it for capacity)
        answer = call(*a)
        counter_page.publish(group._counter, 5, 80, [], status=abi.ERR_CAPACITY)
        return answer
    group._session._call = engine
    with pytest.raises(TokenCapacityExceeded):
        _worst_dispatch(group, 0)
    group._session._call = call
    captured_calls.check(group)
    # An eager worst-case dispatch (sequence 7), which the host does not wait for, that failed:
    # raised once, before the next dispatch is sent, whether the counter slot still holds it
    # or a replay's count (#8) replaced it there and the engine's record has it.
    _worst_dispatch(group, 32)
    assert len(sent) == 2
    counter_page.publish(group._counter, 7, 60, [], status=abi.ERR_CAPACITY)
    engine_side.record_failure(op._ring_words, group._counter, 32)
    counter_page.publish(group._counter, 8, 20, [10, 10])
    with pytest.raises(TokenCapacityExceeded, match="60"):
        _worst_dispatch(group, 32)
    assert len(sent) == 2  # (not sent)
    group.settle_dispatches()
    captured_calls.check(group)


def _worst_dispatch(group, num_worst: int, timeout: float = 5.0):
    from epd.client import stream_calls

    req = epd_pb2.DispatchRequest(num_worst_tokens=num_worst, timeout_seconds=timeout)
    return stream_calls.dispatch(group, req, timeout, object(), True, 0)


def test_an_eager_call_waits_for_the_replays_ahead_of_it(monkeypatch) -> None:
    """An eager dispatch of a group holding captured calls is sent only once the caller's
    stream has run what it holds and the engine has read every trigger of the group's ring:
    the replays ahead of it are numbered first on every rank. Within its deadline: past it,
    DEADLINE_EXCEEDED and nothing is sent."""
    from epd.client import captured_calls

    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    op = _captured_op(group)
    op._ring_words[abi.LL_RING_TAIL] = 3  # three triggers the engine has not read yet
    idle: list[int] = []
    monkeypatch.setattr(captured_calls.cuda_driver, "stream_idle", lambda stream: bool(idle))
    heads: list[int] = []
    call = group._session._call
    group._session._call = lambda *a: (heads.append(int(op._ring_words[abi.LL_RING_HEAD])),
                                       call(*a))[1]

    def gpu() -> None:
        time.sleep(0.05)
        idle.append(1)  # the stream ran the replays' triggers ...
        time.sleep(0.05)
        op._ring_words[abi.LL_RING_HEAD] = 3  # ... and the engine's poller read them
    th = threading.Thread(target=gpu)
    th.start()
    t0 = time.monotonic()
    _worst_dispatch(group, 32)
    th.join()
    assert time.monotonic() - t0 >= 0.09 and heads == [3] and len(sent) == 1

    group, _, sent, _ = _fake_group(monkeypatch, [_answer(1, 1)])
    op = _captured_op(group)
    op._ring_words[abi.LL_RING_TAIL] = 1  # never read
    monkeypatch.setattr(captured_calls.cuda_driver, "stream_idle", lambda stream: True)
    with pytest.raises(DeadlineExceeded, match="replayed from a CUDA graph"):
        _worst_dispatch(group, 32, timeout=0.2)
    assert sent == []


def test_the_poller_runs_a_captured_call_only_when_it_need_not_wait() -> None:
    """One poller serves every session of an engine: a captured call whose run would wait on
    the host for a receive count (its member's latest dispatch, or the one a combine brings
    back, not yet published by notify) is not ready, and stays in its ring until it is."""
    from epd.server.engine import captured_calls as engine_side
    from epd.server.engine.state import HandleInfo

    slot = np.zeros(abi.SLOT_BYTES // 8, np.int64)
    pending = HandleInfo(None, 8, -1, 32, sequence=3)
    member = types.SimpleNamespace(counter_slot=0, pending=pending, handles={9: pending})
    session = types.SimpleNamespace(counter_page=types.SimpleNamespace(slot=lambda i: slot))
    dispatch = types.SimpleNamespace(member=member, session=session, dispatch_op=None,
                                     handle=9)
    combine = types.SimpleNamespace(member=member, session=session, dispatch_op=dispatch)
    assert not engine_side.ready(dispatch) and not engine_side.ready(combine)
    counter_page.publish(slot, 3, 20, [10, 10])
    assert engine_side.ready(dispatch) and engine_side.ready(combine)
    member.pending = None  # (resolved: the combine's handle alone)
    counter_page.publish(slot, 2, 0, [])  # (an older count: the handle's not there)
    assert engine_side.ready(dispatch) and not engine_side.ready(combine)
