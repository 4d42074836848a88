"""The client under bad answers and misuse (twenty-eighth session): an engine answer that does not
decode, an OpenFastPathResponse the client cannot use, empty() with a bad shape, calls after the
session closed, a membership whose Group cannot be built, a PendingDispatch dropped or never
read, an answered-but-unread ring call in the slot the next call needs.

The ring tests drive a FastPathTransport without an engine: the test maps the engine's side of
the ring and writes the answers itself."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time

import grpc
import numpy as np
import pytest
import ranklib

from epd.client import EpdError, Session
from epd.client import transport as TR
from epd.client.transport import FastPathTransport, GrpcTransport
from epd.proto import dtypes, spin
from epd.proto import ring as R
from epd.proto.errors import FailedPrecondition, Internal, InvalidArgument
from epd.proto.v1 import epd_pb2

BF16 = dtypes.BFLOAT16
SLOTS = 4


@contextlib.contextmanager
def ring_transport(spin_seconds: float = 20e-6):
    """(the engine's Ring, a FastPathTransport on it); both closed afterwards."""
    eng = R.Ring.create(SLOTS, R.MIN_SLOT_BYTES)
    t = None
    try:
        t = FastPathTransport(ranklib.NoGrpc(), os.dup(eng.fd), SLOTS, R.MIN_SLOT_BYTES,
                              spin_seconds)
        yield eng, t
    finally:
        if t is not None:
            t.close()
        eng.close()


def _answer(eng: R.Ring, slot: int, status: int, length: int, payload: bytes = b"") -> None:
    """What the engine does: the answer into the slot, DONE, wake the client."""
    words, p, addr = eng.slot(slot)
    p[:len(payload)] = payload
    words[R.S_STATUS] = status
    words[R.S_LENGTH] = length
    words[R.S_STATE] = R.DONE
    R.futex_wake(addr)


@contextlib.contextmanager
def answering_engine(eng: R.Ring, first: int = 1):
    """A thread that answers every request from sequence `first` on with an empty OK message,
    in sequence order (as the engine serves its ring)."""
    stop = threading.Event()

    def serve() -> None:
        seq = first
        while not stop.is_set():
            words, _, _ = eng.slot((seq - 1) % SLOTS)
            if words[R.S_STATE] == R.SUBMITTED and R.seq_of(words) == seq:
                _answer(eng, (seq - 1) % SLOTS, 0, 0)
                seq += 1
            else:
                time.sleep(1e-4)

    th = threading.Thread(target=serve, name="fake-engine", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join(5)
        assert not th.is_alive()


# -- 1. an OK answer that does not decode ---------------------------------------------------------

@pytest.mark.parametrize("length,payload", [(64, b"\xff" * 64), (0xFFFFFFFF, b"\x08\x01")],
                         ids=["not-a-message", "longer-than-the-slot"])
def test_an_answer_that_does_not_decode_is_internal_once(length: int, payload: bytes) -> None:
    """protobuf's DecodeError escaped from result() (no EpdError), and the call was never marked
    done: a second result() spun until the call's deadline. Now: INTERNAL naming the method,
    once; the slot goes back to the ring, which goes on."""
    with ring_transport() as (eng, t):
        fut = t.call_async("Dispatch", epd_pb2.DispatchRequest(), 30.0)
        _answer(eng, 0, 0, length, payload)
        with pytest.raises(Internal, match="Dispatch: the engine's answer could not be decoded"):
            fut.result()
        t0 = time.monotonic()
        with pytest.raises(Internal, match="could not be decoded"):
            fut.result()
        assert time.monotonic() - t0 < 1.0
        assert fut.done()
        words, _, _ = eng.slot(0)
        assert int(words[R.S_STATE]) == R.FREE
        with answering_engine(eng, first=2):
            for _ in range(2 * SLOTS):
                t.call("Ping", epd_pb2.PingRequest(), 5.0)
        assert t.broken is None


# -- 2. the engine's OpenFastPathResponse -----------------------------------------------------

def test_a_ring_the_client_cannot_use_is_refused() -> None:
    """slots=0 gave ZeroDivisionError at the first call: the transport refuses it (ValueError,
    which the session turns into gRPC) and closes the ring's descriptor."""
    eng = R.Ring.create(1, R.MIN_SLOT_BYTES)
    try:
        for slots, slot_bytes in ((0, R.MIN_SLOT_BYTES), (R.MAX_SLOTS + 1, R.MIN_SLOT_BYTES),
                                  (1, R.MIN_SLOT_BYTES - 1), (1, R.MAX_SLOT_BYTES + 1)):
            fd = os.dup(eng.fd)
            with pytest.raises(ValueError, match="fast-path ring of"):
                FastPathTransport(ranklib.NoGrpc(), fd, slots, slot_bytes, 0.0)
            with pytest.raises(OSError):
                os.fstat(fd)  # (closed)
    finally:
        eng.close()


def test_a_spin_never_outlasts_the_calls_deadline() -> None:
    """A huge spin_seconds from the engine made a call spin past its own deadline at 100% CPU:
    a spin ends at the call's deadline whatever its window."""
    with ring_transport() as (_, t):
        t.spin = spin.SpinWindow(10.0, 10.0)  # (a window longer than the call's deadline)
        t0 = time.monotonic()
        with pytest.raises(EpdError) as ei:
            t.call("Ping", epd_pb2.PingRequest(), 0.3)  # nobody answers
        assert time.monotonic() - t0 < 3.0
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_engines_spin_windows_are_clamped(caplog) -> None:
    """... and the engine's windows are clamped to MAX_SPIN_SECONDS (NaN: 0), with a warning."""
    with caplog.at_level(logging.WARNING, logger="epd.client"), \
            ring_transport(spin_seconds=1e9) as (_, t):
        assert t.spin.base == t.spin.longest == TR.MAX_SPIN_SECONDS
        assert "spin windows were clamped" in caplog.text
    for spins, expect in (((float("nan"), -1.0), (0.0, 0.0)),
                          ((float("inf"), 1e-3), (TR.MAX_SPIN_SECONDS, 1e-3)),
                          ((50e-6, 1e-3), (50e-6, 1e-3))):
        assert TR.fast_path_spins(*spins)[:2] == expect


class _OfferingTransport(GrpcTransport):
    """gRPC, with fields of some answers overwritten (an engine that says what it should not);
    records the methods called."""

    def __init__(self, target: str, method: str, **fields) -> None:
        super().__init__(target)
        self.method, self.fields, self.calls = method, fields, []

    def call(self, method, request, timeout):
        self.calls.append(method)
        resp = super().call(method, request, timeout)
        if method == self.method:
            for k, v in self.fields.items():
                setattr(resp, k, v)
        return resp


def test_an_unusable_fast_path_offer_falls_back_to_grpc(daemon, caplog) -> None:
    """Session level: a ring of 0 slots is refused with a logged warning and gRPC carries every
    call; a spin window of 1e9 s is clamped and the fast path used."""
    with caplog.at_level(logging.WARNING, logger="epd.client"):
        inner = _OfferingTransport(daemon.socket(0), "OpenFastPath", slots=0)
        with Session(daemon.socket(0), transport=inner, fast_path=True) as s:
            assert s.transport == "grpc"
            assert "0 slots" in s.fast_path_error
            assert "fast path refused" in caplog.text
            s.ping()
        caplog.clear()
        inner = _OfferingTransport(daemon.socket(0), "OpenFastPath", spin_seconds=1e9,
                                   reply_spin_max_seconds=1e9)
        with Session(daemon.socket(0), transport=inner, fast_path=True) as s:
            assert s.transport == "fastpath"
            assert s._transport.spin.base == TR.MAX_SPIN_SECONDS
            assert "clamped" in caplog.text
            t0 = time.monotonic()
            s.ping()
            assert time.monotonic() - t0 < 5.0


# -- 3. empty() with a bad shape ------------------------------------------------------------------

def test_empty_with_a_bad_shape_registers_nothing(daemon) -> None:
    """A negative or overflowing shape registered a region (NumPy's product wraps around), then
    NumPy raised a plain ValueError: now InvalidArgument naming the shape, nothing registered."""
    with Session(daemon.socket(0), fast_path=False) as s:
        before = s.stats().regions
        for shape, text in (((-1, 4), r"\(-1, 4\) has a negative dimension"),
                            ((2**40, 2**40), r"shape \(1099511627776, 1099511627776\).*bytes"),
                            ((2.5,), "shape must be an int or a sequence of ints")):
            with pytest.raises(InvalidArgument, match=text):
                s.empty(shape, np.float32)
            with pytest.raises(InvalidArgument, match=text):  # (the strategy itself too)
                s.memory.empty(shape, np.dtype(np.float32))
        assert s.stats().regions == before and s._user_regions == []
        a = s.empty((0, 4), np.float32)  # (empty is a shape too)
        assert a.shape == (0, 4) and s.stats().regions == before + 1


# -- 4. calls after close -------------------------------------------------------------------------

def test_a_ring_call_after_the_transport_closed() -> None:
    """done() and result() of a ring call raised IndexError once the transport had closed (the
    ring's slots gone): done() is True and result() raises FAILED_PRECONDITION, every time."""
    with ring_transport() as (_, t):
        fut = t.call_async("Ping", epd_pb2.PingRequest(), 5.0)
        t.close()
        assert fut.done()
        for _ in range(2):
            with pytest.raises(FailedPrecondition, match="the session is closed"):
                fut.result()
        with pytest.raises(FailedPrecondition, match="the session is closed"):
            t.call("Ping", epd_pb2.PingRequest(), 1.0)
        with pytest.raises(FailedPrecondition, match="the session is closed"):
            t.call_async("Ping", epd_pb2.PingRequest(), 1.0).result()


@pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "grpc"])
def test_pending_dispatch_result_after_the_session_closed(daemon, fast: bool) -> None:
    """PendingDispatch.result() after Session.close() raised FAILED_PRECONDITION once, then
    IndexError out of the closed ring: now FAILED_PRECONDITION every time."""
    s = Session(daemon.socket(0), fast_path=fast)
    try:
        assert s.transport == ("fastpath" if fast else "grpc")
        g = s.join(f"closed-{fast}", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2)
        idx = np.array([[0, 1], [2, 3]], np.int64)
        pd = g.dispatch_async(np.ones((2, 64), BF16), idx, np.ones((2, 2), np.float32))
    finally:
        s.close()
    for _ in range(2):
        with pytest.raises(FailedPrecondition, match="the session is closed"):
            pd.result()


