"""Stream-ordered normal-mode calls on the CUDA engine (client/stream_calls.py,
server/engine/stream_calls.py), through the daemon, the way callers use them: one group for many
layers and shapes, fresh inputs per layer, handles held across layers and combined in reverse
(Megatron's backward), engine buffers poisoned between calls, every output compared exactly with
the NumPy reference. Plus: the host does not wait for the GPU in layout/combine, a bad expert id
on one rank fails that dispatch on every rank alike (a worst-case one at the next dispatch; a
layout's is the rank's alone, raised by check()), so does a dispatch one rank's engine refuses,
a combine one rank's engine refuses fails at once on the others (raised by their check()), and
the group goes on, and num_sms reaches the kernels."""

from __future__ import annotations

import time

import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Workload

from .test_daemon import _bits, _doubled, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
LAYERS = 6
SHAPES = [(96, 33), (0, 5), (200, 200), (17, 0)]  # tokens of rank 0, rank 1 per layer kind


def _workload(layer: int) -> Workload:
    t0, t1 = SHAPES[layer % len(SHAPES)]
    return Workload(2, [t0, t1], 1024, 16, 4, seed=100 + layer, drop_prob=0.1)


def _reference(wl: Workload) -> tuple[list, list, list]:
    """(every rank's topk_idx, the reference's dispatch and its combine of the workload)."""
    xs, idx, w = (list(v) for v in zip(*wl.all_inputs(), strict=True))
    disp = ref.dispatch(xs, idx, w, wl.num_experts)
    comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    return idx, disp, comb


