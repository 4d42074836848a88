"""The client's Session: a refused open, calls after close, client-side argument errors, and
the memory strategy chosen at open (issue 9, client side)."""

from __future__ import annotations

import contextlib
import os
import threading

import grpc
import numpy as np
import pytest
from daemon_harness import memfd_names

from epd.client import Buffer, EpdError, Session
from epd.proto import dtypes
from epd.proto.errors import InvalidArgument

pytestmark = pytest.mark.slow

BF16 = dtypes.BFLOAT16


@contextlib.contextmanager
def no_thread_errors():
    """Collect exceptions raised in any thread (the session's watcher included); fail on one,
    and on an `epd-session` thread left running afterwards."""
    errors: list = []
    old = threading.excepthook
    threading.excepthook = errors.append
    before = set(threading.enumerate())
    try:
        yield
    finally:
        threading.excepthook = old
    assert not errors, [f"{e.thread.name}: {e.exc_type.__name__}: {e.exc_value}"
                        for e in errors]
    left = [t.name for t in set(threading.enumerate()) - before
            if t.is_alive() and t.name == "epd-session"]
    assert not left, f"threads left behind by a failed open: {left}"


def test_open_refused_by_the_engine(daemon_factory) -> None:
    """Regression (defect 5): the watcher thread crashed with AttributeError and the error said
    UNAVAILABLE whatever the engine answered. Now: the daemon's status and message, and
    nothing left behind (thread, shared memory)."""
    with (daemon_factory(engines=1, extra=["--max-sessions", "1"]) as d, no_thread_errors(),
          Session(d.socket(0), timeout=5) as first):
        held = memfd_names(os.getpid())
        with pytest.raises(EpdError) as err:
            Session(d.socket(0), timeout=5)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "--max-sessions" in err.value.message
        assert d.socket(0) in err.value.message
        assert memfd_names(os.getpid()) == held
        first.ping()  # the open session is untouched


def test_open_with_nothing_listening(tmp_path) -> None:
    with no_thread_errors(), pytest.raises(EpdError) as err:
        Session(str(tmp_path / "gpu0.sock"), timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
    assert "could not open a session" in err.value.message


def test_calls_after_close_raise_failed_precondition(daemon) -> None:
    """Regression (defect 5): calls after close() raised `ValueError: mmap closed`."""
    with no_thread_errors():
        s = Session(daemon.socket(0), timeout=5)
        g = s.join("after-close", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2, dtype="bfloat16")
        idx = np.array([[0, 1], [2, 3], [1, -1]], np.int64)
        x, w = np.ones((3, 64), BF16), np.ones((3, 2), np.float32)
        g.get_dispatch_layout(idx)
        out = g.dispatch(x, idx, w)
        pending_group = g
        s.close()
        s.close()  # idempotent
        calls = {
            "layout": lambda: g.get_dispatch_layout(idx),
            "dispatch": lambda: g.dispatch(x, idx, w),
            "cached dispatch": lambda: g.dispatch(x, handle=out.handle),
            "dispatch_async": lambda: pending_group.dispatch_async(x, idx, w),
            "combine": lambda: g.combine(out.recv_x, out.handle),
            "low-latency dispatch": lambda: g.low_latency_dispatch(x, idx, 4),
            "empty": lambda: s.empty((4, 4), np.float32),
            "join": lambda: s.join("again", rank=0, num_ranks=1, num_experts=4, hidden=64,
                                   max_tokens_per_rank=8, num_topk=2),
            "ping": s.ping,
            "stats": s.stats,
        }
        for what, call in calls.items():
            with pytest.raises(EpdError) as err:
                call()
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, (what, err.value)
            assert err.value.message == "the session is closed", (what, err.value)
        assert not s.alive


def test_client_argument_errors_are_invalid_argument(daemon) -> None:
    """Bad arguments found by the client raise EpdError(INVALID_ARGUMENT), as the daemon's do;
    TypeError only for an object that is no array at all (Python's convention)."""
    with pytest.raises(InvalidArgument, match="rank= and num_ranks="):
        Buffer(None)
    with Session(daemon.socket(0), timeout=5) as s:
        with pytest.raises(EpdError) as err:
            s.join("bad-dtype", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2, dtype="float64")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(InvalidArgument, match="unsupported element type"):
            s.empty(4, np.complex64)
        g = s.join("args", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2, dtype="bfloat16")
        idx = np.array([[0, 1], [2, 3]], np.int64)
        x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
        with pytest.raises(InvalidArgument, match=r"topk_weights: unsupported element type"):
            g.dispatch(x, idx, w.astype(np.float64))
        with pytest.raises(TypeError, match="expected a NumPy array or torch tensor"):
            g.dispatch(x.tolist(), idx, w)
        buf = Buffer(None, rank=0, num_ranks=1, session=s, group_name="args-buf",
                     max_tokens_per_rank=8)
        _, _, n_exp, _, _ = buf.get_dispatch_layout(idx, 4)
        _, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                             num_tokens_per_expert=n_exp)
        for kwargs, text in (({"handle": handle, "topk_idx": idx}, "cached dispatch"),
                             ({"topk_idx": idx}, "needs both topk_idx and topk_weights")):
            with pytest.raises(InvalidArgument, match=text):
                buf.dispatch(x, **kwargs)
        with pytest.raises(InvalidArgument, match="at most two"):
            buf.combine(x, handle, bias=(x, x, x))
        g.dispatch(x, idx, w)  # nothing was left half done
        buf.destroy()