# -- 5. a membership whose Group cannot be built --------------------------------------------------

def test_a_join_whose_group_cannot_be_built_leaves_the_group(daemon) -> None:
    """JoinGroup succeeded, then building the Group failed (here: a counter slot outside the
    session's page): the membership lived until the session closed. Now the client sends
    LeaveGroup before it raises; the engine holds no membership, and the rank can join again."""
    inner = _OfferingTransport(daemon.socket(0), "JoinGroup", counter_slot=1 << 20)
    with Session(daemon.socket(0), transport=inner, fast_path=False) as s:
        spec = dict(rank=0, num_ranks=1, num_experts=4, hidden=64, max_tokens_per_rank=8,
                    num_topk=2)
        with pytest.raises(Internal, match="counter slot 1048576"):
            s.join("unbuilt", **spec)
        assert inner.calls[-2:] == ["JoinGroup", "LeaveGroup"]
        assert list(s.stats().groups) == [] and s._groups == {}
        inner.method = ""  # (the engine's answers untouched from here)
        g = s.join("unbuilt", **spec)
        idx = np.array([[0, 1], [2, 3]], np.int64)
        assert g.dispatch(np.ones((2, 64), BF16), idx,
                          np.ones((2, 2), np.float32)).num_recv_tokens == 2


# -- 6. a PendingDispatch dropped or never read ---------------------------------------------------

