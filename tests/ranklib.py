"""Test support shared by the CPU test modules (imported by conftest.py and by rank processes).

* `RankPool`: persistent rank processes (multiprocessing *spawn*), each a loop that runs tasks
  (a picklable function + arguments) and sends back an `Outcome`. A task may also talk to the
  test while it runs: `report()` sends an event, `command()` waits for the next command. Every
  wait in the test process is bounded; a worker that does not answer in time is killed.
* `Case` + `run_case` + `check_case`: one dispatch/combine scenario run by every rank of a group
  against a live daemon and compared bit-exactly with the NumPy reference.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from epd.proto import dtypes
from epd.server import reference as ref
from epd.server.demo import expert_transform

BF16 = dtypes.BFLOAT16
FP8 = dtypes.FLOAT8_E4M3
SHM = "/dev/shm"


# ------------------------------------------------------------------------------------------------
# rank processes
# ------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What one task produced: a value, or the EpdError code/details, or a traceback."""

    ok: bool
    value: Any = None
    code: str | None = None  # grpc.StatusCode name of an EpdError
    details: str = ""
    tb: str = ""
    elapsed: float = 0.0

    def describe(self) -> str:
        if self.ok:
            return "ok"
        if self.code:
            return f"EpdError {self.code}: {self.details}"
        return self.tb


_conn: mpc.Connection | None = None
_task: int | None = None  # id of the task this worker runs (commands name it)


def report(payload: Any) -> None:
    """From inside a task: send an event to the test process."""
    assert _conn is not None
    _conn.send(("event", payload))


def command(timeout: float = 120.0) -> Any:
    """From inside a task: wait for the test's next command (bounded). Commands carry the task
    id they were sent to; one left over from an earlier task of this worker is dropped."""
    assert _conn is not None
    deadline = time.monotonic() + timeout
    while True:
        if not _conn.poll(max(deadline - time.monotonic(), 0)):
            raise TimeoutError(f"no command from the test within {timeout} s")
        msg = _conn.recv()
        if msg[0] != "cmd":
            raise RuntimeError(f"expected a command, got {msg[0]!r}")
        if msg[1] == _task:
            return msg[2]


def _worker_main(conn: mpc.Connection) -> None:
    global _conn, _task
    _conn = conn
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # RankPool.dump_stacks
    from epd.proto.errors import EpdError

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] != "task":
            continue
        _, tid, fn, args, kwargs = msg
        _task = tid
        t0 = time.monotonic()
        try:
            out = Outcome(True, fn(*args, **kwargs))
        except EpdError as e:
            out = Outcome(False, code=e.code.name, details=e.details)
        except BaseException:
            out = Outcome(False, tb=traceback.format_exc())
        out.elapsed = time.monotonic() - t0
        # The task's objects are gone now, cycles too: what is still mapped
        # (daemon_harness.memfd_names) is held by something alive, i.e. a leak. (A Session's
        # counter page goes with the last array viewing it, e.g. a Group in a traceback's
        # frames.)
        del fn, args, kwargs
        gc.collect()
        try:
            conn.send(("result", tid, out))
        except (BrokenPipeError, OSError):
            return


@dataclass
class _Worker:
    proc: Any
    conn: mpc.Connection
    events: collections.deque = field(default_factory=collections.deque)


