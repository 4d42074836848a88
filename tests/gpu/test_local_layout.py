"""`get_dispatch_layout` on the caller's own stream (the default, client/local_layout.py),
through a CUDA daemon, the way callers use it: one group, many shapes, fresh random routing per
call, the caching allocator's blocks poisoned before each call (the outputs are new tensors
from it), every output compared exactly with server/reference.py; a dispatch after it stays
exact; a layout captured in a CUDA graph replays on new ids; a bad expert id is skipped and
raised by the rank's Group.check(), naming the rank and the id."""

from __future__ import annotations

import numpy as np
import pytest

from epd.server import reference as ref

from .test_daemon import _bits, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
EXPERTS, TOPK, MAX_TOKENS = 32, 4, 512
TOKENS = [0, 1, 7, 255, 256, 257, 512, 130]


def _ids(rank: int, call: int, t: int) -> np.ndarray:
    rng = np.random.default_rng([7, rank, call])
    idx, _ = ref.random_routing(rng, t, EXPERTS, TOPK, drop_prob=0.2)
    return idx


def _rank(rank: int, socket: str, device: int, q) -> None:
    import os

    import torch

    os.environ["EPD_LOCAL_LAYOUT"] = "1"
    from epd.client import EpdError, Session
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "calls": []}
    with Session(socket, client_name=f"ll-{rank}", timeout=30) as s:
        g = s.join("local-layout", rank=rank, num_ranks=2, num_experts=EXPERTS, hidden=256,
                   max_tokens_per_rank=MAX_TOKENS, num_topk=TOPK, timeout=30)
        res["local"] = g._local_layout is not None
        for call, t in enumerate(TOKENS):
            junk = torch.full((1 << 17,), -1, dtype=torch.int32, device=device)  # small pool
            del junk  # its block (now -1s) goes back to the cache the outputs come from
            tidx = _to_torch(_ids(rank, call, t), device)
            n_rank, n_expert, in_rank = g.get_dispatch_layout(tidx)
            res["calls"].append((_bits(n_rank), _bits(n_expert), _bits(in_rank)))
        # A dispatch afterwards (the engine's own layout inside) receives what the layouts say.
        idx = _ids(rank, 99, 100)
        res["dispatch_ok"] = None
        try:
            out = g.dispatch(torch.zeros((100, 256), dtype=torch.bfloat16, device=device),
                             _to_torch(idx, device),
                             torch.ones(idx.shape, dtype=torch.float32, device=device))
            res["dispatch_counts"] = list(out.num_recv_tokens_per_expert)
        except EpdError as e:
            res["dispatch_ok"] = f"{e.code.name}: {e.details}"
        # Captured in a CUDA graph: replays compute the layout of what the tensor then holds.
        static = _to_torch(_ids(rank, 50, 64), device)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cap = g.get_dispatch_layout(static)
        replays = []
        for call in (51, 52):
            static.copy_(_to_torch(_ids(rank, call, 64), device))
            graph.replay()
            torch.cuda.synchronize()
            replays.append(tuple(_bits(a) for a in cap))
        res["replays"] = replays
        # A bad id on rank 1: skipped now, raised by check() (this rank's alone).
        bad = _to_torch(_ids(rank, 60, 32), device)
        if rank == 1:
            bad[3, 1] = 1000
        n_rank, n_expert, in_rank = g.get_dispatch_layout(bad)
        torch.cuda.synchronize()
        res["bad_out"] = (_bits(n_rank), _bits(n_expert), _bits(in_rank))
        try:
            g.check()
            res["bad"] = "OK"
        except EpdError as e:
            res["bad"], res["bad_msg"] = e.code.name, e.details
        n_rank, _, _ = g.get_dispatch_layout(_to_torch(_ids(rank, 61, 8), device))
        torch.cuda.synchronize()
        res["after_bad"] = _bits(n_rank)
    q.put(res)


def test_local_layout_through_the_daemon(daemon) -> None:
    results = _spawn_ranks(daemon, _rank, 2)
    for r, res in enumerate(results):
        assert res["local"], "the group has no local layout"
        for call, t in enumerate(TOKENS):
            lay = ref.get_dispatch_layout(_ids(r, call, t), EXPERTS, 2)
            got = res["calls"][call]
            np.testing.assert_array_equal(got[0], lay.num_tokens_per_rank)
            np.testing.assert_array_equal(got[1], lay.num_tokens_per_expert)
            np.testing.assert_array_equal(got[2], lay.is_token_in_rank)
        assert res["dispatch_ok"] is None, res["dispatch_ok"]
        local = EXPERTS // 2
        sent = sum(ref.get_dispatch_layout(_ids(s, 99, 100), EXPERTS, 2).num_tokens_per_expert
                   for s in range(2))
        assert res["dispatch_counts"] == [int(c) for c in sent[r * local:(r + 1) * local]]
        for i, call in enumerate((51, 52)):
            lay = ref.get_dispatch_layout(_ids(r, call, 64), EXPERTS, 2)
            np.testing.assert_array_equal(res["replays"][i][0], lay.num_tokens_per_rank)
            np.testing.assert_array_equal(res["replays"][i][1], lay.num_tokens_per_expert)
            np.testing.assert_array_equal(res["replays"][i][2], lay.is_token_in_rank)
        skipped = _ids(r, 60, 32)
        if r == 1:
            skipped[3, 1] = -1
        lay = ref.get_dispatch_layout(skipped, EXPERTS, 2)
        np.testing.assert_array_equal(res["bad_out"][0], lay.num_tokens_per_rank)
        np.testing.assert_array_equal(res["bad_out"][1], lay.num_tokens_per_expert)
        np.testing.assert_array_equal(res["bad_out"][2], lay.is_token_in_rank)
        lay = ref.get_dispatch_layout(_ids(r, 61, 8), EXPERTS, 2)
        np.testing.assert_array_equal(res["after_bad"], lay.num_tokens_per_rank)
    assert results[0]["bad"] == "OK", results[0]
    assert results[1]["bad"] == "INVALID_ARGUMENT", results[1]
    assert "rank 1" in results[1]["bad_msg"] and "1000" in results[1]["bad_msg"]
