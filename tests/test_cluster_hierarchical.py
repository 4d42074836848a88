"""Hierarchical normal mode on the CPU backend (issue 13): a group over several nodes placed
node-major runs DeepEP's hierarchical semantics, exact against reference.hierarchical_dispatch /
hierarchical_combine (row order, recv_src_idx as the forwarder's row, a rounded partial sum per
node in combine); any other spanning placement keeps the flat semantics.

Two levels: the backend's collectives on threads, with the placement given to the membership
(fast: many shapes); and logical-node daemons (tests/test_cluster.py's harness), through the
client and the DeepEP facade."""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from ranklib import (
    Case,
    as_numpy,
    assert_exact,
    case_round,
    check_case,
    expert_out,
    join,
    reference,
)
from test_cluster import cluster

from epd.proto.errors import FailedPrecondition, InvalidArgument
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref
from epd.server.backends import base
from epd.server.backends.base import Hierarchy
from epd.server.backends.cpu import CpuBackend
from epd.server.backends.cpu_plan import CpuPlanner

_names = itertools.count()
DEADLINE = 20.0  # seconds per collective (threads on a loaded 2-core machine)


def case(nodes: int, per_node: int, *, placed: int | None = None, **kw) -> Case:
    """A group of nodes x per_node ranks with uneven token counts (one rank may send none).
    `placed`: the semantics to check against (default: hierarchical over `nodes`)."""
    r = nodes * per_node
    kw.setdefault("cached", True)
    kw.setdefault("bias", True)
    return Case(group=f"hier-{next(_names)}", num_ranks=r, num_experts=4 * r, hidden=256,
                num_topk=3, tokens=tuple((7 * s + 5) % 19 for s in range(r)),
                seed=next(_names), nodes=nodes if placed is None else placed, **kw)


def node_major(nodes: int, per_node: int, first: int = 0) -> tuple[int, ...]:
    return tuple(first + r // per_node for r in range(nodes * per_node))


# -- the placement rule -------------------------------------------------------------------------

def test_which_placements_run_hierarchically():
    assert Hierarchy.of(()) is None and Hierarchy.of((0, 0, 0)) is None  # one node: flat
    assert Hierarchy.of((0, 1)) == Hierarchy(2, 1)
    assert Hierarchy.of((0, 0, 1, 1, 2, 2)) == Hierarchy(3, 2)
    assert Hierarchy.of((1, 1, 2, 2)) == Hierarchy(2, 2)  # the group's nodes, in order
    assert Hierarchy.of((0, 2)) == Hierarchy(2, 1)
    for flat in [(0, 1, 0, 1), (1, 0), (1, 1, 0, 0), (0, 0, 1), (0, 1, 1), (0, 0, 1, 2)]:
        assert Hierarchy.of(flat) is None, flat
    assert Hierarchy(2, 3).source_order() == [0, 3, 1, 4, 2, 5]


# -- backend level: the collectives on threads ----------------------------------------------------

class Threads:
    """One group's ranks as CpuRankComms on threads, placed on nodes by `rank_nodes`."""

    def __init__(self, c: Case, rank_nodes: tuple[int, ...]) -> None:
        r = c.num_ranks
        self.case = c
        self.spec = base.GroupSpec(c.group, r, c.num_experts, c.hidden, c.max_tokens_per_rank,
                                   c.num_topk, epd_pb2.BFLOAT16)
        self.planner = CpuPlanner()
        gid = f"g{c.group}"
        self.plan = self.planner.plan_group(gid, self.spec)
        backend = CpuBackend()
        self.comms = [backend.attach(self.spec, base.Membership(gid, s, (0,) * r, self.plan,
                                                                rank_nodes)) for s in range(r)]
        self.slots = [np.zeros(512, np.int64) for _ in range(r)]
        self.calls = [0] * r  # each rank's counter-page sequence

    def close(self) -> None:
        for cm in self.comms:
            cm.close()
        self.planner.free_group(self.plan)

    def run(self, fn) -> list:
        """fn(rank) on every rank at once; an exception comes back as the rank's result."""
        def one(s):
            try:
                return fn(s)
            except Exception as e:  # the test looks at it
                return e
        with ThreadPoolExecutor(self.case.num_ranks) as ex:
            return list(ex.map(one, range(self.case.num_ranks)))

    def dispatch(self, s: int, args: base.DispatchArgs) -> base.DispatchOutputs:
        self.calls[s] += 1
        return self.comms[s].dispatch(args, self.slots[s], self.calls[s],
                                      time.monotonic() + DEADLINE)

    def round(self, s: int) -> dict:
        """case_round's outputs, from the backend's calls."""
        c, comm = self.case, self.comms[s]
        inp = c.inputs(s)
        lay = comm.layout(inp["topk_idx"])
        res = {"rank": s, "layout": [np.array(a) for a in (lay.num_tokens_per_rank,
                                                             lay.num_tokens_per_expert,
                                                             lay.is_token_in_rank)]}
        for _ in range(c.rounds):
            out = self.dispatch(s, base.DispatchArgs(
                inp["x"], inp["x_scales"], inp["topk_idx"], inp["topk_weights"],
                c.expert_alignment, c.num_worst_tokens))
            for k in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                      "recv_src_idx", "rank_prefix_matrix"):
                v = getattr(out, k)
                res[k] = None if v is None else np.array(v)
            res["num_recv_tokens"] = out.num_recv_tokens
            res["num_recv_tokens_per_expert"] = list(out.num_recv_tokens_per_expert)
            y = expert_out(res["recv_x"], res["recv_x_scales"], res["recv_topk_idx"],
                           res["recv_topk_weights"], s, c.local_experts)
            w = res["recv_topk_weights"] if c.combine_weights else None
            comb = comm.combine(base.CombineArgs(y, out.handle, w, inp["bias_0"], inp["bias_1"]),
                                time.monotonic() + DEADLINE)
            res["combined_x"] = np.array(comb.combined_x)
            res["combined_w"] = as_numpy(comb.combined_topk_weights)
            res["combined_w"] = None if res["combined_w"] is None else res["combined_w"].copy()
        if c.cached:
            out2 = self.dispatch(s, base.DispatchArgs(inp["x2"], inp["x2_scales"], None, None,
                                                      1, c.num_worst_tokens, out.handle))
            res["cached_recv_x"] = np.array(out2.recv_x)
            res["cached_recv_x_scales"] = as_numpy(out2.recv_x_scales)
            if res["cached_recv_x_scales"] is not None:
                res["cached_recv_x_scales"] = res["cached_recv_x_scales"].copy()
            res["cached_num_recv_tokens"] = out2.num_recv_tokens
            res["cached_recv_src_idx"] = np.array(out2.recv_src_idx)
        return res