class RankPool:
    """Up to `size` persistent rank processes; worker i plays whatever rank a test gives it."""

    def __init__(self, size: int = 8) -> None:
        self.ctx = mp.get_context("spawn")
        self.size = size
        self.workers: list[_Worker | None] = [None] * size
        self.results: dict[int, Outcome] = {}
        self.pending: dict[int, int] = {}  # task id -> worker index
        self._next = 0

    # -- processes ---------------------------------------------------------------------------
    def _ensure(self, i: int) -> _Worker:
        w = self.workers[i]
        if w is None:
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=_worker_main, args=(child,), daemon=True,
                                 name=f"epd-test-rank{i}")
            p.start()
            child.close()
            w = self.workers[i] = _Worker(p, parent)
        return w

    def start(self, n: int) -> None:
        for i in range(n):
            self._ensure(i)

    def pid(self, i: int) -> int:
        return self._ensure(i).proc.pid

    def _dead(self, i: int) -> None:
        w = self.workers[i]
        if w is None:
            return
        w.proc.join(10)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(10)
        with contextlib.suppress(OSError):
            w.conn.close()
        self.workers[i] = None
        for tid, wi in list(self.pending.items()):
            if wi == i:
                del self.pending[tid]
                self.results[tid] = Outcome(False, tb=f"rank worker {i} (pid {w.proc.pid}) "
                                                      f"died, exit code {w.proc.exitcode}")

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill worker i (its shared memory is memfds: they go with it)."""
        w = self.workers[i]
        if w is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.proc.pid, sig)
        w.proc.join(10)
        self._dead(i)

    def _pump(self, timeout: float) -> None:
        live = {w.conn: i for i, w in enumerate(self.workers) if w is not None}
        if not live:
            raise RuntimeError("no live rank workers")
        for c in mpc.wait(list(live), max(timeout, 0)):
            i = live[c]
            try:
                msg = c.recv()
            except (EOFError, OSError):
                self._dead(i)
                continue
            if msg[0] == "event":
                self.workers[i].events.append(msg[1])
            elif msg[0] == "result":
                self.pending.pop(msg[1], None)
                self.results[msg[1]] = msg[2]

    # -- tasks -------------------------------------------------------------------------------
    def submit(self, i: int, fn, *args, **kwargs) -> int:
        w = self._ensure(i)
        if any(wi == i for wi in self.pending.values()):
            raise RuntimeError(f"rank worker {i} is busy")
        self._next += 1
        tid = self._next
        self.pending[tid] = i
        w.conn.send(("task", tid, fn, args, kwargs))
        return tid

    def result(self, tid: int, timeout: float) -> Outcome:
        deadline = time.monotonic() + timeout
        while tid not in self.results:
            left = deadline - time.monotonic()
            if left <= 0:
                i = self.pending.get(tid)
                if i is not None:
                    self.kill(i)
                raise TimeoutError(f"rank worker {i} gave no result within {timeout} s")
            self._pump(min(left, 1.0))
        return self.results.pop(tid)

    def gather(self, tids: list[int], timeout: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        out = []
        try:
            for tid in tids:
                out.append(self.result(tid, max(deadline - time.monotonic(), 0)))
        except TimeoutError:
            self.kill_busy()
            raise
        return out

    def run(self, calls: list[tuple], timeout: float = 90.0) -> list[Outcome]:
        """Run calls[i] = (fn, *args) on worker i, all at once; outcomes in order."""
        tids = [self.submit(i, c[0], *c[1:]) for i, c in enumerate(calls)]
        return self.gather(tids, timeout)

    def run_ok(self, calls: list[tuple], timeout: float = 90.0) -> list[Any]:
        outs = self.run(calls, timeout)
        bad = [f"rank {i}: {o.describe()}" for i, o in enumerate(outs) if not o.ok]
        assert not bad, "rank task(s) failed:\n" + "\n".join(bad)
        return [o.value for o in outs]

    def event(self, i: int, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            w = self.workers[i]
            if w is None:
                raise RuntimeError(f"rank worker {i} is gone")
            if w.events:
                return w.events.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                self.dump_stacks(i)
                raise TimeoutError(f"no event from rank worker {i} within {timeout} s")
            self._pump(min(left, 1.0))

    def dump_stacks(self, i: int) -> None:
        """Every thread's stack of a stuck worker, on its stderr (the test's captured output)."""
        w = self.workers[i]
        busy = [tid for tid, wi in self.pending.items() if wi == i]
        print(f"rank worker {i}: pending tasks {busy}; finished results "
              f"{ {t: o.describe() for t, o in self.results.items()} }", flush=True)
        if w is not None and w.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGUSR1)
            time.sleep(0.5)

    def cmd(self, i: int, payload: Any) -> None:
        """Send a command to the task running on worker i (dropped by any later task)."""
        tid = next((t for t, wi in self.pending.items() if wi == i), None)
        self._ensure(i).conn.send(("cmd", tid, payload))

    def kill_busy(self) -> None:
        for i in sorted(set(self.pending.values())):
            self.kill(i)

    def clear(self) -> None:
        """Between tests: stuck workers are killed, stale events and results dropped."""
        self.kill_busy()
        self.results.clear()
        for w in self.workers:
            if w is not None:
                w.events.clear()

    def live_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w is not None and w.proc.is_alive()]

    def close(self) -> None:
        for i, w in enumerate(self.workers):
            if w is None:
                continue
            with contextlib.suppress(OSError):
                w.conn.send(("stop",))
            w.proc.join(5)
            if w.proc.is_alive():
                self.kill(i)
            else:
                self._dead(i)


# ------------------------------------------------------------------------------------------------
# comparisons
# ------------------------------------------------------------------------------------------------

class ProcessGroup:
    """The stand-in for a torch.distributed ProcessGroup that frameworks hand DeepEP: all the
    facade reads of it is rank() / size() (ranks as threads of one test)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def facade_env(daemon, monkeypatch, prefix: str):
    """The DeepEP facade's Buffers built as a framework builds them: the daemon from
    EPD_SOCKET_DIR, engine 0; each Buffer's groups get the instance tag its ranks would agree
    on over a real torch group (the stand-in has no collective): the n-th Buffer a rank makes,
    the same on every rank (`prefix` + n)."""
    import threading

    from epd.client import buffer as B
    monkeypatch.setenv("EPD_SOCKET_DIR", daemon.socket_dir)
    for k in ("EPD_ENGINE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    made: dict[int, int] = {}
    lock = threading.Lock()

    def agreed_instance_tag(group, comm) -> str:
        with lock:
            made[group.rank()] = made.get(group.rank(), 0) + 1
            return f"{prefix}{made[group.rank()]}"

    monkeypatch.setattr(B, "agreed_instance_tag", agreed_instance_tag)
    return daemon


def run_rank_threads(fn, num_ranks: int) -> list:
    """fn(rank, group) on every rank at once (threads), each rank with its own ProcessGroup;
    the ranks' results, or one AssertionError naming every rank that raised."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(num_ranks) as ex:
        futs = [ex.submit(fn, r, ProcessGroup(r, num_ranks)) for r in range(num_ranks)]
        errors = [(r, f.exception(timeout=120)) for r, f in enumerate(futs)]
    failed = [(r, e) for r, e in errors if e is not None]
    if failed:
        raise AssertionError("; ".join(f"rank {r}: {type(e).__name__}: {e}"
                                       for r, e in failed)) from failed[0][1]
    return [f.result() for f in futs]


def all_at_once(calls: dict[int, Any], join: float = 60) -> dict[int, Any]:
    """Run `calls[r]()` for every r at once (threads started together: a collective); the
    results, or the exceptions raised, by r. Every call must return within `join` seconds."""
    out: dict[int, Any] = {}
    go = threading.Barrier(len(calls))

    def run(r: int) -> None:
        try:
            go.wait(10)
            out[r] = calls[r]()
        except Exception as e:  # returned for the caller to check
            out[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    assert not any(t.is_alive() for t in threads), "a rank's call did not return"
    return out


def plain_regions(nbytes: int) -> dict:
    """Region "r" over a plain buffer (no memfd needed for the engine's descriptor checks)."""
    from epd.server.backends.cpu_memory import ShmRegion
    buf = np.zeros(nbytes, np.uint8)

    class Region(ShmRegion):
        def __init__(self) -> None:
            self.region_id, self.size, self.resolved = "r", buf.nbytes, {}

        def view(self, offset, shape, dtype, strides):
            return np.lib.stride_tricks.as_strided(
                buf[offset:].view(dtype), shape, [s * dtype.itemsize for s in strides])

    return {"r": Region()}


class NoGrpc:
    """The gRPC side of a ring-only transport (a ring without a daemon): nothing may fall back
    to it."""

    def call(self, *a, **k):
        raise AssertionError("fell back to gRPC")

    call_async = call

    def close(self) -> None:
        pass


def bits(a: Any) -> np.ndarray:
    """A bit-pattern view (bf16 as uint16, fp8 as uint8, float32 as uint32, ...)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_exact(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if not np.array_equal(bits(got), bits(want)):
        bad = np.argwhere(bits(got) != bits(want))
        raise AssertionError(f"{what}: {len(bad)} element(s) differ, first at {bad[0].tolist()}:"
                             f" got {got[tuple(bad[0])]!r}, expected {want[tuple(bad[0])]!r}")


def as_numpy(a: Any) -> Any:
    if a is None or isinstance(a, np.ndarray):
        return a
    from epd.client.tensors import to_numpy
    return np.array(to_numpy(a, "output"))


# ------------------------------------------------------------------------------------------------
# one dispatch/combine scenario
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    group: str
    num_ranks: int
    num_experts: int
    hidden: int
    num_topk: int
    tokens: tuple[int, ...]
    seed: int = 0
    max_tokens: int = 0  # 0: max(tokens), at least 1
    drop_prob: float = 0.1
    hot_rank: int | None = None
    hot_fraction: float = 0.0
    avoid_rank: int | None = None  # no token routes to this rank (it receives nothing)
    expert_alignment: int = 1
    num_worst_tokens: int = 0
    fp8: bool = False
    bias: bool = False
    combine_weights: bool = True
    cached: bool = False
    use_empty: bool = False
    use_async: bool = False
    use_torch: bool = False
    layout: bool = True
    rounds: int = 1  # dispatch/combine rounds (results of the last one are returned)
    # > 1: the group is placed node-major over this many nodes and runs hierarchical normal
    # mode (checked against reference.hierarchical_dispatch / hierarchical_combine)
    nodes: int = 1

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def max_tokens_per_rank(self) -> int:
        return self.max_tokens or max(max(self.tokens), 1)

    def inputs(self, rank: int) -> dict[str, Any]:
        """Every input of one rank, identical in every process."""
        rng = np.random.default_rng([self.seed, rank, 7])
        t, h = self.tokens[rank], self.hidden
        idx, w = ref.random_routing(rng, t, self.num_experts, self.num_topk,
                                    drop_prob=self.drop_prob, hot_rank=self.hot_rank,
                                    hot_fraction=self.hot_fraction, num_ranks=self.num_ranks)
        if self.avoid_rank is not None:
            off = (idx >= 0) & (idx // self.local_experts == self.avoid_rank)
            idx[off] = -1
            w[off] = 0
        x = ref.random_x(rng, t, h, BF16)
        x2 = ref.random_x(rng, t, h, BF16)
        b0 = ref.random_x(rng, t, h, BF16)
        b1 = ref.random_x(rng, t, h, BF16)
        out = {"x": x, "x_scales": None, "x2": x2, "x2_scales": None, "topk_idx": idx,
               "topk_weights": w, "bias_0": b0 if self.bias else None,
               "bias_1": b1 if self.bias else None}
        if self.fp8:
            out["x"], out["x_scales"] = ref.quantize_fp8(x)
            out["x2"], out["x2_scales"] = ref.quantize_fp8(x2)
        return out


def expert_out(recv_x: np.ndarray, recv_scales: np.ndarray | None, recv_idx: np.ndarray,
               recv_w: np.ndarray, rank: int, local_experts: int) -> np.ndarray:
    """The stand-in experts, bf16 out (FP8 rows are dequantised first)."""
    if recv_scales is not None:
        deq = recv_x.astype(np.float32) * np.repeat(recv_scales, dtypes.FP8_BLOCK, axis=1)
        recv_x = deq.astype(BF16)
    return expert_transform(recv_x, recv_idx, recv_w, rank, local_experts)


def join(session, case: Case, rank: int, timeout: float | None = None,
         service_class: str | None = None):
    return session.join(case.group, rank=rank, num_ranks=case.num_ranks,
                        num_experts=case.num_experts, hidden=case.hidden,
                        max_tokens_per_rank=case.max_tokens_per_rank, num_topk=case.num_topk,
                        dtype="bfloat16", timeout=timeout, service_class=service_class)


def case_round(session, group, case: Case, rank: int) -> dict[str, Any]:
    """One rank's layout + dispatch + combine (+ cached dispatch) on a joined group."""
    inp = case.inputs(rank)
    if case.use_empty:
        for k, v in list(inp.items()):
            if v is not None:
                buf = session.empty(v.shape, v.dtype)
                buf[...] = v
                inp[k] = buf
    if case.use_torch:
        import torch

        from epd.client.tensors import like
        for k, v in list(inp.items()):
            if v is not None:
                inp[k] = like(v, torch.empty(0))
                assert isinstance(inp[k], torch.Tensor)
    res: dict[str, Any] = {"rank": rank}
    if case.layout:
        res["layout"] = [as_numpy(a) for a in group.get_dispatch_layout(inp["topk_idx"])]
    kw = dict(x_scales=inp["x_scales"], expert_alignment=case.expert_alignment,
              num_worst_tokens=case.num_worst_tokens)
    for _ in range(case.rounds):
        if case.use_async:
            pending = group.dispatch_async(inp["x"], inp["topk_idx"], inp["topk_weights"], **kw)
            res["counts"] = pending.counts(timeout=30)
            out = pending.result()
        else:
            out = group.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"], **kw)
        if case.use_torch:
            import torch
            res["torch_out"] = isinstance(out.recv_x, torch.Tensor)
        for k in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                  "recv_src_idx", "rank_prefix_matrix"):
            res[k] = as_numpy(getattr(out, k))
        res["num_recv_tokens"] = out.num_recv_tokens
        res["num_recv_tokens_per_expert"] = list(out.num_recv_tokens_per_expert)
        y = expert_out(res["recv_x"], res["recv_x_scales"], res["recv_topk_idx"],
                       res["recv_topk_weights"], rank, case.local_experts)
        w = res["recv_topk_weights"] if case.combine_weights else None
        if case.use_empty:
            yb = session.empty(y.shape, y.dtype)
            yb[...] = y
            y = yb
            if w is not None:
                wb = session.empty(w.shape, w.dtype)
                wb[...] = w
                w = wb
        if case.use_torch:
            import torch

            from epd.client.tensors import like
            y = like(y, torch.empty(0))
        cx, cw = group.combine(y, out.handle, topk_weights=w, bias_0=inp["bias_0"],
                               bias_1=inp["bias_1"])
        res["combined_x"], res["combined_w"] = as_numpy(cx), as_numpy(cw)
    if case.cached:
        out2 = group.dispatch(inp["x2"], handle=out.handle, x_scales=inp["x2_scales"],
                              num_worst_tokens=case.num_worst_tokens)
        res["cached_recv_x"] = as_numpy(out2.recv_x)
        res["cached_recv_x_scales"] = as_numpy(out2.recv_x_scales)
        res["cached_num_recv_tokens"] = out2.num_recv_tokens
        res["cached_recv_src_idx"] = as_numpy(out2.recv_src_idx)
    res["staging_used"] = session.memory.staging.file is not None  # cpu backend (ShmMemory)
    res["session_id"] = session.session_id
    res["group_id"] = group.group_id
    return res


def run_case(endpoint: str, case: Case, rank: int, timeout: float = 30.0) -> dict[str, Any]:
    """Task: a fresh session on `endpoint`, join the case's group as `rank`, one round."""
    from epd.client import Session
    with Session(endpoint, client_name=f"test-rank{rank}", timeout=timeout) as s:
        g = join(s, case, rank)
        # The join answer and the engine's stats say the same about the semantics
        shown = [x.hierarchical for x in s.stats().groups if x.group_id == g.group_id]
        assert g.hierarchical == (case.nodes > 1) and shown == [g.hierarchical], \
            (case.nodes, g.hierarchical, shown)
        return case_round(s, g, case, rank)


def run_cases(endpoints: list[str], cases: list[Case], rank: int) -> list[dict[str, Any]]:
    """Task: several groups at once. endpoints[i] == endpoints[j] shares one session; rounds
    interleave: all dispatches in order, then combines in reverse order."""
    from epd.client import Session
    sessions: dict[str, Any] = {}
    try:
        groups = []
        for ep, c in zip(endpoints, cases, strict=True):
            if ep not in sessions:
                sessions[ep] = Session(ep, client_name=f"test-rank{rank}", timeout=30)
            groups.append(join(sessions[ep], c, rank))
        outs, results = [], [dict(rank=rank) for _ in cases]
        for ep, c, g, res in zip(endpoints, cases, groups, results, strict=True):
            inp = c.inputs(rank)
            res["layout"] = [np.asarray(a) for a in g.get_dispatch_layout(inp["topk_idx"])]
            out = g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
            outs.append((ep, c, g, res, inp, out))
        for _ep, c, g, res, _inp, out in reversed(outs):
            for k in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                      "recv_src_idx", "rank_prefix_matrix"):
                res[k] = getattr(out, k)
            res["num_recv_tokens"] = out.num_recv_tokens
            res["num_recv_tokens_per_expert"] = list(out.num_recv_tokens_per_expert)
            y = expert_out(out.recv_x, None, out.recv_topk_idx, out.recv_topk_weights, rank,
                           c.local_experts)
            res["combined_x"], res["combined_w"] = g.combine(
                y, out.handle, topk_weights=out.recv_topk_weights)
        for s in sessions.values():
            results[0].setdefault("session_ids", []).append(s.session_id)
        return results
    finally:
        for s in sessions.values():
            s.close()


