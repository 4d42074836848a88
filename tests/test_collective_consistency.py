"""Collectives agree or fail together (issue 12, findings 9 and 10; docs/DESIGN_NOTES.md).

Every rank publishes a header with the collective's kind, number, the dispatch its handle comes
from and the arguments that must agree; after the arrival barrier every rank compares them. A
disagreement fails EVERY member at once with FAILED_PRECONDITION naming the mismatch and the
ranks (never OK with wrong data), the collective's number is consumed on every rank, and the
next valid collective works. A rank that fails its own part after it took part releases the
peers at once ("rejected"); a request rejected before taking part keeps the retry contract.

The two ranks are sessions of this process (rank 0 on engine 0, rank 1 on engine 1), driven
from threads, through the fast path and through gRPC."""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from ranklib import Case, assert_exact, case_round, check_case, expert_out, join

from epd.client import Session
from epd.client.group import Handle
from epd.proto.errors import EpdError, FailedPrecondition, TokenCapacityExceeded
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref

FAILED = grpc.StatusCode.FAILED_PRECONDITION
TIMEOUT = 10.0  # per call: a failure "at once" must come well before it
PROMPT = 2.5  # seconds: at once, with room for a loaded CI machine
E, H, K = 8, 256, 4
SPEC = Case(group="cc", num_ranks=2, num_experts=E, hidden=H, num_topk=K, tokens=(20, 24),
            max_tokens=32, drop_prob=0.2)
_seeds = itertools.count(100)
_names = itertools.count()
TRANSPORTS = pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "grpc"])


@dataclasses.dataclass
class Pair:
    sessions: list[Session]
    groups: list


@pytest.fixture
def pair(daemon, request):
    fast = getattr(request, "param", True)
    sessions = [Session(daemon.socket(r), timeout=TIMEOUT, fast_path=fast) for r in range(2)]
    try:
        assert {s.transport for s in sessions} == {"fastpath" if fast else "grpc"}
        case = dataclasses.replace(SPEC, group=f"cc-{next(_names)}")
        with ThreadPoolExecutor(2) as ex:
            groups = list(ex.map(lambda r: join(sessions[r], case, r, timeout=20), range(2)))
        yield Pair(sessions, groups)
    finally:
        for s in sessions:
            s.close()


def both(fn, p: Pair):
    """fn(rank, group) on both ranks at once; (outcome, seconds) per rank, where an outcome is
    the value or the EpdError raised."""
    def one(r):
        t0 = time.monotonic()
        try:
            out = fn(r, p.groups[r])
        except EpdError as e:
            out = e
        return out, time.monotonic() - t0
    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(one, range(2)))


def expect_failed_together(results, *texts: str) -> list[str]:
    """Both ranks failed with FAILED_PRECONDITION, promptly, with messages holding `texts`."""
    msgs = []
    for r, (out, secs) in enumerate(results):
        assert isinstance(out, EpdError), f"rank {r} returned OK: {out!r}"
        assert out.code == FAILED, f"rank {r}: {out.code.name}: {out.details}"
        for t in texts:
            assert t in out.details, f"rank {r}: {t!r} not in {out.details!r}"
        assert secs < PROMPT, f"rank {r} failed after {secs:.2f} s, not at once: {out.details}"
        msgs.append(out.details)
    return msgs


def valid_round(p: Pair) -> None:
    """A full layout/dispatch/combine/cached-dispatch round on both ranks, exact, promptly."""
    c = dataclasses.replace(SPEC, seed=next(_seeds), cached=True)
    t0 = time.monotonic()
    res = both(lambda r, g: case_round(p.sessions[r], g, c, r), p)
    for r, (out, _) in enumerate(res):
        assert not isinstance(out, EpdError), f"rank {r}: {out.code.name}: {out.details}"
    check_case(c, [out for out, _ in res])
    assert time.monotonic() - t0 < 2 * PROMPT


def inputs(case: Case, r: int):
    i = case.inputs(r)
    return i["x"], i["topk_idx"], i["topk_weights"]


