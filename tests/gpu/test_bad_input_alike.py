"""Bad input in a stream-ordered dispatch fails that call on every rank alike (issue 10's "Done
when"), the way a serving loop meets it: through the DeepEP facade, one Buffer for every layer,
each layer in a try/except that goes on to the next layer. An expert id out of range on one
rank (or on both) fails the dispatch on every rank with INVALID_ARGUMENT naming the (lowest)
rank and its id: at the call for an exact dispatch, at the next dispatch for a worst-case one
(`num_worst_tokens`); no rank is left a collective behind, so every later layer is exact
against the reference and nothing waits out a deadline. A layout's bad id is the rank's own
and raises at `Buffer.check()` only, unless a dispatch already failed for it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from epd.server.demo import Workload

from .test_daemon import _bits, _spawn_ranks, _to_torch
from .test_worst_case_no_wait import _expected

pytestmark = pytest.mark.gpu
MAX_TOKENS = 64
WORST = 2 * MAX_TOKENS
# Per layer: (bad ids on rank 0, on rank 1, worst-case dispatch). A bad id replaces the
# layer's first top-k entry; -7 and 99 are out of range for 16 experts.
PLAN = [(None, None, False), (None, 1000, False), (None, None, False), (None, 1000, True),
        (None, None, True), (None, None, True), (-7, 99, False), (None, None, False)]


def _workload(layer: int) -> Workload:
    return Workload(num_ranks=2, tokens=[40, 53], hidden=256, num_experts=16, num_topk=4,
                    seed=9300 + layer)


def _rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import EpdError, Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "layers": {}, "errors": {}}
    with Session(socket, client_name=f"bad-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=2, session=s, group_name="gpu-bad-alike",
                     max_tokens_per_rank=MAX_TOKENS)
        t0 = time.monotonic()
        for i, plan in enumerate(PLAN):
            wl = _workload(i)
            x, idx, w = wl.inputs(rank)
            if plan[rank] is not None:
                idx = idx.copy()
                idx[0, 0] = plan[rank]
            tx, tidx, tw = (_to_torch(a, device) for a in (x, idx, w))
            try:  # a serving loop: a failed layer is logged, the next one runs
                n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(tidx, wl.num_experts)
                recv_x, _, recv_w, _, handle, _ = buf.dispatch(
                    tx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                    num_tokens_per_expert=n_expert, topk_idx=tidx, topk_weights=tw,
                    num_worst_tokens=WORST if plan[2] else 0)
                combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
                torch.cuda.synchronize(device)
                res["layers"][i] = (_bits(combined), combined_w.cpu().numpy())
            except EpdError as e:
                res["errors"][i] = f"{e.code.name}: {e.details}"
        res["seconds"] = time.monotonic() - t0
        try:
            buf.check()
            res["check"] = "OK"
        except EpdError as e:
            res["check"] = f"{e.code.name}: {e.details}"
        buf.destroy()
    q.put(res)


def test_bad_input_fails_the_dispatch_on_every_rank_and_the_layers_go_on(daemon) -> None:
    results = _spawn_ranks(daemon, _rank, 2)
    # Layer 1: rank 1's id raises at that dispatch; layer 3's (worst-case) at layer 4's
    # dispatch; layer 6's (both ranks) names rank 0, the lowest.
    failed = {1: "rank 1 passed expert id 1000", 4: "rank 1 passed expert id 1000",
              6: "rank 0 passed expert id -7"}
    for r, res in enumerate(results):
        assert sorted(res["errors"]) == sorted(failed), (r, res["errors"])
        for i, text in failed.items():
            err = res["errors"][i]
            assert err.startswith("INVALID_ARGUMENT") and text in err, (r, i, err)
            assert "no rank's dispatch ran and the group goes on" in err, (r, i, err)
        assert "num_worst_tokens" in res["errors"][4], (r, res["errors"][4])
        assert res["seconds"] < 20, (r, res["seconds"])  # no deadline waited out
    for i in range(len(PLAN)):
        if i in failed or i == 3:  # (layer 3's combine ran on no data: its dispatch failed)
            continue
        _, comb = _expected(_workload(i))
        for r, res in enumerate(results):
            got_x, got_w = res["layers"][i]
            np.testing.assert_array_equal(got_x, comb[r][0].view(np.uint16), (r, i))
            np.testing.assert_array_equal(got_w, comb[r][1], (r, i))
    # Rank 0's layouts' bad ids were all failed dispatches' (dropped); rank 1's layer 6 id
    # (99) was not the one its dispatch named: check() raises it, on rank 1 alone.
    assert results[0]["check"] == "OK", results[0]["check"]
    assert results[1]["check"].startswith("INVALID_ARGUMENT"), results[1]["check"]
    assert "rank 1 passed expert id 99" in results[1]["check"], results[1]["check"]