def reference(case: Case) -> dict[str, Any]:
    inputs = [case.inputs(r) for r in range(case.num_ranks)]
    e, r = case.num_experts, case.num_ranks
    xs = [i["x"] for i in inputs]
    idxs = [i["topk_idx"] for i in inputs]
    ws = [i["topk_weights"] for i in inputs]
    scales = [i["x_scales"] for i in inputs] if case.fp8 else None
    hier = None
    if case.nodes > 1:
        hier = ref.hierarchical_dispatch(xs, idxs, ws, e, case.nodes, x_scales=scales,
                                         expert_alignment=case.expert_alignment)
        disp = [hier.received(d) for d in range(r)]
        # rank_prefix_matrix counts the rows from each original source (sources <= s), as on
        # one node, although a hierarchical group's rows follow the forwarders
        per_source = np.stack([np.bincount(hier.sources(d)[0], minlength=r) for d in range(r)],
                              axis=1)
        prefix = np.cumsum(per_source, axis=0).astype(np.int32)
    else:
        disp = ref.dispatch(xs, idxs, ws, e, x_scales=scales,
                            expert_alignment=case.expert_alignment)
        prefix = np.stack([d.src_offsets[1:] for d in disp], axis=1).astype(np.int32)
    counts = [(len(d.recv_x), list(d.num_recv_tokens_per_expert)) for d in disp]
    if case.num_worst_tokens:
        disp = [ref.pad_to_worst(d, case.num_worst_tokens) for d in disp]
    ys = [expert_out(d.recv_x, d.recv_x_scales, d.recv_topk_idx, d.recv_topk_weights, rank,
                     case.local_experts) for rank, d in enumerate(disp)]
    weights = [d.recv_topk_weights for d in disp] if case.combine_weights else None
    biases = dict(bias_0=[i["bias_0"] for i in inputs] if case.bias else None,
                  bias_1=[i["bias_1"] for i in inputs] if case.bias else None)
    if hier is not None:  # (its stages hold the real rows only: padding cut off)
        real = [n for n, _ in counts]
        comb = ref.hierarchical_combine(
            [y[:n] for y, n in zip(ys, real, strict=True)], hier, list(case.tokens),
            recv_topk_weights=(None if weights is None else
                               [w[:n] for w, n in zip(weights, real, strict=True)]), **biases)
    else:
        comb = ref.combine(ys, disp, list(case.tokens), recv_topk_weights=weights, **biases)
    out = {"disp": disp, "counts": counts, "prefix": prefix, "comb": comb,
           "layout": [ref.get_dispatch_layout(i, e, r) for i in idxs]}
    if case.cached:
        x2 = [i["x2"] for i in inputs]
        s2 = [i["x2_scales"] for i in inputs] if case.fp8 else None
        if hier is not None:
            h2 = ref.hierarchical_dispatch(x2, idxs, ws, e, case.nodes, x_scales=s2)
            cached = [h2.received(d) for d in range(r)]
        else:
            cached = ref.dispatch(x2, idxs, ws, e, x_scales=s2)
        if case.num_worst_tokens:
            cached = [ref.pad_to_worst(d, case.num_worst_tokens) for d in cached]
        out["cached"] = cached
    return out


