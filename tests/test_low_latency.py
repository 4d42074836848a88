"""Low-latency (decode) mode on the CPU backend: DeepEP's low_latency_dispatch / _combine through a
real daemon, ranks as threads with one Session each, compared with server/reference.py.

Rows within a local expert may come in any order, so dispatch results are compared as sets keyed
by (source rank, source token); combine results bit-exactly."""

from __future__ import annotations

import collections
import functools
import itertools
import time
import types
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from epd.client import EpdError, Session
from epd.client.buffer import Buffer, EventOverlap
from epd.proto import dtypes
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref

pytestmark = pytest.mark.slow
BF16, FP8 = dtypes.BFLOAT16, dtypes.FLOAT8_E4M3
R, E, K, H = 3, 12, 3, 256  # 4 local experts per rank
MAX_T = 32  # the groups' max_tokens_per_rank
_names = itertools.count()

# use_fp8, round_scale, use_ue8m0
MODES = {"bf16": (False, False, False), "fp8": (True, False, False),
         "fp8-round": (True, True, False), "fp8-ue8m0": (True, False, True)}


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def _workload(tokens: list[int], seed: int, *, drop_prob: float = 0.15,
              experts: int = E, num_ranks: int = R):
    rng = np.random.default_rng(seed)
    xs = [ref.random_x(rng, t, H, BF16) for t in tokens]
    routing = [ref.random_routing(rng, t, experts, K, drop_prob=drop_prob, num_ranks=num_ranks)
               for t in tokens]
    return xs, [r[0] for r in routing], [r[1] for r in routing]


def _run(daemon, fn, *, num_ranks: int = R, fast: bool = True, experts: int = E,
         max_tokens: int = MAX_T):
    """Open one session per rank (engines round robin), join a fresh group, run
    fn(rank, session, group) on every rank at once, return the results by rank."""
    sessions = [Session(daemon.socket(r % daemon.engines), fast_path=fast)
                for r in range(num_ranks)]
    name = f"ll-{next(_names)}"
    try:
        assert {s.transport for s in sessions} == {"fastpath" if fast else "grpc"}

        def rank(r: int):
            g = sessions[r].join(name, rank=r, num_ranks=num_ranks, num_experts=experts,
                                 hidden=H, max_tokens_per_rank=max_tokens, num_topk=K)
            return fn(r, sessions[r], g)
        with ThreadPoolExecutor(num_ranks) as ex:
            return list(ex.map(rank, range(num_ranks)))
    finally:
        for s in sessions:
            s.close()


def _dequant(recv_x, scales) -> np.ndarray:
    """fp32 view of received rows (FP8 times its per-128-channel scale)."""
    x = np.asarray(recv_x).astype(np.float32)
    if scales is not None:
        x = x * np.repeat(np.asarray(scales), dtypes.FP8_BLOCK, axis=-1)
    return x


def _expert(rank: int, recv_x, scales) -> np.ndarray:
    """A per-row 'expert' (depends on the local expert and rank only): bf16 [L, rows, H]."""
    x = _dequant(recv_x, scales)
    factor = (np.arange(x.shape[0], dtype=np.float32) * 0.25 + 0.5 + rank)[:, None, None]
    return (x * factor).astype(BF16)


def _rows(recv_x, scales, src_rank, src_idx, count, e: int) -> dict:
    """{(src_rank, src_idx): (payload bits, scales)} of the valid rows of local expert e."""
    n = int(count[e])
    bits = np.asarray(recv_x)[e, :n].view(np.uint8)
    out = {}
    for row in range(n):
        key = (int(src_rank[e, row]), int(src_idx[e, row]))
        assert key not in out, f"row {key} received twice by local expert {e}"
        out[key] = (bits[row].tobytes(), None if scales is None else
                    np.asarray(scales)[e, row].tobytes())
    return out


def _check_dispatch(got, want: ref.LowLatencyDispatch) -> None:
    """One rank's low-latency dispatch against the reference, as sets per local expert."""
    np.testing.assert_array_equal(got.recv_count, want.recv_count)
    assert got.recv_count.dtype == np.int32
    local = want.recv_count.shape[0]
    fp8 = want.recv_x_scales is not None
    assert got.recv_x.dtype == (FP8 if fp8 else BF16)
    assert got.recv_x.shape == want.recv_x.shape
    assert (got.recv_x_scales is not None) == fp8
    for e in range(local):
        assert _rows(got.recv_x, got.recv_x_scales, got.recv_src_rank, got.recv_src_idx,
                     got.recv_count, e) == \
            _rows(want.recv_x, want.recv_x_scales, want.recv_src_rank, want.recv_src_idx,
                  want.recv_count, e)
        n = int(want.recv_count[e])  # beyond the count: zero rows, source -1 (the reference's)
        assert not np.asarray(got.recv_x)[e, n:].view(np.uint8).any()
        assert (np.asarray(got.recv_src_rank)[e, n:] == -1).all()
        assert (np.asarray(got.recv_src_idx)[e, n:] == -1).all()


def _reference(xs, idx, w, num_max: int, mode: str, experts: int = E):
    use_fp8, round_scale, ue8m0 = MODES[mode]
    disp = ref.low_latency_dispatch(xs, idx, experts, num_max, use_fp8=use_fp8,
                                    round_scale=round_scale or ue8m0)
    ys = [_expert(d, dd.recv_x, dd.recv_x_scales) for d, dd in enumerate(disp)]
    return disp, ref.low_latency_combine(ys, disp, idx, w, experts)


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


# ------------------------------------------------------------------------------------------------
# semantics
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "grpc"])
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_reference(daemon, mode: str, fast: bool) -> None:
    """bf16 and FP8 (plain, round_scale, ue8m0), -1 entries, a rank with zero tokens; two
    rounds with different routing reuse the buffers."""
    use_fp8, round_scale, ue8m0 = MODES[mode]
    num_max = 24
    rounds = [_workload([20, 0, 13], seed=1), _workload([7, 24, 1], seed=2)]

    def fn(r, s, g):
        got = []
        for xs, idx, w in rounds:
            out = g.low_latency_dispatch(xs[r], idx[r], num_max, use_fp8=use_fp8,
                                         round_scale=round_scale, use_ue8m0=ue8m0)
            y = _expert(r, out.recv_x, out.recv_x_scales)
            got.append((out, g.low_latency_combine(y, idx[r], w[r], out.handle)))
        return got

    res = _run(daemon, fn, fast=fast)
    for i, (xs, idx, w) in enumerate(rounds):
        disp, comb = _reference(xs, idx, w, num_max, mode)
        for r in range(R):
            out, cx = res[r][i]
            _check_dispatch(out, disp[r])
            if ue8m0 or round_scale:  # power-of-two scales
                sc = out.recv_x_scales[out.recv_src_rank >= 0]
                np.testing.assert_array_equal(np.exp2(np.round(np.log2(sc))), sc)
            assert cx.dtype == BF16 and cx.shape == (len(xs[r]), H)
            np.testing.assert_array_equal(_bits(cx), _bits(comb[r]))


def test_rank_receiving_nothing_and_no_routes(daemon) -> None:
    """Rank 1's experts are never picked; rank 2 routes every token nowhere (-1)."""
    rng = np.random.default_rng(5)
    tokens = [9, 6, 4]
    xs = [ref.random_x(rng, t, H, BF16) for t in tokens]
    local = E // R
    idx, w = [], []
    for r, t in enumerate(tokens):
        choice = np.full((t, K), -1, dtype=np.int64)
        if r != 2:  # experts of ranks 0 and 2 only, distinct per token
            pool = np.r_[0:local, 2 * local:3 * local]
            for i in range(t):
                choice[i] = rng.choice(pool, K, replace=False)
        idx.append(choice)
        w.append(np.where(choice >= 0, rng.random((t, K)), 0).astype(np.float32))

    def fn(r, s, g):
        out = g.low_latency_dispatch(xs[r], idx[r], 16)
        return out, g.low_latency_combine(_expert(r, out.recv_x, None), idx[r], w[r],
                                          out.handle)

    res = _run(daemon, fn)
    disp, comb = _reference(xs, idx, w, 16, "bf16")
    assert not disp[1].recv_count.any()
    for r in range(R):
        _check_dispatch(res[r][0], disp[r])
        np.testing.assert_array_equal(_bits(res[r][1]), _bits(comb[r]))
    np.testing.assert_array_equal(_bits(res[2][1]), np.zeros((4, H), np.uint16))


def test_mixed_with_normal_mode(daemon) -> None:
    """Normal and low-latency collectives share the group's sequence: interleaved, all exact."""
    xs, idx, w = _workload([11, 5, 8], seed=9)
    disp_n = ref.dispatch(xs, idx, w, E)
    comb_n = ref.combine([d.recv_x for d in disp_n], disp_n, [len(x) for x in xs])
    disp_l, comb_l = _reference(xs, idx, w, 16, "fp8")

    def fn(r, s, g):
        out = []
        for _ in range(2):
            n = g.dispatch(xs[r], idx[r], w[r])
            out.append(("n", n, g.combine(n.recv_x, n.handle)[0]))
            ll = g.low_latency_dispatch(xs[r], idx[r], 16, use_fp8=True)
            out.append(("l", ll, g.low_latency_combine(_expert(r, ll.recv_x, ll.recv_x_scales),
                                                       idx[r], w[r], ll.handle)))
        return out

    for r, got in enumerate(_run(daemon, fn)):
        for kind, d, cx in got:
            if kind == "n":
                np.testing.assert_array_equal(_bits(d.recv_x), _bits(disp_n[r].recv_x))
                np.testing.assert_array_equal(_bits(cx), _bits(comb_n[r][0]))
            else:
                _check_dispatch(d, disp_l[r])
                np.testing.assert_array_equal(_bits(cx), _bits(comb_l[r]))


def test_cumulative_stats_and_out(daemon) -> None:
    """cumulative_local_expert_recv_stats accumulates across calls (a staged NumPy array and one
    in a registered region); out= writes into the caller's array (staged and registered)."""
    xs, idx, w = _workload([10, 12, 3], seed=4)
    disp, comb = _reference(xs, idx, w, 12, "bf16")

    def fn(r, s, g):
        local = E // R
        staged = np.full(local, 5, dtype=np.int32)
        registered = s.empty(local, np.int32)
        registered[:] = 0
        outs = []
        for i in range(3):
            stats = staged if i % 2 == 0 else registered
            d = g.low_latency_dispatch(xs[r], idx[r], 12,
                                       cumulative_local_expert_recv_stats=stats)
            y = _expert(r, d.recv_x, None)
            mine = np.zeros((len(xs[r]), H), dtype=BF16)
            reg_out = s.empty((len(xs[r]), H), BF16)
            a = g.low_latency_combine(y, idx[r], w[r], d.handle, out=mine)
            b = g.low_latency_combine(y, idx[r], w[r], d.handle, out=reg_out)
            c = g.low_latency_combine(y, idx[r], w[r], d.handle)
            outs.append((a is mine, b is reg_out, mine.copy(), np.array(reg_out), c))
        return staged.copy(), np.array(registered), outs

    for r, (staged, registered, outs) in enumerate(_run(daemon, fn)):
        np.testing.assert_array_equal(staged, 5 + 2 * disp[r].recv_count)
        np.testing.assert_array_equal(registered, disp[r].recv_count)
        for same_a, same_b, a, b, c in outs:
            assert same_a and same_b
            for arr in (a, b, c):
                np.testing.assert_array_equal(_bits(arr), _bits(comb[r]))


# ------------------------------------------------------------------------------------------------
# bad input: precise codes, nothing changes, a corrected retry completes the collective
# ------------------------------------------------------------------------------------------------