def run_threads(c: Case, rank_nodes: tuple[int, ...], repeat: int = 1) -> None:
    g = Threads(c, rank_nodes)
    try:
        assert all(cm.hierarchical == (c.nodes > 1) for cm in g.comms)
        for _ in range(repeat):  # the same group again: the sequence and slots carry on
            results = g.run(g.round)
            bad = [(s, r) for s, r in enumerate(results) if isinstance(r, BaseException)]
            assert not bad, bad
            check_case(c, results)
    finally:
        g.close()


def _worst(c: Case) -> int:
    return c.num_ranks * c.max_tokens_per_rank  # every rank could receive every token


@pytest.mark.parametrize(("nodes", "per_node", "variant"), [
    (2, 1, "bf16"), (2, 2, "bf16"), (3, 1, "fp8"), (3, 2, "bf16"), (2, 2, "fp8"),
    (3, 2, "fp8"), (2, 3, "worst"), (3, 2, "worst"), (2, 2, "plain"),
    (2, 8, "bf16"), (2, 8, "fp8")])  # (16 ranks: the cuda engine's wide two-stage groups)
def test_backend_matches_the_hierarchical_reference(nodes: int, per_node: int, variant: str):
    """Rows, their order, recv_src_idx (the forwarder's row), top-k ids and weights, FP8
    scales, per-expert counts with alignment, rank_prefix_matrix, worst-token padding, combine
    with weights and both biases (a rounded partial per node), cached dispatch; two rounds per
    call, and the group used twice."""
    kw = {"bf16": dict(expert_alignment=4, rounds=2),
          "fp8": dict(fp8=True, expert_alignment=2),
          "worst": dict(fp8=True, expert_alignment=3, num_worst_tokens=-1),
          "plain": dict(bias=False, combine_weights=False, cached=False)}[variant]
    c = case(nodes, per_node, **{k: v for k, v in kw.items() if k != "num_worst_tokens"})
    if "num_worst_tokens" in kw:
        c = dataclasses.replace(c, num_worst_tokens=_worst(c))
    run_threads(c, node_major(nodes, per_node, first=1 if nodes == 2 else 0), repeat=2)