def check_case(case: Case, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare every rank's results with the reference, bit for bit. Returns the reference."""
    errors = [f"rank {i}: {res['error']}" for i, res in enumerate(results) if "error" in res]
    assert not errors, f"{case.group}: a round failed: {errors}"
    want = reference(case)
    assert [res["rank"] for res in results] == list(range(case.num_ranks))
    for rank, res in enumerate(results):
        d = want["disp"][rank]
        tag = f"{case.group} rank {rank}"
        if "layout" in res:
            lay = want["layout"][rank]
            assert_exact(res["layout"][0], lay.num_tokens_per_rank, f"{tag} num_tokens_per_rank")
            assert_exact(res["layout"][1], lay.num_tokens_per_expert,
                         f"{tag} num_tokens_per_expert")
            assert_exact(res["layout"][2], lay.is_token_in_rank, f"{tag} is_token_in_rank")
        assert_exact(res["recv_x"], d.recv_x, f"{tag} recv_x")
        if case.fp8:
            assert_exact(res["recv_x_scales"], d.recv_x_scales, f"{tag} recv_x_scales")
        else:
            assert res["recv_x_scales"] is None, f"{tag}: recv_x_scales without FP8"
        assert_exact(res["recv_topk_idx"], d.recv_topk_idx, f"{tag} recv_topk_idx")
        assert_exact(res["recv_topk_weights"], d.recv_topk_weights, f"{tag} recv_topk_weights")
        assert_exact(res["recv_src_idx"], d.recv_src_idx, f"{tag} recv_src_idx")
        assert_exact(res["rank_prefix_matrix"], want["prefix"], f"{tag} rank_prefix_matrix")
        n, per_expert = want["counts"][rank]
        assert res["num_recv_tokens"] == n, (
            f"{tag}: num_recv_tokens {res['num_recv_tokens']} != {n}")
        assert res["num_recv_tokens_per_expert"] == per_expert, (
            f"{tag}: num_recv_tokens_per_expert {res['num_recv_tokens_per_expert']} != "
            f"{per_expert}")
        if "counts" in res:
            assert tuple(res["counts"]) == (n, per_expert), (
                f"{tag}: counts() gave {res['counts']}, expected {(n, per_expert)}")
        cx, cw = want["comb"][rank]
        assert_exact(res["combined_x"], cx, f"{tag} combined_x")
        if case.combine_weights:
            assert_exact(res["combined_w"], cw, f"{tag} combined_topk_weights")
        else:
            assert res["combined_w"] is None
        if case.cached:
            c = want["cached"][rank]
            assert_exact(res["cached_recv_x"], c.recv_x, f"{tag} cached recv_x")
            if case.fp8:
                assert_exact(res["cached_recv_x_scales"], c.recv_x_scales,
                             f"{tag} cached recv_x_scales")
            assert res["cached_num_recv_tokens"] == n
            if case.nodes > 1:  # the handle's rows again: each one's forwarder row
                assert_exact(res["cached_recv_src_idx"], c.recv_src_idx,
                             f"{tag} cached recv_src_idx")
    return want


_COMM_PATHS: dict[str, str] = {}


def comm_path(group_id: str) -> str:
    """Where a test (root, or the daemon's uid) can open a group's communication memfd:
    /proc/<supervisor>/fd/<n> of the descriptor named "epd-<group_id>.comm" (there is no file
    in the shm folder any more). "" when no process holds it."""
    want = f"/memfd:epd-{group_id}.comm"
    path = _COMM_PATHS.get(group_id, "")
    with contextlib.suppress(OSError):
        if path and os.readlink(path).startswith(want):
            return path
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        folder = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(folder)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"{folder}/{fd}").startswith(want):
                    _COMM_PATHS[group_id] = f"{folder}/{fd}"
                    return _COMM_PATHS[group_id]
    _COMM_PATHS.pop(group_id, None)
    return ""