def test_a_dropped_pending_dispatch_releases_the_staging(daemon) -> None:
    """A dropped (or never read) PendingDispatch held the staging for the rest of the session
    unless a dispatch_async followed: staging was never reset, and every file it outgrew stayed
    registered. Once the engine answered, the next call that stages inputs releases it."""
    s0 = Session(daemon.socket(0), fast_path=False)
    s1 = Session(daemon.socket(1), fast_path=False)
    try:
        spec = dict(num_ranks=2, num_experts=4, hidden=64, max_tokens_per_rank=8, num_topk=2)
        out: list = [None, None]

        def join(r: int, s: Session) -> None:
            out[r] = s.join("dropped-staging", rank=r, **spec)

        threads = [threading.Thread(target=join, args=(r, s)) for r, s in enumerate((s0, s1))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert all(g is not None for g in out)
        g0, m = out[0], s0.memory
        idx = np.array([[0, 1], [2, 3]], np.int64)
        x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
        # rank 1 never dispatches: the engine answers rank 0 at the call's deadline
        pd = g0.dispatch_async(x, idx, w, timeout=1.0)
        fut = s0._in_flight[1]
        del pd
        gc.collect()
        regions = s0.stats().regions
        old = m.staging.file
        s0._descs({"x": np.zeros(1 << 20, np.float32)})  # still in flight: a new file
        assert m._held == 1 and m._retired == [old]
        assert s0.stats().regions == regions + 1
        ranklib.wait_until(fut.done, 15, "the dropped dispatch answered")
        d = s0._descs({"x": np.zeros(16, np.float32)})["x"]
        assert m._held == 0 and m._retired == [] and s0._in_flight is None
        assert d.offset_bytes == 0  # (staging reset)
        assert s0.stats().regions == regions  # (the outgrown file unregistered)
        # one answered but never read: the hold goes, the dispatch stays in flight until read
        pd = g0.dispatch_async(x, idx, w, timeout=1.0)
        ranklib.wait_until(s0._in_flight[1].done, 15, "the unread dispatch answered")
        assert m._held == 1
        s0._descs({"x": np.zeros(16, np.float32)})
        assert m._held == 0 and s0._in_flight is not None
        with pytest.raises(EpdError, match="still in flight"):
            g0.dispatch_async(x, idx, w)
        with pytest.raises(EpdError):
            pd.result()  # (its peer never came)
        assert s0._in_flight is None and m._held == 0
    finally:
        s1.close()
        s0.close()


# -- 7. an answered-but-unread ring call ----------------------------------------------------------

def test_an_unread_answer_does_not_block_the_next_call_on_its_slot() -> None:
    """A ring call answered but not read (a live PendingDispatch) made the call that came round
    to its slot wait its whole deadline under the transport's lock, then fail "ring full" with
    one call in flight. Its answer now moves into the call, and the slot is used."""
    with ring_transport() as (eng, t), answering_engine(eng):
        pending = t.call_async("Ping", epd_pb2.PingRequest(), 5.0)
        for _ in range(SLOTS - 1):
            t.call("Ping", epd_pb2.PingRequest(), 5.0)
        t0 = time.monotonic()
        t.call("Ping", epd_pb2.PingRequest(), 5.0)  # (the pending call's slot)
        assert time.monotonic() - t0 < 2.0
        assert pending.done()
        assert isinstance(pending.result(), epd_pb2.PingResponse)
        for _ in range(2 * SLOTS):
            t.call("Ping", epd_pb2.PingRequest(), 5.0)


# -- 8. two threads' calls on one session ---------------------------------------------------------

def test_concurrent_calls_never_share_staged_inputs(daemon) -> None:
    """Two threads' synchronous calls on one session (cpu backend) shared the staging file: each
    call reset it, so one thread's staged inputs were overwritten by the other's before the
    engine read them. Staging is reset only while no other call may read it."""
    with Session(daemon.socket(0)) as s:
        m = s.memory
        a, b = np.full(64, 1.0, np.float32), np.full(64, 2.0, np.float32)
        with m.call_scope():  # (thread A's call, between its describe and its answer)
            da = s._descs({"x": a})["x"]
            got: list = []

            def other() -> None:
                with m.call_scope():
                    got.append(s._descs({"x": b})["x"])

            th = threading.Thread(target=other)
            th.start()
            th.join(10)
            assert len(got) == 1
            assert (m.staging.file.view(da.offset_bytes, (64,), np.dtype(np.float32)) == 1).all()
            db = got[0]
            assert db.region_id != da.region_id or db.offset_bytes >= da.offset_bytes + 256
        assert not m._scopes and s._descs({"x": b})["x"].offset_bytes == 0
        # through the calls: two threads dispatch on two groups of one session
        spec = dict(rank=0, num_ranks=1, num_experts=4, hidden=64, max_tokens_per_rank=8,
                    num_topk=2)
        groups = [s.join(f"threads-{i}", **spec) for i in range(2)]
        idx = np.array([[0, 1], [2, 3]], np.int64)
        w = np.ones((2, 2), np.float32)
        wrong: list = []

        def run(i: int) -> None:
            for n in range(150):
                x = np.full((2, 64), i * 1000 + n, np.float32).astype(BF16)
                out = groups[i].dispatch(x, idx, w)
                if not (out.recv_x.view(np.uint16) == x.view(np.uint16)[0, 0]).all():
                    wrong.append((i, n))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert not wrong, f"calls that received another thread's inputs: {wrong[:5]}"


def test_cuda_registrations_are_safe_from_several_threads(monkeypatch) -> None:
    """The CUDA IPC registrations of a session are used by every thread that calls (vLLM's
    dual-batch overlap: two): registering, reusing and dropping the least recently used from
    two threads at once keeps one consistent table (an OrderedDict changed under another
    thread's iteration raised, or lost a registration)."""
    import types
    from collections import OrderedDict

    from epd.client import cuda_ipc
    from epd.client import memory as M
    from epd.proto import cuda_driver

    monkeypatch.setattr(M, "MAX_DEVICE_REGIONS", 6)
    # Allocations of 4 KiB at 1 MiB strides; buffer id = allocation index.
    monkeypatch.setattr(cuda_driver, "allocation_info",
                        lambda ptr: (ptr & ~0xFFFFF, 4096, ptr >> 20))
    monkeypatch.setattr(cuda_ipc, "ipc_handle", lambda base, dev: b"h%d" % (base >> 20))
    mem = object.__new__(M.CudaIpcMemory)
    mem._regions, mem._by_buffer, mem._heaps, mem._heap_region = OrderedDict(), {}, {}, {}
    mem._lock = threading.Lock()
    live: set[str] = set()
    count = iter(range(10**6))

    def register(req) -> str:
        time.sleep(0.0005)  # (an RPC: other threads run meanwhile)
        rid = f"r{next(count)}"
        live.add(rid)
        return rid

    def unregister(rid: str) -> None:
        time.sleep(0.0005)
        live.discard(rid)
    mem._register, mem._unregister = register, unregister
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                alloc = int(rng.integers(1, 12))
                v = types.SimpleNamespace(ptr=(alloc << 20) + 64, device=0)
                rid, base, size = mem._region_of(v)
                assert rid in live and base == alloc << 20 and size == 4096
        except BaseException as e:  # (reported below)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert len(mem._regions) <= M.MAX_DEVICE_REGIONS
    assert set(mem._regions.values()) == live  # nothing registered twice or lost


# -- an exception inside a ring submission (a KeyboardInterrupt from a signal handler) ----------

def test_an_exception_after_a_submission_is_published_leaves_the_ring_in_step(monkeypatch) -> None:
    """A SIGINT storm wedged the ring for good (a review, thirty-fourth session): an exception
    after a request was published (SUBMITTED) but before its call was registered left an
    answered slot nothing reclaimed, and every later call waited its deadline for it ("ring
    full"). The slot is reclaimable from its publication on: the calls after go on."""
    real = TR._RingCall.__init__
    hits = []

    def interrupted_once(self, *a, **kw):
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt
        real(self, *a, **kw)

    monkeypatch.setattr(TR._RingCall, "__init__", interrupted_once)
    with ring_transport() as (eng, t), answering_engine(eng, first=1):
        with pytest.raises(KeyboardInterrupt):
            t.call("Ping", epd_pb2.PingRequest(), 5.0)
        assert t._next == 2  # (published: its sequence was taken, the engine answers it)
        t0 = time.monotonic()
        for _ in range(3 * SLOTS):  # (round the ring: its slot is needed again)
            t.call("Ping", epd_pb2.PingRequest(), 5.0)
        assert time.monotonic() - t0 < 2.0 and t.broken is None


def test_an_exception_before_a_submission_is_published_takes_no_sequence(monkeypatch) -> None:
    """An exception while the request is written (before SUBMITTED) publishes nothing: its
    sequence is not taken (the engine serves sequences in order, so one taken and never
    published would stall every call after it) and the slot stays free."""
    real = R.set_seq
    hits = []

    def interrupted_once(words, seq):
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt
        real(words, seq)

    monkeypatch.setattr(R, "set_seq", interrupted_once)
    with ring_transport() as (eng, t):
        with pytest.raises(KeyboardInterrupt):
            t.call("Ping", epd_pb2.PingRequest(), 5.0)
        assert t._next == 1 and 0 not in t._orphans
        assert int(eng.slot(0)[0][R.S_STATE]) == R.FREE
        with answering_engine(eng, first=1):
            for _ in range(2 * SLOTS):
                t.call("Ping", epd_pb2.PingRequest(), 5.0)
        assert t.broken is None


def test_a_dropped_call_never_unregisters_a_newer_call_of_its_slot() -> None:
    """A call object dropped late (its answer already reclaimed, its slot now a newer call's)
    marked the slot's entry as its own, so the newer call's answer was thrown away."""
    with ring_transport() as (eng, t), answering_engine(eng, first=1):
        old = t.call_async("Ping", epd_pb2.PingRequest(), 5.0)
        assert old.result() is not None
        old._done = False  # (as if its answer had been taken by the ring's reclaim)
        newer = [t.call_async("Ping", epd_pb2.PingRequest(), 5.0) for _ in range(SLOTS)]
        assert t._orphans[0][0] == SLOTS + 1  # (slot 0 is the newest call's)
        old.__del__()
        assert t._orphans[0][1] is not None and t._orphans[0][0] == SLOTS + 1
        for c in newer:
            c.result()


def test_an_exception_after_the_engine_already_answered_leaves_the_ring_in_step() -> None:
    """The engine can answer a request (DONE) before the submitting thread's next step: an
    exception landing there must still count the request as published (its sequence taken,
    its slot reclaimable), not as never sent (a review found the first fix's check looked for
    SUBMITTED only: the slot then stayed DONE with nothing to reclaim it). Here the engine
    answers, and the exception lands, as the submission takes its sequence."""
    with ring_transport() as (eng, t):
        state = {"armed": True, "next": t.__dict__.pop("_next")}

        class AnsweredAtOnce(type(t)):
            @property
            def _next(self) -> int:
                return state["next"]

            @_next.setter
            def _next(self, v: int) -> None:
                if state["armed"] and v == 2:
                    state["armed"] = False
                    _answer(eng, 0, 0, 0)  # (the engine was faster than this thread)
                    raise KeyboardInterrupt
                state["next"] = v

        t.__class__ = AnsweredAtOnce
        with pytest.raises(KeyboardInterrupt):
            t.call("Ping", epd_pb2.PingRequest(), 5.0)
        assert t._next == 2 and t._orphans[0][0] == 1
        with answering_engine(eng, first=2):
            t0 = time.monotonic()
            for _ in range(3 * SLOTS):
                t.call("Ping", epd_pb2.PingRequest(), 5.0)
            assert time.monotonic() - t0 < 2.0 and t.broken is None


class _MangledOutputs(GrpcTransport):
    """gRPC, with the first output descriptor of each GetDispatchLayout answer changed by
    `mangle` (a broken or hostile engine)."""

    def __init__(self, target: str, mangle) -> None:
        super().__init__(target)
        self.mangle = mangle

    def call(self, method, request, timeout):
        resp = super().call(method, request, timeout)
        if method == "GetDispatchLayout":
            self.mangle(resp.num_tokens_per_rank)
        return resp


@pytest.mark.parametrize("mangle,words", [
    (lambda d: setattr(d, "offset_bytes", (1 << 63) - 1), "past the end of its region"),
    (lambda d: setattr(d, "offset_bytes", 1 << 40), "past the end of its region"),
    (lambda d: d.shape.append(3), "do not match"),
    (lambda d: setattr(d, "dtype", 99), "unsupported dtype enum 99"),
    (lambda d: d.shape.__setitem__(0, 1 << 40), "past the end of its region"),
])
def test_a_malformed_output_descriptor_is_an_internal_error(daemon, mangle, words) -> None:
    """An answer's output descriptor outside its region, with a shape its strides do not
    match, or of an unknown dtype: EpdError INTERNAL naming it (it was NumPy's ValueError or
    OverflowError: an adversarial round's man in the middle; on the GPU a view past the
    mapping). The session goes on."""
    inner = _MangledOutputs(daemon.socket(0), mangle)
    with Session(daemon.socket(0), transport=inner, fast_path=False) as s:
        g = s.join(f"mangled-{abs(hash(words)) % 10**6}", rank=0, num_ranks=1, num_experts=4,
                   hidden=16, num_topk=2, max_tokens_per_rank=8, dtype="float32")
        idx = np.array([[0, 1], [2, 3]], dtype=np.int64)
        with pytest.raises(EpdError) as e:
            g.get_dispatch_layout(idx)
        assert e.value.code == grpc.StatusCode.INTERNAL and words in e.value.details, e.value
        inner.mangle = lambda d: None
        per_rank, per_expert, _ = g.get_dispatch_layout(idx)
        assert list(per_rank) == [2] and list(per_expert) == [1, 1, 1, 1]


# -- interrupts and dropped async dispatches (a fuzzer's round, forty-fourth session) -----------

def test_a_fence_interrupted_between_its_release_and_acquire_still_works() -> None:
    """host_order.full() releases and takes a per-thread lock; an exception between the two (a
    signal handler's KeyboardInterrupt) left it free, and every later fence of the thread, in
    every ring doorbell, raised RuntimeError after its request was published."""
    from epd.proto import host_order
    host_order.full()
    host_order._local.lock.release()  # (the state that exception left)
    host_order.full()
    host_order.full()
    assert host_order._local.lock.locked()


def _one_rank(s: Session, name: str):
    g = s.join(name, rank=0, num_ranks=1, num_experts=4, hidden=16, num_topk=2,
               max_tokens_per_rank=8, dtype="float32")
    idx = np.array([[0, 1], [2, 3]], np.int64)
    return g, np.ones((2, 16), np.float32), idx, np.ones((2, 2), np.float32)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "grpc"])