@pytest.mark.parametrize("placement", [(0, 1, 0, 1), (1, 1, 0, 0), (0, 0, 1, 2)])
def test_backend_other_spanning_placements_stay_flat(placement: tuple[int, ...]):
    run_threads(case(2, 2, placed=1, expert_alignment=2, fp8=True), placement)


def test_backend_hot_and_empty_ranks():
    """A rank that receives nothing and one that almost everything goes to, over 3 nodes."""
    c = case(3, 2, hot_rank=3, hot_fraction=0.8, avoid_rank=4, expert_alignment=2)
    run_threads(c, node_major(3, 2))


def test_backend_int32_scales_are_carried_bit_for_bit():
    """FP8 with int32 scales (packed UE8M0 words) in a hierarchical group: the rows' scales
    arrive in the hierarchical order, bit for bit, in cached dispatch too."""
    c = case(2, 2, fp8=True)
    inputs = [c.inputs(s) for s in range(c.num_ranks)]
    words = [np.ascontiguousarray(i["x_scales"]).view(np.int32) for i in inputs]
    words2 = [np.ascontiguousarray(i["x2_scales"]).view(np.int32) for i in inputs]
    xs, idx, w = ([i[k] for i in inputs] for k in ("x", "topk_idx", "topk_weights"))
    want = ref.hierarchical_dispatch(xs, idx, w, c.num_experts, 2, x_scales=words)
    want2 = ref.hierarchical_dispatch([i["x2"] for i in inputs], idx, w, c.num_experts, 2,
                                      x_scales=words2)
    g = Threads(c, node_major(2, 2))
    try:
        def rank(s):
            i = inputs[s]
            out = g.dispatch(s, base.DispatchArgs(i["x"], words[s], i["topk_idx"],
                                                  i["topk_weights"]))
            got = (np.array(out.recv_x), np.array(out.recv_x_scales), np.array(out.recv_src_idx))
            out2 = g.dispatch(s, base.DispatchArgs(i["x2"], words2[s], None, None, 1, 0,
                                                   out.handle))
            return got, (np.array(out2.recv_x), np.array(out2.recv_x_scales))
        for s, res in enumerate(g.run(rank)):
            assert not isinstance(res, BaseException), res
            (x, sc, src), (x2, sc2) = res
            d, d2 = want.received(s), want2.received(s)
            assert_exact(x, d.recv_x, f"rank {s} recv_x")
            assert_exact(sc, d.recv_x_scales, f"rank {s} recv_x_scales")
            assert_exact(src, d.recv_src_idx, f"rank {s} recv_src_idx")
            assert_exact(x2, d2.recv_x, f"rank {s} cached recv_x")
            assert_exact(sc2, d2.recv_x_scales, f"rank {s} cached recv_x_scales")
    finally:
        g.close()


def test_backend_refuses_dispatch_without_topk():
    """The node stage routes by top-k ids: dispatch by is_token_in_rank alone is refused on
    every rank (InvalidArgument naming why; a rank that called with top-k fails at once,
    naming it), and the group goes on."""
    c = case(2, 1, cached=False)
    g = Threads(c, node_major(2, 1))
    try:
        def no_topk(s):
            i = c.inputs(s)
            lay = ref.get_dispatch_layout(i["topk_idx"], c.num_experts, c.num_ranks)
            return g.dispatch(s, base.DispatchArgs(
                i["x"], None, None, None, is_token_in_rank=lay.is_token_in_rank,
                num_tokens_per_expert=lay.num_tokens_per_expert))
        for res in g.run(no_topk):
            assert isinstance(res, InvalidArgument), res
            assert "hierarchical" in res.details and "without top-k" in res.details, res

        def mixed(s):  # rank 0 with top-k, rank 1 without
            if s == 0:
                i = c.inputs(0)
                return g.dispatch(0, base.DispatchArgs(i["x"], None, i["topk_idx"],
                                                       i["topk_weights"]))
            return no_topk(s)
        res = g.run(mixed)
        assert isinstance(res[0], FailedPrecondition) and "rank 1 rejected" in res[0].details
        assert isinstance(res[1], InvalidArgument), res[1]
        results = g.run(g.round)
        check_case(c, results)
    finally:
        g.close()


# -- logical-node daemons -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def three():
    """Three logical nodes: node 0 with two engines, nodes 1 and 2 with one."""
    with cluster([2, 1, 1]) as c:
        yield c


def run_reporting(endpoint: str, c: Case, rank: int) -> dict:
    """Task: run_case, plus whether the group says it runs hierarchically."""
    from epd.client import Session
    with Session(endpoint, client_name=f"hier-rank{rank}", timeout=30) as s:
        g = join(s, c, rank)
        res = case_round(s, g, c, rank)
        res["hierarchical"] = g.hierarchical
        return res