def dispatch_and_expert(p: Pair, case: Case):
    """Both ranks dispatch `case`'s inputs; (dispatch outputs, expert outputs) per rank."""
    res = both(lambda r, g: g.dispatch(*inputs(case, r)), p)
    outs = [o for o, _ in res]
    ys = [expert_out(o.recv_x, None, o.recv_topk_idx, o.recv_topk_weights, r, E // 2)
          for r, o in enumerate(outs)]
    return outs, ys


def reference_combine(cases: list[Case], ys, weights: bool = True):
    """The reference combine of rank r's expert outputs ys[r] of cases[r]'s dispatch (all
    ranks must have combined the same dispatch for this to mean anything)."""
    case = cases[0]
    ins = [inputs(case, r) for r in range(2)]
    disp = ref.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E)
    return ref.combine(ys, disp, list(case.tokens),
                       recv_topk_weights=[d.recv_topk_weights for d in disp] if weights
                       else None)


# ------------------------------------------------------------------------------------------------
# finding 10: combine of different dispatches; dispatch against combine
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", [True, False], ids=["fastpath", "grpc"], indirect=True)
def test_combine_of_different_dispatches_fails_on_both(pair):
    """Rank 0 combines the first dispatch, rank 1 the second: before, OK with 13/16 rows wrong.
    Now both fail naming the two dispatches; then both combine the same one, exactly."""
    c1 = dataclasses.replace(SPEC, seed=next(_seeds))
    c2 = dataclasses.replace(SPEC, seed=next(_seeds))
    outs1, ys1 = dispatch_and_expert(pair, c1)
    outs2, ys2 = dispatch_and_expert(pair, c2)
    mixed = [(outs1[0], ys1[0]), (outs2[1], ys2[1])]
    res = both(lambda r, g: g.combine(mixed[r][1], mixed[r][0].handle,
                                      topk_weights=mixed[r][0].recv_topk_weights), pair)
    msgs = expect_failed_together(res, "combine of dispatch #", "rank 0", "rank 1")
    assert msgs[0] == msgs[1]  # one verdict, the same text on every rank
    # The group is usable: both combine the second dispatch and get the reference's answer.
    res = both(lambda r, g: g.combine(ys2[r], outs2[r].handle,
                                      topk_weights=outs2[r].recv_topk_weights), pair)
    want = reference_combine([c2, c2], ys2)
    for r, ((cx, cw), _) in enumerate(res):
        assert_exact(cx, want[r][0], f"rank {r} combined_x")
        assert_exact(cw, want[r][1], f"rank {r} combined_topk_weights")
    valid_round(pair)


