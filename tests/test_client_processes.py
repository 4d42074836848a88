"""The client in the lives of real processes (a review of the thirty-fourth session): a forked
child, interpreter exit with a Buffer still alive, several threads on one Group, two threads'
dispatch_async at once, the engine killed while a caller waits for its receive counts.

The process tests run small client scripts in child interpreters against the module's CPU
daemon; each must finish well within its deadline (the bugs they guard against were hangs)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest

from epd.client import EpdError, Session
from epd.proto.errors import FailedPrecondition

pytestmark = pytest.mark.slow
E, K, H, T = 4, 2, 64, 8
CHILD_SECONDS = 60


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    w = rng.random((T, K)).astype(np.float32)
    return x, idx, w


def _join(s: Session, name: str):
    return s.join(name, rank=0, num_ranks=1, num_experts=E, hidden=H, max_tokens_per_rank=T,
                  num_topk=K, dtype="float32")


def _join_two(name: str, sessions: tuple[Session, Session]) -> list:
    """Both ranks of a two-rank group, joined at once (one thread each)."""
    groups: list = [None, None]

    def join(k: int) -> None:
        groups[k] = sessions[k].join(name, rank=k, num_ranks=2, num_experts=E, hidden=H,
                                     max_tokens_per_rank=T, num_topk=K, dtype="float32")

    threads = [threading.Thread(target=join, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return groups


def _script(body: str, socket: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter (SOCKET: the engine's socket); its outcome."""
    prelude = textwrap.dedent(f"""
        import os, sys, numpy as np
        from epd.client import Session, EpdError
        from epd.client.buffer import Buffer
        SOCKET = {socket!r}
        rng = np.random.default_rng(0)
        x = rng.standard_normal(({T}, {H})).astype(np.float32)
        idx = np.stack([rng.permutation({E})[:{K}] for _ in range({T})]).astype(np.int64)
        w = rng.random(({T}, {K})).astype(np.float32)
        """)
    # (its own process group: a script that forks and hangs leaves no process behind)
    p = subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(body)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return subprocess.CompletedProcess(p.args, -signal.SIGKILL, out, err + "\n(timed out)")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # (what the script forked and left)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_a_buffer_alive_at_interpreter_exit_does_not_hang(daemon) -> None:
    """A DeepEP-style Buffer (explicitly_destroy=False) still alive when the script ends: its
    __del__ ran during interpreter shutdown and closed the session's gRPC channel, which waits
    for threads that no longer run; the process never exited. It exits now (its lease's end
    frees the session)."""
    t0 = time.monotonic()
    r = _script("""
        buf = Buffer(rank=0, num_ranks=1, endpoint=SOCKET, group_name="exit")
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, 4)
        out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=n_exp)
        print("done", flush=True)
        """, daemon.socket(0))
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_a_forked_child_cannot_use_or_end_the_parents_session(daemon) -> None:
    """A process with a Session, a Group and a Buffer forks (a DataLoader's workers): the
    child's calls raise FAILED_PRECONDITION naming the parent; its close(), destroy() and its
    exit with the Buffer alive touch nothing of the parent's (they used to leave the parent's
    groups, mark its ring closed, or take its ring sequence numbers so that the parent's next
    call waited out its deadline). The parent's calls before and after stay exact (against
    the reference; a second Buffer the child destroyed still serves the parent)."""
    r = _script("""
        from epd.server import reference as ref
        want = ref.dispatch([x], [idx], [w], 4)[0]
        s = Session(SOCKET)
        g = s.join("fork", rank=0, num_ranks=1, num_experts=4, hidden=64,
                   max_tokens_per_rank=8, num_topk=2, dtype="float32")
        buf = Buffer(rank=0, num_ranks=1, endpoint=SOCKET, group_name="forkbuf")
        buf2 = Buffer(rank=0, num_ranks=1, endpoint=SOCKET, group_name="forkbuf2")
        n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, 4)
        before = g.dispatch(x, idx, w)
        assert np.array_equal(before.recv_x, want.recv_x)
        pid = os.fork()
        if pid == 0:
            ok = True
            for call in (lambda: s.stats(), lambda: g.dispatch(x, idx, w),
                         lambda: buf.get_dispatch_layout(idx, 4)):
                try:
                    call()
                    ok = False
                except EpdError as e:
                    ok &= e.code.name == "FAILED_PRECONDITION" and "forked child" in e.details
            buf2.destroy()
            s.close()
            sys.exit(0 if ok else 3)  # (`buf` is still alive: its __del__ runs at exit)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        for b in (buf, buf2, buf, buf2):
            after = g.dispatch(x, idx, w)
            assert np.array_equal(after.recv_x, want.recv_x)
            out = b.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank,
                             is_token_in_rank=in_rank, num_tokens_per_expert=n_exp)
            assert np.array_equal(np.asarray(out[0]), want.recv_x)
        print("transport", s.transport, "groups", len(s.stats().groups), flush=True)
        buf.destroy()
        buf2.destroy()
        s.close()
        """, daemon.socket(0))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "child 0" in r.stdout, r.stdout
    assert "transport fastpath groups 1" in r.stdout, r.stdout