def _rank(rank: int, socket: str, device: int, q) -> None:
    import os

    import torch

    # The daemon's layout path (test_local_layout.py covers the default, the caller's stream).
    os.environ["EPD_LOCAL_LAYOUT"] = "0"

    from epd.client import EpdError, Session
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "layers": []}
    with Session(socket, client_name=f"so-{rank}", timeout=30) as s:
        g = s.join("stream-ordered", rank=rank, num_ranks=2, num_experts=16, hidden=1024,
                   max_tokens_per_rank=256, num_topk=4, timeout=30)
        held = []
        for layer in range(LAYERS):
            wl = _workload(layer)
            x, idx, w = wl.inputs(rank)
            tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
            # Poison the engine's receive buffers (copy=False views of them).
            if layer:
                poison = g.dispatch(tx, tidx, tw, copy=False)
                poison.recv_x.view(torch.int16).fill_(-1)
                poison.recv_topk_idx.fill_(77)
                poison.recv_src_idx.fill_(-5)
            n_rank, n_expert, in_rank = g.get_dispatch_layout(tidx)
            out = g.dispatch(tx, tidx, tw, expert_alignment=2)
            cached = g.dispatch(tx * 2, handle=out.handle)  # (other rows: doubled)
            held.append((layer, out, cached, tw))
            res["layers"].append({
                "n_rank": _bits(n_rank), "n_expert": _bits(n_expert),
                "in_rank": _bits(in_rank), "recv_x": _bits(out.recv_x),
                "recv_idx": _bits(out.recv_topk_idx), "recv_w": _bits(out.recv_topk_weights),
                "src_idx": _bits(out.recv_src_idx), "prefix": _bits(out.rank_prefix_matrix),
                "counts": out.num_recv_tokens_per_expert, "cached": _bits(cached.recv_x)})
        # Backward: combine every layer's rows in reverse, handles held all along; the
        # outputs of the dispatches above must still hold their data (new tensors).
        combined = {}
        for layer, out, _cached, _tw in reversed(held):
            assert np.array_equal(_bits(out.recv_x), res["layers"][layer]["recv_x"])
            cx, cw = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
            combined[layer] = (_bits(cx), _bits(cw))
        res["combined"] = combined
        # The host does not wait for the GPU: a layout and a combine behind 200 ms of GPU
        # sleep return long before it ends; the results are right afterwards.
        wl = _workload(0)
        x, idx, w = wl.inputs(rank)
        tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
        out = g.dispatch(tx, tidx, tw)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(200e-3 * 1.98e9))  # ~200 ms at the H200's clock
        t0 = time.perf_counter()
        n_rank, _, _ = g.get_dispatch_layout(tidx)
        cx, _ = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
        res["host_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res["gpu_s"] = time.perf_counter() - t1
        res["late_n_rank"], res["late_cx"] = _bits(n_rank), _bits(cx)
        # A bad expert id on rank 1 only: notify fails the dispatch on every rank alike,
        # raised by the call itself, naming rank 1 and the id; the group goes on.
        bad = tidx.clone()
        if rank == 1 and bad.shape[0]:
            bad[0, 0] = 1000

        def outcome(call) -> str:
            try:
                call()
                torch.cuda.synchronize()
                return "OK"
            except EpdError as e:
                return f"{e.code.name}: {e.details}"
        res["bad"] = outcome(lambda: g.dispatch(tx, bad, tw, num_sms=2))
        # The daemon's layout of the same ids first: its failure is this rank's alone and is
        # not raised at the dispatch (which fails alike), nor again at check() afterwards.
        res["bad_layout_then_dispatch"] = outcome(
            lambda: (g.get_dispatch_layout(bad), g.dispatch(tx, bad, tw)))
        res["check_after_dispatch"] = outcome(g.check)
        # A layout's bad id alone: raised by check() on rank 1 only.
        res["bad_layout_check"] = outcome(lambda: (g.get_dispatch_layout(bad),
                                                   torch.cuda.synchronize(), g.check()))
        # A worst-case dispatch of it: returns on every rank, its combine is skipped, and the
        # next dispatch raises it on every rank before it is sent.
        wc = g.dispatch(tx, bad, tw, num_worst_tokens=512)
        g.combine(wc.recv_x, wc.handle, topk_weights=wc.recv_topk_weights)
        res["bad_worst_next"] = outcome(lambda: g.dispatch(tx, tidx, tw))
        # A dispatch rank 1's engine refuses (float16 weights): rank 1 gets the reason, and
        # its part is taken with no tokens, so rank 0 fails at once (not at its deadline).
        t0 = time.perf_counter()
        res["one_refused"] = outcome(lambda: g.dispatch(tx, tidx, tw.half() if rank else tw))
        res["one_refused_s"] = time.perf_counter() - t0
        again = g.dispatch(tx, tidx, tw, num_sms=1)
        res["again_x"] = _bits(again.recv_x)
        # Normal mode inside a CUDA graph capture is refused before anything reaches the
        # engine (it runs a call's kernels once, not per replay); the group goes on.
        res["captured"] = {}
        for what, call in (("layout", lambda: g.get_dispatch_layout(tidx)),
                           ("dispatch", lambda: g.dispatch(tx, tidx, tw)),
                           ("combine", lambda: g.combine(again.recv_x, again.handle))):
            torch.cuda.synchronize()
            try:
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    call()
                res["captured"][what] = "no error"
            except EpdError as e:
                res["captured"][what] = e.code.name
        after = g.dispatch(tx, tidx, tw)
        res["after_capture_x"] = _bits(after.recv_x)
        # A combine the engine refuses (x one row short, on both ranks: no rank waits for
        # the other) raises at the call, naming the shape; the group goes on, exact.
        try:
            g.combine(after.recv_x[:-1] if after.recv_x.shape[0] else
                      torch.empty((1, 1024), dtype=after.recv_x.dtype, device=device),
                      after.handle)
            res["refused"] = "no error"
        except EpdError as e:
            res["refused"], res["refused_msg"] = e.code.name, e.message
        cx, _ = g.combine(after.recv_x, after.handle, topk_weights=after.recv_topk_weights)
        res["after_refusal_cx"] = _bits(cx)
        # A combine only rank 1's engine refuses (x one row short there): rank 1 gets the
        # reason at the call, its part is taken pushing nothing, so rank 0's combine ends at
        # once (not at its deadline) and its check() names rank 1; the group goes on, exact.
        one = g.dispatch(tx, tidx, tw)
        short = (one.recv_x[:-1] if one.recv_x.shape[0] else
                 torch.empty((1, 1024), dtype=one.recv_x.dtype, device=device))
        junk = torch.full(tuple(tx.shape), -1.0, dtype=tx.dtype, device=device)
        del junk  # (its block, -1s, is what the combine's new output tensor likely gets)
        t0 = time.perf_counter()
        got: list = []
        res["one_combine"] = outcome(lambda: got.append(g.combine(
            short if rank else one.recv_x, one.handle)))
        res["one_combine_s"] = time.perf_counter() - t0
        # (rank 0's output of it: zeros, not what its new tensor held)
        res["one_combine_zeros"] = bool(got) and not bool(got[0][0].view(torch.int16).any())
        res["one_combine_next"] = outcome(lambda: g.dispatch(tx, tidx, tw))  # (not raised)
        res["one_combine_check"] = outcome(g.check)
        cx, _ = g.combine(one.recv_x, one.handle, topk_weights=one.recv_topk_weights)
        res["after_one_combine_cx"] = _bits(cx)
        # Two combines rank 1's engine refuses back to back while rank 0's stream is ~200 ms
        # behind: each refused part waits at the combine's entry barrier, so the second does
        # not overwrite the first's verdict before rank 0 reduced it; rank 0's check() after
        # each of its combines names rank 1.
        if rank == 0:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(200e-3 * 1.98e9))
        for key in ("two_a", "two_b"):
            res[key] = outcome(lambda: g.combine(short if rank else one.recv_x, one.handle))
            res[key + "_check"] = outcome(g.check)
        cx, _ = g.combine(one.recv_x, one.handle, topk_weights=one.recv_topk_weights)
        res["after_two_cx"] = _bits(cx)
    q.put(res)


