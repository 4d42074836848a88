"""Soak: many client processes in many groups on one daemon, every round checked bit for bit
against the reference, and the engines' descriptors, memory and files counted before and after.

Short in CI (16 client processes in 8 groups, a few rounds each). The long run is the same test
with more rounds: `EPD_LONG_TESTS=1 .venv/bin/python -m pytest tests/test_soak.py -s` (its figures
are in docs/BENCHMARKS.md, "Issue 12").
"""

from __future__ import annotations

import os
import time

import pytest
import ranklib
from conftest import running_daemon
from daemon_harness import memfd_names
from ranklib import Case

pytestmark = pytest.mark.slow

LONG = os.environ.get("EPD_LONG_TESTS") == "1"
GROUPS = 8
RANKS = 2  # per group: 16 client processes
ROUNDS = 60 if LONG else 3
ENGINES = 4


def _case(g: int, rnd: int) -> Case:
    """Group g's inputs in round rnd: sizes differ by group, values by round."""
    tokens = (24 + 5 * g, 17 + 3 * g) if g % 3 else (0, 9 + g)  # an empty rank in some groups
    return Case(f"soak{g}", RANKS, 8 * RANKS, 128 * (1 + g % 2), 2 + g % 3, tokens,
                seed=1000 * g + rnd, max_tokens=64, fp8=g % 4 == 1, bias=g % 4 == 2,
                cached=g % 4 == 3, use_async=g % 5 == 4)


def soak_rank(endpoint: str, g: int, rank: int, rounds: int) -> list[dict]:
    """Task: one long-lived session and group; `rounds` rounds, each returned for checking."""
    from epd.client import Session

    out = []
    with Session(endpoint, client_name=f"soak-g{g}r{rank}", timeout=30) as s:
        grp = ranklib.join(s, _case(g, 0), rank)
        for rnd in range(rounds):
            out.append(ranklib.case_round(s, grp, _case(g, rnd), rank))
        grp.leave()
    return out


def _engine_usage(pid: int) -> tuple[int, int]:
    """(open descriptors, resident KiB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return fds, rss


def _client_maps(engine_pids: list[int]) -> list[str]:
    """Clients' regions the engines still hold (none once every session is torn down)."""
    return [n for p in engine_pids for n in memfd_names(p, "epd-client-")]


def test_soak_many_clients_many_groups() -> None:
    pool = ranklib.RankPool(size=GROUPS * RANKS)
    try:
        pool.start(GROUPS * RANKS)
        with running_daemon(engines=ENGINES, timeout_seconds=30.0) as d:
            endpoint = [d.socket(i % ENGINES) for i in range(GROUPS * RANKS)]
            pids = [d.engine_pid(e) for e in range(ENGINES)]
            # Warm up (lazily created per-process state), then take the baseline.
            pool.run_ok([(soak_rank, endpoint[i], i // RANKS, i % RANKS, 1)
                         for i in range(GROUPS * RANKS)], timeout=120)
            ranklib.wait_until(lambda: not _client_maps(pids), 10, "sessions closed")
            before = [_engine_usage(p) for p in pids]
            t0 = time.monotonic()
            results = pool.run_ok([(soak_rank, endpoint[i], i // RANKS, i % RANKS, ROUNDS)
                                   for i in range(GROUPS * RANKS)],
                                  timeout=120 + 20 * ROUNDS)
            elapsed = time.monotonic() - t0
            checked = 0
            for g in range(GROUPS):
                for rnd in range(ROUNDS):
                    ranklib.check_case(_case(g, rnd),
                                       [results[g * RANKS + r][rnd] for r in range(RANKS)])
                    checked += 1
            ranklib.wait_until(lambda: not _client_maps(pids), 10, "sessions closed")
            # Closed connections and session threads settle within a moment; a leak does not.
            deadline = time.monotonic() + 10
            while True:
                after = [_engine_usage(p) for p in pids]
                settled = all(a[0] <= b[0] + 2 for a, b in zip(after, before, strict=True))
                if settled or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert [d.engine_pid(e) for e in range(ENGINES)] == pids, "an engine restarted"
            print(f"\nsoak: {GROUPS * RANKS} clients, {GROUPS} groups, {checked} group-rounds "
                  f"exact in {elapsed:.1f} s; engine (fds, RSS KiB) before {before}, "
                  f"after {after}")
            for (fd0, rss0), (fd1, rss1) in zip(before, after, strict=True):
                assert fd1 <= fd0 + 2, f"engine descriptors grew: {fd0} -> {fd1}"
                assert rss1 <= rss0 + 64 * 1024, f"engine RSS grew: {rss0} -> {rss1} KiB"
    finally:
        pool.close()