def test_a_dropped_pending_dispatch_gives_its_handle_back(daemon, fast: bool) -> None:
    """A PendingDispatch dropped without result() (the caller's code raised between
    dispatch_async and result()) left its handle in the engine for good: 50 such calls held 50,
    and --max-handles-per-session of them refused every dispatch after. Its group's next
    dispatch releases it."""
    with Session(daemon.socket(0), fast_path=fast) as s:
        g, x, idx, w = _one_rank(s, f"dropped-handle-{int(fast)}")
        for _ in range(5):
            p = g.dispatch_async(x, idx, w)
            p.counts()
            del p
        gc.collect()
        r = g.dispatch(x, idx, w)
        assert g.release_handles() == 1  # (r's alone)
        del r
        gc.collect()
        assert g.release_handles() == 0
        p = g.dispatch_async(x, idx, w)  # read: its handle is the caller's
        res = p.result()
        del p
        gc.collect()
        g.dispatch(x, idx, w)
        assert g.release_handles() == 1 and res.handle.handle_id


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "grpc"])
def test_counts_of_a_refused_dispatch_raise_its_error_at_once(daemon, fast: bool) -> None:
    """counts() of a dispatch the engine refused before it took part (x of the wrong hidden
    size) waited out its whole deadline and raised DEADLINE_EXCEEDED; result() had the reason.
    counts() raises that reason as soon as the answer is in."""
    with Session(daemon.socket(0), fast_path=fast) as s:
        g, x, idx, w = _one_rank(s, f"refused-counts-{int(fast)}")
        p = g.dispatch_async(np.ones((2, 17), np.float32), idx, w, timeout=20.0)
        t0 = time.monotonic()
        with pytest.raises(EpdError) as e:
            p.counts()
        assert time.monotonic() - t0 < 5.0
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "hidden" in e.value.details
        with pytest.raises(EpdError) as e2:
            p.result()
        assert e2.value.code == grpc.StatusCode.INVALID_ARGUMENT
        n, _ = g.dispatch_async(x, idx, w).counts()  # (a new one goes on)
        assert n == 2


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "grpc"])
def test_a_dropped_refused_dispatch_does_not_block_the_next(daemon, fast: bool) -> None:
    """A refused dispatch_async dropped unread, then another dropped unread: the second was
    kept alive by a reference cycle (the first's stored error, raised again, held the frame
    that made the second), so the next dispatch_async was refused "still in flight" until a
    garbage collection. The ring's stored error is raised as a copy, and grpc's (its future
    itself) loses its traceback."""
    with Session(daemon.socket(0), fast_path=fast) as s:
        g, x, idx, w = _one_rank(s, f"dropped-refused-{int(fast)}")
        gc.disable()
        try:
            g.dispatch_async(np.ones((2, 17), np.float32), idx, w)  # refused, dropped
            g.dispatch_async(x, idx, w)  # dropped
            p = g.dispatch_async(x, idx, w)
            assert p.result().num_recv_tokens == 2
        finally:
            gc.enable()


