"""Races of group formation and teardown: sessions joining, leaving, closing and rejoining the
same group names at once. Each join either succeeds into one consistent instance or fails with
a precise error, no peer waits past its deadline, no instance mixes ranks of two incarnations,
and a later clean join of the name works, exact against the reference.

The coordinator's deadline races are reproduced in-process on one event loop (the timers are
made to fall due in one turn, in a fixed order); the others run against a CPU daemon."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time

import grpc
import numpy as np
import pytest
import ranklib
from ranklib import all_at_once

from epd.client import EpdError, Session
from epd.proto import dtypes
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref
from epd.server.backends import cpu_plan
from epd.server.coordinator import Coordinator

BF16 = dtypes.BFLOAT16
_names = itertools.count()


def _name(what: str) -> str:
    return f"race-{what}-{os.getpid()}-{next(_names)}"


def _code(x: object) -> str | None:
    return x.code.name if isinstance(x, EpdError) else None


# -- the coordinator's deadlines racing the last arrival ---------------------------------------
def _spec(name: str, num_ranks: int = 2) -> epd_pb2.GroupSpec:
    return epd_pb2.GroupSpec(name=name, num_ranks=num_ranks, num_experts=4 * num_ranks,
                             hidden=128, max_tokens_per_rank=8, num_topk=2,
                             x_dtype=epd_pb2.BFLOAT16)


def _req(spec: epd_pb2.GroupSpec, rank: int, timeout: float, *, attached: bool = False,
         group_id: str = "") -> epd_pb2.RendezvousRequest:
    return epd_pb2.RendezvousRequest(
        spec=spec, rank=rank, engine_index=rank % 2, session_id=f"s{rank}",
        timeout_seconds=timeout, peer_uid=os.getuid(), peer_gid=os.getgid(), has_peer=True,
        attached=attached, group_id=group_id)


async def _late_in_the_deadlines_turn(first, last) -> list:
    """`first()` waits with a 0.3 s deadline; `last()` (the arrival it waits for) starts from
    a timer due just before that deadline, and the loop is held until both are due: in the
    turn that runs them the deadline fires while the last arrival's task has yet to run, and
    that task completes the wait before the waiting task resumes. (Its timer is due first so
    that its task runs before the waiting one on every asyncio: from Python 3.12 wait_for's
    timeout cancels the waiting task at once, and an arrival due after the deadline would
    come only after that task had resumed and given up.)"""
    loop = asyncio.get_running_loop()
    t0 = loop.time()  # (first's deadline: its wait starts after this, so later than t0 + 0.3)
    tasks = [asyncio.ensure_future(first())]
    loop.call_at(t0 + 0.29, lambda: tasks.append(asyncio.ensure_future(last())))
    await asyncio.sleep(0.05)  # (the first waits)
    time.sleep(0.5)  # (holds the loop: both timers fall due in its next turn)
    await asyncio.sleep(0.1)
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_a_rendezvous_deadline_racing_the_last_arrival_keeps_the_rank() -> None:
    """The last rank forms the group in the turn rank 0's deadline fires: rank 0 is a member
    (its peer got the placement and waits for it at the attach barrier), so it must get the
    placement too. It failed with DEADLINE_EXCEEDED naming no rank ("rank(s) [] did not
    join"), dropped from a formed group, and rank 1 waited out its attach deadline."""
    coord = Coordinator(cpu_plan.CpuPlanner())
    spec = _spec(_name("rdv-deadline"))

    async def run():
        got = await _late_in_the_deadlines_turn(lambda: coord.rendezvous(_req(spec, 0, 0.3)),
                                                lambda: coord.rendezvous(_req(spec, 1, 5)))
        assert all(isinstance(r, epd_pb2.RendezvousResponse) for r in got), got
        assert got[0].group_id == got[1].group_id and got[0].plan == got[1].plan
        t0 = asyncio.get_running_loop().time()
        both = await asyncio.gather(*(coord.rendezvous(_req(spec, r, 2, attached=True,
                                                            group_id=got[0].group_id))
                                      for r in range(2)), return_exceptions=True)
        assert all(isinstance(r, epd_pb2.RendezvousResponse) for r in both), both
        assert asyncio.get_running_loop().time() - t0 < 1
        for r in range(2):
            coord.release(got[0].group_id, r, "left", left=True)
        assert not coord.by_id and not coord.by_name
    asyncio.run(run())
    coord.close()


def test_a_join_cancelled_as_the_group_forms_releases_its_rank() -> None:
    """Rank 0's engine gives up (gRPC cancels its Rendezvous) in the turns after the last rank
    formed the group, before rank 0's wait resumed: the rank must be released (its engine
    never learns the group's id), not kept in the group for its peers to wait out the attach
    deadline. asyncio.wait_for on Python 3.11 returned the placement instead (a review)."""
    async def trial(turns: int) -> bool:
        coord = Coordinator(cpu_plan.CpuPlanner())
        spec = _spec(_name(f"cancel-formed-{turns}"))
        first = asyncio.ensure_future(coord.rendezvous(_req(spec, 0, 5)))
        await asyncio.sleep(0.05)
        last = asyncio.ensure_future(coord.rendezvous(_req(spec, 1, 5)))
        for _ in range(turns):
            await asyncio.sleep(0)
        answered = first.done()  # (then its placement went out: nothing to release)
        first.cancel()
        got = await asyncio.gather(first, last, return_exceptions=True)
        g = next(iter(coord.by_id.values()), None)
        if not answered:
            assert isinstance(got[0], asyncio.CancelledError), (turns, got[0])
            assert g is None or 0 in g.released, (turns, g.released)
        coord.close()
        return not answered

    async def run():
        cut = [await trial(turns) for turns in range(5)]
        assert cut[0] and cut[1], cut  # (the turns where wait_for lost the cancellation)
    asyncio.run(run())


def test_an_attach_deadline_racing_the_last_attach_opens_the_barrier() -> None:
    """The same at the attach barrier: the last rank attaches in the turn rank 0's attach
    deadline fires. Rank 0 failed "rank(s) [] did not attach" (and its engine's drop then
    aborted the group its peer had just started); it must go on with it."""
    coord = Coordinator(cpu_plan.CpuPlanner())
    spec = _spec(_name("attach-deadline"))

    async def run():
        formed = await asyncio.gather(*(coord.rendezvous(_req(spec, r, 5)) for r in range(2)))
        gid = formed[0].group_id
        got = await _late_in_the_deadlines_turn(
            lambda: coord.rendezvous(_req(spec, 0, 0.3, attached=True, group_id=gid)),
            lambda: coord.rendezvous(_req(spec, 1, 5, attached=True, group_id=gid)))
        assert all(isinstance(r, epd_pb2.RendezvousResponse) for r in got), got
        assert coord.by_id[gid].aborted is None
        for r in range(2):
            coord.release(gid, r, "left", left=True)
        assert not coord.by_id
    asyncio.run(run())
    coord.close()


def test_a_rendezvous_deadline_without_the_last_arrival_still_names_it() -> None:
    """(The guard's other side: a deadline with the group not formed fails naming the missing
    rank and leaves no instance behind; the name forms afresh.)"""
    coord = Coordinator(cpu_plan.CpuPlanner())
    spec = _spec(_name("rdv-missing"))

    async def run():
        with pytest.raises(EpdError, match=r"rank\(s\) \[1\] did not join") as e:
            await coord.rendezvous(_req(spec, 0, 0.2))
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not coord.by_name and not coord.by_id
        got = await asyncio.gather(*(coord.rendezvous(_req(spec, r, 5)) for r in range(2)))
        assert got[0].group_id == got[1].group_id
    asyncio.run(run())
    coord.close()


# -- against a daemon ----------------------------------------------------------------------------
def _case(name: str, seed: int = 0, ranks: int = 2) -> ranklib.Case:
    return ranklib.Case(group=name, num_ranks=ranks, num_experts=4 * ranks, hidden=128,
                        num_topk=2, tokens=(9, 13, 7)[:ranks], seed=seed)


def _round_exact(sessions: list[Session], groups: list, case: ranklib.Case) -> None:
    res = all_at_once({r: (lambda r=r: ranklib.case_round(sessions[r], groups[r], case, r))
                for r in range(case.num_ranks)})
    assert not any(isinstance(v, Exception) for v in res.values()), res
    ranklib.check_case(case, [res[r] for r in range(case.num_ranks)])


def _live_groups(daemon) -> int:
    """Groups formed or forming on the daemon (the coordinator's count, GetTopology)."""
    from epd.proto.v1 import epd_pb2_grpc
    with grpc.insecure_channel(f"unix://{daemon.node_socket}") as ch:
        topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(), timeout=5)
    return topo.latency_groups + topo.throughput_groups


