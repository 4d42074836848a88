"""The DeepEP-compatible Buffer facade: DeepEP's call sequence, checked against the reference."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Daemon, Workload

pytestmark = pytest.mark.slow


def _rank(rank: int, socket: str, wl: Workload, use_torch: bool, q) -> None:
    try:
        from epd.client.buffer import Buffer
        x, idx, w = wl.inputs(rank)
        if use_torch:
            import torch
            x = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
            idx, w = torch.from_numpy(idx), torch.from_numpy(w)
        buf = Buffer(None, rank=rank, num_ranks=wl.num_ranks, endpoint=socket,
                     max_tokens_per_rank=max(wl.tokens))
        n_rank, n_rdma, n_exp, in_rank, ev = buf.get_dispatch_layout(idx, wl.num_experts)
        recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
            x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w, expert_alignment=4)
        ev.current_stream_wait()
        cx, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        cached = buf.dispatch(x, handle=handle)
        conv = (lambda a: a.view(__import__("torch").int16).numpy().view(np.uint16)) \
            if use_torch else (lambda a: a.view(np.uint16))
        num = (lambda a: a.numpy()) if use_torch else (lambda a: a)
        q.put({"rank": rank, "n_rank": num(n_rank), "n_exp": num(n_exp),
               "in_rank": num(in_rank), "n_rdma": n_rdma, "recv_x": conv(recv_x),
               "recv_idx": num(recv_idx), "recv_w": num(recv_w), "counts": counts,
               "cx": conv(cx), "cw": num(cw), "cached_x": conv(cached[0]),
               "cached_rest": cached[1:5], "torch_out": type(cx).__module__})
        buf.destroy()
    except Exception as e:
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


@pytest.mark.parametrize("use_torch", [False, True])
def test_deepep_call_sequence(use_torch: bool) -> None:
    if use_torch:
        pytest.importorskip("torch")
    wl = Workload(num_ranks=2, tokens=[24, 17], hidden=128, num_experts=8, num_topk=3, seed=7)
    with Daemon(backend="cpu", engines=2) as d:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, d.socket(r), wl, use_torch, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        got = sorted((q.get(timeout=60) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(10)
    inputs = wl.all_inputs()
    disp = ref.dispatch([i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs],
                        wl.num_experts, expert_alignment=4)
    comb = ref.combine([dd.recv_x for dd in disp], disp, wl.tokens,
                       recv_topk_weights=[dd.recv_topk_weights for dd in disp])
    for r, res in enumerate(got):
        assert "error" not in res, res.get("error")
        lay = ref.get_dispatch_layout(inputs[r][1], wl.num_experts, 2)
        np.testing.assert_array_equal(res["n_rank"], lay.num_tokens_per_rank)
        np.testing.assert_array_equal(res["n_exp"], lay.num_tokens_per_expert)
        np.testing.assert_array_equal(res["in_rank"], lay.is_token_in_rank)
        assert res["n_rdma"] is None
        np.testing.assert_array_equal(res["recv_x"], disp[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(res["recv_idx"], disp[r].recv_topk_idx)
        np.testing.assert_array_equal(res["recv_w"], disp[r].recv_topk_weights)
        assert res["counts"] == disp[r].num_recv_tokens_per_expert
        np.testing.assert_array_equal(res["cx"], comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(res["cw"], comb[r][1])
        np.testing.assert_array_equal(res["cached_x"], disp[r].recv_x.view(np.uint16))
        assert res["cached_rest"] == (None, None, None, None)
        assert res["torch_out"].startswith("torch") == use_torch