def run(pool, c: Case, endpoints: list[str]) -> None:
    results = pool.run_ok([(run_reporting, endpoints[r], c, r) for r in range(c.num_ranks)])
    check_case(c, results)
    assert [res["hierarchical"] for res in results] == [c.nodes > 1] * c.num_ranks


@pytest.mark.slow
def test_two_nodes_through_the_daemons(three, ranks):
    """Nodes 1 and 2 (the group's nodes 0 and 1) with two ranks each, then nodes 0 and 1 with
    one rank each: bf16, alignment, worst-token padding, weights and biases, cached, two rounds
    on each group."""
    c = case(2, 2, expert_alignment=4, rounds=2)
    c = dataclasses.replace(c, num_worst_tokens=_worst(c))
    run(ranks, c, [three.ep(1), three.ep(1), three.ep(2), three.ep(2)])
    run(ranks, case(2, 1, fp8=True, rounds=2), [three.ep(0, 1), three.ep(1)])


@pytest.mark.slow
def test_three_nodes_through_the_daemons(three, ranks):
    """3 nodes x 2 ranks (node 0's on two engines), FP8 with alignment, cached, biases."""
    eps = [three.ep(0, 0), three.ep(0, 1), three.ep(1), three.ep(1), three.ep(2), three.ep(2)]
    run(ranks, case(3, 2, fp8=True, expert_alignment=2), eps)


@pytest.mark.slow
def test_a_spanning_group_not_node_major_stays_flat(three, ranks):
    run(ranks, case(2, 2, placed=1, expert_alignment=2),
        [three.ep(0, 0), three.ep(1), three.ep(0, 1), three.ep(1)])


def facade_round(endpoint: str, rank: int, c: Case) -> dict:
    """Task: the DeepEP facade's layout, dispatch, combine (weights, both biases) and cached
    dispatch on a group over nodes, and its handle's positions 0 and 3."""
    from epd.client.buffer import Buffer
    inp = c.inputs(rank)
    buf = Buffer(None, rank=rank, num_ranks=c.num_ranks, endpoint=endpoint,
                 max_tokens_per_rank=c.max_tokens_per_rank, group_name=c.group, timeout=30)
    try:
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(inp["topk_idx"],
                                                                       c.num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            inp["x"], num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
            topk_idx=inp["topk_idx"], topk_weights=inp["topk_weights"])
        res = {"rank": rank, "recv_x": np.array(recv_x), "recv_topk_idx": np.array(recv_idx),
               "recv_topk_weights": np.array(recv_w), "counts": list(counts),
               "prefix": np.array(handle[0]), "recv_src_idx": np.array(handle[3]),
               "hierarchical": handle.handle.group.hierarchical,
               "stats_hierarchical": [g.hierarchical for g in buf.session.stats().groups
                                      if g.group_id == handle.handle.group.group_id]}
        y = expert_out(res["recv_x"], None, res["recv_topk_idx"], res["recv_topk_weights"],
                       rank, c.local_experts)
        cx, cw, _ = buf.combine(y, handle, topk_weights=res["recv_topk_weights"],
                                bias=(inp["bias_0"], inp["bias_1"]))
        res["combined_x"], res["combined_w"] = np.array(cx), np.array(cw)
        res["cached_recv_x"] = np.array(buf.dispatch(inp["x2"], handle=handle)[0])
        return res
    finally:
        buf.destroy()


@pytest.mark.slow
def test_the_deepep_facade_in_a_hierarchical_group(three, ranks):
    c = case(3, 1)
    eps = [three.ep(0, 0), three.ep(1), three.ep(2)]
    out = ranks.run_ok([(facade_round, eps[r], r, c) for r in range(3)])
    want = reference(c)
    for r, o in enumerate(out):
        d = want["disp"][r]
        assert o["hierarchical"] and o["stats_hierarchical"] == [True], (r, o)
        for k in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx"):
            assert_exact(o[k], getattr(d, k), f"rank {r} {k}")
        assert o["counts"] == want["counts"][r][1]
        assert_exact(o["prefix"], want["prefix"], f"rank {r} rank_prefix_matrix")
        assert_exact(o["combined_x"], want["comb"][r][0], f"rank {r} combined_x")
        assert_exact(o["combined_w"], want["comb"][r][1], f"rank {r} combined_topk_weights")
        assert_exact(o["cached_recv_x"], want["cached"][r].recv_x, f"rank {r} cached recv_x")

