"""A real daemon and several client processes (one per rank), compared bit-exactly with the
NumPy reference (DESIGN.md §6)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from ranklib import Case, check_case, run_case, run_cases

pytestmark = pytest.mark.slow
_names = itertools.count()


def case(**kw) -> Case:
    kw.setdefault("group", f"it-{next(_names)}")
    kw.setdefault("seed", next(_names))
    return Case(**kw)


def run(pool, daemon, c: Case, endpoints: list[str] | None = None) -> list[dict]:
    eps = endpoints or daemon.endpoints(c.num_ranks)
    results = pool.run_ok([(run_case, eps[r], c, r) for r in range(c.num_ranks)])
    check_case(c, results)
    return results


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_ranks_exact(daemon, ranks, num_ranks):
    c = case(num_ranks=num_ranks, num_experts=4 * num_ranks, hidden=256, num_topk=4,
             tokens=tuple(24 + 5 * r for r in range(num_ranks)))
    results = run(ranks, daemon, c)
    assert all(r["num_recv_tokens"] > 0 for r in results)


def test_eight_ranks_on_four_engines(daemon_factory, ranks):
    c = case(num_ranks=8, num_experts=32, hidden=128, num_topk=4, tokens=(16,) * 8)
    with daemon_factory(engines=4) as d:
        results = run(ranks, d, c)
    assert len({r["session_id"] for r in results}) == 8


def test_four_ranks_on_one_engine(daemon_factory, ranks):
    """Several clients of one engine (every rank's session on gpu0.sock)."""
    c = case(num_ranks=4, num_experts=8, hidden=256, num_topk=2, tokens=(20, 7, 31, 12))
    with daemon_factory(engines=1) as d:
        run(ranks, d, c, [d.socket(0)] * 4)


def test_dropped_entries_and_a_rank_that_receives_nothing(daemon, ranks):
    c = case(num_ranks=3, num_experts=9, hidden=128, num_topk=3, tokens=(30, 30, 30),
             drop_prob=0.3, avoid_rank=1)
    results = run(ranks, daemon, c)
    assert results[1]["num_recv_tokens"] == 0
    assert results[1]["recv_x"].shape == (0, 128)
    assert any((r["layout"][2] == 0).any() for r in results)  # -1 entries were really there


def test_zero_tokens_on_a_rank(daemon, ranks):
    c = case(num_ranks=3, num_experts=6, hidden=128, num_topk=2, tokens=(0, 17, 9))
    results = run(ranks, daemon, c)
    assert results[0]["combined_x"].shape == (0, 128)


def test_all_ranks_zero_tokens(daemon, ranks):
    c = case(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(0, 0), max_tokens=8)
    results = run(ranks, daemon, c)
    assert all(r["num_recv_tokens"] == 0 for r in results)


def test_skewed_load_hot_rank(daemon, ranks):
    c = case(num_ranks=4, num_experts=16, hidden=128, num_topk=4, tokens=(40, 40, 40, 40),
             hot_rank=2, hot_fraction=0.9)
    results = run(ranks, daemon, c)
    recv = [r["num_recv_tokens"] for r in results]
    assert recv[2] == max(recv) and recv[2] >= 140, recv


@pytest.mark.parametrize("alignment", [4, 128])
def test_expert_alignment(daemon, ranks, alignment):
    c = case(num_ranks=2, num_experts=8, hidden=128, num_topk=3, tokens=(33, 21),
             expert_alignment=alignment)
    results = run(ranks, daemon, c)
    for r in results:
        assert all(v % alignment == 0 for v in r["num_recv_tokens_per_expert"])


def test_num_worst_tokens(daemon, ranks):
    c = case(num_ranks=3, num_experts=6, hidden=128, num_topk=2, tokens=(12, 19, 5),
             num_worst_tokens=3 * 19)
    results = run(ranks, daemon, c)
    for r in results:
        assert r["recv_x"].shape[0] == 57
        assert (r["recv_topk_idx"][r["num_recv_tokens"]:] == -1).all()


def test_cached_dispatch(daemon, ranks):
    c = case(num_ranks=3, num_experts=12, hidden=256, num_topk=4, tokens=(25, 14, 30),
             cached=True)
    run(ranks, daemon, c)


def test_cached_dispatch_with_worst_tokens(daemon, ranks):
    c = case(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(10, 12),
             cached=True, num_worst_tokens=24)
    run(ranks, daemon, c)


def test_fp8_payload(daemon, ranks):
    c = case(num_ranks=3, num_experts=6, hidden=256, num_topk=2, tokens=(15, 22, 8),
             fp8=True)
    results = run(ranks, daemon, c)
    assert all(r["recv_x"].dtype.name == "float8_e4m3fn" for r in results)


def test_fp8_cached_and_worst(daemon, ranks):
    c = case(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(9, 13), fp8=True,
             cached=True, num_worst_tokens=26)
    run(ranks, daemon, c)


def test_combine_with_biases(daemon, ranks):
    c = case(num_ranks=3, num_experts=6, hidden=128, num_topk=3, tokens=(11, 16, 13),
             bias=True, drop_prob=0.4)
    run(ranks, daemon, c)


def test_combine_without_topk_weights(daemon, ranks):
    c = case(num_ranks=2, num_experts=8, hidden=128, num_topk=2, tokens=(14, 9),
             combine_weights=False)
    run(ranks, daemon, c)


def test_dispatch_async_counts_before_result(daemon, ranks):
    c = case(num_ranks=3, num_experts=9, hidden=256, num_topk=3, tokens=(21, 18, 27),
             use_async=True, expert_alignment=8)
    results = run(ranks, daemon, c)
    assert all("counts" in r for r in results)


def test_session_empty_is_zero_copy(daemon, ranks):
    c = case(num_ranks=2, num_experts=4, hidden=256, num_topk=2, tokens=(19, 23),
             use_empty=True, bias=True)
    results = run(ranks, daemon, c)
    # Every input lived in a registered region: nothing went through the staging region.
    assert not any(r["staging_used"] for r in results)


def test_repeated_rounds_on_one_group(daemon, ranks):
    c = case(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(16, 12), rounds=5)
    run(ranks, daemon, c)


def test_torch_cpu_tensors(daemon, ranks):
    pytest.importorskip("torch")
    c = case(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(10, 13),
             use_torch=True, bias=True)
    results = run(ranks, daemon, c)
    assert all(r["torch_out"] for r in results)


def _two_groups(daemon, pool, same_session: bool):
    a = case(num_ranks=2, num_experts=8, hidden=256, num_topk=4, tokens=(20, 13))
    b = case(num_ranks=2, num_experts=6, hidden=128, num_topk=2, tokens=(9, 17), drop_prob=0.3)
    calls = []
    for r in range(2):
        if same_session:
            eps = [daemon.socket(r % 2)] * 2
        else:
            eps = [daemon.socket(r % 2), daemon.socket((r + 1) % 2)]
        calls.append((run_cases, eps, [a, b], r))
    results = pool.run_ok(calls)
    check_case(a, [res[0] for res in results])
    check_case(b, [res[1] for res in results])
    return results


def test_two_groups_in_one_session(daemon, ranks):
    results = _two_groups(daemon, ranks, same_session=True)
    assert all(len(r[0]["session_ids"]) == 1 for r in results)


def test_two_groups_in_separate_sessions(daemon, ranks):
    results = _two_groups(daemon, ranks, same_session=False)
    assert all(len(set(r[0]["session_ids"])) == 2 for r in results)


def test_group_name_reusable_after_members_leave(daemon, ranks):
    """A finished group's name can form a new instance (with a different spec)."""
    c1 = case(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(8, 8))
    r1 = run(ranks, daemon, c1)
    c2 = Case(group=c1.group, num_ranks=2, num_experts=8, hidden=256, num_topk=3,
              tokens=(5, 11), seed=99)
    r2 = run(ranks, daemon, c2)
    assert r1[0]["group_id"] != r2[0]["group_id"]
    np.testing.assert_array_equal(r2[0]["layout"][0].shape, (2,))


def test_session_watcher_ends_cleanly(daemon):
    """The lease thread ends without an exception when the session closes."""
    import threading

    from epd.client import Session
    errors = []
    old = threading.excepthook
    threading.excepthook = errors.append
    try:
        s = Session(daemon.socket(0), timeout=5)
        s.close()
        s._watcher.join(5)
    finally:
        threading.excepthook = old
    assert not s._watcher.is_alive()
    assert not errors, [f"{e.exc_type.__name__}: {e.exc_value}" for e in errors]
