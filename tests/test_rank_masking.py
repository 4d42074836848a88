"""Rank masking of low-latency groups (issue 11, DeepEP's shrink mode), on the CPU backend: a rank
that goes away (its session closes, its process is killed) is masked by the daemon and the
other ranks' low-latency calls go on without it, exact against the reference with that rank
left out; a rank masked by a call takes no part until unmasked; the mask is shared by the
group's ranks and survives nothing it should not. Normal-mode calls and groups without shrink
keep the old rule (a rank that goes away aborts the group)."""

from __future__ import annotations

import itertools
import signal
import threading
import time

import numpy as np
import pytest
import ranklib
from daemon_harness import samples
from ranklib import all_at_once

from epd.client import EpdError, Session
from epd.client.buffer import Buffer
from epd.proto import dtypes
from epd.server import reference as ref

BF16 = dtypes.BFLOAT16
R, E, H, K, M = 3, 12, 256, 3, 16  # ranks, experts, hidden, top-k, num_max
LX = E // R
_names = itertools.count()
IN, MASKED, GONE = 0, 1, 2


def _inputs(step: int, rank: int, tokens: int = 11):
    rng = np.random.default_rng([77, step, rank])
    idx, w = ref.random_routing(rng, tokens, E, K, drop_prob=0.1, num_ranks=R)
    return ref.random_x(rng, tokens, H, BF16), idx, w


