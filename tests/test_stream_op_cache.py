"""The Buffer's cache of armed low-latency calls (client/stream_op_cache.py): LRU bound, pinned
ops never evicted, combines evicted with their dispatch, eviction only after the op's last
trigger passed, slot exhaustion, and GPU failures raised once. Fakes stand in for the daemon's
ops and CUDA events; the GPU test (tests/gpu/test_ll_plain.py) runs the real thing."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from epd.client.stream_op_cache import StreamOpCache
from epd.client.stream_ops import done_error
from epd.proto import abi
from epd.proto.errors import EpdError, ResourceExhausted


class FakeOp:
    next_id = 1

    def __init__(self, kind: str = "dispatch", log: list | None = None) -> None:
        self.op_id, FakeOp.next_id = FakeOp.next_id, FakeOp.next_id + 1
        self.kind, self.armed, self.done, self.log = kind, True, abi.DONE_OK, log
        self.words = np.zeros(8, np.int32)  # the op's counter slot (int32 words)

    def status(self) -> int:
        return self.done

    def error(self, status: int | None = None) -> EpdError | None:
        return done_error(self.status() if status is None else status, f"op {self.op_id}",
                          self.words, 16, combine=self.kind == "combine")

    def take_verdict(self) -> EpdError | None:  # (as StreamOp's)
        value = int(self.words[abi.STREAM_FAIL_DONE])
        self.words[abi.STREAM_FAIL_DONE] = 0
        return self.error(value) if value else None

    def fail_alike(self, code: int, source: int, token: int, value: int, seq: int = 1) -> None:
        """What the engine's done kernel writes for a dispatch a source's bad ids failed, or a
        combine whose own top-k had a bad entry (the slot's words are int32: the done word as
        the host reads it)."""
        self.words[abi.STREAM_FAIL_TOKEN] = token
        self.words.view(np.int64)[abi.STREAM_FAIL_VALUE] = value
        self.done = (abi.DONE_FAILED | code << abi.DONE_CODE_SHIFT
                     | (source + 1) << abi.DONE_RANK_SHIFT | (seq & 0x7F) << abi.DONE_SEQ_SHIFT)
        assert 0 < self.done < 2**31  # a stream's wait for done >= 1 is a cyclic comparison
        self.words[abi.STREAM_FAIL_DONE] = self.done

    def disarm(self) -> None:
        self.armed = False
        if self.log is not None:
            self.log.append(("disarm", self.op_id))


class FakeEvent:
    def __init__(self, device: int) -> None:
        self.complete, self.waited, self.recorded = True, 0, 0

    def record(self, stream: int) -> None:
        self.recorded += 1

    def done(self) -> bool:
        return self.complete

    def wait(self) -> bool:
        self.waited += 1
        self.complete = True
        return True


def _cache(limit: int = 2) -> StreamOpCache:
    return StreamOpCache(0, limit, new_event=FakeEvent)


def test_lru_evicts_the_least_recently_used_plain_op_after_its_trigger() -> None:
    log: list = []
    c = _cache(2)
    a = c.arm(("a",), lambda: FakeOp(log=log), pin=False, capturing=False)
    b = c.arm(("b",), lambda: FakeOp(log=log), pin=False, capturing=False)
    c.triggered(a, 1)
    a.event.complete = False  # a's last trigger is still in flight
    assert c.get(("b",), pin=False) is b  # b is now the most recently used... then a again
    assert c.get(("a",), pin=False) is a
    c.arm(("c",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert log == [("disarm", b.op.op_id)] and c.get(("b",), pin=False) is None
    c.arm(("d",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert log[-1] == ("disarm", a.op.op_id)
    assert a.event.waited == 1  # evicted only once its trigger had passed
    assert len(c) == 2


def test_pinned_ops_and_their_dispatch_are_never_evicted() -> None:
    log: list = []
    c = _cache(1)
    d = c.arm(("d",), lambda: FakeOp(log=log), pin=False, capturing=False)
    comb = c.arm(("c",), lambda: FakeOp("combine", log), pin=True, capturing=False, source=d)
    assert d.pinned and comb.pinned  # a graph's combine pins the dispatch it reads
    e = c.arm(("e",), lambda: FakeOp(log=log), pin=False, capturing=False)
    c.arm(("f",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert log == [("disarm", e.op.op_id)]
    assert c.get(("d",), pin=False) is d and c.get(("c",), pin=False) is comb


def test_a_dispatch_goes_with_its_combines() -> None:
    log: list = []
    c = _cache(3)
    d = c.arm(("d",), lambda: FakeOp(log=log), pin=False, capturing=False)
    comb = c.arm(("c",), lambda: FakeOp("combine", log), pin=False, capturing=False, source=d)
    c.arm(("x",), lambda: FakeOp(log=log), pin=False, capturing=False)
    c.arm(("y",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert log == [("disarm", comb.op.op_id), ("disarm", d.op.op_id)]  # combine first
    assert c.entry_of(d.op) is None and not d.op.armed


def test_out_of_slots_evicts_then_falls_back_or_raises() -> None:
    log: list = []
    c = _cache(8)
    c.arm(("a",), lambda: FakeOp(log=log), pin=False, capturing=False)
    calls = {"n": 0}

    def full_once() -> FakeOp:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ResourceExhausted("no free counter slot")
        return FakeOp(log=log)

    assert c.arm(("b",), full_once, pin=False, capturing=False) is not None
    assert len(log) == 1 and calls["n"] == 2  # evicted a, then armed

    def full() -> FakeOp:
        raise ResourceExhausted("no free counter slot")

    c2 = _cache(8)
    assert c2.arm(("p",), full, pin=False, capturing=False) is None  # plain: synchronous path
    with pytest.raises(EpdError) as ei:
        c2.arm(("g",), full, pin=True, capturing=True)
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # While a graph is captured nothing is evicted (no host wait is capturable).
    c3 = _cache(1)
    c3.arm(("a",), lambda: FakeOp(log=log), pin=False, capturing=False)
    n = len(log)
    c3.arm(("b",), lambda: FakeOp(log=log), pin=True, capturing=True)
    assert len(log) == n and len(c3) == 2


def test_gpu_failures_raise_once_after_the_trigger_completed() -> None:
    c = _cache(4)
    e = c.arm(("a",), lambda: FakeOp(), pin=False, capturing=False)
    c.triggered(e, 7)
    e.event.complete = False
    e.op.done = abi.DONE_FAILED | (4 << 8)  # not trusted until the trigger's event completed
    c.check()
    e.event.complete = True
    with pytest.raises(EpdError) as ei:
        c.check()
    assert ei.value.code == grpc.StatusCode.ABORTED and "expert id" in ei.value.details
    c.check()  # raised once
    c.triggered(e, 7)
    e.op.done = abi.DONE_OK
    c.check()
    c.triggered(e, 7)
    e.event.complete = False
    e.op.done = abi.DONE_RELEASED
    with pytest.raises(EpdError) as ei:
        c.check(wait=True)  # Buffer.check(): waits for the trigger
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_disarmed_op_is_forgotten() -> None:
    c = _cache(4)
    e = c.arm(("a",), lambda: FakeOp(), pin=False, capturing=False)
    c.triggered(e, 1)
    e.op.armed = False  # its group was left: its slot may serve another op now
    e.op.done = abi.DONE_FAILED | (2 << 8)
    c.check()  # not read
    assert c.get(("a",), pin=False) is None and len(c) == 0


class FakeTensor:
    def __init__(self, ptr: int, shape: tuple[int, ...]) -> None:
        self.ptr, self.shape = ptr, shape

    def data_ptr(self) -> int:
        return self.ptr


def test_buffer_keys_are_computed_once_per_live_array(monkeypatch) -> None:
    from epd.client import cuda_ipc

    calls: list[int] = []

    def fake_key(x, device: int) -> tuple:
        calls.append(x.ptr)
        return (x.ptr, 1000 + len(calls), tuple(x.shape), (1,), 0)

    monkeypatch.setattr(cuda_ipc, "buffer_key", fake_key)
    keys = cuda_ipc.BufferKeys(0)
    a = FakeTensor(0x1000, (4, 8))
    k1 = keys(a)
    assert keys(a) == k1 and calls == [0x1000]  # cached
    a.ptr = 0x2000  # re-pointed (torch set_): recomputed
    assert keys(a)[0] == 0x2000 and len(calls) == 2
    a.shape = (2, 8)
    keys(a)
    assert len(calls) == 3
    assert keys(None) == ()
    b = FakeTensor(0x2000, (2, 8))  # another object at the same address: its own key
    assert keys(b)[1] != keys(a)[1]


def test_an_op_whose_trigger_never_passes_is_not_evicted() -> None:
    """Evicting an op waits for its last trigger's event (disarmed under a pending trigger, the
    stream would wait for a done word no one writes); a wait that runs out raises
    DEADLINE_EXCEEDED and leaves the op armed, instead of blocking forever."""
    log: list = []
    c = _cache(1)
    a = c.arm(("a",), lambda: FakeOp(log=log), pin=False, capturing=False)
    c.triggered(a, 1)
    a.event.complete = False
    a.event.wait = lambda: False  # (StreamEvent.wait's deadline ran out)
    with pytest.raises(EpdError) as ei:
        c.arm(("b",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
    assert log == [] and a.op.armed and c.get(("a",), pin=False) is a


def test_a_stream_events_host_wait_has_a_deadline() -> None:
    import time
    import types

    from epd.client import cuda_ipc

    e = cuda_ipc.StreamEvent.__new__(cuda_ipc.StreamEvent)
    e._event = types.SimpleNamespace(done=False)  # a stream that never gets there
    t0 = time.monotonic()
    assert e.wait(0.05) is False and time.monotonic() - t0 < 1.0
    e._event.done = True
    assert e.wait(0.05) is True


def test_a_hook_op_is_held_until_its_hook_ran_then_kept_lru() -> None:
    """A call with a receive hook holds its op until the hook ran (its receive half), then the
    op is evicted like a plain one, after an event recorded behind that half. (Pinned for good
    before: a server in eager mode, whose every new batch size is a new call with a hook, ran
    out of counter slots after ~60 steps.) A dispatch whose combine holds is kept."""
    log: list = []
    c = _cache(2)
    h = c.arm(("h",), lambda: FakeOp(log=log), pin=False, capturing=False, hold=True)
    assert h.holds == 1 and not h.pinned
    a = c.arm(("a",), lambda: FakeOp(log=log), pin=False, capturing=False)
    c.arm(("b",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert log == [("disarm", a.op.op_id)]  # h, held, was passed over
    c.release(h, 7)
    assert h.holds == 0 and h.event.recorded == 1
    c.arm(("c",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert log[-1] == ("disarm", h.op.op_id) and h.event.waited == 1
    # a dispatch held by its combine's pending hook stays; once released, both may go
    d = c.arm(("d",), lambda: FakeOp(log=log), pin=False, capturing=False)
    comb = c.arm(("dc",), lambda: FakeOp("combine", log), pin=False, capturing=False,
                 source=d, hold=True)
    n = len(log)
    c.arm(("e",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert d.op.armed and comb.op.armed and len(log) == n and len(c) == 3  # (over the
    # limit for a while: nothing could go)
    assert c.get(("dc",), pin=False, hold=True) is comb and comb.holds == 2
    c.release(comb, 7)
    c.release(comb, 7)
    c.arm(("f",), lambda: FakeOp(log=log), pin=False, capturing=False)
    assert not d.op.armed and not comb.op.armed  # (evicted together)
    assert comb.event.waited == 1 and len(c) == 2

    def full() -> FakeOp:
        raise ResourceExhausted("no free counter slot")

    # out of slots with nothing evictable: a hook call takes the synchronous path
    assert _cache(8).arm(("x",), full, pin=False, capturing=False, hold=True) is None


def test_check_all_reads_every_armed_ops_done_word() -> None:
    """After a synchronise, Buffer.check() also raises a failure in the done word of a hook or
    graph op (no event follows their triggers; epd bench's low-latency rows passed on the last
    good output of a trigger that failed), once per failure."""
    c = _cache(4)
    graph = c.arm(("g",), lambda: FakeOp(), pin=True, capturing=True)
    hook = c.arm(("h",), lambda: FakeOp(), pin=False, capturing=False, hold=True)
    c.check_all()  # all fine
    hook.op.done = abi.DONE_FAILED | (4 << 8)
    with pytest.raises(EpdError) as ei:
        c.check_all()
    assert "expert id" in ei.value.details
    c.check_all()  # raised once
    graph.op.done = abi.DONE_RELEASED
    with pytest.raises(EpdError) as ei:
        c.check_all()
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    graph.op.done = 0  # a trigger in flight: nothing to say
    c.check_all()


def _buffer_check(c: StreamOpCache) -> None:
    """What Buffer.check() runs (client/buffer_low_latency.py)."""
    c.take_verdicts()
    c.check(wait=True)
    c.check_all()


def test_a_dispatch_verdict_raises_at_check_only(caplog) -> None:
    """A dispatch that a source's bad ids failed on every rank (its verdict in the done word,
    and sticky in the op's slot) raises at Buffer.check() only, once: never at a plain call,
    whose check sees only what has completed (a rank whose GPU ran ahead would raise a call
    before its peers, and the ranks would part); a plain call logs it once instead."""
    import logging

    c = _cache(16)
    d = c.arm(("d",), lambda: FakeOp(), pin=False, capturing=False)
    c.triggered(d, 7)
    d.op.fail_alike(abi.ERR_BAD_INPUT, 1, 5, 300)
    with caplog.at_level(logging.WARNING, logger="epd.client"):
        c.check()  # a later plain call: logged, not raised
        c.check()
    assert len(caplog.records) == 1 and "expert id 300" in caplog.records[0].getMessage()
    with pytest.raises(EpdError) as ei:
        _buffer_check(c)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 1 passed expert id 300 in topk_idx[5]" in ei.value.details
    assert "[0, 16)" in ei.value.details and "group goes on" in ei.value.details
    _buffer_check(c)  # once
    # A later trigger of the op succeeds before anyone checked: the sticky word still says
    # what failed. The same failure again, 128 dispatches later (the same done value): raised.
    for seq in (9, 9 + 128):
        c.triggered(d, 7)
        d.op.fail_alike(abi.ERR_BAD_DUPLICATE, 0, 2, 7, seq=seq)
        d.op.done = abi.DONE_OK
        with pytest.raises(EpdError, match="rank 0's topk_idx\\[2\\] names expert 7 twice"):
            _buffer_check(c)
        _buffer_check(c)
    # A graph's op: the same, after the synchronise; the same bad input replayed: again.
    h = c.arm(("h",), lambda: FakeOp(), pin=True, capturing=True)
    for _ in range(2):
        h.op.fail_alike(abi.ERR_BAD_INPUT, 1, 0, -5, seq=200)
        with pytest.raises(EpdError, match="expert id -5"):
            _buffer_check(c)
        _buffer_check(c)


def test_verdicts_of_one_window_raise_once_before_a_ranks_own_failure() -> None:
    """Every rank raises exactly when some dispatch failed since its last check, however its
    tensors map to ops: two failed dispatches on two ops (another rank may have had them on
    one) raise once; a verdict goes before a failure of this rank's own (a deadline), which
    the next check raises."""
    c = _cache(16)
    d1 = c.arm(("d1",), lambda: FakeOp(), pin=False, capturing=False)
    d2 = c.arm(("d2",), lambda: FakeOp(), pin=False, capturing=False)
    x = c.arm(("x",), lambda: FakeOp("combine"), pin=False, capturing=False)
    for e in (d1, d2, x):
        c.triggered(e, 7)
    d1.op.fail_alike(abi.ERR_BAD_INPUT, 0, 0, 99)
    d2.op.fail_alike(abi.ERR_BAD_INPUT, 0, 1, 98)
    x.op.done = abi.DONE_FAILED | abi.ERR_DEADLINE << abi.DONE_CODE_SHIFT
    with pytest.raises(EpdError, match="expert id 99"):
        _buffer_check(c)
    with pytest.raises(EpdError, match="deadline"):
        _buffer_check(c)
    _buffer_check(c)


def test_a_combines_verdict_is_its_ranks_own_and_comes_after_a_dispatchs() -> None:
    """A combine whose own top-k named an expert its dispatch did not send the token to (or one
    twice): its rank's Buffer.check() raises it, once, naming the entry; with a dispatch's
    verdict in the same window (every rank has that one), the dispatch's goes first and the
    combine's is kept for the next check (an evicted op's: the test below)."""
    c = _cache(16)
    x = c.arm(("x",), lambda: FakeOp("combine"), pin=False, capturing=False)
    c.triggered(x, 7)
    x.op.fail_alike(abi.ERR_NOT_DISPATCHED, 1, 4, 9)
    c.check()  # a plain call: not raised
    with pytest.raises(EpdError) as ei:
        _buffer_check(c)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ("rank 1's topk_idx[4] names expert 9, its dispatch did not send that token to it"
            in ei.value.details), ei.value.details
    assert "the other ranks' combines are exact" in ei.value.details
    _buffer_check(c)
    d = c.arm(("d",), lambda: FakeOp(), pin=False, capturing=False)
    c.triggered(d, 7)
    c.triggered(x, 7)
    x.op.fail_alike(abi.ERR_BAD_DUPLICATE, 1, 2, 3, seq=2)
    d.op.fail_alike(abi.ERR_BAD_INPUT, 0, 0, 99)
    with pytest.raises(EpdError, match="expert id 99"):
        _buffer_check(c)
    with pytest.raises(EpdError, match="names expert 3, named twice"):
        _buffer_check(c)
    _buffer_check(c)


def test_the_native_ops_check_raises_a_verdict_once() -> None:
    """StreamOp.check() (the native API, after a synchronise): a dispatch's verdict once, even
    when its done word still holds it, and one recorded before a later successful trigger."""
    from types import SimpleNamespace

    from epd.client.stream_ops import StreamOp

    op = StreamOp.__new__(StreamOp)
    op.op_id, op.kind = 4, "dispatch"
    op.group = SimpleNamespace(spec=SimpleNamespace(num_experts=16))
    fake = FakeOp()
    op._words = fake.words
    fake.fail_alike(abi.ERR_BAD_INPUT, 1, 3, 44)
    op._words[abi.STREAM_DONE] = fake.done
    with pytest.raises(EpdError, match="expert id 44 in topk_idx\\[3\\]"):
        op.check()
    op.check()  # the done word still holds it: not again
    fake.fail_alike(abi.ERR_BAD_INPUT, 1, 3, 45, seq=2)
    op._words[abi.STREAM_DONE] = abi.DONE_OK  # a later trigger succeeded
    with pytest.raises(EpdError, match="expert id 45"):
        op.check()
    op.check()
    op._words[abi.STREAM_DONE] = abi.DONE_FAILED | abi.ERR_ABORTED << abi.DONE_CODE_SHIFT
    with pytest.raises(EpdError, match="aborted"):
        op.check()


@pytest.mark.parametrize(("kind", "code", "words"), [
    ("dispatch", abi.ERR_BAD_INPUT, "expert id 77 in topk_idx\\[2\\]"),
    ("combine", abi.ERR_NOT_DISPATCHED, "topk_idx\\[2\\] names expert 77")])
def test_an_evicted_ops_verdict_is_still_raised_at_check(kind: str, code: int,
                                                         words: str) -> None:
    """A plain dispatch (or combine) evicted (LRU) before Buffer.check() ran: its sticky
    verdict, final once its last trigger has passed, is kept and raised by the next check."""
    log: list = []
    c = _cache(1)
    d = c.arm(("d",), lambda: FakeOp(kind, log), pin=False, capturing=False)
    c.triggered(d, 7)
    d.op.fail_alike(code, 1, 2, 77)
    c.arm(("e",), lambda: FakeOp(log=log), pin=False, capturing=False)  # evicts d
    assert log == [("disarm", d.op.op_id)]
    with pytest.raises(EpdError, match=words):
        _buffer_check(c)
    _buffer_check(c)


def test_a_receive_buffers_header_verdict_decodes() -> None:
    """The header words the dispatch's last block writes (left-out set, code | source << 8 |
    token << 32, the id as two's complement), as the engine's synchronous dispatch and the GPU
    tests read them."""
    from epd.proto import counter_page

    header = np.array([3, abi.ERR_BAD_DUPLICATE | 5 << 8 | 77 << 32, 0, 9], np.uint64)
    header[2] = np.int64(-3).astype(np.uint64)
    assert counter_page.ll_header_verdict(header) == (abi.ERR_BAD_DUPLICATE, 5, 77, -3)
    assert counter_page.ll_header_verdict(np.zeros(3, np.uint64)) == (0, 0, 0, 0)
    # No verdict: the other words are not read (a combine's value word is never cleared; the
    # GPU tests poison the whole buffer).
    poisoned = np.full(3, 0xABABABABABABABAB, np.uint64)
    poisoned[1] = 0xAB << 8
    assert counter_page.ll_header_verdict(poisoned) == (0, 0, 0, 0)
    # A combine's verdict words (from LL_COMBINE_VERDICT on) decode alike.
    words = np.zeros(abi.LL_TOPK_HEADER // 8, np.uint64)
    words[abi.LL_COMBINE_VERDICT + 1] = abi.ERR_NOT_DISPATCHED | 1 << 8 | 4 << 32
    words[abi.LL_COMBINE_VERDICT + 2] = 9
    assert counter_page.ll_header_verdict(words[abi.LL_COMBINE_VERDICT:]) == (
        abi.ERR_NOT_DISPATCHED, 1, 4, 9)


def test_a_disagreement_verdict_raises_failed_precondition_at_check() -> None:
    """Ranks that passed different num_max or use_fp8 to a low-latency dispatch fail it alike
    (ERR_DISAGREE, decoded from the header the dispatch's last block writes: source, its
    num_max; its fp8 | the lowest rank's fp8 << 1 | the lowest rank << 8 | its num_max << 32):
    FAILED_PRECONDITION at Buffer.check(), as the CPU backend refuses such a collective."""
    from epd.proto import counter_page

    header = np.array([3, abi.ERR_DISAGREE | 1 << 8 | 4 << 32, 0 | 1 << 1 | 0 << 8 | 8 << 32,
                       9], np.uint64)
    code, source, token, value = counter_page.ll_header_verdict(header)
    err = counter_page.ll_verdict_error("dispatch #3", code, source, token, value, 16)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ("rank 1 num_max_dispatch_tokens_per_rank=4, use_fp8=False; rank 0 8, use_fp8=True"
            in err.message), err.message
    c = _cache(16)
    d = c.arm(("d",), lambda: FakeOp(), pin=False, capturing=False)
    c.triggered(d, 7)
    d.op.fail_alike(abi.ERR_DISAGREE, 1, 4, 1 << 1 | 8 << 32)
    c.check()  # a plain call: not raised
    with pytest.raises(EpdError) as ei:
        _buffer_check(c)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