@pytest.mark.parametrize("pair", [True, False], ids=["fastpath", "grpc"], indirect=True)
def test_dispatch_against_combine_fails_on_both(pair):
    """Rank 0 calls Dispatch while rank 1 calls Combine: before, OK on both (the dispatch read
    the combine's metadata). Now both fail naming the two calls; the group still works."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    outs, ys = dispatch_and_expert(pair, c)

    def fn(r, g):
        if r == 0:
            return g.dispatch(*inputs(c, 0))
        return g.combine(ys[1], outs[1].handle)

    expect_failed_together(both(fn, pair), "rank 0 called dispatch",
                           "rank 1 called combine of dispatch #")
    # The handle survived the failed call: both combine it now, exactly.
    res = both(lambda r, g: g.combine(ys[r], outs[r].handle), pair)
    want = reference_combine([c, c], ys, weights=False)
    for r, ((cx, cw), _) in enumerate(res):
        assert_exact(cx, want[r][0], f"rank {r} combined_x")
        assert cw is None
    valid_round(pair)


# ------------------------------------------------------------------------------------------------
# finding 9: topk_weights passed by one rank only
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", [True, False], ids=["fastpath", "grpc"], indirect=True)
def test_topk_weights_on_one_rank_only(pair):
    """Before: the rank with weights failed, the other returned OK, and the next dispatch of
    both waited out the deadline, blaming the wrong rank. Now both fail at once naming the
    mismatch, and the next dispatch on both succeeds promptly."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    outs, ys = dispatch_and_expert(pair, c)
    res = both(lambda r, g: g.combine(ys[r], outs[r].handle,
                                      topk_weights=outs[r].recv_topk_weights if r == 0
                                      else None), pair)
    expect_failed_together(res, "topk_weights: passed on rank 0, not passed on rank 1")
    t0 = time.monotonic()
    nxt = dataclasses.replace(SPEC, seed=next(_seeds))
    res = both(lambda r, g: g.dispatch(*inputs(nxt, r)), pair)
    for r, (out, secs) in enumerate(res):
        assert not isinstance(out, EpdError), f"rank {r}: {out.code.name}: {out.details}"
        assert secs < PROMPT, f"rank {r}: the next dispatch took {secs:.2f} s"
    assert time.monotonic() - t0 < PROMPT
    # Its handles are good for a combine (both with weights now), and a whole round works.
    ys = [expert_out(o.recv_x, None, o.recv_topk_idx, o.recv_topk_weights, r, E // 2)
          for r, ((o, _)) in enumerate(res)]
    got = both(lambda r, g: g.combine(ys[r], res[r][0].handle,
                                      topk_weights=res[r][0].recv_topk_weights), pair)
    want = reference_combine([nxt, nxt], ys)
    for r, ((cx, cw), _) in enumerate(got):
        assert_exact(cx, want[r][0], f"rank {r} combined_x")
        assert_exact(cw, want[r][1], f"rank {r} combined_topk_weights")
    valid_round(pair)


# ------------------------------------------------------------------------------------------------
# other arguments that must agree
# ------------------------------------------------------------------------------------------------

def test_cached_against_fresh_dispatch(pair):
    """A cached dispatch on one rank, a fresh one on the other (the fresh one would read routing
    the cached rank never wrote)."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    outs, _ = dispatch_and_expert(pair, c)

    def fn(r, g):
        x, idx, w = inputs(c, r)
        return g.dispatch(x, handle=outs[r].handle) if r == 0 else g.dispatch(x, idx, w)

    expect_failed_together(both(fn, pair), "rank 0 called cached dispatch of dispatch #",
                           "rank 1 called dispatch")
    valid_round(pair)


def test_cached_dispatch_of_different_dispatches(pair):
    c1 = dataclasses.replace(SPEC, seed=next(_seeds))
    outs1, _ = dispatch_and_expert(pair, c1)
    outs2, _ = dispatch_and_expert(pair, c1)
    handles = [outs1[0].handle, outs2[1].handle]
    res = both(lambda r, g: g.dispatch(inputs(c1, r)[0], handle=handles[r]), pair)
    expect_failed_together(res, "cached dispatch of dispatch #")
    valid_round(pair)


def test_fp8_on_one_rank_only(pair):
    """One rank sends FP8 (+ scales), the other bf16: the receiver would read one rank's bytes
    as the other's dtype."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))

    def fn(r, g):
        x, idx, w = inputs(c, r)
        if r == 0:
            x8, scales = ref.quantize_fp8(x)
            return g.dispatch(x8, idx, w, x_scales=scales)
        return g.dispatch(x, idx, w)

    expect_failed_together(both(fn, pair), "FP8 payload (x_scales): yes on rank 0, no on rank 1")
    valid_round(pair)


def test_num_worst_tokens_and_alignment_must_agree(pair):
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    res = both(lambda r, g: g.dispatch(*inputs(c, r), num_worst_tokens=48 if r else 0), pair)
    expect_failed_together(res, "num_worst_tokens: 0 on rank 0, 48 on rank 1")
    res = both(lambda r, g: g.dispatch(*inputs(c, r), expert_alignment=4 if r else 1), pair)
    expect_failed_together(res, "expert_alignment: 1 on rank 0, 4 on rank 1")
    valid_round(pair)


@pytest.mark.parametrize("pair", [True, False], ids=["fastpath", "grpc"], indirect=True)
def test_dispatch_beyond_capacity_fails_on_every_rank(pair):
    """Rank 0 dispatches more tokens than the group holds (40 > 32), rank 1 fewer: both fail at
    once with RESOURCE_EXHAUSTED (TokenCapacityExceeded) naming rank 0 and the tokens needed, so
    that both can grow alike (the facade does); handles made before survive, the group goes on."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    outs, ys = dispatch_and_expert(pair, c)
    big = dataclasses.replace(SPEC, seed=next(_seeds), tokens=(40, 24))
    res = both(lambda r, g: g.dispatch(*inputs(big, r)), pair)
    msgs = []
    for r, (out, secs) in enumerate(res):
        assert isinstance(out, TokenCapacityExceeded), f"rank {r}: {out!r}"
        assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert out.tokens_needed == 40, out.details
        assert "rank 0 dispatched 40 tokens" in out.details and "rank 1" not in out.details
        assert secs < PROMPT, f"rank {r} failed after {secs:.2f} s"
        msgs.append(out.details)
    assert msgs[0] == msgs[1]
    # Both over: the larger call is the one needed.
    big2 = dataclasses.replace(SPEC, seed=next(_seeds), tokens=(33, 48))
    for out, _ in both(lambda r, g: g.dispatch(*inputs(big2, r)), pair):
        assert isinstance(out, TokenCapacityExceeded) and out.tokens_needed == 48
    # The handle made before the failed calls still combines exactly.
    res = both(lambda r, g: g.combine(ys[r], outs[r].handle,
                                      topk_weights=outs[r].recv_topk_weights), pair)
    want = reference_combine([c, c], ys)
    for r, ((cx, cw), _) in enumerate(res):
        assert_exact(cx, want[r][0], f"rank {r} combined_x")
        assert_exact(cw, want[r][1], f"rank {r} combined_topk_weights")
    valid_round(pair)


def test_low_latency_against_normal(daemon):
    """A low-latency dispatch on one rank, a normal one on the other."""
    sessions = [Session(daemon.socket(r), timeout=TIMEOUT) for r in range(2)]
    try:
        name = f"cc-ll-{next(_names)}"
        with ThreadPoolExecutor(2) as ex:
            groups = list(ex.map(lambda r: sessions[r].join(
                name, rank=r, num_ranks=2, num_experts=E, hidden=H, max_tokens_per_rank=32,
                num_topk=K, low_latency_mode=True, timeout=20), range(2)))
        p = Pair(sessions, groups)
        c = dataclasses.replace(SPEC, seed=next(_seeds), drop_prob=0.0)

        def fn(r, g):
            x, idx, w = inputs(c, r)
            if r == 0:
                return g.low_latency_dispatch(x, idx, 32)
            return g.dispatch(x, idx, w)

        expect_failed_together(both(fn, p), "rank 0 called low-latency dispatch",
                               "rank 1 called dispatch")
        valid_round(p)
    finally:
        for s in sessions:
            s.close()


# ------------------------------------------------------------------------------------------------
# rejected before taking part vs after
# ------------------------------------------------------------------------------------------------

def test_rejected_before_taking_part_keeps_the_retry_contract(pair):
    """Rank 0 names a handle it does not know while rank 1 already waits in combine: rank 0 is
    rejected before taking part, so its corrected retry completes the collective; and a rank
    that gives up and calls something else releases the waiting peer at once."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    outs, ys = dispatch_and_expert(pair, c)
    g0 = pair.groups[0]
    arrived = threading.Event()

    def fn(r, g):
        if r == 1:
            arrived.set()
            return g.combine(ys[1], outs[1].handle)
        arrived.wait()
        time.sleep(0.2)  # rank 1 is waiting in the collective now
        with pytest.raises(EpdError) as ei:
            g.combine(ys[0], Handle(g0, 9999, 0, 0, outs[0].num_recv_tokens))
        assert ei.value.code == FAILED and "handle 9999 is not known" in ei.value.details
        return g.combine(ys[0], outs[0].handle)

    res = both(fn, pair)
    want = reference_combine([c, c], ys, weights=False)
    for r, (out, _) in enumerate(res):
        assert not isinstance(out, EpdError), f"rank {r}: {out.code.name}: {out.details}"
        assert_exact(out[0], want[r][0], f"rank {r} combined_x")

    # Now rank 0 gives up on the combine rank 1 waits in and dispatches: both fail at once.
    outs, ys = dispatch_and_expert(pair, c)

    def gives_up(r, g):
        if r == 1:
            return g.combine(ys[1], outs[1].handle)
        time.sleep(0.2)
        with pytest.raises(EpdError):
            g.combine(ys[0], Handle(g0, 9999, 0, 0, outs[0].num_recv_tokens))
        return g.dispatch(*inputs(c, 0))

    res = both(gives_up, pair)
    expect_failed_together(res, "rank 0 called dispatch", "rank 1 called combine of dispatch #")
    valid_round(pair)


def test_rank_rejected_after_taking_part_releases_the_peers():
    """Backend level (no daemon): rank 0 fails its own part of a combine after it claimed the
    collective (its input cannot be copied into its slot); rank 1, already waiting, fails at
    once with FAILED_PRECONDITION naming rank 0 and the reason; then both combine correctly."""
    from epd.server.backends import base
    from epd.server.backends.cpu import CpuBackend
    from epd.server.backends.cpu_plan import CpuPlanner

    spec = base.GroupSpec("cc-backend", 2, E, H, 32, K, epd_pb2.BFLOAT16)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        planner = CpuPlanner(d)
        plan = planner.plan_group("gcc", spec)
        backend = CpuBackend()
        comms = [backend.attach(spec, base.Membership("gcc", r, (0, 0), plan))
                 for r in range(2)]
        try:
            case = dataclasses.replace(SPEC, group="cc-backend", seed=next(_seeds))
            ins = [inputs(case, r) for r in range(2)]
            slots = [np.zeros(512, np.int64) for _ in range(2)]

            def run(fn):
                def one(r):
                    t0 = time.monotonic()
                    try:
                        out = fn(r)
                    except Exception as e:  # the test compares them
                        out = e
                    return out, time.monotonic() - t0
                with ThreadPoolExecutor(2) as ex:
                    return list(ex.map(one, range(2)))

            disp = run(lambda r: comms[r].dispatch(
                base.DispatchArgs(ins[r][0], None, ins[r][1], ins[r][2], 1, 0, None),
                slots[r], 1, time.monotonic() + TIMEOUT))
            outs = [o for o, _ in disp]
            ys = [expert_out(np.array(o.recv_x), None, np.array(o.recv_topk_idx),
                             np.array(o.recv_topk_weights), r, E // 2)
                  for r, o in enumerate(outs)]

            def combine(r, bad=False):
                if r == 1:
                    time.sleep(0.1)  # rank 0 has rejected its part before rank 1 arrives
                y = ys[r][:-1] if bad and r == 0 else ys[r]  # cannot fill its slot
                return comms[r].combine(base.CombineArgs(y, outs[r].handle, None, None, None),
                                        time.monotonic() + TIMEOUT)

            res = run(lambda r: combine(r, bad=True))
            assert not isinstance(res[0][0], base.CombineOutputs)
            assert isinstance(res[1][0], FailedPrecondition), repr(res[1][0])
            assert "rank 0 rejected its combine" in res[1][0].details, res[1][0].details
            assert res[1][1] < PROMPT
            res = run(combine)
            want = reference_combine([case, case], ys, weights=False)
            for r, (out, _) in enumerate(res):
                assert isinstance(out, base.CombineOutputs), repr(out)
                assert_exact(np.array(out.combined_x), want[r][0], f"rank {r} combined_x")
        finally:
            for cm in comms:
                cm.close()
            planner.free_group(plan)


def test_the_verdict_names_every_rank():
    """The verdict is a function of the headers alone (the same words on every rank); ranks
    that agree with each other are named together."""
    from epd.server.backends import cpu_calls as cpu
    from epd.server.backends.cpu_comm_file import ARRIVED, COMBINE, DISPATCH, F_WEIGHTS, REJECTED

    d = cpu.CallHeader(DISPATCH, align=1)
    c3 = cpu.CallHeader(COMBINE, ref=3)
    ok = [ARRIVED] * 3
    assert cpu.call_disagreement([5] * 3, [d, d, d], ok, [""] * 3) is None
    assert cpu.call_disagreement([5] * 3, [c3, d, c3], ok, [""] * 3) == (
        "ranks called different collectives: ranks [0, 2] called combine of dispatch #3, "
        "rank 1 called dispatch")
    w = cpu.CallHeader(COMBINE, ref=3, flags=F_WEIGHTS)
    assert cpu.call_disagreement([5] * 3, [c3, w, w], ok, [""] * 3) == (
        "combine arguments differ across ranks: topk_weights: not passed on rank 0, passed on "
        "ranks [1, 2]")
    assert cpu.call_disagreement([5] * 3, [c3, c3, c3], [ARRIVED, REJECTED, ARRIVED],
                                 ["", "ValueError: no", ""]) == (
        "rank 1 rejected its combine of dispatch #3: ValueError: no")