def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(EpdError) as ei:
        fn()
    return ei.value.code, str(ei.value)


@pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "grpc"])
def test_bad_input(daemon, fast: bool) -> None:
    xs, idx, w = _workload([6, 4, 5], seed=11)
    disp, comb = _reference(xs, idx, w, 8, "bf16")
    INV, PRE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

    def fn(r, s, g):
        stats = np.zeros(E // R, dtype=np.int32)
        errors = []
        if r == 0:  # rejected before the rank takes part: the peers just wait for it
            x, i = xs[0], idx[0]
            dup = i.copy()
            dup[0, 1] = dup[0, 0] = 3
            cases = {
                "num_max above the group's": lambda: g.low_latency_dispatch(
                    x, i, MAX_T + 1, cumulative_local_expert_recv_stats=stats),
                "num_max zero": lambda: g.low_latency_dispatch(x, i, 0),
                "tokens above num_max": lambda: g.low_latency_dispatch(
                    x, i, 5, cumulative_local_expert_recv_stats=stats),
                "wrong num_experts": lambda: g.low_latency_dispatch(x, i, 8, num_experts=E + 3),
                "x float32": lambda: g.low_latency_dispatch(x.astype(np.float32), i, 8),
                "topk_idx int32": lambda: g.low_latency_dispatch(x, i.astype(np.int32), 8),
                "topk_idx wrong width": lambda: g.low_latency_dispatch(x, i[:, :2], 8),
                "expert id out of range": lambda: g.low_latency_dispatch(
                    x, np.where(i >= 0, i, E), 8),
                "duplicate expert": lambda: g.low_latency_dispatch(x, dup, 8),
                "round_scale without fp8": lambda: g.low_latency_dispatch(
                    x, i, 8, round_scale=True),
                "stats wrong shape": lambda: g.low_latency_dispatch(
                    x, i, 8, cumulative_local_expert_recv_stats=np.zeros(E, np.int32)),
                "stats wrong dtype": lambda: g.low_latency_dispatch(
                    x, i, 8, cumulative_local_expert_recv_stats=np.zeros(E // R, np.int64)),
                "receive buffer 2": lambda: g.low_latency_dispatch(x, i, 8, buffer=2),
            }
            for what, call in cases.items():
                errors.append((what, *_code(call)))
        d = g.low_latency_dispatch(xs[r], idx[r], 8, cumulative_local_expert_recv_stats=stats)
        y = _expert(r, d.recv_x, None)
        if r == 0:
            unknown = type(d.handle)(g, 999, d.handle.num_tokens, 8, E, H)
            bad_idx = idx[0].copy()
            bad_idx[0] = [e for e in range(E) if e not in idx[0][0]][:K]
            dup_c = idx[0].copy()  # a row naming one of its dispatched experts twice
            t_dup = next(t for t in range(len(dup_c)) if dup_c[t, 0] >= 0)
            dup_c[t_dup, 1] = dup_c[t_dup, 0]
            cases = {
                "combine duplicate expert": lambda: g.low_latency_combine(y, dup_c, w[0],
                                                                          d.handle),
                "unknown handle": lambda: g.low_latency_combine(y, idx[0], w[0], unknown),
                "x wrong rows": lambda: g.low_latency_combine(y[:, :-1], idx[0], w[0],
                                                              d.handle),
                "combine x float32": lambda: g.low_latency_combine(
                    y.astype(np.float32), idx[0], w[0], d.handle),
                "weights wrong shape": lambda: g.low_latency_combine(y, idx[0], w[0][:-1],
                                                                     d.handle),
                "out wrong shape": lambda: g.low_latency_combine(
                    y, idx[0], w[0], d.handle, out=np.zeros((1, H), BF16)),
                "expert not dispatched": lambda: g.low_latency_combine(y, bad_idx, w[0],
                                                                       d.handle),
                "not found group": lambda: s._call(
                    "LowLatencyCombine", epd_pb2.LowLatencyCombineRequest(
                        session_id=s.session_id, group_id="nope", handle=d.handle.handle_id)),
            }
            for what, call in cases.items():
                errors.append((what, *_code(call)))
        cx = g.low_latency_combine(y, idx[r], w[r], d.handle)
        # A normal handle to low-latency combine and back: FAILED_PRECONDITION.
        n = g.dispatch(xs[r], idx[r], w[r])
        if r == 0:
            normal_as_ll = type(d.handle)(g, n.handle.handle_id, len(xs[0]), 8, E, H)
            errors.append(("normal handle to ll combine",
                           *_code(lambda: g.low_latency_combine(y, idx[0], w[0],
                                                                normal_as_ll))))
            ll_as_normal = type(n.handle)(g, d.handle.handle_id, 0, 0, n.handle.rows)
            errors.append(("ll handle to combine",
                           *_code(lambda: g.combine(n.recv_x, ll_as_normal))))
            errors.append(("ll handle to cached dispatch",
                           *_code(lambda: g.dispatch(xs[0], handle=ll_as_normal))))
        g.combine(n.recv_x, n.handle)
        return errors, stats, d, cx

    res = _run(daemon, fn, fast=fast)
    want = {
        "num_max above the group's": (INV, "exceeds the group's max_tokens_per_rank=32"),
        "num_max zero": (INV, "num_max_dispatch_tokens_per_rank must be positive"),
        "tokens above num_max": (INV, "6 tokens exceed num_max_dispatch_tokens_per_rank=5"),
        "wrong num_experts": (INV, "num_experts=15 does not match the group's num_experts=12"),
        "x float32": (INV, "x: dtype float32 is not one of ['bfloat16']"),
        "topk_idx int32": (INV, "topk_idx: dtype int32"),
        "topk_idx wrong width": (INV, "topk_idx has shape [6, 2], expected [6, 3]"),
        "expert id out of range": (INV, "valid ids are -1 (none) and [0, 12)"),
        "duplicate expert": (INV, "topk_idx[0] names expert 3 twice"),
        "round_scale without fp8": (INV, "they need use_fp8"),
        "stats wrong shape": (INV, "expected [4] (local experts)"),
        "stats wrong dtype": (INV, "cumulative_local_expert_recv_stats: dtype int64"),
        "receive buffer 2": (INV, "buffer=2: a rank has receive buffers 0 and 1"),
        "unknown handle": (PRE, "handle 999 is not known"),
        "x wrong rows": (INV, "expected [4, 24, 256]"),
        "combine x float32": (INV, "x: dtype float32 is not one of ['bfloat16']"),
        "weights wrong shape": (INV, "topk_weights has shape [5, 3], expected [6, 3]"),
        "out wrong shape": (INV, "out has shape [1, 256], expected [6, 256]"),
        "expert not dispatched": (INV, "was not dispatched to that expert"),
        "combine duplicate expert": (INV, "twice; low-latency mode needs distinct experts"),
        "not found group": (grpc.StatusCode.NOT_FOUND, "group 'nope' is not joined"),
        "normal handle to ll combine": (PRE, "comes from a normal dispatch; pass it to Combine"),
        "ll handle to combine": (PRE, "comes from a low-latency dispatch; pass it to "
                                      "LowLatencyCombine"),
        "ll handle to cached dispatch": (PRE, "comes from a low-latency dispatch"),
    }
    errors = {what: (code, msg) for what, code, msg in res[0][0]}
    assert set(errors) == set(want)
    for what, (code, text) in want.items():
        assert errors[what][0] == code, (what, errors[what])
        assert text in errors[what][1], (what, errors[what][1])
    # Nothing changed: the stats got exactly one dispatch's counts, the results are exact.
    for r in range(R):
        _, stats, d, cx = res[r]
        np.testing.assert_array_equal(stats, disp[r].recv_count)
        _check_dispatch(d, disp[r])
        np.testing.assert_array_equal(_bits(cx), _bits(comb[r]))


def test_a_combine_of_an_overwritten_receive_buffer_is_refused(daemon) -> None:
    """DeepEP's double buffer on the CPU backend as on the CUDA engine: two dispatches may be
    in flight, one per receive buffer (D0 D1 C0 C1: exact); a third into a buffer overwrites
    the dispatch there, whose combine is then refused with FAILED_PRECONDITION on every rank,
    before taking part; the group goes on."""
    xs, idx, w = _workload([6, 5, 4], seed=21)
    _, comb = _reference(xs, idx, w, 8, "bf16")

    def fn(r, s, g):
        d0 = g.low_latency_dispatch(xs[r], idx[r], 8, buffer=0)
        d1 = g.low_latency_dispatch(xs[r], idx[r], 8, buffer=1)
        c0 = g.low_latency_combine(_expert(r, d0.recv_x, None), idx[r], w[r], d0.handle)
        c1 = g.low_latency_combine(_expert(r, d1.recv_x, None), idx[r], w[r], d1.handle)
        d2 = g.low_latency_dispatch(xs[r], idx[r], 8, buffer=0)
        stale = _code(lambda: g.low_latency_combine(_expert(r, d0.recv_x, None), idx[r], w[r],
                                                    d0.handle))
        c2 = g.low_latency_combine(_expert(r, d2.recv_x, None), idx[r], w[r], d2.handle)
        return stale, c0, c1, c2

    res = _run(daemon, fn)
    for r in range(R):
        (code, msg), *cs = res[r]
        assert code == grpc.StatusCode.FAILED_PRECONDITION, msg
        assert "in receive buffer 0 was overwritten by dispatch" in msg, msg
        for c in cs:
            np.testing.assert_array_equal(_bits(c), _bits(comb[r]))


def test_arguments_that_differ_across_ranks(daemon) -> None:
    """num_max_dispatch_tokens_per_rank / use_fp8 must agree: every rank gets
    FAILED_PRECONDITION naming the disagreement, and the group stays usable (see
    test_collective_consistency.py)."""
    xs, idx, w = _workload([4, 4, 4], seed=3)
    disp, comb = _reference(xs, idx, w, 8, "bf16")

    def fn(r, s, g):
        first = _code(lambda: g.low_latency_dispatch(xs[r], idx[r], 8 if r else 16))
        second = _code(lambda: g.low_latency_dispatch(xs[r], idx[r], 8, use_fp8=r == 2))
        d = g.low_latency_dispatch(xs[r], idx[r], 8)
        return first, second, d, g.low_latency_combine(_expert(r, d.recv_x, None), idx[r],
                                                       w[r], d.handle)

    for r, (first, second, d, cx) in enumerate(_run(daemon, fn)):
        for code, msg in (first, second):
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "arguments differ across ranks" in msg
        _check_dispatch(d, disp[r])
        np.testing.assert_array_equal(_bits(cx), _bits(comb[r]))


# ------------------------------------------------------------------------------------------------
# the DeepEP facade
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_torch", [False, True], ids=["numpy", "torch"])
def test_deepep_low_latency_call_sequence(daemon, use_torch: bool) -> None:
    torch = pytest.importorskip("torch") if use_torch else None
    xs, idx, w = _workload([14, 9, 16], seed=17)
    num_max = 16
    disp, comb = _reference(xs, idx, w, num_max, "fp8")
    disp_bf, comb_bf = _reference(xs, idx, w, num_max, "bf16")

    def to_in(a):
        if torch is None:
            return a
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def to_np(a):
        if torch is None:
            return np.asarray(a)
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).numpy().view(BF16)
        if a.dtype == torch.float8_e4m3fn:
            return a.view(torch.uint8).numpy().view(FP8)
        return a.numpy()

    def rank(r: int):
        buf = Buffer(None, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=E // R,
                     rank=r, num_ranks=R, endpoint=daemon.socket(r % daemon.engines),
                     group_name=f"deepep-ll-{use_torch}", max_tokens_per_rank=MAX_T)
        try:
            assert Buffer.get_low_latency_rdma_size_hint(num_max, H, R, E) > 0
            buf.clean_low_latency_buffer(num_max, H, E)
            x, i, wt = to_in(xs[r]), to_in(idx[r]), to_in(w[r])
            stats = to_in(np.zeros(E // R, dtype=np.int32))
            (rx, rs), count, handle, event, hook = buf.low_latency_dispatch(
                x, i, num_max, E, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                async_finish=True, return_recv_hook=True)
            assert isinstance(event, EventOverlap) and callable(hook)
            event.current_stream_wait()
            hook()
            got = {"fp8": (to_np(rx), to_np(rs), to_np(count), handle)}
            y = buf.get_next_low_latency_combine_buffer(handle)
            assert type(y).__module__.startswith("torch" if torch else "numpy")
            y[...] = to_in(_expert(r, to_np(rx), to_np(rs)))
            out = to_in(np.zeros((len(xs[r]), H), dtype=BF16))
            cx, event, hook = buf.low_latency_combine(y, i, wt, handle, zero_copy=True,
                                                      out=out)
            assert cx is out and hook is None and isinstance(event, EventOverlap)
            got["fp8_combined"] = to_np(cx).copy()
            # bf16 dispatch, no hook, a fresh output tensor
            rx, count, handle, _, hook = buf.low_latency_dispatch(
                x, i, num_max, E, cumulative_local_expert_recv_stats=stats, use_fp8=False)
            assert hook is None
            cx, _, _ = buf.low_latency_combine(to_in(_expert(r, to_np(rx), None)), i, wt,
                                               handle, return_recv_hook=True)
            got["bf16"] = (to_np(rx), to_np(count), to_np(cx), to_np(stats).copy())
            return got
        finally:
            buf.destroy()

    with ThreadPoolExecutor(R) as ex:
        res = list(ex.map(rank, range(R)))
    for r, got in enumerate(res):
        rx, rs, count, _ = got["fp8"]
        np.testing.assert_array_equal(count, disp[r].recv_count)
        assert rx.dtype == FP8 and rs.dtype == np.float32
        assert rx.shape == (E // R, R * num_max, H) and rs.shape == (E // R, R * num_max, H // 128)
        # compare as multisets of rows per expert (no source info in DeepEP's return values)
        for e in range(E // R):
            n = int(count[e])
            mine = sorted(zip(rx[e, :n].view(np.uint8).tolist(), rs[e, :n].tolist(),
                              strict=True))
            want = sorted(zip(disp[r].recv_x[e, :n].view(np.uint8).tolist(),
                              disp[r].recv_x_scales[e, :n].tolist(), strict=True))
            assert mine == want
        np.testing.assert_array_equal(_bits(got["fp8_combined"]), _bits(comb[r]))
        rx, count, cx, stats = got["bf16"]
        np.testing.assert_array_equal(count, disp_bf[r].recv_count)
        assert rx.dtype == BF16
        np.testing.assert_array_equal(_bits(cx), _bits(comb_bf[r]))
        np.testing.assert_array_equal(stats, 2 * disp[r].recv_count)


def test_two_micro_batches_get_two_combine_buffers(daemon) -> None:
    """get_next_low_latency_combine_buffer gives the two dispatches in flight (D0 D1, one per
    receive buffer) buffers of their own, and the same one again to a handle of the same
    receive buffer (a review: one per shape, so C0's and C1's expert outputs shared memory)."""
    xs, idx, w = _workload([6], seed=19)
    buf = Buffer(None, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=E, rank=0,
                 num_ranks=1, endpoint=daemon.socket(0), group_name="ll-two-buffers",
                 max_tokens_per_rank=MAX_T)
    try:
        handles = [buf.low_latency_dispatch(xs[0], idx[0], 8, E, use_fp8=False)[2]
                   for _ in range(2)]
        y0, y1 = (buf.get_next_low_latency_combine_buffer(h) for h in handles)
        assert not np.shares_memory(y0, y1)
        assert buf.get_next_low_latency_combine_buffer(handles[0]) is y0
        for h, y in zip(handles, (y0, y1), strict=True):  # (each combines its own)
            y[...] = 0
            cx, _, _ = buf.low_latency_combine(y, idx[0], w[0], h)
            assert not np.asarray(cx).any()
    finally:
        buf.destroy()


# ------------------------------------------------------------------------------------------------
# metrics and backends without low-latency kernels
# ------------------------------------------------------------------------------------------------

def test_metrics(daemon) -> None:
    """Low-latency ops count under their method names and time into the dispatch/combine
    histograms with the usual labels (path grpc / fastpath)."""
    xs, idx, w = _workload([3, 2, 4], seed=23)

    def fn(r, s, g):
        d = g.low_latency_dispatch(xs[r], idx[r], 4)
        g.low_latency_combine(_expert(r, d.recv_x, None), idx[r], w[r], d.handle)
        return g.name

    names = {path: _run(daemon, fn, fast=path == "fastpath")[0] for path in ("fastpath", "grpc")}
    status, text = daemon.get("/metrics")
    assert status == 200
    for method in ("LowLatencyDispatch", "LowLatencyCombine"):
        assert f'epd_requests_total{{code="OK",method="{method}"}}' in text
    for hist in ("epd_dispatch_seconds", "epd_combine_seconds"):
        for path, name in names.items():  # one observation per rank, summed over engines
            lines = [line for line in text.splitlines() if line.startswith(f"{hist}_count{{")
                     and f'group="{name}"' in line and f'path="{path}"' in line]
            assert len(lines) == 1 and float(lines[0].split()[-1]) == R, (hist, path, lines)


def test_backend_without_low_latency_answers_failed_precondition() -> None:
    """The RankComm defaults (a backend without low-latency kernels)."""
    from epd.proto.errors import FailedPrecondition
    from epd.server.backends.base import LowLatencyCombineArgs, LowLatencyDispatchArgs, RankComm

    class NoLowLatency(RankComm):
        backend_name = "cuda"
        layout = dispatch = combine = abort = abort_reason = close = None  # type: ignore

    comm = NoLowLatency()
    for call in (lambda: comm.low_latency_dispatch(LowLatencyDispatchArgs(None, None, 1), 0.0),
                 lambda: comm.low_latency_combine(LowLatencyCombineArgs(None, None, None, None),
                                                  0.0)):
        with pytest.raises(FailedPrecondition,
                           match="low-latency mode is not implemented on the cuda backend"):
            call()



def test_stream_ordered_calls_need_the_cuda_backend(daemon) -> None:
    """Arming a stream-ordered call on the cpu backend is refused before anything changes: the
    counter slot is not taken (64 refused arms later, joining still works), and disarming an
    unknown op is NOT_FOUND. (The stream-ordered path itself runs on GPUs: tests/gpu.)"""
    with Session(daemon.socket(0), timeout=10) as s:
        g = s.join(f"arm-{next(_names)}", rank=0, num_ranks=1, num_experts=4, hidden=H,
                   max_tokens_per_rank=8, num_topk=2)
        x = np.zeros((4, H), BF16)
        idx = np.tile(np.array([[0, 3]], np.int64), (4, 1))
        d = s._descs({"x": x, "topk_idx": idx})
        inner = epd_pb2.LowLatencyDispatchRequest(
            session_id=s.session_id, group_id=g.group_id, num_max_dispatch_tokens_per_rank=8,
            num_experts=4, **d)
        for _ in range(70):
            code, msg = _code(lambda: s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
                session_id=s.session_id, group_id=g.group_id, low_latency_dispatch=inner)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "need the cuda backend" in msg
        code, msg = _code(lambda: s._call("ArmStreamOp", epd_pb2.ArmStreamOpRequest(
            session_id=s.session_id, group_id=g.group_id)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs" in msg
        code, _ = _code(lambda: s._call("DisarmStreamOp", epd_pb2.DisarmStreamOpRequest(
            session_id=s.session_id, op_id=12345)))
        assert code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(EpdError, match="need the cuda backend"):
            g.arm_low_latency_dispatch(x, idx, 8)
        g2 = s.join(f"arm-{next(_names)}", rank=0, num_ranks=1, num_experts=4, hidden=H,
                    max_tokens_per_rank=8, num_topk=2)
        out = g2.low_latency_dispatch(x, idx, 8)
        assert int(np.asarray(out.recv_count).sum()) == 4 * 2


def test_stream_op_done_words() -> None:
    """The done-word protocol shared by the engine (stream_ops.py, epd_stream_done) and the
    client: values the GPU and the engine write, and the errors the client makes of them."""
    from epd.client import stream_ops as C
    from epd.server.backends import cuda_kernels as ck
    from epd.server.engine import stream_ops as S

    assert (C.REQUEST, C.DONE) == (S.REQUEST, S.DONE)
    assert (C.DONE_OK, C.DONE_FAILED, C.DONE_RELEASED) == (S.DONE_OK, S.DONE_FAILED,
                                                           S.DONE_RELEASED)
    assert C.done_error(C.DONE_OK, "op") is None
    assert C.done_error(0, "op") is None  # in flight
    e = C.done_error(C.DONE_FAILED | (ck.ERR_BAD_INPUT << 8), "op 3")
    assert e.code == grpc.StatusCode.ABORTED and "bad expert id" in e.details
    e = C.done_error(C.DONE_FAILED | (ck.ERR_DEADLINE << 8), "op 3")
    assert "deadline" in e.details
    e = C.done_error(C.DONE_FAILED | (0xFF << 8), "op 3")
    assert "could not launch" in e.details
    e = C.done_error(C.DONE_RELEASED, "op 3")
    assert e.code == grpc.StatusCode.UNAVAILABLE


def _stand_in_op(group: str, launch):
    """An armed dispatch op (slot 3) around a stand-in comm whose launches call `launch`:
    (op, comm, member, session, the slot's words)."""
    import threading
    import types

    from epd.server.engine import stream_ops as S

    comm = types.SimpleNamespace(launch_prepared=launch)
    member = types.SimpleNamespace(comm=comm, spec=types.SimpleNamespace(name=group, label=group),
                                   dispatches=0, combines=0)
    session = types.SimpleNamespace(op_lock=threading.Lock(), stream_ops={}, free_slots=[],
                                    describe=lambda: "session")
    _slots_of(session)
    words = np.zeros(8, np.int32)
    op = _held(S.StreamOp(1, S.KIND_DISPATCH, session, member, None, 3, words, "prepared"))
    return op, comm, member, session, words


def _held(op):
    """A stand-in op made without an arm, holding its slot whole as an arm's would."""
    op.session.record_slots[op.slot] = {0}
    return op


def test_stream_op_fire_and_release_bookkeeping() -> None:
    """The engine side of a stream op around the backend (a stand-in comm records launches):
    a trigger launches the prepared op under the session's lock, a launch failure answers
    through the done word, and releasing the session frees the slot and lets waiters go."""
    import types

    from epd.client import stream_ops as C
    from epd.proto import abi
    from epd.server.backends.base import NotFilled
    from epd.server.engine import stream_ops as S

    launched: list = []
    op, comm, member, session, words = _stand_in_op("g", lambda p, b: launched.append((p, b)))
    ops = S.StreamOps(types.SimpleNamespace(index=0))

    def fire(buffer: int) -> None:  # (as the poller does: under the session's lock)
        with session.op_lock:
            ops._fire(op, buffer)
    fire(0)  # the receive buffer of the ring entry
    fire(1)
    assert launched == [("prepared", 0), ("prepared", 1)] and member.dispatches == 2
    for bad in (2, -1, 1 << 20):  # a buffer no trigger appends: the op fails, no launch
        words[S.DONE] = 0
        fire(bad)
        assert words[S.DONE] == S.DONE_FAILED | (0xFF << 8)
    assert len(launched) == 2

    def fail(_prepared, _buffer) -> None:
        raise RuntimeError("launch failed")
    comm.launch_prepared = fail
    words[S.DONE] = 0
    fire(1)
    assert words[S.DONE] == S.DONE_FAILED | (0xFF << 8)

    def not_filled(_prepared, _buffer) -> None:  # (the poller's combine into a buffer that
        raise NotFilled("receive buffer 1 does not hold the armed dispatch")  # holds another)
    comm.launch_prepared = not_filled
    words[S.DONE] = 0
    fire(1)  # the chain's code for the case, so the client's message is the same on both
    assert words[S.DONE] == S.DONE_FAILED | (abi.ERR_NOT_FILLED << 8)
    assert "holds another dispatch" in str(C.done_error(int(words[S.DONE]), "op 3"))
    session.stream_ops[1] = ops.ops[1] = op
    ops.release_session(session)
    assert words[S.DONE] == S.DONE_RELEASED and not ops.ops and not session.stream_ops
    assert session.free_slots == [3] and not op.armed
    fire(1)  # a trigger seen after the release launches nothing
    assert len(launched) == 2


def _ringed(ops, op, ring=None):
    """Register `op` with the poller and its member's trigger ring (made in a stand-in slot of
    1024 words when `ring` is None); returns the ring."""
    from epd.server.engine import stream_ops as S

    if ring is None:
        ring = S.Ring(op.member, 9, np.zeros(1024, np.uint32))
        ops.rings[id(op.member)] = ring
    op.entry = ops._take(ring, op)
    ops.ops[op.op_id] = op
    op.session.stream_ops[op.op_id] = op
    return ring


def _chained_ring(name: str, top_up) -> types.SimpleNamespace:
    """A stand-in chained ring of the poller: a member named `name` whose chain is deep
    enough for the poller's nap and whose `top_up()` is given."""
    member = types.SimpleNamespace(spec=types.SimpleNamespace(name=name, label=name),
                                   dispatches=0, combines=0)
    chain = types.SimpleNamespace(depth=64, enqueue_seconds=0.0, top_up=top_up)
    return types.SimpleNamespace(chain=chain, member=member)


def _poller_engine(*, spin_us: int, poll_us: int, inflight: int = 0, chain_poll_us: int = 500,
                   idle_poll_us: int = 0):
    """A stand-in engine for StreamOps's poller thread: its spin and poll settings (no idle
    back-off unless `idle_poll_us`), and the engine state whose calls in flight shorten the
    spin (none here unless `inflight`)."""
    import types

    return types.SimpleNamespace(
        index=0, backend=types.SimpleNamespace(thread_init=lambda: None),
        config=types.SimpleNamespace(stream_op_spin_us=spin_us, stream_op_busy_spin_us=0,
                                     stream_op_poll_us=poll_us,
                                     stream_op_idle_poll_us=idle_poll_us,
                                     ll_chain_poll_us=chain_poll_us),
        state=types.SimpleNamespace(last_call=0.0, inflight=inflight))


def _trigger(ring, value: int) -> None:
    """What the client's trigger kernel does: append an entry, publish the tail."""
    from epd.proto import abi

    tail = int(ring.words[abi.LL_RING_TAIL])
    ring.words[tail % abi.LL_RING] = value
    ring.words[abi.LL_RING_TAIL] = (tail + 1) & 0xFFFFFFFF


def test_stream_op_poller_reports_how_late_it_saw_a_trigger() -> None:
    """The poller's detection gap (epd_stream_op_detect_seconds): with the poller sleeping 30 ms
    between looks (no spin), a trigger appended meanwhile is seen up to one sleep later, and the
    gap it reports is that sleep, not the microseconds of the launch."""
    import threading

    import prometheus_client

    from epd.server.engine import stream_ops as S

    launched = threading.Event()
    op, _, _, _, _ = _stand_in_op("detect-g", lambda p, b: launched.set())
    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=30_000))
    ring = _ringed(ops, op)
    ops._ensure_thread()
    try:
        time.sleep(0.1)  # the poller is in its 30 ms sleeps now
        _trigger(ring, op.entry)
        assert launched.wait(5)
    finally:
        ops.stop()
    labels = {"group": "detect-g", "kind": S.KIND_DISPATCH}
    value = prometheus_client.REGISTRY.get_sample_value
    assert value("epd_stream_op_detect_seconds_count", labels) == 1
    gap = value("epd_stream_op_detect_seconds_sum", labels)
    assert 0.02 <= gap <= 1.0, gap
    assert value("epd_stream_op_launch_seconds_sum", labels) < 0.15  # (a loaded host)


@pytest.mark.parametrize("busy", [False, True])
def test_stream_op_poller_spins_long_only_while_no_session_call_is_served(busy: bool) -> None:
    """After a trigger the poller keeps looking for stream_op_spin_us (here 5 s) while only
    triggers come, so a trigger 0.2 s later is seen at once; while the engine serves a call
    (a session's thread wants the GIL) it spins stream_op_busy_spin_us (0) and then sleeps
    between 200 ms looks, so the same trigger is seen up to a sleep later."""
    import threading

    import prometheus_client

    from epd.server.engine import stream_ops as S

    launched = threading.Semaphore(0)
    name = f"spin-g-{busy}"
    op, _, _, _, _ = _stand_in_op(name, lambda p, b: launched.release())
    ops = S.StreamOps(_poller_engine(spin_us=5_000_000, poll_us=200_000,
                                     inflight=int(busy)))
    ring = _ringed(ops, op)
    labels = {"group": name, "kind": S.KIND_DISPATCH}
    value = prometheus_client.REGISTRY.get_sample_value
    ops._ensure_thread()
    try:
        _trigger(ring, op.entry)
        assert launched.acquire(timeout=5)
        time.sleep(0.2)
        first = value("epd_stream_op_detect_seconds_sum", labels) or 0.0
        _trigger(ring, op.entry)
        assert launched.acquire(timeout=5)
    finally:
        ops.stop()
    gap = value("epd_stream_op_detect_seconds_sum", labels) - first
    if busy:  # (a whole 200 ms sleep between its looks)
        assert 0.05 <= gap <= 1.0, gap
    else:  # (spinning: seen at once, but for a loaded host's descheduling)
        assert gap < 0.1, gap


def test_spin_window_is_short_while_calls_are_served() -> None:
    import types

    from epd.server.engine.stream_ops import spin_window

    cfg = types.SimpleNamespace(stream_op_spin_us=5000, stream_op_busy_spin_us=200)
    assert spin_window(cfg, 0.0, 0, 100.0) == pytest.approx(5e-3)  # no call ever
    assert spin_window(cfg, 99.999, 0, 100.0) == pytest.approx(2e-4)  # one left 1 ms ago
    assert spin_window(cfg, 99.99, 0, 100.0) == pytest.approx(5e-3)  # 10 ms ago
    assert spin_window(cfg, 0.0, 1, 100.0) == pytest.approx(2e-4)  # one in flight
    short = types.SimpleNamespace(stream_op_spin_us=100, stream_op_busy_spin_us=200)
    assert spin_window(short, 0.0, 1, 100.0) == pytest.approx(1e-4)  # never the longer


def test_engine_state_records_when_the_last_call_left() -> None:
    from epd.server.engine.executor import EngineState

    state = EngineState(0)
    assert state.last_call == 0.0
    before = time.perf_counter()
    with state.admit():
        assert state.inflight == 1
    assert state.inflight == 0 and before <= state.last_call <= time.perf_counter()


def test_stream_op_poller_launches_in_trigger_order() -> None:
    """A member's calls are launched in the order their triggers reached the GPU, whatever the
    order the ops were armed in (the peers pair calls by sequence: D1 launched before D0 on one
    rank mixed two micro-batches on an H200); each entry's buffer reaches the launch; the head
    follows; an entry of a disarmed op (also once its index is reused) or a released entry
    launches nothing."""
    import types

    from epd.proto import abi
    from epd.server.engine import stream_ops as S

    launched: list = []
    d0, _, member, session, _ = _stand_in_op("order-g", lambda p, b: launched.append((p, b)))
    session.free_slots = []
    words1 = np.zeros(8, np.int32)
    d1 = _held(S.StreamOp(2, S.KIND_DISPATCH, session, member, None, 4, words1, "d1"))  # (slot 4)
    ops = S.StreamOps(types.SimpleNamespace(index=0))
    ring = _ringed(ops, d0)
    _ringed(ops, d1, ring)
    # D1 (buffer 1) reached the GPU first, then D0 (buffer 0), then D1 again into buffer 0
    for value in (d1.entry | 1 << 8, d0.entry, d1.entry):
        _trigger(ring, value)
    assert ops._run_ring(ring, 0.0)
    assert launched == [("d1", 1), ("prepared", 0), ("d1", 0)]
    assert ring.head == 3 and ring.words[abi.LL_RING_HEAD] == 3
    assert not ops._run_ring(ring, 0.0)  # nothing new

    stale = d1.entry
    ops._remove(d1)
    d2 = _held(S.StreamOp(3, S.KIND_DISPATCH, session, member, None, 5, words1, "d2"))
    _ringed(ops, d2, ring)
    assert d2.entry & 0xFF == stale & 0xFF and d2.entry != stale  # d1's index, reused
    for value in (stale, abi.LL_ENTRY_RELEASED, d2.entry | 1 << 8):
        _trigger(ring, value)
    ops._run_ring(ring, 0.0)
    assert launched[3:] == [("d2", 1)]
    assert ring.head == 6

    ring.head = ring.words[abi.LL_RING_HEAD] = ring.words[abi.LL_RING_TAIL] = 0xFFFFFFFF
    _trigger(ring, d0.entry | 1 << 8)  # the positions wrap at 2**32
    _trigger(ring, d2.entry)
    ops._run_ring(ring, 0.0)
    assert launched[4:] == [("prepared", 1), ("d2", 0)] and ring.head == 1

    # the member's last op gone: the ring goes and its slot is free again, once (a second
    # removal of an op changes nothing); a look at the ring after that writes nothing into
    # the slot
    ops._remove(d0)
    ops._remove(d2)
    ops._remove(d2)
    assert id(member) not in ops.rings and sorted(session.free_slots) == [3, 4, 5, 9]
    _trigger(ring, d0.entry)
    assert not ops._run_ring(ring, 0.0) and ring.words[abi.LL_RING_HEAD] == 1
    # the member's next ring: an entry of the old ring (a graph replayed after its op went)
    # does not name the new ring's op at the same index, since generations go on
    ring2 = _ringed(ops, _held(S.StreamOp(4, S.KIND_DISPATCH, session, member, None, 6,
                                          words1, "d3")))
    _trigger(ring2, d0.entry)
    assert not ops._run_ring(ring2, 0.0) and len(launched) == 6


def test_stream_op_poller_thread_keeps_the_order_of_triggers_seen_together() -> None:
    """The bug's own path: the poller asleep between looks, D1 then D0 triggered meanwhile (a
    replayed graph's two micro-batches), both seen at one look: launched D1 first, as on the
    GPU. (The poller of the doorbell design launched them in the order it scanned its ops.)"""
    import threading

    from epd.server.engine import stream_ops as S

    launched: list = []
    both = threading.Event()

    def launch(prepared, buffer) -> None:
        launched.append((prepared, buffer))
        if len(launched) == 2:
            both.set()
    d0, _, member, session, _ = _stand_in_op("order-thread-g", launch)
    d1 = _held(S.StreamOp(2, S.KIND_DISPATCH, session, member, None, 4, np.zeros(8, np.int32),
                          "d1"))
    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=30_000))
    ring = _ringed(ops, d0)
    _ringed(ops, d1, ring)
    ops._ensure_thread()
    try:
        time.sleep(0.1)  # the poller is in its 30 ms sleeps now
        _trigger(ring, d1.entry | 1 << 8)
        _trigger(ring, d0.entry)
        assert both.wait(5)
    finally:
        ops.stop()
    assert launched == [("d1", 1), ("prepared", 0)]


def test_a_ring_tail_far_past_its_head_runs_nothing_and_fails_its_ops() -> None:
    """A client writes its counter page: a ring tail more than LL_RING entries past the head
    (a trigger kernel waits for room, so none writes it) must not keep the engine-wide poller
    in one ring for 2**32 entries. Nothing is launched, the head catches up, the member's op
    fails its stream; a normal ring still runs, at most LL_RING entries per look."""
    import types

    from epd.proto import abi
    from epd.server.engine import stream_ops as S

    launched: list = []
    op, _, _, _, words = _stand_in_op("tail-g", lambda p, b: launched.append(b))
    ops = S.StreamOps(types.SimpleNamespace(index=0))
    ring = _ringed(ops, op)
    ring.words[ring.head % abi.LL_RING] = op.entry
    ring.words[abi.LL_RING_TAIL] = (ring.head - 1) & 0xFFFFFFFF  # 2**32 - 1 "entries"
    t0 = time.perf_counter()
    assert ops._run_ring(ring, 0.0) is False
    assert time.perf_counter() - t0 < 0.5
    assert launched == []
    assert ring.head == 0xFFFFFFFF and int(ring.words[abi.LL_RING_HEAD]) == 0xFFFFFFFF
    assert int(words[S.DONE]) & 0xFF == S.DONE_FAILED
    # real triggers from there, past the uint32 wrap: a full ring, then a few more
    for _ in range(abi.LL_RING):
        _trigger(ring, op.entry)
    assert ops._run_ring(ring, 0.0) is True and len(launched) == abi.LL_RING
    for _ in range(6):
        _trigger(ring, op.entry)
    assert ops._run_ring(ring, 0.0) is True and len(launched) == abi.LL_RING + 6
    assert ring.head == int(ring.words[abi.LL_RING_TAIL]) == abi.LL_RING + 5


def test_a_session_running_an_operation_holds_only_its_own_triggers() -> None:
    """One poller serves every session of an engine, and launches under the op's session
    lock: while session A runs an operation (a collective may take up to its deadline), its
    triggers wait, and session B's are launched meanwhile; A's run once its operation ends,
    in their order."""
    import threading

    from epd.server.engine import stream_ops as S

    launched: list = []
    b_done = threading.Event()
    a, _, _, a_session, _ = _stand_in_op("busy-a", lambda p, b: launched.append(("a", b)))
    b, _, _, _, _ = _stand_in_op("free-b", lambda p, b: (launched.append(("b", b)),
                                                         b_done.set()))
    ops = S.StreamOps(_poller_engine(spin_us=1_000_000, poll_us=1000))
    ring_a, ring_b = _ringed(ops, a), _ringed(ops, b)  # (two members, two rings)
    assert ring_a is not ring_b
    a_session.op_lock.acquire()  # A's operation runs
    try:
        ops._ensure_thread()
        _trigger(ring_a, a.entry)
        _trigger(ring_a, a.entry | 1 << 8)
        _trigger(ring_b, b.entry)
        assert b_done.wait(5)
        time.sleep(0.05)
        assert launched == [("b", 0)]  # A's wait for its lock, B's went
    finally:
        a_session.op_lock.release()
    try:
        deadline = time.monotonic() + 5
        while len(launched) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert launched == [("b", 0), ("a", 0), ("a", 1)]
    finally:
        ops.stop()


def test_two_sessions_arming_at_once_start_one_poller(monkeypatch) -> None:
    """Sessions arm on their own workers: the first arms of two at once start one poller (two
    would launch one member's ring entries out of order)."""
    import threading
    import types

    from epd.server.engine import stream_ops as S

    started: list = []
    gate = threading.Barrier(2)

    class SlowThread:
        def __init__(self, **kw) -> None:
            time.sleep(0.05)  # (widens the window between the check and the assignment)

        def start(self) -> None:
            started.append(self)

    ops = S.StreamOps(types.SimpleNamespace(index=0))
    monkeypatch.setattr(S, "NamedThread", SlowThread)

    def arm() -> None:
        gate.wait()
        ops._ensure_thread()
    threads = [threading.Thread(target=arm) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(started) == 1


def _stand_in_arming(monkeypatch, *, chain: str = "off", open_chain=None, on_mps: bool = False,
                     shrink: bool = False, spans_nodes: bool = False):
    """StreamOps around a stand-in engine, session and counter page whose dispatches arm
    without a GPU (the backend's preparation and output views are stand-ins): arming's
    checks and its counter-slot accounting."""
    import threading
    import types

    from epd.server.engine import stream_ops as S

    monkeypatch.setattr(S, "ll_dispatch_response",
                        lambda *a: epd_pb2.LowLatencyDispatchResponse())
    mem = np.full((8, 1024), 0xABCD, np.uint32)  # (garbage a new ring must clear)
    page = types.SimpleNamespace(slot=lambda i: types.SimpleNamespace(
        device_ptr=0x10000 + 4096 * i, view=lambda dt: mem[i].view(dt)))
    closed: list = []
    comm = types.SimpleNamespace(
        low_latency_outputs=lambda *a: None,
        prepare_low_latency_dispatch=lambda *a: "prepared",
        open_chain=open_chain or (lambda words, ptr: None),
        close_chain=lambda timeout: closed.append(timeout),
        launch_prepared=lambda p, b: None, spans_nodes=spans_nodes)
    member = types.SimpleNamespace(comm=comm, spec=types.SimpleNamespace(
        name="arm-g", label="arm-g", shrink=shrink),
                                   service_class="throughput", dispatches=0, combines=0)
    args = types.SimpleNamespace(num_max_dispatch_tokens_per_rank=8, use_fp8=False)
    engine = types.SimpleNamespace(
        index=0, backend=types.SimpleNamespace(thread_init=lambda: None),
        config=types.SimpleNamespace(ll_chain=chain, ll_chain_members=4, timeout_seconds=1.0,
                                     cuda_max_connections=32,
                                     stream_op_spin_us=0, stream_op_busy_spin_us=0,
                                     stream_op_poll_us=1000, max_stream_ops_per_session=64,
                                     stream_op_idle_poll_us=0, ll_chain_poll_us=500),
        state=types.SimpleNamespace(last_call=0.0, inflight=0),
        ll_dispatch_args=lambda session, inner: (member, args, None),
        _timeout=lambda t: 1.0)
    session = types.SimpleNamespace(free_slots=[2, 3, 5], counter_page=page, stream_ops={},
                                    op_lock=threading.Lock(), describe=lambda: "session",
                                    on_engine_mps=on_mps)
    _slots_of(session)
    return S.StreamOps(engine), session, member, mem, closed


def _slots_of(session) -> None:
    """A stand-in session's counter slots and op records, as Session keeps them."""
    from epd.server.engine.state import Session

    session.record_slots, session.free_records = {}, collections.deque()
    for name in ("take_slot", "take_record", "give_record", "free_record"):
        setattr(session, name, functools.partial(getattr(Session, name), session))


def _arm_request(ring_trigger: bool = True, records: bool = False
                 ) -> epd_pb2.ArmStreamOpRequest:
    return epd_pb2.ArmStreamOpRequest(
        session_id="s", group_id="g", ring_trigger=ring_trigger, op_records=records,
        low_latency_dispatch=epd_pb2.LowLatencyDispatchRequest(
            num_max_dispatch_tokens_per_rank=8))


def test_arming_takes_a_ring_slot_with_the_first_op_and_gives_both_back(monkeypatch) -> None:
    """A member's first armed op takes two counter slots (its own and its member's ring, the
    ring's words cleared), later ones one; refused arms take nothing (one slot left for a first
    op: RESOURCE_EXHAUSTED naming the ring; a client without the ring trigger:
    FAILED_PRECONDITION); disarming the last op gives the ring's slot back too."""
    from epd.proto import abi
    from epd.proto.errors import FailedPrecondition, ResourceExhausted

    ops, session, member, mem, _ = _stand_in_arming(monkeypatch)
    try:
        with pytest.raises(FailedPrecondition, match="upgrade epd on the client"):
            ops.arm(session, _arm_request(ring_trigger=False))
        assert session.free_slots == [2, 3, 5] and not ops.rings and not ops.ops
        session.free_slots = [2]
        with pytest.raises(ResourceExhausted, match="trigger ring"):
            ops.arm(session, _arm_request())
        assert session.free_slots == [2] and not ops.rings
        session.free_slots = [2, 3, 5]

        first = ops.arm(session, _arm_request())
        assert first.ordered and not first.chained
        assert (first.counter_slot, first.chain_slot) == (2, 3) and session.free_slots == [5]
        assert not mem[3, :abi.LL_RING_HEAD + 1].any()  # the ring's words, cleared
        second = ops.arm(session, _arm_request())
        assert (second.counter_slot, second.chain_slot) == (5, 3) and session.free_slots == []
        assert second.chain_entry != first.chain_entry

        ops.disarm(session, first.op_id)
        assert session.free_slots == [2] and id(member) in ops.rings
        ops.disarm(session, second.op_id)
        assert sorted(session.free_slots) == [2, 3, 5] and not ops.rings
    finally:
        ops.stop()


def test_armed_ops_share_counter_slots_as_records(monkeypatch) -> None:
    """A client that reads records (op_records) gets its ops' words as records of shared
    counter slots, OP_RECORDS to a slot, each record distinct and its done word set; a group
    holds at most LL_CHAIN_OPS ops (the arm beyond is refused and takes nothing); a disarmed
    op's record is the next arm's, cleared; a slot goes back once it holds no op; a client
    that does not ask for records gets a slot of its own, as before. (A model captured at
    dozens of batch sizes arms hundreds of ops: one slot each ran out at 64.)"""
    from epd.proto import abi
    from epd.proto.errors import ResourceExhausted
    from epd.server.engine import stream_ops as S

    ops, session, _, mem, _ = _stand_in_arming(monkeypatch)
    ops.engine.config.max_stream_ops_per_session = 1024
    session.free_slots = [2, 3, 5, 6, 7]
    words = mem.view(np.int32)

    def done(r) -> int:
        return int(words[r.counter_slot, r.counter_record * abi.OP_RECORD_BYTES // 4 + S.DONE])
    try:
        armed = [ops.arm(session, _arm_request(records=True)) for _ in range(abi.OP_RECORDS + 1)]
        places = [(r.counter_slot, r.counter_record) for r in armed]
        assert len(set(places)) == len(places) and armed[0].chain_slot == 3
        assert {p[0] for p in places} == {2, 5} and session.free_slots == [6, 7]
        assert all(0 <= p[1] < abi.OP_RECORDS for p in places)
        assert all(done(r) == S.DONE_OK for r in armed)
        while len(armed) < abi.LL_CHAIN_OPS:
            armed.append(ops.arm(session, _arm_request(records=True)))
        assert session.free_slots == []
        held = ({s: set(u) for s, u in session.record_slots.items()},
                list(session.free_records))
        assert held[1] == [(7, abi.OP_RECORDS - 1)]
        with pytest.raises(ResourceExhausted, match=f"'arm-g' holds {abi.LL_CHAIN_OPS} armed "
                           f"calls, the most a group may"):
            ops.arm(session, _arm_request(records=True))
        assert (session.record_slots, list(session.free_records)) == held
        assert len(ops.ops) == abi.LL_CHAIN_OPS

        # records are reused freed-longest-ago first, cleared
        gone = armed.pop(7)
        ops.disarm(session, gone.op_id)
        words[gone.counter_slot, gone.counter_record * abi.OP_RECORD_BYTES // 4 + 6] = 99
        first = ops.arm(session, _arm_request(records=True))
        assert (first.counter_slot, first.counter_record) == (7, abi.OP_RECORDS - 1)
        armed.append(first)
        ops.disarm(session, armed.pop(9).op_id)
        again = ops.arm(session, _arm_request(records=True))
        assert (again.counter_slot, again.counter_record) == (gone.counter_slot,
                                                              gone.counter_record)
        start = again.counter_record * abi.OP_RECORD_BYTES // 4
        assert words[again.counter_slot, start + 6] == 0 and done(again) == S.DONE_OK
        armed.append(again)

        last_slot = [r for r in armed if r.counter_slot == 7]
        for r in last_slot:
            ops.disarm(session, r.op_id)
            armed.remove(r)
        assert session.free_slots == [7] and 7 not in session.record_slots
        assert all(p[0] != 7 for p in session.free_records)
        whole = ops.arm(session, _arm_request(records=False))
        assert (whole.counter_slot, whole.counter_record) == (7, 0)
        assert session.record_slots[7] == {0}  # (no other op's record in its slot)
        assert all(p[0] != 7 for p in session.free_records)
        armed.append(whole)
        for r in armed:
            ops.disarm(session, r.op_id)
        assert sorted(session.free_slots) == [2, 3, 5, 6, 7] and not session.record_slots
    finally:
        ops.stop()


def test_stats_count_each_ranks_armed_calls() -> None:
    """GetStats' armed_calls: a rank's armed ops (how close its group is to the 255 a group
    may hold), each session's own and by member; the epd_stream_ops_armed gauge sums them."""
    from epd.server.engine.core import Engine

    def member(name: str):
        comm = types.SimpleNamespace(abort_reason=lambda: None, stream_priority=0, num_sms=0,
                                     ll_num_sms=0, held_bytes=0, hierarchical=False,
                                     two_stage=False)
        return types.SimpleNamespace(
            group_id=name, spec=types.SimpleNamespace(name=name, num_ranks=2, service_class=0),
            rank=0, dispatches=0, combines=0, bytes_sent=0, bytes_received=0, handles={},
            queued_calls=0, queue_wait_seconds=0.0, comm=comm)
    a, b, c = member("a"), member("b"), member("c")
    ops = {i: types.SimpleNamespace(member=m) for i, m in enumerate([a, a, a, b])}
    session = types.SimpleNamespace(members={"a": a, "b": b, "c": c}, stream_ops=ops,
                                    regions={})
    engine = types.SimpleNamespace(index=0, sessions={"s": session})
    got = {g.name: g.armed_calls for g in Engine.stats(engine, session).groups}
    assert got == {"a": 3, "b": 1, "c": 0}


def test_an_arm_and_a_join_at_once_take_different_slots(monkeypatch) -> None:
    """A join on the event loop takes counter slots while an arm runs on the session's
    worker: the arm keeps the slot it prepared its op with and the join's is never the op's
    (one slot with two owners would mix their done and count words)."""
    from epd.proto.errors import ResourceExhausted

    ops, session, member, _, _ = _stand_in_arming(monkeypatch)
    joined: list[int] = []

    def prepare(*a):
        joined.append(session.free_slots.pop(0))  # the join, in the middle of the arm
        return "prepared"
    member.comm.prepare_low_latency_dispatch = prepare
    try:
        resp = ops.arm(session, _arm_request())
        assert resp.counter_slot == 2 and joined == [3] and resp.chain_slot == 5
        assert session.free_slots == []
        with pytest.raises(ResourceExhausted):  # no slot left: nothing taken, nothing lost
            ops.arm(session, _arm_request())
        assert session.free_slots == []
        ops.disarm(session, resp.op_id)
        assert sorted(session.free_slots) == [2, 5]
    finally:
        ops.stop()


def test_a_first_release_pass_lets_every_stream_go_and_waits_once(monkeypatch) -> None:
    """Teardown's first pass (without the session's lock) lets every op's waiting stream go
    at once, then removes what it can: while an operation holds the session it waits once,
    not once per op (the locked last pass removes the rest)."""
    from epd.server.engine import stream_ops as S

    ops, session, _, mem, _ = _stand_in_arming(monkeypatch)
    monkeypatch.setattr(S, "RELEASE_WAIT_SECONDS", 1.0)  # (a loaded host's margin: 1 s)
    session.free_slots.append(6)
    try:
        armed = [ops.arm(session, _arm_request()) for _ in range(3)]
        with session.op_lock:  # (an operation of the session runs)
            t0 = time.monotonic()
            ops.release_session(session)
            assert time.monotonic() - t0 < 2.0  # (one wait, not two or three: 2 s, 3 s)
        for r in armed:
            assert mem[r.counter_slot].view(np.int32)[S.DONE] == S.DONE_RELEASED
        assert len(ops.ops) == 3  # (not removed yet)
        with session.op_lock:
            ops.release_session(session, locked=True)
        assert not ops.ops and sorted(session.free_slots) == [2, 3, 5, 6]
    finally:
        ops.stop()


def test_releasing_a_session_under_its_lock_frees_every_op(monkeypatch) -> None:
    """Teardown's last pass runs with the session's operation lock held (an arm that was
    still running during the first pass registered its op after it): it removes every op
    without taking the lock again, and frees their slots and the ring's."""
    import threading

    from epd.server.engine import stream_ops as S

    ops, session, _, mem, _ = _stand_in_arming(monkeypatch)
    try:
        a = ops.arm(session, _arm_request())
        b = ops.arm(session, _arm_request())
        assert session.free_slots == []
        with session.op_lock:
            t = threading.Thread(target=ops.release_session, args=(session,),
                                 kwargs={"locked": True})
            t.start()
            t.join(5)
            assert not t.is_alive()
        assert not ops.ops and not ops.rings and not session.stream_ops
        assert sorted(session.free_slots) == [2, 3, 5]
        for r in (a, b):  # their streams are let go
            assert mem[r.counter_slot].view(np.int32)[S.DONE] == S.DONE_RELEASED
    finally:
        ops.stop()


def test_arming_gives_the_slots_back_when_the_chain_fails_to_open(monkeypatch) -> None:
    """--ll-chain: a chain that fails to open fails the arm, and both slots are free again; a
    backend without a chain (open_chain gives None) leaves the member on the poller."""
    def fail(words, ptr):
        raise RuntimeError("no chain here")
    ops, session, member, _, _ = _stand_in_arming(monkeypatch, chain="on", open_chain=fail)
    try:
        with pytest.raises(RuntimeError, match="no chain here"):
            ops.arm(session, _arm_request())
        assert sorted(session.free_slots) == [2, 3, 5] and not ops.rings and not ops.ops
        assert ops._opening == 0  # the chain it was opening no longer counts
        member.comm.open_chain = lambda words, ptr: None
        resp = ops.arm(session, _arm_request())
        assert resp.ordered and not resp.chained and ops.rings[id(member)].chain is None
    finally:
        ops.stop()


@pytest.mark.parametrize(("mode", "on_mps", "shrink", "spans_nodes", "chained"), [
    ("auto", True, False, False, True),  # a client on the engine's MPS server
    ("auto", False, False, False, False),  # time-sliced contexts: the poller
    ("auto", True, True, False, False),  # a shrink group: a rejoin needs the host's sequences
    ("auto", True, False, True, False),  # a group over nodes: not run on a GPU chained
    ("on", False, True, True, True),  # asked for: whatever the case
    ("off", True, False, False, False),
])
def test_which_members_get_a_chain(monkeypatch, mode: str, on_mps: bool, shrink: bool,
                                   spans_nodes: bool, chained: bool) -> None:
    """--ll-chain auto chains a member's armed ops only where a chain pays and nothing needs
    the host's sequences; on and off decide for every member."""
    opened: list = []
    chain = types.SimpleNamespace(add=lambda *a: types.SimpleNamespace(entry=1),
                                  remove=lambda *a: None, busy=lambda: False, top_up=lambda: [],
                                  finished=lambda: [],
                                  enqueue_seconds=0.0, depth=0)

    def open_chain(words, ptr):
        opened.append(ptr)
        return chain
    ops, session, member, _, _ = _stand_in_arming(monkeypatch, chain=mode, open_chain=open_chain,
                                                  on_mps=on_mps, shrink=shrink,
                                                  spans_nodes=spans_nodes)
    try:
        ops.arm(session, _arm_request())
        assert (ops.rings[id(member)].chain is chain) == chained
        assert len(opened) == int(chained)
    finally:
        ops.stop()


@pytest.mark.parametrize(("mode", "members", "queues", "limit"), [
    ("auto", 8, 32, 8), ("auto", 2, 32, 2), ("auto", 8, 31, 0), ("auto", 8, 8, 0),
    ("on", 8, 8, 8),  # asked for: as many as --ll-chain-members says
])
def test_chains_per_engine(mode: str, members: int, queues: int, limit: int) -> None:
    """auto chains only with the 32 hardware queues its chains were measured with (on CUDA's
    default 8, two parked chains stalled each other's pairs for milliseconds)."""
    from epd.server.config import chain_limit
    cfg = types.SimpleNamespace(ll_chain=mode, ll_chain_members=members,
                                cuda_max_connections=queues)
    assert chain_limit(cfg) == limit


def test_chains_being_opened_count_against_the_limit(monkeypatch) -> None:
    """Two members' first arms at once, one chain left in the engine's budget: the chain being
    opened by the first counts, so the second's ring goes to the poller."""
    import threading

    from epd.proto.errors import ResourceExhausted
    from epd.server.engine.state import Session
    opening, release = threading.Event(), threading.Event()
    chain = types.SimpleNamespace(add=lambda *a: types.SimpleNamespace(entry=1),
                                  remove=lambda *a: None, busy=lambda: False, top_up=lambda: [],
                                  finished=lambda: [],
                                  enqueue_seconds=0.0, depth=0)

    def slow_open(words, ptr):
        opening.set()
        assert release.wait(5)
        return chain
    ops, session, member, _, _ = _stand_in_arming(monkeypatch, chain="auto", open_chain=slow_open,
                                                  on_mps=True)
    ops.engine.config.ll_chain_members = 1
    other = types.SimpleNamespace(**{**vars(member), "spec": types.SimpleNamespace(
        name="arm-h", shrink=False)})
    session2 = types.SimpleNamespace(**{**vars(session), "free_slots": [7]})
    session2.take_slot = functools.partial(Session.take_slot, session2)
    rings = {}
    first = threading.Thread(target=lambda: rings.setdefault(1, ops._ring_for(session, member)))
    first.start()
    try:
        assert opening.wait(5)
        rings[2] = ops._ring_for(session2, other)  # while the first chain is being opened
        release.set()
        first.join(5)
        assert not first.is_alive(), "the first arm did not finish"
        assert rings[1].chain is chain and rings[2].chain is None
        assert ops._opening == 0
        # a third member whose session has no slot left: refused, nothing stays reserved
        session3 = types.SimpleNamespace(**{**vars(session), "free_slots": []})
        session3.take_slot = functools.partial(Session.take_slot, session3)
        third = types.SimpleNamespace(**{**vars(member), "spec": types.SimpleNamespace(
            name="arm-i", shrink=False)})
        ops.engine.config.ll_chain_members = 3
        with pytest.raises(ResourceExhausted):
            ops._ring_for(session3, third)
        assert ops._opening == 0 and id(third) not in ops.rings
    finally:
        release.set()
        ops.stop()


def test_the_poller_naps_only_while_every_ring_is_a_deep_chain() -> None:
    """A chain holds its instances enqueued ahead, so no call waits for the poller's look: it
    naps --ll-chain-poll-us between top-ups. A poller ring (its calls launched by the look),
    a shallow chain, or 0 keeps the spin."""
    from epd.server.engine import stream_ops as S
    cfg = types.SimpleNamespace(ll_chain_poll_us=500)
    deep = types.SimpleNamespace(chain=types.SimpleNamespace(depth=64))
    shallow = types.SimpleNamespace(chain=types.SimpleNamespace(depth=S.CHAIN_NAP_DEPTH - 1))
    poller = types.SimpleNamespace(chain=None)
    assert S.chain_nap(cfg, [deep, deep]) == pytest.approx(500e-6)
    assert S.chain_nap(cfg, [deep, poller]) == 0.0
    assert S.chain_nap(cfg, [deep, shallow]) == 0.0
    assert S.chain_nap(types.SimpleNamespace(ll_chain_poll_us=0), [deep]) == 0.0


@pytest.mark.parametrize("chain_poll_us", [0, 20_000])
def test_a_poller_of_chains_only_looks_every_nap(chain_poll_us: int) -> None:
    """With every ring chained and calls running (each top-up finds some), the poller that
    would spin for 5 s looks once per 20 ms nap; with naps off it looks without pause."""
    from epd.proto import abi
    from epd.server.engine import stream_ops as S

    looks = []
    member = types.SimpleNamespace(spec=types.SimpleNamespace(name="nap-g", label="nap-g"),
                                   dispatches=0, combines=0)
    chain = types.SimpleNamespace(depth=64, enqueue_seconds=0.0,
                                  top_up=lambda: looks.append(1) or [abi.LLX_DISPATCH])
    ops = S.StreamOps(_poller_engine(spin_us=5_000_000, poll_us=50,
                                     chain_poll_us=chain_poll_us))
    ops.rings[1] = types.SimpleNamespace(chain=chain, member=member)
    ops._ensure_thread()
    try:
        time.sleep(0.3)
    finally:
        ops.stop()
    if chain_poll_us:
        assert 3 <= len(looks) <= 20, len(looks)  # ~15 naps of 20 ms in 0.3 s, and the first
    else:
        assert len(looks) > 100, len(looks)


def test_busy_deep_chains_do_not_keep_the_poller_spinning_for_an_idle_poller_ring() -> None:
    """A busy deep chain beside a poller ring without triggers (a normal-mode call captured
    in a graph that is not being replayed, or another tenant's op): the chain's calls do not
    keep the poller spinning for that ring (they did: ~120 µs of the engine's CPU per chained
    low-latency call on one H100, BENCHMARKS forty-fifth and forty-sixth sessions); it looks
    every stream_op_poll_us, as for idle poller rings, and still sees that ring's trigger."""
    import threading

    from epd.proto import abi
    from epd.server.engine import stream_ops as S

    looks = []
    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=20_000, chain_poll_us=20_000))
    ops.rings[1] = _chained_ring("busy-c", lambda: looks.append(1) or [abi.LLX_DISPATCH])
    launched = threading.Event()
    op, _, _, _, _ = _stand_in_op("idle-p", lambda p, b: launched.set())
    ring = _ringed(ops, op)
    ops._ensure_thread()
    try:
        time.sleep(0.3)
        assert 3 <= len(looks) <= 20, len(looks)  # ~15 looks of 20 ms in 0.3 s
        _trigger(ring, op.entry)
        assert launched.wait(5)
    finally:
        ops.stop()


def test_chains_are_topped_up_at_their_cadence_while_the_poller_looks_at_an_idle_ring() -> None:
    """Deep chains beside an idle poller ring: the poller looks at the ring every
    stream_op_poll_us but tops the chains up only every ll_chain_poll_us (each look topped
    them up, most of a look's host time: the low-latency rows' engine CPU in BENCHMARKS,
    forty-seventh session); a chain armed during the nap is topped up at once, and the
    ring's trigger is still seen at its look."""
    import threading

    from epd.server.engine import stream_ops as S

    def chained(name: str, top_ups: list) -> types.SimpleNamespace:
        return _chained_ring(name, lambda: top_ups.append(time.perf_counter()) or [])

    top_ups: list = []
    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=2_000, chain_poll_us=100_000))
    ops.rings[1] = chained("cadence-c", top_ups)
    looks: list = []
    run_ring = ops._run_ring
    ops._run_ring = lambda ring, gap: looks.append(1) or run_ring(ring, gap)
    launched = threading.Event()
    op, _, _, _, _ = _stand_in_op("cadence-p", lambda p, b: launched.set())
    ring = _ringed(ops, op)
    ops._ensure_thread()
    try:
        time.sleep(0.55)  # (the arm below mid-way between two top-ups)
        assert len(looks) >= 40, len(looks)  # (a look every 2 ms: ~275, fewer on a busy host)
        assert 3 <= len(top_ups) <= 9, len(top_ups)  # (every 100 ms: ~6)
        late: list = []
        ops.rings[2] = chained("late-c", late)
        t0 = time.perf_counter()
        ops._ensure_thread()  # (what an arm does)
        deadline = time.monotonic() + 5
        while not late and time.monotonic() < deadline:
            time.sleep(0.001)
        assert late and late[0] - t0 < 0.05  # (not at the next top-up, up to 100 ms on)
        _trigger(ring, op.entry)
        assert launched.wait(5)
    finally:
        ops.stop()


def test_idle_period_backs_off_after_the_long_spin() -> None:
    """The look period of idle rings: stream_op_poll_us for stream_op_spin_us past the spin
    window, then a sixteenth of the idle time beyond, capped; no back-off with a cap below
    the base period."""
    from epd.server.engine.stream_ops import idle_period

    cfg = types.SimpleNamespace(stream_op_poll_us=50, stream_op_spin_us=5000,
                                stream_op_idle_poll_us=500)
    assert idle_period(cfg, 0.0) == pytest.approx(50e-6)
    assert idle_period(cfg, 5e-3) == pytest.approx(50e-6)
    assert idle_period(cfg, 5e-3 + 3.2e-3) == pytest.approx(200e-6)
    assert idle_period(cfg, 1.0) == pytest.approx(500e-6)
    cfg.stream_op_idle_poll_us = 0
    assert idle_period(cfg, 1.0) == pytest.approx(50e-6)


def test_a_trigger_held_back_is_retried_at_the_fast_pace() -> None:
    """A poller ring whose trigger was seen but left in the ring (its session ran another
    operation) keeps the poller looking at the base period however long the rings were idle;
    the back-off resumes once it has run."""
    from epd.server.engine import stream_ops as S

    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=1_000, idle_poll_us=50_000))
    op, _, _, _, _ = _stand_in_op("held-p", lambda p, b: None)
    ring = _ringed(ops, op)
    assert ops._look_period([ring], 10.0) == pytest.approx(0.05)
    _trigger(ring, op.entry)  # (pending: not launched yet)
    assert ops._look_period([ring], 10.0) == pytest.approx(0.001)
    with op.session.op_lock:  # (its session busy: the poller leaves the entry)
        assert ops._run_ring(ring, 0.0) is False
    assert ops._look_period([ring], 10.0) == pytest.approx(0.001)
    assert ops._run_ring(ring, 0.0) is True
    assert ops._look_period([ring], 10.0) == pytest.approx(0.05)


def test_an_arm_between_a_timed_out_wait_and_the_next_is_not_lost() -> None:
    """The poller's wake flag (set by an arm or a stop) is cleared only by a wait that saw it:
    an arm landing after a wait timed out is seen by the next wait, at once."""
    from epd.server.engine import stream_ops as S

    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=1_000))
    assert ops._woken(0.001) is False
    ops._wake.set()  # (what an arm does, here between two waits)
    t0 = time.perf_counter()
    assert ops._woken(5.0) is True and time.perf_counter() - t0 < 1.0
    assert ops._woken(0.001) is False  # (seen once)