def test_a_session_closed_during_its_rendezvous_frees_its_rank(daemon) -> None:
    """Rank 0's session closes while its join waits for rank 1: the rank is free again, so a
    new session takes rank 0 and the group forms with it, exact; nothing of the closed
    session's join is left in the group."""
    case = _case(_name("closed-in-rdv"))
    s0 = Session(daemon.socket(0))
    out: dict[str, object] = {}

    def join0() -> None:
        try:
            out["g"] = ranklib.join(s0, case, 0, timeout=10)
        except Exception as e:  # (checked below)
            out["e"] = e
    before = _live_groups(daemon)
    t = threading.Thread(target=join0)
    t.start()
    # rank 0 waits at the rendezvous: its forming instance is counted (not a guessed sleep,
    # after which a loaded host's join might not have started and the race not be run)
    ranklib.wait_until(lambda: _live_groups(daemon) > before, 10, "rank 0 at the rendezvous")
    s0.close()
    t.join(15)
    assert not t.is_alive() and "g" not in out, out
    sessions = [Session(daemon.socket(r)) for r in range(2)]
    try:
        t0 = time.monotonic()
        groups = all_at_once({r: (lambda r=r: ranklib.join(sessions[r], case, r, timeout=10))
                       for r in range(2)})
        assert not any(isinstance(g, Exception) for g in groups.values()), groups
        assert time.monotonic() - t0 < 5
        _round_exact(sessions, [groups[0], groups[1]], case)
    finally:
        for s in sessions:
            s.close()