@pytest.mark.parametrize("seq_cleared", [True, False], ids=["seq-cleared", "seq-left"])
def test_an_answer_taken_by_an_interrupted_read_counts_as_done(seq_cleared: bool) -> None:
    """An exception inside the read of an answer, after the slot was freed but before the call
    kept the answer (and before or after the slot's sequence was cleared), left done() False
    for good: an interrupted dispatch's hold on the staged inputs was never let go, and
    staging grew for the rest of the session; a second result() waited out its deadline."""
    with ring_transport() as (eng, t), answering_engine(eng, first=1):
        call = t.call_async("Ping", epd_pb2.PingRequest(), 5.0)
        ranklib.wait_until(call.done, 5, "answered")
        words, _, _ = t.ring.slot(call.slot)
        words[R.S_STATE] = R.FREE  # (what the cut-short read left: freed, not kept)
        if seq_cleared:
            R.set_seq(words, 0)
        assert call.done()
        t0 = time.monotonic()
        with pytest.raises(EpdError) as e:
            call.result()
        assert e.value.code == grpc.StatusCode.INTERNAL and "interrupted" in e.value.details
        assert time.monotonic() - t0 < 1.0 and t.broken is None
        t.call("Ping", epd_pb2.PingRequest(), 5.0)


def test_a_call_scope_whose_exit_was_cut_short_ends_with_its_object(daemon) -> None:
    """An exception as a call scope's __exit__ began (before it could count the call out) left
    the session's count of calls inside one too high for good: staging was never reset and every
    call grew it (256 MiB after 300 calls). A scope counts while its object lives."""
    with Session(daemon.socket(0)) as s:
        m = s.memory
        scope = m.call_scope()
        scope.__enter__()  # (and no __exit__: the exception's state)
        other: list = []
        th = threading.Thread(target=lambda: other.append(m._others()))
        th.start()
        th.join(5)
        assert other == [1]
        del scope
        gc.collect()
        assert not m._scopes
        s._descs({"x": np.zeros(1 << 20, np.float32)})
        assert s._descs({"x": np.zeros(16, np.float32)})["x"].offset_bytes == 0