def test_the_poller_looks_at_idle_rings_less_often_as_they_stay_idle() -> None:
    """An idle poller ring (a captured normal-mode call not being replayed): with the back-off
    the poller looks a few dozen times in 0.6 s where it looked every 1 ms (each look ~20-30
    µs of the engine's CPU on a GPU host: a fifth of a core at 50 µs); a trigger after the
    idle stretch is still seen within the longest period, and an arm brings the fast looks
    back at once."""
    import threading

    from epd.server.engine import stream_ops as S

    def looks_in(idle_poll_us: int) -> tuple[int, float, list]:
        ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=1_000, idle_poll_us=idle_poll_us))
        looks: list = []
        run_ring = ops._run_ring
        ops._run_ring = lambda ring, gap: looks.append(time.perf_counter()) or run_ring(ring,
                                                                                        gap)
        launched = threading.Event()
        op, _, _, _, _ = _stand_in_op(f"idle-{idle_poll_us}", lambda p, b: launched.set())
        ring = _ringed(ops, op)
        ops._ensure_thread()
        try:
            time.sleep(0.6)
            n = len(looks)
            t0 = time.perf_counter()
            _trigger(ring, op.entry)
            assert launched.wait(5)
            seen = time.perf_counter() - t0
            time.sleep(0.4)  # (idle again: backed off to the longest period)
            ops._ensure_thread()  # (what an arm does)
            armed = time.perf_counter()
            time.sleep(0.05)
            after_arm = [t for t in looks if t > armed]
        finally:
            ops.stop()
        return n, seen, after_arm

    steady, _, _ = looks_in(0)
    backed_off, seen, after_arm = looks_in(20_000)
    assert steady > 150, steady  # (every ~1 ms: ~550, fewer on a busy host)
    # (1 ms for 0 s, then t/16 up to 20 ms: ~16 + 48 + 14 ≈ 80)
    assert backed_off < steady / 3 and backed_off < 150, (backed_off, steady)
    assert seen < 0.5, seen  # (the longest period is 20 ms)
    # (every ~1 ms again: ~45 in 50 ms; 2-3 at the longest period)
    assert len(after_arm) >= 10, len(after_arm)


