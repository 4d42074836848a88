"""Property test: random shapes and routings through one daemon and 3 persistent rank processes,
compared bit-exactly with the reference."""

from __future__ import annotations

import itertools

import pytest
from daemon_harness import memfd_names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ranklib import Case, check_case, serve_rounds

pytestmark = pytest.mark.slow
R = 3
MAX_TOKENS = 40
_names = itertools.count()


@pytest.fixture(scope="module")
def rank_loops(daemon, rank_pool):
    rank_pool.clear()
    tids = [rank_pool.submit(r, serve_rounds, daemon.socket(r % 2), r) for r in range(R)]
    yield rank_pool
    for r in range(R):
        rank_pool.cmd(r, None)
    outs = rank_pool.gather(tids, 30)
    assert all(o.ok for o in outs), [o.describe() for o in outs]
    assert not any(memfd_names(rank_pool.pid(r)) for r in range(R))


@st.composite
def cases(draw):
    local = draw(st.sampled_from([1, 2, 4]))
    experts = R * local
    return Case(
        group=f"prop-{next(_names)}", num_ranks=R, num_experts=experts,
        hidden=draw(st.sampled_from([128, 256, 384])),
        num_topk=draw(st.integers(1, min(4, experts))),
        tokens=tuple(draw(st.lists(st.integers(0, MAX_TOKENS), min_size=R, max_size=R))),
        max_tokens=MAX_TOKENS, seed=draw(st.integers(0, 2**31)),
        drop_prob=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        expert_alignment=draw(st.sampled_from([1, 2, 8])),
        bias=draw(st.booleans()), layout=draw(st.booleans()))


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(c=cases())
def test_dispatch_combine_match_reference(rank_loops, c):
    for r in range(R):
        rank_loops.cmd(r, c)
    results = [rank_loops.event(r, timeout=60) for r in range(R)]
    errors = [res for res in results if "error" in res]
    assert not errors, errors[0]["tb"]
    check_case(c, results)