def test_a_call_inside_another_on_one_thread_leaves_the_outers_inputs(daemon) -> None:
    """A call made inside another on the same thread (a signal handler's, during the outer
    call's wait) must not reset the staging the outer call's inputs are in: the first form of
    the scope objects counted none of the thread's own scopes, and the inner call overwrote
    the outer's staged x."""
    with Session(daemon.socket(0)) as s:
        m = s.memory
        with m.call_scope():
            outer = s._descs({"x": np.full(64, 1.0, np.float32)})["x"]
            with m.call_scope():
                inner = s._descs({"x": np.full(64, 2.0, np.float32)})["x"]
            assert (inner.region_id, inner.offset_bytes) != (outer.region_id, outer.offset_bytes)
            assert (m.staging.file.view(outer.offset_bytes, (64,), np.dtype(np.float32))
                    == 1).all()
        assert s._descs({"x": np.zeros(16, np.float32)})["x"].offset_bytes == 0


def test_a_dispatch_async_only_loop_gives_dropped_handles_back(daemon_factory) -> None:
    """Code that only calls dispatch_async (dropping some unread) never sent the releases its
    group queued: only dispatch, low_latency_dispatch or release_handles() carried them, and
    the session ran into --max-handles-per-session. dispatch_async carries them too."""
    with daemon_factory(engines=1, extra=["--max-handles-per-session", "4"]) as d, \
            Session(d.socket(0)) as s:
        g, x, idx, w = _one_rank(s, "async-only-releases")
        for _ in range(12):
            g.dispatch_async(x, idx, w).counts()  # dropped unread
            gc.collect()
            r = g.dispatch_async(x, idx, w).result()
            del r
            gc.collect()
        assert g.release_handles() == 0