def test_stream_ordered_layers(daemon) -> None:
    results = _spawn_ranks(daemon, _rank, 2)
    for layer in range(LAYERS):
        wl = _workload(layer)
        xs, idx, w = (list(v) for v in zip(*wl.all_inputs(), strict=True))
        disp = ref.dispatch(xs, idx, w, wl.num_experts, expert_alignment=2)
        comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                           recv_topk_weights=[d.recv_topk_weights for d in disp])
        for r, res in enumerate(results):
            got = res["layers"][layer]
            lay = ref.get_dispatch_layout(idx[r], wl.num_experts, 2)
            np.testing.assert_array_equal(got["n_rank"], lay.num_tokens_per_rank)
            np.testing.assert_array_equal(got["n_expert"], lay.num_tokens_per_expert)
            np.testing.assert_array_equal(got["in_rank"], lay.is_token_in_rank)
            np.testing.assert_array_equal(got["recv_x"], disp[r].recv_x.view(np.uint16))
            np.testing.assert_array_equal(got["recv_idx"], disp[r].recv_topk_idx)
            np.testing.assert_array_equal(got["recv_w"], disp[r].recv_topk_weights)
            np.testing.assert_array_equal(got["src_idx"], disp[r].recv_src_idx)
            # prefix[s][d]: rows from sources <= s received by d (DeepEP's rank_prefix_matrix)
            prefix = [[int(disp[d].src_offsets[src + 1]) for d in range(2)] for src in range(2)]
            np.testing.assert_array_equal(got["prefix"], np.array(prefix, np.int32))
            assert got["counts"] == disp[r].num_recv_tokens_per_expert
            np.testing.assert_array_equal(got["cached"], _doubled(disp[r].recv_x))
            cx, cw = res["combined"][layer]
            np.testing.assert_array_equal(cx, comb[r][0].view(np.uint16))
            np.testing.assert_array_equal(cw, comb[r][1])
    wl = _workload(0)
    xs, idx, w = (list(v) for v in zip(*wl.all_inputs(), strict=True))
    _, disp, comb = _reference(wl)
    for r, res in enumerate(results):
        assert res["host_s"] < 0.1 < res["gpu_s"] + res["host_s"], res
        lay = ref.get_dispatch_layout(idx[r], wl.num_experts, 2)
        np.testing.assert_array_equal(res["late_n_rank"], lay.num_tokens_per_rank)
        np.testing.assert_array_equal(res["late_cx"], comb[r][0].view(np.uint16))
    # The bad id: every rank's dispatch fails naming rank 1 and the id; a layout's alone is
    # rank 1's (check()); a worst-case dispatch's raises at the next dispatch on every rank.
    named = "INVALID_ARGUMENT: group 'stream-ordered', dispatch #"
    for r, res in enumerate(results):
        for key in ("bad", "bad_layout_then_dispatch", "bad_worst_next"):
            assert res[key].startswith(named), (r, key, res[key])
            assert "rank 1 passed expert id 1000 in topk_idx" in res[key], (r, key, res[key])
            assert "no rank's dispatch ran and the group goes on" in res[key], (r, key)
        assert "num_worst_tokens" in res["bad_worst_next"], (r, res["bad_worst_next"])
        assert res["check_after_dispatch"] == "OK", (r, res["check_after_dispatch"])
    # The refused part: rank 1 the reason, rank 0 a failure naming rank 1, at once.
    assert results[1]["one_refused"].startswith("INVALID_ARGUMENT"), results[1]
    assert "topk_weights" in results[1]["one_refused"], results[1]["one_refused"]
    assert results[0]["one_refused"].startswith("FAILED_PRECONDITION"), results[0]
    assert "rank 1's engine refused its part" in results[0]["one_refused"], results[0]
    assert results[0]["one_refused_s"] < 10, results[0]["one_refused_s"]  # (deadline: 30 s)
    assert results[0]["bad_layout_check"] == "OK", results[0]["bad_layout_check"]
    assert results[1]["bad_layout_check"].startswith("INVALID_ARGUMENT"), results[1]
    assert "rank 1 passed expert id 1000" in results[1]["bad_layout_check"], results[1]
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["again_x"], disp[r].recv_x.view(np.uint16))
        assert res["captured"] == dict.fromkeys(("layout", "dispatch", "combine"),
                                                "FAILED_PRECONDITION"), res["captured"]
        np.testing.assert_array_equal(res["after_capture_x"], disp[r].recv_x.view(np.uint16))
    for r, res in enumerate(results):
        assert res["refused"] == "INVALID_ARGUMENT", res
        assert "combine x has shape" in res["refused_msg"], res
        np.testing.assert_array_equal(res["after_refusal_cx"], comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(res["after_one_combine_cx"], comb[r][0].view(np.uint16))
        assert res["one_combine_next"] == "OK", (r, res["one_combine_next"])
    # The combine rank 1's engine alone refused: rank 1 the reason at the call, rank 0 a
    # failure naming rank 1 at check() (its combine and next dispatch returned), at once.
    assert results[1]["one_combine"].startswith("INVALID_ARGUMENT"), results[1]["one_combine"]
    assert "combine x has shape" in results[1]["one_combine"], results[1]["one_combine"]
    assert results[1]["one_combine_check"] == "OK", results[1]["one_combine_check"]
    assert results[0]["one_combine"] == "OK", results[0]["one_combine"]
    assert results[0]["one_combine_check"].startswith("FAILED_PRECONDITION"), results[0]
    assert "rank 1's engine refused its part of the combine" in results[0]["one_combine_check"]
    assert results[0]["one_combine_s"] < 10, results[0]["one_combine_s"]  # (deadline: 30 s)
    assert results[0]["one_combine_zeros"], "rank 0's refused combine is not zeros"
    for key in ("two_a", "two_b"):
        assert results[1][key].startswith("INVALID_ARGUMENT"), (key, results[1][key])
        assert results[1][key + "_check"] == "OK", (key, results[1][key + "_check"])
        assert results[0][key] == "OK", (key, results[0][key])
        assert "rank 1's engine refused its part of the combine" in results[0][key + "_check"]
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["after_two_cx"], comb[r][0].view(np.uint16))