def test_memory_strategy_is_chosen_at_open(daemon) -> None:
    """The cpu backend's sessions use shared-memory staging and file-mapped outputs."""
    from epd.client.memory import ShmMemory

    with Session(daemon.socket(0), timeout=5) as s:
        assert isinstance(s.memory, ShmMemory) and s.backend == "cpu"
        assert not s.memory.supports_stream_ops
        a = s.empty((3, 4), np.float32)
        assert isinstance(a, np.ndarray) and s._user_regions
        with pytest.raises(EpdError, match="need the cuda backend"):
            s.memory.counter_page_device_ptr()


def test_buffer_destroy_closes_its_session_when_a_leave_fails(daemon, monkeypatch) -> None:
    """A Buffer whose engine went away cannot leave its groups: destroy() still closes the
    session it opened (its channel, ring and mappings), then raises the leave's error."""
    from epd.client.group import Group

    buf = Buffer(None, rank=0, num_ranks=1, endpoint=daemon.socket(0),
                 group_name="destroy-buf", max_tokens_per_rank=8)
    idx = np.array([[0, 1], [2, 3]], np.int64)
    buf.get_dispatch_layout(idx, 4)

    def gone(self) -> None:
        raise EpdError(grpc.StatusCode.UNAVAILABLE, "session lost: the engine went away")
    monkeypatch.setattr(Group, "leave", gone)
    with pytest.raises(EpdError, match="went away"):
        buf.destroy()
    assert not buf.session.alive and not buf._groups


def test_a_buffer_that_fails_to_start_opens_no_session(daemon, monkeypatch) -> None:
    """Buffer's own argument errors come before it opens a session: none is left counting
    against the engine's --max-sessions."""
    with Session(daemon.socket(0), fast_path=False) as s:
        before = s.stats().sessions
        monkeypatch.setenv("EPD_LL_PLAIN_OPS", "0")
        with pytest.raises(EpdError, match="EPD_LL_PLAIN_OPS"):
            Buffer(None, rank=0, num_ranks=1, endpoint=daemon.socket(0),
                   group_name="no-start", max_tokens_per_rank=8)
        assert s.stats().sessions == before