def test_a_disarm_counts_the_calls_its_chain_ran_since_the_last_look() -> None:
    """The poller counts a chain's calls at its top-ups (up to a nap apart); an op disarmed in
    between has its last calls counted first, while the chain's log can still name them."""
    from epd.proto import abi
    from epd.server.engine import stream_ops as S

    member = types.SimpleNamespace(spec=types.SimpleNamespace(name="g", label="g"), dispatches=0,
                                   combines=0)
    removed: list = []
    chain = types.SimpleNamespace(
        finished=lambda: [abi.LLX_DISPATCH, abi.LLX_COMBINE, abi.LLX_DISPATCH],
        remove=removed.append)
    ring = S.Ring(member, 9, np.zeros(1024, np.uint32), chain)
    ring.release(types.SimpleNamespace(chained="row 3", entry=0))
    assert (member.dispatches, member.combines) == (2, 1) and removed == ["row 3"]


def test_an_arm_ends_the_pollers_nap_at_once() -> None:
    """A poller napping 2 s between its chains' top-ups: a poller ring armed meanwhile (its
    calls wait for the poller's look) is looked at at once, not after the nap."""
    import threading

    from epd.server.engine import stream_ops as S

    ops = S.StreamOps(_poller_engine(spin_us=0, poll_us=50, chain_poll_us=2_000_000))
    ops.rings[1] = _chained_ring("nap-c", lambda: [])
    launched = threading.Event()
    op, _, _, _, _ = _stand_in_op("nap-p", lambda p, b: launched.set())
    ops._ensure_thread()
    try:
        time.sleep(0.2)  # (the poller is in its 2 s nap now)
        ring = _ringed(ops, op)
        _trigger(ring, op.entry)
        t0 = time.perf_counter()
        ops._ensure_thread()  # (what an arm does)
        assert launched.wait(5)
        assert time.perf_counter() - t0 < 1.0
    finally:
        ops.stop()