def _rank_mixed(rank: int, socket: str, device: int, q) -> None:
    """A synchronous call (dispatch_async) after stream-ordered calls the client's stream has
    not reached yet (they wait behind ~1 s of GPU sleep): with a short deadline it fails with
    DEADLINE_EXCEEDED and changes nothing (the engine waits for the READY word on the host, with
    the call's deadline, instead of synchronising its stream behind it without one); with a
    long one it waits for the stream and is exact; the group goes on."""
    import torch

    from epd.client import EpdError, Session
    torch.cuda.set_device(device)
    res: dict = {"rank": rank}
    wl = _workload(0)
    x, idx, w = wl.inputs(rank)
    tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
    with Session(socket, client_name=f"mixed-{rank}", timeout=30) as s:
        g = s.join("stream-mixed", rank=rank, num_ranks=2, num_experts=16, hidden=1024,
                   max_tokens_per_rank=256, num_topk=4, timeout=30)
        out = g.dispatch(tx, tidx, tw)
        torch.cuda.synchronize()
        for deadline in (0.3, 30.0):
            torch.cuda._sleep(int(1.0 * 1.98e9))  # ~1 s at the H200's clock
            cx, _ = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
            t0 = time.perf_counter()
            try:
                got = g.dispatch_async(tx, tidx, tw, timeout=deadline).result()
                res[f"async_{deadline}"] = "OK"
                res[f"async_{deadline}_x"] = _bits(got.recv_x)
            except EpdError as e:
                res[f"async_{deadline}"], res[f"async_{deadline}_msg"] = e.code.name, e.details
            res[f"async_{deadline}_s"] = time.perf_counter() - t0
            torch.cuda.synchronize()
            res[f"cx_{deadline}"] = _bits(cx)
        again = g.dispatch(tx, tidx, tw)
        res["again_x"] = _bits(again.recv_x)
    q.put(res)


def test_synchronous_call_behind_unstarted_stream_calls(daemon) -> None:
    results = _spawn_ranks(daemon, _rank_mixed, 2)
    _, disp, comb = _reference(_workload(0))
    for r, res in enumerate(results):
        assert res["async_0.3"] == "DEADLINE_EXCEEDED", res
        assert "has not started" in res["async_0.3_msg"], res
        assert res["async_0.3_s"] < 0.9, res  # at its deadline, not behind the GPU's sleep
        assert res["async_30.0"] == "OK", res
        np.testing.assert_array_equal(res["async_30.0_x"], disp[r].recv_x.view(np.uint16))
        for d in ("0.3", "30.0"):
            np.testing.assert_array_equal(res[f"cx_{d}"], comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(res["again_x"], disp[r].recv_x.view(np.uint16))
