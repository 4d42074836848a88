"""Rank masking on the CUDA engine (issue 11, DeepEP's shrink mode): three ranks of a low-latency
group joined through the facade with `enable_shrink=True`.
- A rank that goes away: after a first step, rank 2's process exits without a word. The engine
  masks it (its bit in every rank's control block), and the other two ranks' plain low-latency
  calls go on: exact against the reference with rank 2 left out (its tokens absent, every entry
  for one of its experts dropped), no deadline waited out, the mask buffer showing it.
- A live rank masked by a call: rank 0 masks rank 1 between steps (rank 1 keeps calling and
  gets nothing: zero counts, a zero combine), then unmasks it with the clean call; every step
  exact against the reference with the ranks left out, the mask buffer showing each state."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from epd.proto.dtypes import BFLOAT16
from epd.server import reference as ref

from .conftest import GPU_COUNT
from .test_daemon import _bits, _check_ll, _compact, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
R, E, K, H, M = 3, 24, 4, 2048, 16
LX = E // R
TOKENS = (16, 9, 13)


def _inputs(step: int, rank: int):
    rng = np.random.default_rng([2024, step, rank])
    idx, w = ref.random_routing(rng, TOKENS[rank], E, K, drop_prob=0.1)
    return ref.random_x(rng, TOKENS[rank], H, BFLOAT16), idx, w


def _expected(step: int, left_out: set[int]):
    """(dispatch reference, combined bits) per rank with `left_out` taking no part: their
    tokens absent, every entry for one of their experts dropped; identity experts; a rank
    left out gets zeros (a live one; one that went away is not checked)."""
    xs, idx, w = zip(*(_inputs(step, r) for r in range(R)), strict=True)
    kept, ws = [], []
    for r in range(R):
        i = idx[r].copy()
        i[np.isin(np.where(i >= 0, i // LX, -1), sorted(left_out))] = -1
        kept.append(i[:0] if r in left_out else i)
        ws.append(w[r][:0] if r in left_out else w[r])
    disp = ref.low_latency_dispatch([x[:0] if r in left_out else x for r, x in enumerate(xs)],
                                    kept, E, M)
    combined = ref.low_latency_combine([d.recv_x for d in disp], disp, kept, ws, E)
    return disp, [np.zeros(xs[r].shape, np.uint16) if r in left_out else
                  combined[r].view(np.uint16) for r in range(R)]


def _ll_round(buf, step: int, rank: int, device: int) -> dict:
    """One plain low-latency dispatch + combine of `rank`'s inputs of `step`, identity experts:
    the received rows (compact) and the combined bits."""
    import torch
    x, idx, w = (_to_torch(a, device) for a in _inputs(step, rank))
    recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    cx, _, _ = buf.low_latency_combine(recv, idx, w, handle)
    torch.cuda.synchronize()
    buf.check()
    return {"compact": _compact(SimpleNamespace(
        recv_x=recv, recv_count=count, recv_x_scales=None,
        recv_src_rank=handle.src_rank, recv_src_idx=handle.src_idx), LX), "cx": _bits(cx)}


def _rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import EpdError
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "steps": []}
    buf = Buffer(None, rank=rank, num_ranks=R, endpoint=socket, low_latency_mode=True,
                 enable_shrink=True, group_name="gpu-shrink", timeout=30)
    for step in range(3):
        if rank == 2 and step == 1:  # goes away without a word (as a crash)
            q.put(res)
            q.close()
            q.join_thread()
            os._exit(0)
        t0 = time.monotonic()
        got = _ll_round(buf, step, rank, device)
        res["steps"].append({**got, "seconds": time.monotonic() - t0})
    mask = torch.full((R,), 7, dtype=torch.int32, device=device)
    buf.low_latency_query_mask_buffer(mask)
    res["mask"] = mask.cpu().numpy()
    try:  # a rank that went away cannot be unmasked
        buf.low_latency_update_mask_buffer(2, False)
        res["unmask_gone"] = "accepted"
    except EpdError as e:
        res["unmask_gone"] = e.code.name
    buf.destroy()
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_rank_that_goes_away_is_masked_on_the_cuda_engine(daemon) -> None:
    results = _spawn_ranks(daemon, _rank, R)
    assert len(results[2]["steps"]) == 1
    for step in range(3):
        disp, combined = _expected(step, set() if step == 0 else {2})
        for r in (0, 1) if step else (0, 1, 2):
            got = results[r]["steps"][step]
            _check_ll(disp[r], got["compact"], LX)
            np.testing.assert_array_equal(got["cx"], combined[r],
                                          err_msg=f"step {step} rank {r}")
            assert got["seconds"] < 10, "a deadline was waited out"
    for r in (0, 1):  # (the other survivor may have left already: its bit is not checked)
        assert results[r]["mask"][2] == 1 and results[r]["mask"][r] == 0, results[r]["mask"]
        assert results[r]["unmask_gone"] == "FAILED_PRECONDITION"


# step -> the ranks masked by a call before it (set by rank 0 between barriers)
LIVE_STEPS = [set(), {1}, {1}, set(), {2}, {0, 2}, set()]


def _live_rank(rank: int, socket: str, device: int, barrier, q) -> None:
    import torch

    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "steps": [], "masks": []}
    buf = Buffer(None, rank=rank, num_ranks=R, endpoint=socket, low_latency_mode=True,
                 enable_shrink=True, group_name="gpu-shrink-live", timeout=30)
    mask = torch.zeros((R,), dtype=torch.int32, device=device)
    masked: set[int] = set()
    for step, want in enumerate(LIVE_STEPS):
        if rank == 0:
            if not want:
                buf.low_latency_clean_mask_buffer()
            for r in sorted(want - masked):
                buf.low_latency_update_mask_buffer(r, True)
            for r in sorted(masked - want):
                buf.low_latency_update_mask_buffer(r, False)
        masked = set(want)
        barrier.wait()
        mask.fill_(7)
        buf.low_latency_query_mask_buffer(mask)
        res["masks"].append(mask.cpu().numpy())
        res["steps"].append(_ll_round(buf, 10 + step, rank, device))
        barrier.wait()  # every rank done with the step before the next mask change
    buf.destroy()
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_live_rank_masked_by_a_call_on_the_cuda_engine(daemon) -> None:
    import multiprocessing as mp
    barrier = mp.get_context("spawn").Barrier(R)
    results = _spawn_ranks(daemon, _live_rank, R, barrier)
    for step, left_out in enumerate(LIVE_STEPS):
        disp, combined = _expected(10 + step, left_out)
        for r in range(R):
            got = results[r]["steps"][step]
            _check_ll(disp[r], got["compact"], LX)
            np.testing.assert_array_equal(got["cx"], combined[r],
                                          err_msg=f"step {step} rank {r} left out {left_out}")
            np.testing.assert_array_equal(results[r]["masks"][step],
                                          [int(x in left_out) for x in range(R)])


def _rejoin_rank(rank: int, socket: str, device: int, step1_done, joined, survivors,
                 queried, q) -> None:
    """Ranks 0 and 1 take part throughout; rank 2 goes away after step 0; "rank" 3 is the
    replacement for rank 2 (on rank 2's GPU and engine): refused at its first call, then the
    Rejoin collective, then steps 2 and 3 with all three ranks. The three read the mask, then
    wait for each other before leaving (a rank that has left is masked: the ninth session's
    run saw rank 1 leave before rank 0 read it)."""
    import torch

    from epd.client import EpdError
    from epd.client.buffer import Buffer
    replacement = rank == 3
    me = 2 if replacement else rank
    if replacement:
        device = 2 % GPU_COUNT
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "steps": {}}  # (rank: the process, 3 for the replacement)

    def step(buf, s: int) -> None:
        res["steps"][s] = _ll_round(buf, s, me, device)

    if replacement:
        assert step1_done.wait(120), "the survivors did not finish step 1"
    buf = Buffer(None, rank=me, num_ranks=R, endpoint=socket, low_latency_mode=True,
                 enable_shrink=True, group_name="gpu-shrink-rejoin", timeout=30)
    if replacement:
        try:
            step(buf, 2)
            res["refused"] = "accepted"
        except EpdError as e:
            res["refused"] = f"{e.code.name}: {e.details}"
        joined.set()
        t0 = time.monotonic()
        buf.low_latency_rejoin()
        res["rejoin_seconds"] = time.monotonic() - t0
    else:
        for s in (0, 1):
            if rank == 2 and s == 1:  # goes away without a word (as a crash)
                q.put(res)
                q.close()
                q.join_thread()
                os._exit(0)
            step(buf, s)
        survivors.wait(60)
        if rank == 0:
            step1_done.set()
        assert joined.wait(120), "the replacement did not join"
        t0 = time.monotonic()
        buf.low_latency_rejoin(2)
        res["rejoin_seconds"] = time.monotonic() - t0
    for s in (2, 3):
        step(buf, s)
    mask = torch.full((R,), 7, dtype=torch.int32, device=device)
    buf.low_latency_query_mask_buffer(mask)
    res["mask"] = mask.cpu().numpy()
    queried.wait(60)
    buf.destroy()
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_a_replacement_rejoins_on_the_cuda_engine(daemon) -> None:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    step1_done, joined, survivors = ctx.Event(), ctx.Event(), ctx.Barrier(2)
    queried = ctx.Barrier(3)  # ranks 0, 1 and the replacement, before any leaves
    endpoints = [daemon.socket(r % GPU_COUNT) for r in (0, 1, 2, 2)]
    results = _spawn_ranks(daemon, _rejoin_rank, 4, step1_done, joined, survivors, queried,
                           endpoints=endpoints)
    by_rank = {0: results[0], 1: results[1], 2: results[3]}
    assert set(results[2]["steps"]) == {0}  # the original rank 2: step 0, then gone
    assert results[3]["refused"].startswith("FAILED_PRECONDITION"), results[3]["refused"]
    assert "rejoins" in results[3]["refused"], results[3]["refused"]
    for s, left_out in ((0, set()), (1, {2}), (2, set()), (3, set())):
        disp, combined = _expected(s, left_out)
        for r in range(R):
            if r in left_out:
                continue
            got = (results[2] if (r == 2 and s == 0) else by_rank[r])["steps"][s]
            _check_ll(disp[r], got["compact"], LX)
            np.testing.assert_array_equal(got["cx"], combined[r], err_msg=f"step {s} rank {r}")
    for r, res in by_rank.items():
        np.testing.assert_array_equal(res["mask"], [0, 0, 0], err_msg=f"rank {r}")
        assert res["rejoin_seconds"] < 20, res["rejoin_seconds"]