def _expected(step: int, left_out: set[int]):
    """Per rank: (dispatch reference, combined bits) with the ranks in `left_out` taking no
    part: their tokens absent, every entry for one of their experts dropped (-1); identity
    experts (the reference combine of the reference dispatch's own rows). A rank left out
    gets zeros."""
    xs, idx, w = zip(*(_inputs(step, r) for r in range(R)), strict=True)
    kept = []
    for r in range(R):
        i = idx[r].copy()
        if r in left_out:
            i[:] = -1
        else:
            i[np.isin(np.where(i >= 0, i // LX, -1), sorted(left_out))] = -1
        kept.append(i)
    part = [r not in left_out for r in range(R)]
    disp = ref.low_latency_dispatch([x if p else x[:0] for x, p in zip(xs, part, strict=True)],
                                    [i if p else i[:0] for i, p in zip(kept, part, strict=True)],
                                    E, M)
    combined = ref.low_latency_combine(
        [d.recv_x for d in disp], disp, [i if p else i[:0] for i, p in zip(kept, part,
                                                                           strict=True)],
        [v if p else v[:0] for v, p in zip(w, part, strict=True)], E)
    return disp, [c.view(np.uint16) if p else np.zeros(xs[r].shape, np.uint16)
                  for r, (c, p) in enumerate(zip(combined, part, strict=True))]


def _step(g, step: int, rank: int) -> dict:
    x, idx, w = _inputs(step, rank)
    d = g.low_latency_dispatch(x, idx, M)
    cx = g.low_latency_combine(d.recv_x, idx, w, d.handle)
    return {"count": np.asarray(d.recv_count).copy(), "recv_x": np.asarray(d.recv_x).copy(),
            "src_rank": np.asarray(d.recv_src_rank).copy(),
            "src_idx": np.asarray(d.recv_src_idx).copy(),
            "cx": np.asarray(cx).view(np.uint16).copy()}


def _check(got: dict, step: int, rank: int, left_out: set[int],
           combine_left_out: set[int] | None = None) -> None:
    """One rank's step against the reference with `left_out` taking no part in the dispatch
    and `combine_left_out` (default the same) in the combine's result (a rank left out of the
    dispatch or of the combine adds nothing to it)."""
    _check_dispatch(got, step, rank, left_out)
    _, combined = _expected(step, left_out if combine_left_out is None else combine_left_out)
    np.testing.assert_array_equal(got["cx"], combined[rank], err_msg=f"step {step} rank {rank}")


def _check_dispatch(got: dict, step: int, rank: int, left_out: set[int]) -> None:
    disp, _ = _expected(step, left_out)
    want = disp[rank]
    np.testing.assert_array_equal(got["count"], want.recv_count, err_msg=f"step {step}")
    for e in range(LX):  # the CPU backend orders rows by source, then token: exact
        n = int(want.recv_count[e])
        np.testing.assert_array_equal(got["src_rank"][e, :n], want.recv_src_rank[e, :n])
        np.testing.assert_array_equal(got["src_idx"][e, :n], want.recv_src_idx[e, :n])
        np.testing.assert_array_equal(got["recv_x"][e, :n].view(np.uint16),
                                      want.recv_x[e, :n].view(np.uint16))


def _sessions(daemon) -> list[Session]:
    return [Session(daemon.socket(r % daemon.engines)) for r in range(R)]


def _join_all(sessions: list[Session], name: str, shrink: bool = True) -> list:
    out: list = [None] * R

    def join(r: int) -> None:
        out[r] = sessions[r].join(name, rank=r, num_ranks=R, num_experts=E, hidden=H,
                                  max_tokens_per_rank=M, num_topk=K, low_latency_mode=True,
                                  shrink=shrink, timeout=20)
    threads = [threading.Thread(target=join, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in out)
    return out


def _steps(groups: list, ranks: list[int], step: int) -> dict[int, dict]:
    res: dict[int, dict] = {}
    errors: list = []

    def run(r: int) -> None:
        try:
            res[r] = _step(groups[r], step, r)
        except Exception as e:  # reported below
            errors.append((r, e))
    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return res


def _masked(daemon, why: str) -> float:
    """epd_ranks_masked_total{why} as the daemon exports it (0 before the first)."""
    return sum(s.value for s in samples(daemon).get("epd_ranks_masked_total", [])
               if s.labels.get("why") == why)


def test_a_rank_that_leaves_is_masked_and_the_others_go_on(daemon) -> None:
    gone_before = _masked(daemon, "gone")
    sessions = _sessions(daemon)
    try:
        groups = _join_all(sessions, f"shrink-{next(_names)}")
        for r, got in _steps(groups, [0, 1, 2], 0).items():
            _check(got, 0, r, set())
        assert groups[0].rank_mask() == [IN, IN, IN]
        sessions[2].close()  # rank 2 goes away (as if its process ended)
        t0 = time.monotonic()
        for step in (1, 2):  # the survivors' calls go on, exact, rank 2 left out
            for r, got in _steps(groups, [0, 1], step).items():
                _check(got, step, r, {2})
        assert time.monotonic() - t0 < 10  # no deadline was waited out
        assert groups[1].rank_mask() == [IN, IN, GONE]
        assert _masked(daemon, "gone") == gone_before + 1
        with pytest.raises(EpdError, match=r"rank 2 of group .* went away") as e:
            groups[0].rank_mask(unmask=2)
        assert e.value.code.name == "FAILED_PRECONDITION"
        assert groups[0].rank_mask(clean=True) == [IN, IN, GONE]  # a gone rank stays masked
    finally:
        for s in sessions:
            s.close()


def test_masking_a_live_rank_by_a_call(daemon) -> None:
    """Rank 0 masks rank 1: from then on every rank's calls leave it out, rank 1's own calls
    included (they return nothing for it); unmasking takes it back."""
    call_before = _masked(daemon, "call")
    sessions = _sessions(daemon)
    try:
        groups = _join_all(sessions, f"shrink-{next(_names)}")
        assert groups[0].rank_mask(mask=1) == [IN, MASKED, IN]
        assert groups[0].rank_mask(mask=1) == [IN, MASKED, IN]  # again: no change, not counted
        assert _masked(daemon, "call") == call_before + 1
        assert groups[2].rank_mask() == [IN, MASKED, IN]  # the group's mask, shared
        got = _steps(groups, [0, 1, 2], 3)
        for r in range(R):
            _check(got[r], 3, r, {1})
        assert not got[1]["count"].any()  # the masked rank received nothing
        assert groups[1].rank_mask(unmask=1) == [IN, IN, IN]
        for r, g in _steps(groups, [0, 1, 2], 4).items():
            _check(g, 4, r, set())
        groups[2].rank_mask(mask=0)
        assert groups[1].rank_mask(clean=True) == [IN, IN, IN]
        for r, g in _steps(groups, [0, 1, 2], 5).items():
            _check(g, 5, r, set())
    finally:
        for s in sessions:
            s.close()


def test_mask_requests_are_checked(daemon) -> None:
    sessions = _sessions(daemon)
    try:
        groups = _join_all(sessions, f"shrink-{next(_names)}")
        plain = _join_all(sessions, f"plain-{next(_names)}", shrink=False)
        cases = [
            (lambda: groups[0].rank_mask(mask=3), "INVALID_ARGUMENT", "has ranks 0..2"),
            (lambda: groups[0].rank_mask(unmask=-1), "INVALID_ARGUMENT", "has ranks 0..2"),
            (lambda: plain[0].rank_mask(mask=1), "FAILED_PRECONDITION",
             "was not joined with shrink"),
            (lambda: groups[0].dispatch(*_inputs(0, 0)), "FAILED_PRECONDITION",
             "takes low-latency calls only"),
        ]
        for call, code, text in cases:
            with pytest.raises(EpdError) as e:
                call()
            assert e.value.code.name == code and text in e.value.details, e.value
        assert plain[0].rank_mask() == [IN, IN, IN]  # reading is fine on any group
        assert groups[0].rank_mask() == [IN, IN, IN]  # nothing changed
        with pytest.raises(Exception, match="at most one"):
            groups[0].rank_mask(mask=1, clean=True)
        with pytest.raises(EpdError, match=r"shrink .* is for low-latency groups"):
            sessions[0].join(f"x-{next(_names)}", rank=0, num_ranks=R, num_experts=E, hidden=H,
                             max_tokens_per_rank=M, num_topk=K, shrink=True, timeout=5)
    finally:
        for s in sessions:
            s.close()


def test_without_shrink_a_rank_that_leaves_still_aborts(daemon) -> None:
    sessions = _sessions(daemon)
    try:
        groups = _join_all(sessions, f"plain-{next(_names)}", shrink=False)
        _steps(groups, [0, 1, 2], 0)
        sessions[2].close()
        with pytest.raises(EpdError) as e:
            _step(groups[0], 1, 0)
        assert e.value.code.name == "ABORTED" and "rank 2" in e.value.details
    finally:
        for s in sessions:
            s.close()


# -- a killed rank process, through the DeepEP facade ------------------------------------------

def _facade_rank(socket: str, rank: int, name: str) -> dict:
    buf = Buffer(rank=rank, num_ranks=R, endpoint=socket, low_latency_mode=True,
                 enable_shrink=True, group_name=name, timeout=20)
    out: dict = {"steps": []}
    try:
        for step in range(3):
            if step == 1:
                ranklib.report("step 0 done")
                ranklib.command()  # the test kills rank 2, then lets the others go on
            if rank == 2 and step > 0:
                break
            x, idx, w = _inputs(step, rank)
            recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            cx, _, _ = buf.low_latency_combine(recv, idx, w, handle)
            out["steps"].append({"count": np.asarray(count).copy(),
                                 "recv_x": np.asarray(recv).copy(),
                                 "src_rank": np.asarray(handle.src_rank).copy(),
                                 "src_idx": np.asarray(handle.src_idx).copy(),
                                 "cx": np.asarray(cx).view(np.uint16).copy()})
        mask = np.full(R, 7, np.int32)
        buf.low_latency_query_mask_buffer(mask)
        out["mask"] = mask
        return out
    finally:
        buf.destroy()


def test_killed_rank_is_masked_through_the_facade(daemon, ranks) -> None:
    name = f"facade-shrink-{next(_names)}"
    tids = [ranks.submit(r, _facade_rank, daemon.socket(r % daemon.engines), r, name)
            for r in range(R)]
    for r in range(R):
        assert ranks.event(r, 60) == "step 0 done"
    ranks.kill(2, signal.SIGKILL)
    for r in (0, 1):
        ranks.cmd(r, "go")
    outs = ranks.gather(tids[:2], 90)
    for r, o in enumerate(outs):
        assert o.ok, o.describe()
        steps = o.value["steps"]
        _check(steps[0], 0, r, set())
        for step in (1, 2):
            _check(steps[step], step, r, {2})
        np.testing.assert_array_equal(o.value["mask"], [0, 0, 1])


def test_a_backend_without_masking_refuses_changes_and_still_aborts() -> None:
    """A backend without rank masking (RankComm's defaults): a shrink group's mask reads
    all-in, unmasking a rank that is in is a no-op, masking is FAILED_PRECONDITION naming the
    backend, and a rank that goes away raises the abort word as in any group (Engine._abort)."""
    import types

    from epd.proto.v1 import epd_pb2
    from epd.server.backends.base import GroupSpec, RankComm
    from epd.server.engine.core import Engine
    from epd.server.engine.ops import DataPlane

    spec = GroupSpec("g", R, E, H, M, K, epd_pb2.BFLOAT16, True, 0, True)
    aborted: list[str] = []
    comm = types.SimpleNamespace(spec=spec, backend_name="other", supports_rank_masking=False,
                                 MASK_IN=IN, MASK_MASKED=MASKED, MASK_GONE=GONE,
                                 abort=aborted.append, abort_reason=lambda: None)
    comm.mask_states = lambda: RankComm.mask_states(comm)
    comm.set_mask = lambda rank, state: RankComm.set_mask(comm, rank, state)
    member = types.SimpleNamespace(spec=spec, comm=comm)

    class Plane(DataPlane):
        def member(self, session, group_id):  # type: ignore[override]
            return member

    def ask(**change) -> list[int]:
        req = epd_pb2.RankMaskRequest(session_id="s", group_id="g", **change)
        return list(Plane().rank_mask_op(None, req, "grpc").state)  # type: ignore[arg-type]

    assert ask() == [IN] * R
    assert ask(unmask=1) == [IN] * R and ask(clean=True) == [IN] * R
    with pytest.raises(EpdError, match="rank masking is not implemented on the other backend") \
            as e:
        ask(mask=1)
    assert e.value.code.name == "FAILED_PRECONDITION"
    Engine._abort(member, "rank 2 went away")  # type: ignore[arg-type]
    assert aborted == ["rank 2 went away"]


def test_mask_changes_during_collectives_give_one_set_per_collective(daemon) -> None:
    """Rank 1 is masked and unmasked (through rank 0's session) while the ranks run steps, so
    a change lands in the middle of collectives: each collective must be exact against the
    reference for one left-out set, the same on every rank: the dispatch for {} or {1}, the
    combine for that set or {1} (a change between a step's dispatch and its combine)."""
    sessions = _sessions(daemon)
    stop = threading.Event()
    try:
        groups = _join_all(sessions, f"shrink-{next(_names)}")

        def toggle() -> None:
            flip = True
            while not stop.is_set():
                groups[0].rank_mask(**({"mask": 1} if flip else {"unmask": 1}))
                flip = not flip
                time.sleep(0.003)
        toggler = threading.Thread(target=toggle)
        toggler.start()
        seen = set()
        for step in range(10, 40):
            got = _steps(groups, [0, 1, 2], step)
            fits = []
            for left_out, combine_left_out in ((set(), set()), (set(), {1}), ({1}, {1})):
                try:
                    for r in range(R):
                        _check(got[r], step, r, left_out, combine_left_out)
                    fits.append((frozenset(left_out), frozenset(combine_left_out)))
                except AssertionError:
                    pass
            assert len(fits) == 1, f"step {step}: outputs fit {fits} (want exactly one)"
            seen.add(fits[0][0])
        stop.set()
        toggler.join(10)
        assert seen == {frozenset(), frozenset({1})}, seen  # both happened
    finally:
        stop.set()
        for s in sessions:
            s.close()


def _replace(daemon, name: str, rank: int = 2) -> tuple[Session, object]:
    s = Session(daemon.socket(rank % daemon.engines))
    g = s.join(name, rank=rank, num_ranks=R, num_experts=E, hidden=H, max_tokens_per_rank=M,
               num_topk=K, low_latency_mode=True, shrink=True, timeout=20)
    return s, g


def test_a_replacement_rejoins_its_shrink_group(daemon) -> None:
    """Rank 2 goes away; the others go on without it; a replacement joins under the same name,
    rank and spec (still gone for its peers: its own calls are refused, the others go on); the
    Rejoin collective brings it back, and every later step is exact with all three ranks."""
    sessions = _sessions(daemon)
    name = f"shrink-{next(_names)}"
    replacement = None
    try:
        groups = _join_all(sessions, name)
        for r, got in _steps(groups, [0, 1, 2], 0).items():
            _check(got, 0, r, set())
        sessions[2].close()
        for r, got in _steps(groups, [0, 1], 1).items():
            _check(got, 1, r, {2})
        replacement, g2 = _replace(daemon, name)
        assert groups[0].rank_mask() == [IN, IN, GONE]  # not back yet
        with pytest.raises(EpdError, match="rejoins group") as e:
            _step(g2, 2, 2)
        assert e.value.code.name == "FAILED_PRECONDITION"
        with pytest.raises(EpdError, match="has not gone away") as e:
            groups[0].rejoin(1)  # (refused before it is a collective: nothing consumed)
        assert e.value.code.name == "FAILED_PRECONDITION"
        for r, got in _steps(groups, [0, 1], 2).items():  # meanwhile the others go on
            _check(got, 2, r, {2})
        groups[2] = g2
        # Rank 1 comes late: the replacement must not come in (and stop being gone) before
        # every rank that takes part arrived, or rank 1 would find nothing to rejoin.
        back = all_at_once({0: lambda: groups[0].rejoin(2),
                            1: lambda: (time.sleep(0.5), groups[1].rejoin(2))[1],
                            2: lambda: g2.rejoin()})
        assert back == {0: [IN, IN, IN], 1: [IN, IN, IN], 2: [IN, IN, IN]}, back
        for step in (3, 4):
            for r, got in _steps(groups, [0, 1, 2], step).items():
                _check(got, step, r, set())
    finally:
        for s in [*sessions, *([replacement] if replacement else [])]:
            s.close()


def test_a_rejoin_nobody_completes_leaves_the_group_going(daemon) -> None:
    """The others call Rejoin and the replacement never does (or the replacement calls and the
    others never do): the callers fail at their deadline, and the group goes on without it."""
    sessions = _sessions(daemon)
    name = f"shrink-{next(_names)}"
    replacement = None
    try:
        groups = _join_all(sessions, name)
        sessions[2].close()
        for r, got in _steps(groups, [0, 1], 0).items():
            _check(got, 0, r, {2})
        late = all_at_once({0: lambda: groups[0].rejoin(2, timeout=1),
                            1: lambda: groups[1].rejoin(2, timeout=1)})
        for r in (0, 1):
            assert isinstance(late[r], EpdError) and late[r].code.name == "DEADLINE_EXCEEDED"
            assert "did not come back" in str(late[r])
        for r, got in _steps(groups, [0, 1], 1).items():
            _check(got, 1, r, {2})
        replacement, g2 = _replace(daemon, name)
        with pytest.raises(EpdError, match="not every rank called Rejoin") as e:
            g2.rejoin(timeout=1)
        assert e.value.code.name == "DEADLINE_EXCEEDED"
        for r, got in _steps(groups, [0, 1], 2).items():
            _check(got, 2, r, {2})
        groups[2] = g2  # and it can still come back afterwards
        back = all_at_once({0: lambda: groups[0].rejoin(2), 1: lambda: groups[1].rejoin(2),
                            2: lambda: g2.rejoin()})
        assert all(v == [IN, IN, IN] for v in back.values()), back
        for r, got in _steps(groups, [0, 1, 2], 3).items():
            _check(got, 3, r, set())
    finally:
        for s in [*sessions, *([replacement] if replacement else [])]:
            s.close()


def test_a_rejoin_met_by_another_collective_fails_at_once_and_the_group_goes_on(daemon):
    """Rank 0 calls Rejoin for the gone rank 2 while rank 1 makes a low-latency dispatch: both
    fail at once with FAILED_PRECONDITION (rank 0 waited for the replacement until its
    deadline, and rank 1's next call, waiting for rank 0's slot, then aborted the group), and
    the group goes on."""
    sessions = _sessions(daemon)
    name = f"shrink-{next(_names)}"
    try:
        groups = _join_all(sessions, name)
        sessions[2].close()
        for r, got in _steps(groups, [0, 1], 0).items():
            _check(got, 0, r, {2})
        x, idx, _ = _inputs(1, 1)
        t0 = time.monotonic()
        got = all_at_once({0: lambda: groups[0].rejoin(2, timeout=10),
                           1: lambda: groups[1].low_latency_dispatch(x, idx, M, timeout=10)})
        assert time.monotonic() - t0 < 5, got
        for r in (0, 1):
            assert isinstance(got[r], EpdError), got
            assert got[r].code.name == "FAILED_PRECONDITION", got[r]
        for r, out in _steps(groups, [0, 1], 2).items():
            _check(out, 2, r, {2})
    finally:
        for s in sessions:
            s.close()


@pytest.mark.parametrize(("takes_back", "same_engine", "engine", "want"), [
    (False, False, 0, "cannot take a rank back"),
    (True, True, 1, "its replacement must join there"),  # the CUDA planner's rule
    (True, True, 0, "accepted"),
    (True, False, 1, "accepted")])
def test_rejoin_needs_a_backend_that_takes_ranks_back(takes_back: bool, same_engine: bool,
                                                       engine: int, want: str) -> None:
    """The coordinator refuses a replacement where the planner cannot take a rank back, or
    (the CUDA planner: its peers reach the rank's buffers there) on another engine than the
    rank it replaces; an accepted one learns that it rejoins."""
    import asyncio

    from epd.proto.v1 import epd_pb2
    from epd.server.backends.cuda_plan import CudaPlanner
    from epd.server.coordinator import Coordinator

    assert CudaPlanner.supports_rejoin and CudaPlanner.rejoin_on_same_engine

    class Planner:
        supports_rank_masking, supports_rejoin = True, takes_back
        rejoin_on_same_engine = same_engine

        def validate_spec(self, spec) -> None:
            return None

        def plan_group(self, group_id, spec, rank_nodes=()) -> bytes:
            return b"plan"

        def mark_gone(self, plan, rank, reason) -> None:
            return None

        def free_group(self, plan) -> None:
            return None

    async def scenario() -> str:
        c = Coordinator(Planner())  # type: ignore[arg-type]
        spec = epd_pb2.GroupSpec(name="g", num_ranks=2, num_experts=4, hidden=128,
                                 max_tokens_per_rank=8, num_topk=2, x_dtype=epd_pb2.BFLOAT16,
                                 low_latency_mode=True, shrink=True)

        def req(rank: int) -> epd_pb2.RendezvousRequest:
            return epd_pb2.RendezvousRequest(spec=spec, rank=rank, session_id=f"s{rank}",
                                             timeout_seconds=5, has_peer=True, peer_uid=1)
        first = await asyncio.gather(c.rendezvous(req(0)), c.rendezvous(req(1)))
        assert not first[1].rejoining
        attached = []  # (the group runs: a rank gone before all attached aborts it)
        for r in range(2):
            attached.append(req(r))
            attached[-1].attached, attached[-1].group_id = True, first[0].group_id
        await asyncio.gather(*(c.rendezvous(a) for a in attached))
        c.release(first[0].group_id, 1, "rank 1 went away")
        again = req(1)
        again.engine_index = engine
        try:
            resp = await c.rendezvous(again)
        except EpdError as e:
            return f"{e.code.name}: {e.message}"
        assert resp.rejoining and resp.group_id == first[0].group_id
        return "accepted"

    got = asyncio.run(scenario())
    if want == "accepted":
        assert got == "accepted"
    else:
        assert got.startswith("FAILED_PRECONDITION") and want in got, got


def test_a_replacement_rejoins_through_the_facade(daemon) -> None:
    """DeepEP's API: three Buffers with enable_shrink; rank 2's goes away (destroy), the others
    go on; a replacement Buffer of the same name and rank is refused at its first call, then
    `low_latency_rejoin` on every rank brings it back and every step is exact again."""
    name = f"facade-rejoin-{next(_names)}"

    def buffer(r: int) -> Buffer:
        return Buffer(rank=r, num_ranks=R, endpoint=daemon.socket(r % daemon.engines),
                      low_latency_mode=True, enable_shrink=True, group_name=name, timeout=20)

    def step(buf: Buffer, step: int, r: int) -> dict:
        x, idx, w = _inputs(step, r)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        cx, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        return {"count": np.asarray(count).copy(), "recv_x": np.asarray(recv).copy(),
                "src_rank": np.asarray(handle.src_rank).copy(),
                "src_idx": np.asarray(handle.src_idx).copy(),
                "cx": np.asarray(cx).view(np.uint16).copy()}

    bufs = all_at_once({r: (lambda r=r: buffer(r)) for r in range(R)})
    try:
        for r, got in all_at_once({r: (lambda r=r: step(bufs[r], 0, r))
                                   for r in range(R)}).items():
            _check(got, 0, r, set())
        bufs[2].destroy()
        for r, got in all_at_once({r: (lambda r=r: step(bufs[r], 1, r)) for r in (0, 1)}).items():
            _check(got, 1, r, {2})
        bufs[2] = buffer(2)
        with pytest.raises(EpdError, match="rejoins group") as e:
            step(bufs[2], 2, 2)
        assert e.value.code.name == "FAILED_PRECONDITION"
        back = all_at_once({0: lambda: bufs[0].low_latency_rejoin(2),
                            1: lambda: bufs[1].low_latency_rejoin(2),
                            2: lambda: bufs[2].low_latency_rejoin()})
        assert back == {0: None, 1: None, 2: None}, back
        mask = np.full(R, 7, np.int32)
        bufs[0].low_latency_query_mask_buffer(mask)
        np.testing.assert_array_equal(mask, [0, 0, 0])
        for n in (3, 4):
            for r, got in all_at_once({r: (lambda r=r, n=n: step(bufs[r], n, r))
                                       for r in range(R)}).items():
                _check(got, n, r, set())
    finally:
        for b in bufs.values():
            b.destroy()


def test_the_facades_mask_is_the_groups_shared_one(daemon) -> None:
    """DeepEP's mask calls through the facade: rank 0 masks rank 1, rank 2 unmasks it again
    (the mask is the group's, shared by its ranks): every rank's query then says nobody is
    masked, and a low-latency group formed afterwards (a new num_max) leaves nobody out. (Each
    Buffer kept its own record of its own mask calls: rank 0 still reported rank 1 masked, and
    masked it again in every group it formed later, dropping its tokens for all.)"""
    name = f"facade-shared-mask-{next(_names)}"
    bufs = all_at_once({r: (lambda r=r: Buffer(
        rank=r, num_ranks=R, endpoint=daemon.socket(r % daemon.engines), low_latency_mode=True,
        enable_shrink=True, group_name=name, timeout=20)) for r in range(R)})

    def step(r: int, num_max: int) -> dict:
        x, idx, _ = _inputs(5, r)
        _, count, _, _, _ = bufs[r].low_latency_dispatch(x, idx, num_max, E, use_fp8=False)
        return {"count": np.asarray(count).copy()}

    try:
        all_at_once({r: (lambda r=r: step(r, M)) for r in range(R)})
        bufs[0].low_latency_update_mask_buffer(1, True)
        bufs[2].low_latency_update_mask_buffer(1, False)
        for r in range(R):
            mask = np.full(R, 7, np.int32)
            bufs[r].low_latency_query_mask_buffer(mask)
            np.testing.assert_array_equal(mask, [0, 0, 0], err_msg=f"rank {r}")
        got = all_at_once({r: (lambda r=r: step(r, M + 4)) for r in range(R)})
        want, _ = _expected(5, set())  # (nobody left out: the reference's counts)
        for r in range(R):
            np.testing.assert_array_equal(got[r]["count"], want[r].recv_count)
    finally:
        for b in bufs.values():
            b.destroy()