def test_two_sessions_joining_one_rank_at_once(daemon) -> None:
    """Two sessions ask for rank 0 at the same moment as rank 1 joins: one of them gets it and
    the group works exactly; the other fails at once naming the rank as taken (or the group as
    formed), never at its deadline; repeated."""
    for i in range(3):
        _same_rank_once(daemon, i)


def _same_rank_once(daemon, i: int) -> None:
    case = _case(_name("same-rank"), seed=i)
    sessions = [Session(daemon.socket(0)), Session(daemon.socket(1)),
                Session(daemon.socket(1))]
    try:
        t0 = time.monotonic()
        got = all_at_once({0: lambda s=sessions[0]: ranklib.join(s, case, 0, timeout=8),
                    1: lambda s=sessions[2]: ranklib.join(s, case, 0, timeout=8),
                    2: lambda s=sessions[1]: ranklib.join(s, case, 1, timeout=8)})
        assert time.monotonic() - t0 < 5, got
        winners = [k for k in (0, 1) if not isinstance(got[k], Exception)]
        assert len(winners) == 1, got
        loser = got[1 - winners[0]]
        assert _code(loser) == "FAILED_PRECONDITION", loser
        assert "already taken" in str(loser) or "already formed" in str(loser), loser
        w = winners[0]
        _round_exact([sessions[0 if w == 0 else 2], sessions[1]], [got[w], got[2]], case)
    finally:
        for s in sessions:
            s.close()


def test_leave_racing_the_peers_collective_and_a_new_join_of_the_name(daemon) -> None:
    """Rank 1 waits in a dispatch when rank 0 leaves and, at once, joins the same name again:
    rank 1 fails ABORTED well before its deadline, the new join starts a fresh instance (a
    new group id) rather than entering the old one, rank 1 joins it too, and it is exact.
    Repeated."""
    for i in range(3):
        _leave_rejoin_once(daemon, i)


def _leave_rejoin_once(daemon, i: int) -> None:
    case = _case(_name("leave-rejoin"), seed=i)
    sessions = [Session(daemon.socket(r)) for r in range(2)]
    try:
        groups = all_at_once({r: (lambda r=r: ranklib.join(sessions[r], case, r, timeout=10))
                       for r in range(2)})
        _round_exact(sessions, [groups[0], groups[1]], case)
        old = groups[0].group_id
        inp = case.inputs(1)
        result: dict[str, object] = {}

        def waiting_dispatch() -> None:
            t0 = time.monotonic()
            try:
                groups[1].dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"],
                                   timeout=8)
            except EpdError as e:
                result["e"] = e
            result["took"] = time.monotonic() - t0
        arrived = ranklib.comm_arrivals("", old, 2)
        t = threading.Thread(target=waiting_dispatch)
        t.start()
        # rank 1 inside its collective (its arrival counted), not a guess of how long it takes
        ranklib.wait_until(lambda: (a := ranklib.comm_arrivals("", old, 2)) is not None
                           and a[1] > arrived[1], 10, "rank 1's dispatch in its collective")
        groups[0].leave()
        fresh: dict[int, object] = {}
        j0 = threading.Thread(target=lambda: fresh.__setitem__(
            0, ranklib.join(sessions[0], case, 0, timeout=10)))
        j0.start()
        t.join(15)
        assert _code(result.get("e")) == "ABORTED", result
        assert result["took"] < 5, result
        groups[1].leave()
        fresh[1] = ranklib.join(sessions[1], case, 1, timeout=10)
        j0.join(15)
        assert 0 in fresh, "rank 0's new join did not complete"
        assert fresh[0].group_id == fresh[1].group_id != old
        _round_exact(sessions, [fresh[0], fresh[1]], case)
    finally:
        for s in sessions:
            s.close()