def test_a_fork_while_another_thread_is_in_a_call_is_refused_in_the_child(daemon) -> None:
    """The parent forks while another of its threads is inside a call of a group (it waits
    for a peer): the child inherits that group's lock held, and its call of the group waited
    on it for ever. The child's call is refused first (FAILED_PRECONDITION), before any lock."""
    r = _script("""
        import threading, time
        s0, s1 = Session(SOCKET), Session(SOCKET)
        gs = [None, None]
        def join(k, s):
            gs[k] = s.join("forklock", rank=k, num_ranks=2, num_experts=4, hidden=64,
                           max_tokens_per_rank=8, num_topk=2, dtype="float32")
        ths = [threading.Thread(target=join, args=(k, s)) for k, s in enumerate((s0, s1))]
        [t.start() for t in ths]; [t.join(30) for t in ths]
        g0 = gs[0]
        def blocked():  # (rank 1 never dispatches: this waits in the call, holding its lock)
            try:
                g0.dispatch(x, idx, w, timeout=3)
            except EpdError:
                pass
        th = threading.Thread(target=blocked); th.start()
        time.sleep(0.5)
        pid = os.fork()
        if pid == 0:
            import signal
            signal.alarm(10)
            try:
                g0.dispatch(x, idx, w, timeout=1)
                os._exit(3)
            except EpdError as e:
                os._exit(0 if e.code.name == "FAILED_PRECONDITION" else 4)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), flush=True)
        th.join(30)
        s0.close(); s1.close()
        """, daemon.socket(0))
    assert r.returncode == 0 and "child 0" in r.stdout, r.stdout + r.stderr[-3000:]


def test_threads_sharing_a_group_each_get_their_own_outputs(daemon) -> None:
    """Four threads dispatch and combine their own inputs on one Group: the engine writes each
    answered call's outputs into the membership's one output region and the client copies them
    out after the answer, so another thread's call in between overwrote them (a review saw a
    few wrong results in every 1,200 rounds, each another thread's). Calls on one group now
    hold its lock from their description to their copy-out."""
    with Session(daemon.socket(0)) as s:
        g = _join(s, "threads")
        ins = [_inputs(10 + k) for k in range(4)]
        want = []
        for x, idx, w in ins:
            o = g.dispatch(x, idx, w)
            cx, _ = g.combine(o.recv_x, o.handle, topk_weights=o.recv_topk_weights)
            want.append((o.recv_x.copy(), cx.copy()))
        wrong: list[str] = []

        def work(k: int) -> None:
            x, idx, w = ins[k]
            for _ in range(150):
                o = g.dispatch(x, idx, w)
                if not np.array_equal(o.recv_x, want[k][0]):
                    wrong.append(f"thread {k} dispatch")
                cx, _ = g.combine(o.recv_x, o.handle, topk_weights=o.recv_topk_weights)
                if not np.array_equal(cx, want[k][1]):
                    wrong.append(f"thread {k} combine")

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        assert wrong == []


