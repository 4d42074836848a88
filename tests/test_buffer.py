"""The DeepEP-compatible Buffer facade: DeepEP's call sequence, and one Buffer over many layers
of several shapes, checked bit for bit against the reference."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from ranklib import Case, assert_exact, expert_out, reference

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


# ------------------------------------------------------------------------------------------------
# one Buffer, many layers: how real callers use the facade
# ------------------------------------------------------------------------------------------------

# (hidden, num_topk, tokens per rank): several shapes interleaved, token counts of 0 included.
_LAYER_SHAPES = [(128, 2, (24, 17)), (256, 3, (9, 0)), (128, 2, (0, 11)), (256, 3, (20, 20)),
                 (128, 3, (5, 8)), (128, 2, (16, 3)), (256, 3, (0, 0)), (128, 3, (13, 1)),
                 (256, 2, (7, 19)), (128, 2, (24, 24)), (256, 3, (1, 6)), (128, 3, (0, 4))]
LAYERS = [Case(f"layer{i}", num_ranks=2, num_experts=8, hidden=h, num_topk=k, tokens=t,
               seed=300 + i, cached=True) for i, (h, k, t) in enumerate(_LAYER_SHAPES)]
MAX_TOKENS = 32


def deepep_layers(endpoint: str, cases: list[Case], rank: int) -> dict:
    """Task: one Buffer for a whole model. Forward: per layer layout, dispatch, combine and a
    cached dispatch, keeping every layer's handle; backward, in reverse layer order: a cached
    dispatch and a combine with the handle the forward kept (DeepEP's backward)."""
    from epd.client import Buffer
    buf = Buffer(None, rank=rank, num_ranks=cases[0].num_ranks, endpoint=endpoint,
                 group_name="layers", max_tokens_per_rank=MAX_TOKENS)
    try:
        fwd, handles = [], []
        for c in cases:
            inp = c.inputs(rank)
            n_rank, n_rdma, n_exp, in_rank, _ = buf.get_dispatch_layout(inp["topk_idx"],
                                                                        c.num_experts)
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                inp["x"], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_exp, topk_idx=inp["topk_idx"],
                topk_weights=inp["topk_weights"])
            y = expert_out(recv_x, None, recv_idx, recv_w, rank, c.local_experts)
            cx, cw, _ = buf.combine(y, handle, topk_weights=recv_w)
            cached = buf.dispatch(inp["x2"], handle=handle)
            handles.append(handle)
            fwd.append({"layout": (n_rank, n_exp, in_rank), "n_rdma": n_rdma, "recv_x": recv_x,
                        "recv_idx": recv_idx, "recv_w": recv_w, "counts": counts, "cx": cx,
                        "cw": cw, "cached_x": cached[0], "cached_rest": cached[1:5]})
        bwd: list = [None] * len(cases)
        for i in reversed(range(len(cases))):
            again = buf.dispatch(cases[i].inputs(rank)["x2"], handle=handles[i])[0]
            back, back_w, _ = buf.combine(again, handles[i])
            bwd[i] = {"recv_x": again, "cx": back, "cw": back_w}
        return {"fwd": fwd, "bwd": bwd, "groups": len(buf._groups)}
    finally:
        buf.destroy()


def test_one_buffer_many_layers(daemon, ranks) -> None:
    """Regression (issue 9, defect 1): a Buffer's second get_dispatch_layout raised ValueError
    (group keys had grown a field), so every caller beyond one layer broke."""
    results = ranks.run_ok([(deepep_layers, daemon.socket(r), LAYERS, r) for r in range(2)],
                           timeout=240)
    for c_i, c in enumerate(LAYERS):
        want = reference(c)
        back = ref.combine([d.recv_x for d in want["cached"]], want["disp"], list(c.tokens))
        for r, res in enumerate(results):
            got, tag = res["fwd"][c_i], f"layer {c_i} rank {r}"
            lay = want["layout"][r]
            assert_exact(got["layout"][0], lay.num_tokens_per_rank, f"{tag} num_tokens_per_rank")
            assert_exact(got["layout"][1], lay.num_tokens_per_expert, f"{tag} per expert")
            assert_exact(got["layout"][2], lay.is_token_in_rank, f"{tag} is_token_in_rank")
            assert got["n_rdma"] is None
            d = want["disp"][r]
            assert_exact(got["recv_x"], d.recv_x, f"{tag} recv_x")
            assert_exact(got["recv_idx"], d.recv_topk_idx, f"{tag} recv_topk_idx")
            assert_exact(got["recv_w"], d.recv_topk_weights, f"{tag} recv_topk_weights")
            assert got["counts"] == list(d.num_recv_tokens_per_expert), tag
            assert_exact(got["cx"], want["comb"][r][0], f"{tag} combined_x")
            assert_exact(got["cw"], want["comb"][r][1], f"{tag} combined_w")
            assert_exact(got["cached_x"], want["cached"][r].recv_x, f"{tag} cached recv_x")
            assert got["cached_rest"] == (None, None, None, None)
            b = res["bwd"][c_i]
            assert_exact(b["recv_x"], want["cached"][r].recv_x, f"{tag} backward recv_x")
            assert_exact(b["cx"], back[r][0], f"{tag} backward combined_x")
            assert b["cw"] is None
    # One daemon group per (hidden, top-k) shape; layouts reuse them (a layout before any
    # dispatch of its top-k forms the hidden-128 group, which is one of the four here).
    assert [res["groups"] for res in results] == [4, 4]