def test_a_buffers_timeout_bounds_its_normal_mode_calls(daemon) -> None:
    """Buffer(timeout=...) is the deadline of its dispatch and combine too, not only of its
    joins: a dispatch whose peer never comes fails after it (the daemon's default is 3 s)."""
    import time

    idx = np.array([[0, 1], [2, 3]], np.int64)
    x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
    bufs = [Buffer(None, rank=r, num_ranks=2, endpoint=daemon.socket(r), timeout=0.5,
                   group_name="short-deadline", max_tokens_per_rank=8) for r in range(2)]
    try:
        done: list = [None, None]

        def layer(r: int) -> None:  # (the first dispatch forms the group)
            n_exp = bufs[r].get_dispatch_layout(idx, 4)[2]
            bufs[r].dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=n_exp)
            done[r] = n_exp
        threads = [threading.Thread(target=layer, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(d is not None for d in done)
        t0 = time.monotonic()
        with pytest.raises(EpdError) as ei:  # rank 1 never dispatches again
            bufs[0].dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=done[0])
        assert time.monotonic() - t0 < 2.0, ei.value
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
    finally:
        for b in bufs:
            with contextlib.suppress(EpdError):
                b.destroy()


def test_a_dropped_async_dispatch_does_not_stall_the_fast_path(daemon_factory) -> None:
    """A PendingDispatch dropped unread (its counts() raised and the caller gave up) held its
    fast-path slot forever: once the ring came round to it, every call of the session waited
    its whole deadline and failed. Its answer is now taken when the slot is needed, and the
    next dispatch_async goes ahead (after it, so the counts it reads are its own)."""
    import gc

    from epd.proto.v1 import epd_pb2

    idx = np.array([[0, 1], [2, 3]], np.int64)
    x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
    with (daemon_factory(engines=1, extra=["--fast-path-slots", "4"]) as d,
          Session(d.socket(0)) as s):
        assert s.transport == "fastpath"
        g = s.join("dropped", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2)
        pd = g.dispatch_async(x, idx, w)
        pd.counts()
        del pd
        gc.collect()
        for _ in range(6):  # round the 4-slot ring, past the dropped call's slot
            s._transport.call("Ping", epd_pb2.PingRequest(), 1.0)
        again = g.dispatch_async(x, idx, w)
        assert again.counts()[0] == again.result().num_recv_tokens == 2  # (both tokens)
        # any ring call dropped unanswered (an exception while it waited) gives its slot back
        dropped = s._transport.call_async("Ping", epd_pb2.PingRequest(), 1.0)
        del dropped
        for _ in range(6):
            s._transport.call("Ping", epd_pb2.PingRequest(), 1.0)
        assert s.transport == "fastpath"


def test_staged_inputs_of_an_async_call_are_not_reused_while_it_is_in_flight(daemon) -> None:
    """The cpu backend copies a call's host inputs into one staging file, reused from its start
    by every call: an async dispatch's copies must survive the session's next calls until the
    engine has run it (it reads them only once its peers have arrived)."""
    with Session(daemon.socket(0), fast_path=False) as s:
        m = s.memory
        first, second = np.arange(64, dtype=np.float32), -np.arange(64, dtype=np.float32)
        d1 = m.describe({"x": first})["x"]
        m.hold_staging()  # (what dispatch_async does after its describe)
        d2 = m.describe({"x": second})["x"]
        assert d2.region_id != d1.region_id or d2.offset_bytes >= d1.offset_bytes + 256
        if d2.region_id == d1.region_id:
            assert (m.staging.file.view(d1.offset_bytes, (64,), np.float32) == first).all()
        m.release_staging()  # (PendingDispatch.result())
        assert m.describe({"x": second})["x"].offset_bytes == 0
        # through the group: the pending dispatch holds the staging until its result is taken
        g = s.join("staged", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2)
        idx = np.array([[0, 1], [2, 3]], np.int64)
        x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
        pd = g.dispatch_async(x, idx, w)
        assert m._held == 1
        pd.result()
        assert m._held == 0
        # a second result() of a dispatch done releases nothing of the next one in flight
        pd2 = g.dispatch_async(x, idx, w)
        pd.result()
        assert m._held == 1
        with pytest.raises(EpdError, match="still in flight"):
            g.dispatch_async(x, idx, w)
        pd2.result()
        assert m._held == 0
        # a staging file outgrown while held stays registered until the call is done
        held = m.staging.file
        m.hold_staging()
        m.describe({"x": np.zeros(1 << 20, np.float32)})  # (more than the file holds)
        assert m.staging.file is not held and m._retired == [held]
        m.release_staging()
        assert m._retired == []


def test_counts_of_a_dispatch_refused_for_num_worst_tokens_raise(daemon) -> None:
    """A dispatch that receives more than num_worst_tokens fails; its counts were published as
    good before that check, so PendingDispatch.counts() returned them: they are published
    only once the call is accepted, and counts() raises (result() names the cause)."""
    with Session(daemon.socket(0), fast_path=False) as s:
        g = s.join("worst", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2)
        idx = np.array([[0, 1], [2, 3]], np.int64)
        x, w = np.ones((2, 64), BF16), np.ones((2, 2), np.float32)
        pd = g.dispatch_async(x, idx, w, num_worst_tokens=1)
        with pytest.raises(EpdError) as ei:
            pd.counts(timeout=10)
        assert ei.value.code == grpc.StatusCode.ABORTED, ei.value
        with pytest.raises(EpdError, match="more than num_worst_tokens=1"):
            pd.result()
        assert g.dispatch(x, idx, w).num_recv_tokens == 2  # (the group goes on)


def test_an_open_whose_lease_thread_cannot_start_closes_what_it_opened(daemon,
                                                                       monkeypatch) -> None:
    """When the lease thread cannot start (the process's thread limit), the open fails with
    that error and closes what it opened: the descriptor channel (connected first, for the
    ticket) and the gRPC channel. close() joined the thread that never started, which raised
    over the open's error and left both open."""
    from epd.proto import fd_channel as fdc
    closed: list[str] = []
    real_close = fdc.Channel.close
    real_start = threading.Thread.start

    def close(self) -> None:
        closed.append(self.path)
        real_close(self)

    def start(self) -> None:
        if self.name == "epd-session":
            raise RuntimeError("can't start new thread")
        real_start(self)
    monkeypatch.setattr(fdc.Channel, "close", close)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError) as err:
        Session(daemon.socket(0), timeout=5)
    assert "can't start new thread" in str(err.value), err.value
    assert closed == [fdc.socket_path_for(daemon.socket(0))], closed