def test_two_threads_dispatch_async_one_in_flight(daemon, monkeypatch) -> None:
    """Two threads start a dispatch_async on two groups of one session at the same moment: one
    is in flight, the other is refused (FAILED_PRECONDITION); both checks passed before, the
    staging hold of one was lost and the session's staging grew for good. (The request's
    description is slowed down here: the window between the check and the start, which the
    race needs, is then wide every time.)"""
    from epd.client.group import Group

    describe = Group._dispatch_request

    def slow(self, *a, **kw):
        time.sleep(0.01)
        return describe(self, *a, **kw)

    monkeypatch.setattr(Group, "_dispatch_request", slow)
    with Session(daemon.socket(0)) as s:
        groups = [_join(s, "async-a"), _join(s, "async-b")]
        x, idx, w = _inputs(3)
        both = 0
        for _ in range(20):
            barrier = threading.Barrier(2)
            got: list = [None, None]

            def start(k: int, barrier=barrier, got=got) -> None:
                barrier.wait()
                try:
                    got[k] = groups[k].dispatch_async(x, idx, w)
                except FailedPrecondition:
                    got[k] = "refused"

            threads = [threading.Thread(target=start, args=(k,)) for k in range(2)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
            started = [p for p in got if p != "refused"]
            both += len(started) == 2
            for p in started:
                p.result()
        assert both == 0
        assert s.memory._held == 0  # (every hold given back)


def test_counts_fail_at_once_when_the_engine_goes_away(daemon_factory) -> None:
    """PendingDispatch.counts() waited out its whole deadline after the engine died (result()
    failed at once): it now ends with UNAVAILABLE as soon as the session's lease does."""
    with daemon_factory(engines=1, timeout_seconds=20) as d, \
            Session(d.socket(0), timeout=20) as s:
        peer = Session(d.socket(0), timeout=20)
        try:
            joined = _join_two("counts", (s, peer))
            x, idx, w = _inputs(5)
            pending = joined[0].dispatch_async(x, idx, w)  # (rank 1 never comes)
            threading.Timer(0.5, os.kill, (d.engine_pid(0), signal.SIGKILL)).start()
            t0 = time.monotonic()
            with pytest.raises(EpdError) as ei:
                pending.counts()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE, ei.value
            assert time.monotonic() - t0 < 10  # (the deadline: 20 s)
        finally:
            peer.close()


def test_an_interrupted_dispatch_is_settled_by_the_groups_next_dispatch(daemon) -> None:
    """Rank 0's dispatch is interrupted (KeyboardInterrupt) while it waits for rank 1; the
    engine still runs it once rank 1 comes. Its handle, which only its answer names, is
    released by rank 0's next dispatch (it stayed in the engine until the session ended), and
    a dispatch_async after it reads its own counts, not the interrupted one's (it read those:
    the client expected the sequence after the one it had seen)."""
    import _thread

    s0, s1 = Session(daemon.socket(0)), Session(daemon.socket(1))
    try:
        g0, g1 = _join_two("interrupted", (s0, s1))
        a0, a1 = _inputs(21), _inputs(22)
        b = _inputs(23)
        b0 = (b[0][:3], b[1][:3], b[2][:3])  # (other counts than dispatch A's)
        interrupted = threading.Event()
        out1: dict = {}

        def rank1() -> None:
            interrupted.wait(30)
            out1["a"] = g1.dispatch(*a1)
            out1["b"] = g1.dispatch(*b)

        th = threading.Thread(target=rank1)
        th.start()
        threading.Timer(0.3, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            g0.dispatch(*a0)
        interrupted.set()
        pending = g0.dispatch_async(*b0)
        n, per_expert = pending.counts()
        got = pending.result()
        th.join(30)
        assert (n, per_expert) == (got.num_recv_tokens, got.num_recv_tokens_per_expert)
        del got, pending
        out1.clear()
        gc.collect()
        assert g0.release_handles() == 0  # (dispatch A's handle too: released, not kept)
    finally:
        s0.close()
        s1.close()