def _join_retrying(s: Session, case: ranklib.Case, rank: int, until: float):
    """A client that finds the name still held by the incarnation before (refused at once,
    FAILED_PRECONDITION) tries again until `until`."""
    while True:
        try:
            return ranklib.join(s, case, rank, timeout=8)
        except EpdError as e:
            if e.code.name != "FAILED_PRECONDITION" or time.monotonic() > until:
                raise
            assert "already formed" in e.details or "already taken" in e.details, e
            time.sleep(0.05)


def _incarnation(daemon, case: ranklib.Case, prev: list[Session]) -> tuple[list[Session], str]:
    sessions = [Session(daemon.socket(r)) for r in range(2)]
    closer = threading.Thread(target=lambda: [s.close() for s in prev])
    closer.start()  # the previous incarnation goes while this one joins
    until = time.monotonic() + 8
    groups = all_at_once({r: (lambda r=r: _join_retrying(sessions[r], case, r, until))
                   for r in range(2)})
    closer.join(15)
    assert not any(isinstance(g, Exception) for g in groups.values()), groups
    assert groups[0].group_id == groups[1].group_id, groups
    _round_exact(sessions, [groups[0], groups[1]], case)
    return sessions, groups[0].group_id


def test_churn_of_one_name_never_mixes_incarnations(daemon) -> None:
    """Incarnation k of a name: two fresh sessions join, run an exact round and close, while
    incarnation k + 1's sessions already join the same name. Every incarnation forms with
    both of its own ranks (one group id per incarnation, never reused), exact; a join that
    meets the incarnation before still holding the name is refused at once, precisely."""
    name = _name("churn")
    seen: list[str] = []
    prev: list[Session] = []
    try:
        for k in range(4):
            prev, gid = _incarnation(daemon, _case(name, seed=k), prev)
            assert gid not in seen
            seen.append(gid)
    finally:
        for s in prev:
            s.close()


# -- shrink groups ---------------------------------------------------------------------------------
R, E, H, K, M = 3, 12, 256, 3, 16  # ranks, experts, hidden, top-k, num_max (low-latency)
LX = E // R


def _ll_join(s: Session, name: str, rank: int, timeout: float = 10):
    return s.join(name, rank=rank, num_ranks=R, num_experts=E, hidden=H, max_tokens_per_rank=M,
                  num_topk=K, low_latency_mode=True, shrink=True, timeout=timeout)


def _ll_inputs(step: int, rank: int, tokens: int = 11):
    rng = np.random.default_rng([91, step, rank])
    idx, w = ref.random_routing(rng, tokens, E, K, drop_prob=0.1, num_ranks=R)
    return ref.random_x(rng, tokens, H, BF16), idx, w


def _ll_step(g, step: int, rank: int, timeout: float | None = None) -> dict:
    x, idx, w = _ll_inputs(step, rank)
    d = g.low_latency_dispatch(x, idx, M, timeout=timeout)
    cx = g.low_latency_combine(d.recv_x, idx, w, d.handle, timeout=timeout)
    return {"count": np.asarray(d.recv_count).copy(),
            "cx": np.asarray(cx).view(np.uint16).copy()}


