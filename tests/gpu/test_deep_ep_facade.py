"""The DeepEP V1 facade on the CUDA engine, called as frameworks call it: one Buffer for many
layers, `async_finish=True` with `previous_event` from `capture()` (events on the facade's comm
stream, Megatron/SGLang style), handles held across layers and indexed as DeepEP's tuple, a
cached dispatch, combine in reverse layer order; every output exact against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Workload

from .test_daemon import _bits, _doubled, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
LAYERS = 6


def _scaled(x: np.ndarray, layer: int) -> np.ndarray:
    """Layer `layer`'s input: x times (layer + 1), rounded to x's dtype on the host."""
    return (x.astype(np.float32) * (layer + 1)).astype(x.dtype)


def _facade_rank(rank: int, socket: str, device: int, wl: Workload, q) -> None:
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    x, idx, w = wl.inputs(rank)
    res: dict = {"rank": rank, "layers": []}
    with Session(socket, client_name=f"facade-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=wl.num_ranks, session=s,
                     group_name="gpu-facade", max_tokens_per_rank=max(wl.tokens))
        held = []
        for layer in range(LAYERS):
            tx = _to_torch(_scaled(x, layer), device)
            tidx, tw = _to_torch(idx, device), _to_torch(w, device)
            before = buf.capture()
            n_rank, _, n_expert, in_rank, ev = buf.get_dispatch_layout(
                tidx, wl.num_experts, previous_event=before, async_finish=True)
            recv_x, recv_idx, recv_w, counts, handle, ev = buf.dispatch(
                tx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_expert, topk_idx=tidx, topk_weights=tw,
                previous_event=ev, async_finish=True, allocate_on_comm_stream=True)
            ev.current_stream_wait()
            held.append((layer, recv_x, recv_idx, recv_w, list(counts), handle))
        for layer, recv_x, recv_idx, recv_w, counts, handle in reversed(held):
            again, *_ = buf.dispatch(_to_torch(_scaled(x, layer), device), handle=handle)
            combined, combined_w, ev = buf.combine(recv_x, handle, topk_weights=recv_w,
                                                   async_finish=True)
            ev.current_stream_wait()
            torch.cuda.synchronize(device)
            res["layers"].append({
                "layer": layer, "counts": counts, "recv_x": _bits(recv_x),
                "recv_idx": recv_idx.cpu().numpy(),
                "prefix": np.asarray(handle[0].cpu() if hasattr(handle[0], "cpu")
                                     else handle[0]),
                "again": _bits(again), "combined": _bits(combined),
                "combined_w": combined_w.cpu().numpy()})
        buf.destroy()
    q.put(res)


def test_facade_v1_pattern_with_events(daemon) -> None:
    wl = Workload(2, [96, 57], 2048, 32, 4, seed=11, drop_prob=0.05)
    results = _spawn_ranks(daemon, _facade_rank, 2, wl)
    inputs = wl.all_inputs()
    for layer in range(LAYERS):
        xs = [_scaled(i[0], layer) for i in inputs]
        idx, w = [i[1] for i in inputs], [i[2] for i in inputs]
        disp = ref.dispatch(xs, idx, w, wl.num_experts)
        comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                           recv_topk_weights=[d.recv_topk_weights for d in disp])
        for r, res in enumerate(results):
            got = next(g for g in res["layers"] if g["layer"] == layer)
            np.testing.assert_array_equal(got["recv_x"], disp[r].recv_x.view(np.uint16))
            np.testing.assert_array_equal(got["recv_idx"], disp[r].recv_topk_idx)
            assert got["counts"] == disp[r].num_recv_tokens_per_expert
            np.testing.assert_array_equal(got["again"], disp[r].recv_x.view(np.uint16))
            in_rank = [ref.get_dispatch_layout(i, wl.num_experts, 2).is_token_in_rank
                       for i in idx]
            prefix = np.cumsum([m.sum(axis=0) for m in in_rank], axis=0)
            np.testing.assert_array_equal(got["prefix"], prefix)  # handle[0]
            np.testing.assert_array_equal(got["combined"], comb[r][0].view(np.uint16))
            np.testing.assert_array_equal(got["combined_w"], comb[r][1])


# Token growth on the CUDA engine (issue 11): (tokens per rank) of each layer; the Buffer starts
# at 64 tokens per rank and grows to hold the largest call (at least doubling).
GROWTH = [(40, 30), (150, 20), (10, 300), (64, 64)]
GROWTH_CAPS = [64, 150, 300, 300]


def _growth_workload(i: int) -> Workload:
    return Workload(2, list(GROWTH[i]), 1024, 16, 4, seed=300 + i, drop_prob=0.05)


def _growing_rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "layers": [], "caps": []}
    with Session(socket, client_name=f"grow-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=2, session=s, group_name="gpu-grow",
                     max_tokens_per_rank=64)
        held = None
        for i in range(len(GROWTH)):
            x, idx, w = _growth_workload(i).inputs(rank)
            tx, tidx, tw = (_to_torch(a, device) for a in (x, idx, w))
            n_rank, _, n_expert, in_rank, ev = buf.get_dispatch_layout(
                tidx, 16, previous_event=buf.capture(), async_finish=True)
            recv_x, _, recv_w, counts, handle, ev = buf.dispatch(
                tx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_expert, topk_idx=tidx, topk_weights=tw,
                previous_event=ev, async_finish=True)
            ev.current_stream_wait()
            again, *_ = buf.dispatch(tx * 2, handle=handle)  # (other rows: doubled)
            got = {"layout": (n_rank.cpu().numpy(), n_expert.cpu().numpy(),
                              in_rank.cpu().numpy()),
                   "recv_x": _bits(recv_x), "counts": list(counts), "again": _bits(again)}
            if i == 0:
                held = (recv_x, recv_w, handle)
            else:
                combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
                got.update(combined=_bits(combined), combined_w=combined_w.cpu().numpy())
            torch.cuda.synchronize(device)
            res["layers"].append(got)
            res["caps"].append(buf.max_tokens_per_rank)
        recv_x, recv_w, handle = held
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        torch.cuda.synchronize(device)
        res["held"] = (_bits(combined), combined_w.cpu().numpy())
        buf.destroy()
    q.put(res)


def test_token_capacity_grows_on_the_cuda_engine(daemon) -> None:
    """A dispatch with more tokens than the groups hold (on either rank) fails in the notify
    kernel on every rank, and the facade grows the group and calls again; a layout beyond the
    capacity is computed in the caller's process; a handle made before the growth combines
    after it. Every output exact against the reference."""
    results = _spawn_ranks(daemon, _growing_rank, 2)
    for i in range(len(GROWTH)):
        wl = _growth_workload(i)
        inputs = wl.all_inputs()
        xs, idx, w = ([inp[j] for inp in inputs] for j in range(3))
        disp = ref.dispatch(xs, idx, w, wl.num_experts)
        comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                           recv_topk_weights=[d.recv_topk_weights for d in disp])
        for r, res in enumerate(results):
            assert res["caps"] == GROWTH_CAPS, res["caps"]
            got, tag = res["layers"][i], f"layer {i} rank {r}"
            lay = ref.get_dispatch_layout(idx[r], wl.num_experts, 2)
            np.testing.assert_array_equal(got["layout"][0], lay.num_tokens_per_rank, tag)
            np.testing.assert_array_equal(got["layout"][1], lay.num_tokens_per_expert, tag)
            np.testing.assert_array_equal(got["layout"][2], lay.is_token_in_rank, tag)
            np.testing.assert_array_equal(got["recv_x"], disp[r].recv_x.view(np.uint16), tag)
            assert got["counts"] == disp[r].num_recv_tokens_per_expert, tag
            np.testing.assert_array_equal(got["again"], _doubled(disp[r].recv_x), tag)
            want = comb[r] if i else None
            if i:
                np.testing.assert_array_equal(got["combined"], want[0].view(np.uint16), tag)
                np.testing.assert_array_equal(got["combined_w"], want[1], tag)
            else:
                np.testing.assert_array_equal(res["held"][0], comb[r][0].view(np.uint16), tag)
                np.testing.assert_array_equal(res["held"][1], comb[r][1], tag)