def comm_arrivals(shm_dir: str, group_id: str, num_ranks: int) -> np.ndarray | None:
    """The CPU backend's arrival words of a group (None when it is gone). `shm_dir` is unused:
    the group's memory is a memfd of the supervisor (comm_path)."""
    from epd.server.backends import cpu_comm_file as cpu
    path = comm_path(group_id) or os.path.join(shm_dir, f"epd-{group_id}.comm")
    try:
        with open(path, "rb") as f:
            f.seek(cpu.ARRIVALS)
            raw = f.read(8 * num_ranks)
    except FileNotFoundError:
        return None
    return np.frombuffer(raw, dtype=np.int64).copy()


def wait_until(pred, timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll an observable condition (bounded): returns its first truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout} s")
        time.sleep(interval)


def comm_abort_reason(shm_dir: str, group_id: str) -> str | None:
    """The abort reason written in a group's communication memfd (None: not aborted/gone)."""
    from epd.server.backends import cpu_comm_file as cpu
    path = comm_path(group_id) or os.path.join(shm_dir, f"epd-{group_id}.comm")
    try:
        with open(path, "rb") as f:
            raw = f.read(cpu.ABORT_TEXT + cpu.ABORT_TEXT_MAX)
    except FileNotFoundError:
        return None
    header = np.frombuffer(raw[:cpu.ABORT_TEXT + cpu.ABORT_TEXT_MAX // 8 * 8], np.int64)
    return cpu.read_abort(header)


def member(endpoint: str, case: Case, rank: int, timeout: float | None = 30.0) -> dict:
    """Task: join the case's group, report the ids, then obey the test's commands:
    "dispatch" (one dispatch; its status and duration are reported), "round" (a full
    `case_round`, reported), "wait_lost" (until the session's stream ends), "done"."""
    from epd.client import Session
    from epd.proto.errors import EpdError
    kw = {} if timeout is None else {"timeout": timeout}
    with Session(endpoint, client_name=f"member{rank}", **kw) as s:
        g = join(s, case, rank)
        report({"session_id": s.session_id, "group_id": g.group_id, "pid": os.getpid(),
                "engine": s.engine_index})
        while True:
            cmd = command(timeout=300)
            if cmd == "dispatch":
                inp = case.inputs(rank)
                t0 = time.monotonic()
                try:
                    g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
                    res = {"code": "OK", "details": ""}
                except EpdError as e:
                    res = {"code": e.code.name, "details": e.details}
                res["elapsed"] = time.monotonic() - t0
                report(res)
            elif cmd == "round":
                try:
                    report(case_round(s, g, case, rank))
                except EpdError as e:  # say why at once (the test fails on it, not on a wait)
                    report({"error": f"{e.code.name}: {e.details}"})
            elif cmd == "wait_lost":
                s._watcher.join(60)
                report({"alive": s.alive})
            elif cmd == "done":
                return {"alive": s.alive}


def serve_rounds(endpoint: str, rank: int) -> int:
    """Task: a persistent rank. Commands: a Case (join its group when it is a new one, leaving
    the previous group, then one `case_round`, reported) or None (stop). Returns rounds run."""
    from epd.client import Session
    done = 0
    with Session(endpoint, client_name=f"prop-rank{rank}", timeout=30) as s:
        group = None
        while True:
            case = command(timeout=600)
            if case is None:
                return done
            try:
                if group is None or group.name != case.group:
                    if group is not None:
                        group.leave()
                    group = join(s, case, rank)
                report(case_round(s, group, case, rank))
            except Exception as e:
                report({"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()})
            done += 1