def _ll_check(got: dict[int, dict], step: int, left_out: set[int]) -> None:
    """Receive counts and combined bits of the ranks in `got` against the reference with the
    ranks in `left_out` taking no part (identity experts)."""
    xs, idx, w = zip(*(_ll_inputs(step, r) for r in range(R)), strict=True)
    kept, part = [], [r not in left_out for r in range(R)]
    for r in range(R):
        i = idx[r].copy()
        i[np.isin(np.where(i >= 0, i // LX, -1), sorted(left_out))] = -1
        kept.append(i if part[r] else i[:0])
    disp = ref.low_latency_dispatch([x if p else x[:0] for x, p in zip(xs, part, strict=True)],
                                    kept, E, M)
    comb = ref.low_latency_combine([d.recv_x for d in disp], disp, kept,
                                   [v if p else v[:0] for v, p in zip(w, part, strict=True)], E)
    for r, g in got.items():
        np.testing.assert_array_equal(g["count"], disp[r].recv_count, err_msg=f"rank {r}")
        np.testing.assert_array_equal(g["cx"], comb[r].view(np.uint16), err_msg=f"rank {r}")


def test_a_rank_released_during_the_peers_collective_is_masked_in_it(daemon) -> None:
    """Ranks 0 and 1 of a shrink group wait in a low-latency step for rank 2 when rank 2's
    session closes: its release masks it while they wait, and they complete that very step
    without it, exact, long before their deadline. Repeated on fresh groups."""
    for _ in range(2):
        _masked_in_flight_once(daemon)


def _masked_in_flight_once(daemon) -> None:
    name = _name("mask")
    sessions = [Session(daemon.socket(r % daemon.engines)) for r in range(R)]
    try:
        groups = all_at_once({r: (lambda r=r: _ll_join(sessions[r], name, r)) for r in range(R)})
        got = all_at_once({r: (lambda r=r: _ll_step(groups[r], 0, r)) for r in range(R)})
        _ll_check(got, 0, set())
        t0 = time.monotonic()
        closer = threading.Timer(0.2, sessions[2].close)
        closer.start()
        got = all_at_once({r: (lambda r=r: _ll_step(groups[r], 1, r, timeout=8)) for r in (0, 1)})
        closer.join(10)
        assert not any(isinstance(v, Exception) for v in got.values()), got
        assert time.monotonic() - t0 < 5
        _ll_check(got, 1, {2})
    finally:
        for s in sessions:
            s.close()


def test_a_shrink_group_aborted_as_a_whole_is_not_rejoined(daemon) -> None:
    """A shrink group fails as a whole (rank 2 misses a collective: the deadline aborts it).
    Rank 0 leaves and joins the name again: it used to be placed in the dead instance as a
    replacement (same group id, every call ABORTED), since the coordinator sees only a masked
    rank go. It must fail at once, precisely, naming the abort; once every old member left,
    a clean join of all ranks forms a fresh instance, exact."""
    name = _name("dead-shrink")
    sessions = [Session(daemon.socket(r % daemon.engines)) for r in range(R)]
    try:
        groups = all_at_once({r: (lambda r=r: _ll_join(sessions[r], name, r)) for r in range(R)})
        old = groups[0].group_id
        got = all_at_once({r: (lambda r=r: _ll_step(groups[r], 0, r, timeout=1)) for r in (0, 1)})
        assert all(_code(v) == "DEADLINE_EXCEEDED" for v in got.values()), got
        groups[0].leave()
        t0 = time.monotonic()
        with pytest.raises(EpdError, match="was aborted") as e:
            _ll_join(sessions[0], name, 0, timeout=5)
        assert e.value.code.name == "FAILED_PRECONDITION", e.value
        assert "did not arrive" in e.value.details, e.value  # (the abort's own reason)
        assert time.monotonic() - t0 < 3
        assert not [g for g in sessions[0].stats().groups if g.name == name]
        groups[1].leave()
        groups[2].leave()
        fresh = all_at_once({r: (lambda r=r: _ll_join(sessions[r], name, r)) for r in range(R)})
        assert not any(isinstance(g, Exception) for g in fresh.values()), fresh
        assert len({g.group_id for g in fresh.values()}) == 1 and fresh[0].group_id != old
        _ll_check(all_at_once({r: (lambda r=r: _ll_step(fresh[r], 1, r))
                               for r in range(R)}), 1, set())
    finally:
        for s in sessions:
            s.close()


def test_a_replacement_is_not_placed_where_no_rank_takes_part(daemon) -> None:
    """Rank 2 goes; its replacement joins (waiting for the Rejoin collective); then ranks 0
    and 1 go too. A restart joining ranks 0 and 1 under the name used to be placed in that
    instance as replacements as well: three ranks each waiting for a Rejoin that no rank
    taking part is left to make, every call refused. Such a join must fail at once, naming
    why; once the last member left, a clean join of all ranks forms afresh, exact."""
    name = _name("no-one-left")
    sessions = [Session(daemon.socket(r % daemon.engines)) for r in range(R)]
    later: list[Session] = []
    try:
        groups = all_at_once({r: (lambda r=r: _ll_join(sessions[r], name, r)) for r in range(R)})
        old = groups[0].group_id
        sessions[2].close()
        later.append(Session(daemon.socket(0)))
        assert _ll_join(later[0], name, 2).group_id == old  # (a replacement: it rejoins)
        sessions[0].close()
        sessions[1].close()
        restart = [Session(daemon.socket(r % daemon.engines)) for r in range(2)]
        later += restart
        t0 = time.monotonic()
        for r in range(2):
            with pytest.raises(EpdError, match="takes part any more") as e:
                _ll_join(restart[r], name, r, timeout=5)
            assert e.value.code.name == "FAILED_PRECONDITION", e.value
        assert time.monotonic() - t0 < 3
        later[0].close()  # the last member goes: the name is free
        third = Session(daemon.socket(0))
        later.append(third)
        members = [*restart, third]
        fresh = all_at_once({r: (lambda r=r: _ll_join(members[r], name, r)) for r in range(R)})
        assert not any(isinstance(g, Exception) for g in fresh.values()), fresh
        assert len({g.group_id for g in fresh.values()}) == 1 and fresh[0].group_id != old
        _ll_check(all_at_once({r: (lambda r=r: _ll_step(fresh[r], 2, r))
                               for r in range(R)}), 2, set())
    finally:
        for s in [*sessions, *later]:
            s.close()


def test_a_mask_change_never_overwrites_a_rank_gone_meanwhile() -> None:
    """RankMask reads the mask, then writes the rank's new state; the supervisor may mark that
    rank gone in between (it went away). The write must keep GONE: written over with IN, the
    peers would wait for a rank that is not there until the deadline aborted the group."""
    import tempfile

    from epd.proto.v1 import epd_pb2
    from epd.server.backends import base
    from epd.server.backends.cpu import CpuBackend
    from epd.server.backends.cpu_plan import CpuPlanner

    spec = base.GroupSpec("mask-race", 2, 4, 128, 8, 2, epd_pb2.BFLOAT16,
                          low_latency_mode=True, shrink=True)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        planner = CpuPlanner(d)
        plan = planner.plan_group("gmaskrace", spec)
        comm = CpuBackend().attach(spec, base.Membership("gmaskrace", 0, (0, 0), plan))
        try:
            assert comm.mask_states()[1] == comm.MASK_IN  # what RankMask read
            planner.mark_gone(plan, 1, "its session ended")  # the supervisor, meanwhile
            comm.set_mask(1, comm.MASK_MASKED)  # the write decided from the stale read
            assert comm.mask_states()[1] == comm.MASK_GONE
            comm.set_mask(1, comm.MASK_IN)  # (an unmask likewise)
            assert comm.mask_states()[1] == comm.MASK_GONE
            comm.set_mask(0, comm.MASK_MASKED)  # a live rank's change still takes
            assert comm.mask_states()[0] == comm.MASK_MASKED
        finally:
            comm.close()


def test_a_rank_that_never_attaches_is_released_after_a_grace(monkeypatch) -> None:
    """A formed group whose rank 1 never attaches nor releases (its engine's Rendezvous call
    was cancelled after the answer went out: it never learnt it holds the rank): rank 0
    fails at its attach deadline and releases; rank 1 is released by the coordinator
    LATE_ATTACH_SECONDS later, so the instance and its plan go, where they stayed until
    rank 1's engine was lost."""
    from epd.server import coordinator as C
    monkeypatch.setattr(C, "LATE_ATTACH_SECONDS", 0.3)
    coord = Coordinator(cpu_plan.CpuPlanner())
    spec = _spec(_name("never-attached"))

    async def run():
        got = await asyncio.gather(*(coord.rendezvous(_req(spec, r, 5)) for r in range(2)))
        gid = got[0].group_id
        with pytest.raises(EpdError, match=r"rank\(s\) \[1\] did not attach"):
            await coord.rendezvous(_req(spec, 0, 0.2, attached=True, group_id=gid))
        coord.release(gid, 0, "its attach deadline passed")  # (what rank 0's engine does)
        assert gid in coord.by_id  # (rank 1 is still held)
        await asyncio.sleep(0.6)
        assert gid not in coord.by_id and not coord.by_name
    asyncio.run(run())
    coord.close()
