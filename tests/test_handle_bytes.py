"""The engine memory a session's dispatch handles hold is budgeted
(--max-handle-bytes-per-session), not only their count.

A handle keeps routing arrays that grow with its tokens (on the cpu backend a low-latency
handle holds three [T, K] int64 arrays: 96 MiB at T = 65536, K = 64), so a session that kept
4096 handles of the largest shape could make the engine, which every tenant on its device
shares, allocate terabytes. Each backend states a bound per handle (`RankComm.handle_bytes`),
checked here against the arrays a real handle holds; the engine charges it before the
collective and refuses a dispatch that would pass the budget, naming the flag.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from epd.client import Session
from epd.proto import dtypes
from epd.proto.errors import EpdError
from epd.proto.v1 import epd_pb2
from epd.server.backends import base

TIMEOUT = 20.0


def held_nbytes(handle) -> int:
    """The bytes of the arrays a backend handle holds, each array counted once."""
    seen: set[int] = set()

    def walk(v) -> int:
        if isinstance(v, np.ndarray):
            if id(v) in seen:
                return 0
            seen.add(id(v))
            return v.nbytes
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return sum(walk(getattr(v, f.name)) for f in dataclasses.fields(v))
        return 0

    return walk(handle)


def _comms(spec: base.GroupSpec):
    from epd.server.backends.cpu import CpuBackend
    from epd.server.backends.cpu_plan import CpuPlanner

    d = tempfile.TemporaryDirectory(dir="/dev/shm")
    plan = CpuPlanner(d.name).plan_group("ghb", spec)
    backend = CpuBackend()
    comms = [backend.attach(spec, base.Membership("ghb", r, (0, 0), plan))
             for r in range(spec.num_ranks)]
    return d, comms


def _all(comms, fn):
    with ThreadPoolExecutor(len(comms)) as ex:
        return list(ex.map(fn, range(len(comms))))


def _dispatch(comms, args: list, slots: list, sequence: int) -> list:
    return _all(comms, lambda r: comms[r].dispatch(args[r], slots[r], sequence,
                                                   time.monotonic() + TIMEOUT))


def _routing(rng, t: int, k: int, experts: int) -> np.ndarray:
    idx = np.stack([rng.permutation(experts)[:k] for _ in range(t)]).astype(np.int64)
    idx[rng.random((t, k)) < 0.2] = -1  # some slots unused, as DeepEP allows
    return idx.reshape(t, k)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_cpu_normal_handles_stay_within_their_stated_bound(num_ranks: int) -> None:
    """Normal mode: the handle of a dispatch (random tokens per rank, up to the group's
    capacity, where every token can go to every rank) and of a cached dispatch hold no more
    than `handle_bytes` says."""
    rng = np.random.default_rng(num_ranks)
    experts, hidden, cap, k = 6 * num_ranks, 16, 48, 4
    spec = base.GroupSpec("hb", num_ranks, experts, hidden, cap, k, epd_pb2.BFLOAT16)
    d, comms = _comms(spec)
    try:
        for rnd in range(3):
            ts = [cap if rnd == 0 else int(rng.integers(0, cap + 1)) for _ in comms]
            xs = [np.zeros((t, hidden), dtypes.to_numpy(epd_pb2.BFLOAT16)) for t in ts]
            idx = [_routing(rng, t, k, experts) for t in ts]
            ws = [np.ones((t, k), np.float32) for t in ts]
            slots = [np.zeros(512, np.int64) for _ in comms]
            args = [base.DispatchArgs(xs[r], None, idx[r], ws[r]) for r in range(num_ranks)]
            outs = _dispatch(comms, args, slots, 2 * rnd + 1)
            for r, o in enumerate(outs):
                bound = comms[r].handle_bytes(False, ts[r], k)
                assert 0 < held_nbytes(o.handle) <= bound, (r, ts[r], held_nbytes(o.handle))
            args = [base.DispatchArgs(xs[r], None, None, None, cached=outs[r].handle)
                    for r in range(num_ranks)]
            again = _dispatch(comms, args, slots, 2 * rnd + 2)
            for r, o in enumerate(again):  # (the engine charges it the cached one's bound)
                assert held_nbytes(o.handle) <= comms[r].handle_bytes(False, ts[r], k)
    finally:
        for c in comms:
            c.close()
        d.cleanup()


def test_cpu_low_latency_handles_stay_within_their_stated_bound() -> None:
    rng = np.random.default_rng(7)
    num_ranks, experts, hidden, cap, k = 2, 8, 128, 32, 3
    spec = base.GroupSpec("hbll", num_ranks, experts, hidden, cap, k, epd_pb2.BFLOAT16,
                          low_latency_mode=True)
    d, comms = _comms(spec)
    try:
        for _ in range(3):
            ts = [int(rng.integers(0, cap + 1)) for _ in comms]
            xs = [np.zeros((t, hidden), dtypes.to_numpy(epd_pb2.BFLOAT16)) for t in ts]
            idx = [_routing(rng, t, k, experts) for t in ts]
            args = [base.LowLatencyDispatchArgs(xs[r], idx[r], cap, topk_idx_host=idx[r])
                    for r in range(num_ranks)]
            outs = _all(comms, lambda r, args=args: comms[r].low_latency_dispatch(
                args[r], time.monotonic() + TIMEOUT))
            for r, o in enumerate(outs):
                assert 0 < held_nbytes(o.handle) <= comms[r].handle_bytes(True, ts[r], k)
    finally:
        for c in comms:
            c.close()
        d.cleanup()


# -- through the daemon -----------------------------------------------------------------------
T, K, E, H = 4096, 8, 16, 8


def test_low_latency_handle_bytes_are_budgeted(daemon_factory) -> None:
    """One session keeps low-latency handles of 4096 tokens x top-8 (three [T, K] int64 arrays,
    768 KiB each on the cpu backend, though no row travels): with a 3 MiB budget the fourth
    dispatch is refused RESOURCE_EXHAUSTED naming the flag and the bytes, before the collective
    (nothing changes: the dispatch each receive buffer holds still combines), and dropping one
    makes room."""
    per = 24 * T * K + 8 * E
    budget = ["--max-handle-bytes-per-session", str(3 * per + per // 2)]
    with daemon_factory(engines=1, extra=budget) as d, Session(d.socket(0), timeout=TIMEOUT) as s:
        g = s.join("hb-ll", rank=0, num_ranks=1, num_experts=E, hidden=H,
                   max_tokens_per_rank=T, num_topk=K, low_latency_mode=True)
        x = s.empty((T, H), dtypes.BFLOAT16)
        x[:] = 1
        idx = s.empty((T, K), np.int64)
        idx[:] = -1
        idx[:, 0] = np.arange(T) % E
        # (receive buffers 0, 1, 0: the third overwrites the first's, which it keeps a
        # handle of all the same; DeepEP's double buffer)
        held = [g.low_latency_dispatch(x, idx, T, copy=False, buffer=i % 2) for i in range(3)]
        with pytest.raises(EpdError) as ei:
            g.low_latency_dispatch(x, idx, T, copy=False, buffer=1)
        assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-handle-bytes-per-session" in ei.value.details
        assert f"holds {3 * per} bytes of dispatch handles" in ei.value.details
        assert s.stats().groups[0].handles == 3
        w = np.ones((T, K), np.float32)
        for out in held[1:]:  # the refused call changed nothing: each buffer's dispatch
            y = g.low_latency_combine(out.recv_x, idx, w, out.handle)  # combines
            np.testing.assert_array_equal(np.asarray(y, np.float32), 1.0)
        held.pop(0)
        gc.collect()
        g.low_latency_dispatch(x, idx, T, copy=False)  # room again once one is dropped


def test_normal_handle_bytes_are_budgeted_and_cached_dispatch_charged(daemon_factory) -> None:
    """Normal mode: a budget of one handle's bound and a half takes a dispatch; the next
    dispatch, and a cached dispatch of the first (which keeps its arrays alive), are refused
    naming the flag; after the first handle is dropped a new dispatch fits."""
    r, t, cap = 1, 64, 64
    bound = t * r + 8 * r * r + 12 * r * cap
    budget = ["--max-handle-bytes-per-session", str(bound + bound // 2)]
    with daemon_factory(engines=1, extra=budget) as d, Session(d.socket(0), timeout=TIMEOUT) as s:
        g = s.join("hb-n", rank=0, num_ranks=1, num_experts=E, hidden=H,
                   max_tokens_per_rank=cap, num_topk=K)
        x = np.ones((t, H), dtypes.BFLOAT16)
        idx = np.tile(np.arange(K, dtype=np.int64), (t, 1))
        w = np.ones((t, K), np.float32)
        first = g.dispatch(x, idx, w)
        for cached in (None, first.handle):
            with pytest.raises(EpdError) as ei:
                if cached is None:
                    g.dispatch(x, idx, w)
                else:
                    g.dispatch(x, handle=cached)
            assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-handle-bytes-per-session" in ei.value.details
        combined, _ = g.combine(first.recv_x, first.handle)
        # (one rank: each token's row comes back once)
        np.testing.assert_array_equal(np.asarray(combined, np.float32), 1.0)
        # (the refusal's traceback holds the cached call's handle argument)
        del first, cached, ei
        gc.collect()
        g.dispatch(x, idx, w)