def test_chain_top_ups_count_as_engine_work(monkeypatch) -> None:
    """The chains' top-ups are the engine's host work per chained call (after it, not before):
    the thread CPU of one that found calls run goes into epd_request_cpu_seconds (path chain),
    as the poller's launches do, so `epd bench`'s engine work per call covers both paths; a
    look that found nothing (the poller's spin) or failed is not counted."""
    from epd.proto import abi
    from epd.server import metrics
    from epd.server.engine import stream_ops as S
    seen: list[tuple] = []
    monkeypatch.setattr(metrics, "inc", lambda metric, labels, value=1.0: seen.append(
        (metric, labels, value)))

    def busy_top_up():
        t = time.thread_time()
        while time.thread_time() - t < 0.002:  # 2 ms of this thread's CPU
            pass
        return [abi.LLX_DISPATCH, abi.LLX_COMBINE]

    def failing_top_up():
        raise RuntimeError("the chain closed under it")
    member = types.SimpleNamespace(spec=types.SimpleNamespace(name="g", label="g"), dispatches=0,
                                   combines=0)
    rings = [types.SimpleNamespace(chain=types.SimpleNamespace(top_up=f), member=member)
             for f in (busy_top_up, failing_top_up, lambda: [])]
    rings.append(types.SimpleNamespace(chain=None, member=member))  # a poller ring: nothing
    ops = S.StreamOps(types.SimpleNamespace(index=0))
    assert ops._top_up(rings) is True
    work = [v for m, labels, v in seen if m is metrics.REQUEST_CPU_SECONDS]
    assert len(work) == 1 and work[0] >= 0.002
    assert {labels for m, labels, _ in seen if m is metrics.REQUEST_CPU_SECONDS} == {
        (S.TOP_UP_METHOD, "chain")}
    assert (member.dispatches, member.combines) == (1, 1)