def test_a_hello_to_an_engine_older_than_the_client_says_so() -> None:
    """A client opens its session through the descriptor channel's hello; an engine from
    before it took the hello for a binding request naming no session and answered NOT_FOUND
    "session '' is not open", which told the user nothing. The client says what it is."""
    import socket as S

    from epd.proto import fd_channel as fdc
    from epd.proto.errors import FailedPrecondition, status_value
    from epd.proto.v1 import epd_pb2

    name = f"\0epd-test-old-engine-{os.getpid()}"  # (abstract: no file)
    with S.socket(S.AF_UNIX, S.SOCK_SEQPACKET) as server:
        server.bind(name)
        server.listen(1)
        server.settimeout(10)

        def old_engine() -> None:  # the old FdServer's answer to a first request without a session
            conn, _ = server.accept()
            with conn:
                fdc.recv(conn, epd_pb2.FdRequest)
                fdc.send(conn, epd_pb2.FdResponse(
                    code=status_value(grpc.StatusCode.NOT_FOUND),
                    message="session '' is not open on engine 0"))
        t = threading.Thread(target=old_engine, daemon=True)
        t.start()
        channel = fdc.Channel(name)
        try:
            with pytest.raises(FailedPrecondition, match="older than this client"):
                channel.hello()
        finally:
            channel.close()
            t.join(10)