def test_an_interrupted_settle_keeps_the_calls_it_had_not_settled(daemon) -> None:
    """An exception inside the settling of dropped dispatches lost the ones it had taken off
    the group's list: their handles stayed in the engine for good. A call leaves the list
    once settled (one whose settling was cut short stays for the next pass)."""
    with Session(daemon.socket(0)) as s:
        g, x, idx, w = _one_rank(s, "interrupted-settle")
        g.dispatch_async(x, idx, w).counts()
        gc.collect()
        assert len(g._dropped) == 1
        first = g._dropped[0]
        real = first.result
        calls: list = []

        def interrupted(*a, **kw):
            if not calls:
                calls.append(1)
                raise KeyboardInterrupt
            return real(*a, **kw)

        first.result = interrupted
        with pytest.raises(KeyboardInterrupt):
            g._settle_unanswered(wait=True)
        assert first in g._dropped
        g.dispatch(x, idx, w)
        gc.collect()
        assert not g._dropped and g.release_handles() == 0


def test_a_grpc_wait_ends_at_its_deadline_even_if_grpc_never_answers() -> None:
    """A wait on a gRPC future had no deadline of its own: with grpc's channel lock left held
    by an exception inside grpc's code (a signal handler's KeyboardInterrupt), no deadline event
    was ever delivered and the next call hung for good. The wait ends at the call's deadline
    plus a margin, DEADLINE_EXCEEDED, and the future is cancelled."""

    class Stuck:
        cancelled = False

        def result(self, timeout=None):
            time.sleep(timeout)
            raise grpc.FutureTimeoutError()

        def cancel(self):
            Stuck.cancelled = True
            return True

        def done(self):
            return False

    fut = TR._Future(Stuck(), "Dispatch", 0.05)
    fut._deadline = time.monotonic() + 0.1  # (the call's deadline and a shortened margin)
    t0 = time.monotonic()
    with pytest.raises(EpdError) as e:
        fut.result()
    assert time.monotonic() - t0 < 2.0 and Stuck.cancelled
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "Dispatch" in e.value.details
    assert fut.done()
    with pytest.raises(EpdError) as again:  # (not grpc's FutureCancelledError)
        fut.result()
    assert again.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_grpc_call_that_ends_as_its_wait_runs_out_keeps_its_outcome() -> None:
    """The wait's limit ran out as the call ended: cancel() came too late, and the answer (a
    dispatch's, naming a handle) stands instead of a DEADLINE_EXCEEDED that lost it."""
    answer = epd_pb2.PingResponse()

    class JustInTime:
        def __init__(self):
            self.ended = False

        def result(self, timeout=None):
            if not self.ended:
                self.ended = True
                raise grpc.FutureTimeoutError()
            return answer

        def cancel(self):
            return False  # (already done)

        def done(self):
            return self.ended

    fut = TR._Future(JustInTime(), "Ping", 0.0)
    fut._deadline = time.monotonic()
    assert fut.result() is answer