class _Slot(np.ndarray):
    device_ptr: int = 0


def test_a_cached_dispatch_of_a_captured_handle_is_refused() -> None:
    """A captured dispatch's handle has its arrays refilled by the op's next replay
    (DispatchArgs.refill): a cached dispatch sharing them would read another replay's routing,
    so the engine refuses it (the client never sends one; the ids are guessable), while the
    same handle uncaptured is reused."""
    from host_region import HostRegion

    from epd.proto.errors import FailedPrecondition
    from epd.server.engine.ops import DataPlane
    from epd.server.engine.state import HandleInfo

    spec = types.SimpleNamespace(name="g", shrink=False, x_dtype=epd_pb2.FLOAT32, hidden=8,
                                 max_tokens_per_rank=16, max_recv_tokens=32)
    member = types.SimpleNamespace(spec=spec, comm=types.SimpleNamespace(
        known_abort_reason=lambda: None), handles={7: HandleInfo("arrays", 4, 9, 9)})
    engine = types.SimpleNamespace(_timeout=lambda t: 5.0, backend=types.SimpleNamespace(
        agrees_on_capacity=True), _resolve=lambda s, m, info: True)
    for name in ("_check_alive", "_handle"):
        setattr(engine, name, functools.partial(getattr(DataPlane, name), engine))
    engine._check_normal_mode, engine._check_kind = (DataPlane._check_normal_mode,
                                                     DataPlane._check_kind)
    session = types.SimpleNamespace(regions={"r": HostRegion()})
    req = epd_pb2.DispatchRequest(stream_ordered=True, cached_handle=7, x=epd_pb2.TensorDesc(
        region_id="r", shape=[4, 8], dtype=epd_pb2.FLOAT32))
    args, cached, _ = DataPlane.dispatch_args(engine, session, member, req)
    assert args.cached == "arrays" and cached is member.handles[7]
    member.handles[7].captured = True
    with pytest.raises(FailedPrecondition, match="captured in a CUDA graph"):
        DataPlane.dispatch_args(engine, session, member, req)


def test_captured_normal_calls_arm_on_the_poller_and_run_as_eager_calls(monkeypatch) -> None:
    """A worst-case dispatch and its combine captured in a CUDA graph (engine/captured_calls.py)
    arm on the member's poller ring even where a chain is wanted (its slot's sticky failure
    cleared, the ring slot's failure record cleared and noted on the member); each trigger runs
    the stored request as an eager call, its arguments checked at the op's first trigger and
    kept: the previous trigger's handle released by it (and its arrays refilled), the
    member's READY written by the host, the launch run, the op's done word signalled after
    it, the dispatch's sequence and num_worst_tokens noted; a combine brings back its dispatch
    op's latest handle; a refused trigger fails the done word and its sticky copy, launching
    nothing; a trigger that would wait for a count is not run; disarming frees the last
    handle, and the ring's last op takes the member's failure record with it."""
    from epd.proto import abi
    from epd.proto.errors import Aborted
    from epd.server.engine import captured_calls as C
    from epd.server.engine.state import HandleInfo

    ops, session, member, mem, _ = _stand_in_arming(monkeypatch, chain="on", on_mps=True)
    mem[:, :] = 0xABCD

    def slot(i: int) -> np.ndarray:  # (the engine's CounterSlot: int64 words, device pointer)
        words = mem[i].view(np.int64).view(_Slot)
        words.device_ptr = 0x10000 + 4096 * i
        return words
    session.counter_page = types.SimpleNamespace(slot=slot)
    mem[0] = 0
    member.counter_slot, member.pending, member.handles, member.failure_words = 0, None, {}, None
    signalled: list = []
    member.comm.signal_after = lambda ptr, value: signalled.append((ptr, value))
    after: list = []
    ran: list = []
    session.executor = types.SimpleNamespace(
        take_after=lambda: [after.pop() for _ in list(after)][::-1])
    released: list = []
    handles = itertools.count(41)

    checked: list = []  # the first trigger's checks, kept for the later ones (op.plan)
    refills: list = []  # the released handle each dispatch may refill

    def dispatch_args(s, m, req):
        checked.append("dispatch")
        return types.SimpleNamespace(refill=None), None, 5.0

    def launch_stream_dispatch(s, m, req, args, cached, timeout, path):
        refills.append(args.refill)
        released.extend(req.release_handles)
        for h in req.release_handles:
            member.handles.pop(h)
        after.append(lambda: ran.append(("dispatch", list(req.release_handles))))
        h = next(handles)
        member.handles[h] = HandleInfo(f"backend handle {h}", 8, -1, 32)
        return None, h, 3, 7

    def combine_inputs(s, m, req, rows, t, rows_are):
        checked.append(("combine", rows, t))
        return "x", None, [None, None]

    def launch_stream_combine(s, m, info, args, out, out_w, timeout, path, num_sms):
        assert args.handle == info.backend_handle and out == "out"
        handle = cop.request.handle
        after.append(lambda: ran.append(("combine", handle)))
        return 8
    engine = ops.engine
    engine.dispatch_args, engine.launch_stream_dispatch = dispatch_args, launch_stream_dispatch
    alive: list = []  # the group's state asked (dispatch_args asks at a dispatch's first)
    engine._check_alive = lambda m, stream_ordered: alive.append(stream_ordered)
    engine.combine_taking_part = lambda m, req, run: run()
    engine._handle = lambda m, h, kind: member.handles[h]
    engine._resolve = lambda s, m, info, wait: True
    engine.combine_inputs, engine.launch_stream_combine = combine_inputs, launch_stream_combine
    engine.combine_outputs = lambda s, m, req, t, with_weights: ("out", None)
    engine._release = lambda m, ids: released.extend(ids)
    monkeypatch.setattr(C, "arm_dispatch",
                        lambda e, s, req: (member, epd_pb2.DispatchResponse()))
    monkeypatch.setattr(C, "arm_combine", lambda e, s, req, src: member)
    try:
        d = ops.arm(session, epd_pb2.ArmStreamOpRequest(
            session_id="s", group_id="g", ring_trigger=True,
            dispatch=epd_pb2.DispatchRequest(num_worst_tokens=32)))
        c = ops.arm(session, epd_pb2.ArmStreamOpRequest(
            session_id="s", group_id="g", ring_trigger=True, dispatch_op=d.op_id,
            combine=epd_pb2.CombineRequest()))
        assert d.ordered and not d.chained and not c.chained  # (the poller's ring)
        ring = mem[d.chain_slot].view(np.int64)
        assert not ring[abi.RING_FAIL_STATUS:abi.RING_FIRED_WORST + 1].any()
        assert member.failure_words is not None
        assert mem[d.counter_slot].view(np.int32)[abi.STREAM_FAIL_DONE] == 0
        dop, cop = ops.ops[d.op_id], ops.ops[c.op_id]
        for _ in range(2):  # two replays: the second frees the first's handle
            ops._fire(dop, 0)
            ops._fire(cop, 0)
        assert ran == [("dispatch", []), ("combine", 41), ("dispatch", [41]), ("combine", 42)]
        assert checked == ["dispatch", ("combine", 32, 8)]  # (once per op)
        assert refills == [None, "backend handle 41"]  # (the second refills the first's)
        assert member.handles[42].captured and dop.plan[0].refill is None
        assert alive == [True] * 3  # (both combines, the second dispatch)
        released.clear()
        slot32 = mem[0].view(np.int32)
        assert slot32[abi.SLOT32_READY + 7 % abi.READY_RING] == 7  # (the trigger's READY)
        assert slot32[abi.SLOT32_READY + 8 % abi.READY_RING] == 8
        assert len(signalled) == 4 and all(v == abi.DONE_OK for _, v in signalled)
        # A later trigger still asks whether the group is alive: aborted, nothing launched.
        def aborted(m, stream_ordered):
            raise Aborted("group 'g' is aborted: a peer left")
        engine._check_alive = aborted
        ops._fire(dop, 0)
        assert mem[d.counter_slot].view(np.int32)[abi.STREAM_DONE] & 0xFF == abi.DONE_FAILED
        assert not after and len(ran) == 4 and released == [42] and dop.handle == 0
        engine._check_alive = lambda m, stream_ordered: None
        mem[d.counter_slot].view(np.int32)[abi.STREAM_DONE] = abi.DONE_OK
        ops._fire(dop, 0)  # (a trigger after a failed one: no handle to free or refill)
        assert ran[-1] == ("dispatch", []) and refills[-1] is None
        released.clear()
        # A trigger that would wait for its member's latest count is not ready.
        member.pending = HandleInfo(None, 8, -1, 32, sequence=4)
        assert not C.ready(dop)
        member.pending = None
        # A refused trigger: nothing launched, the done word and its sticky copy failed.
        def refused(s, m, req, args, cached, timeout, path):
            after.append(lambda: ran.append("must not run"))
            raise RuntimeError("refused")
        engine.launch_stream_dispatch = refused
        ops._fire(dop, 0)
        words = mem[d.counter_slot].view(np.int32)
        assert words[abi.STREAM_DONE] & 0xFF == abi.DONE_FAILED
        assert words[abi.STREAM_FAIL_DONE] == words[abi.STREAM_DONE] and not after
        assert released == [43] and dop.handle == 0  # (a combine must not read it)
        assert "must not run" not in ran
        ops.disarm(session, c.op_id)
        ops.disarm(session, d.op_id)
        assert member.failure_words is None and not ops.rings
    finally:
        ops.stop()
