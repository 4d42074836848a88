"""Plain low-latency calls through the DeepEP facade on the CUDA engine (issue 10): every call
goes through an armed op (no round trip to the daemon once its tensors were seen), outputs are
the caller's own and stay valid while held, ops are evicted LRU (a tiny limit here, so the
eviction path runs), a bad expert id fails that dispatch on every rank alike (raised at
`Buffer.check()`) and the calls after it are exact, a bad entry in a combine's own top-k fails
that rank's combine alone, and a call captured into a CUDA graph on its first appearance (no
earlier call on those tensors) works."""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import numpy as np
import pytest

from epd.proto.dtypes import BFLOAT16
from epd.server import config
from epd.server import reference as ref
from epd.server.cli import build_parser

from .common import ll_combined
from .conftest import GPU_COUNT
from .test_daemon import _bits, _check_ll, _compact, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
R, E, K, H, M = 2, 32, 4, 2048, 32
LX = E // R
# (tokens of rank 0, tokens of rank 1, fp8) per layer; layers 4 and 5 reuse layer 3's tensors
LAYERS = [(32, 17, False), (9, 32, True), (1, 25, False), (32, 31, True), (32, 31, True),
          (32, 31, False)]
REUSE = {4: 3, 5: 3}


def _inputs(layer: int, rank: int, tokens: int):
    rng = np.random.default_rng([909, layer, rank])
    idx, w = ref.random_routing(rng, tokens, E, K, drop_prob=0.1)
    return ref.random_x(rng, tokens, H, BFLOAT16), idx, w


def _expert_value(e: int) -> float:
    return (e % 8 + 1) / 8  # exact in bf16


def _combined(xs, idx, w, rank: int, identity: bool) -> np.ndarray:
    """Reference combine: identity experts, or each expert's `_expert_value` on every column."""
    return ll_combined(xs[rank], idx[rank], w[rank], None if identity else _expert_value)


# A combine whose own top-k is bad (after the dispatches' bad ids): (step, rank, token, plain or
# hook); step 3 names an expert the dispatch did not send the token to, step 4 one twice.
BAD_COMBINES = ((3, 0, 2, False), (4, 1, 1, True))


def _spoiled(step: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(the combine top-k sent, the reference's with the bad entry left out, its expert) of
    step 3's or step 4's bad combine, from its dispatch's `idx`."""
    _, _, t, _ = next(b for b in BAD_COMBINES if b[0] == step)
    sent, kept = idx.copy(), idx.copy()
    k0 = int(np.flatnonzero(idx[t, :K - 1] >= 0)[0])  # (the kernels flag a repeat's later k)
    ex = (next(x for x in range(E) if x not in idx[t]) if step == 3 else int(idx[t, k0]))
    sent[t, K - 1], kept[t, K - 1] = ex, -1
    return sent, kept, ex


def _plain_rank(rank: int, socket: str, device: int, q) -> None:
    os.environ["EPD_LL_PLAIN_OPS"] = "3"  # evictions every few layers
    import torch

    from epd.client import EpdError, Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "layers": []}
    with Session(socket, client_name=f"gpu-ll-plain-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=R, session=s, low_latency_mode=True,
                     group_name="gpu-ll-plain")
        values = torch.tensor([_expert_value(rank * LX + le) for le in range(LX)],
                              dtype=torch.bfloat16, device=device)
        held, tensors = [], {}
        for layer, (t0, t1, fp8) in enumerate(LAYERS):
            t = (t0, t1)[rank]
            x, idx, w = _inputs(layer, rank, t)
            if layer in REUSE:  # the same tensors, new contents: the armed op again
                tx, tidx, tw = tensors[REUSE[layer]]
                tx.copy_(_to_torch(x, device))
                tidx.copy_(_to_torch(idx, device))
                tw.copy_(_to_torch(w, device))
            else:
                tx, tidx, tw = (_to_torch(a, device) for a in (x, idx, w))
            tensors[layer] = (tx, tidx, tw)
            recv, count, handle, _, hook = buf.low_latency_dispatch(
                tx, tidx, M, E, use_fp8=fp8)
            assert hook is None
            # fp8: each expert returns its value; bf16: identity experts (the received
            # rows are the caller's own tensor)
            y = values[:, None, None].expand(LX, R * M, H).contiguous() if fp8 else recv
            cx, _, _ = buf.low_latency_combine(y, tidx, tw, handle)
            held.append((recv, count, handle, cx))
        torch.cuda.synchronize()
        buf.check()
        res["armed"] = len(buf._stream_ops)
        # whether the engine ran these ops on a GPU chain (--ll-chain on, or auto under MPS)
        res["chained"] = any(getattr(h.handle, "chained", False) for _, _, h, _ in held)
        for recv, count, handle, cx in held:  # every layer's outputs, read at the end
            rx, scales = recv if isinstance(recv, tuple) else (recv, None)
            out = SimpleNamespace(recv_x=rx, recv_count=count, recv_x_scales=scales,
                                  recv_src_rank=handle.src_rank, recv_src_idx=handle.src_idx)
            res["layers"].append({"compact": _compact(out, LX), "cx": _bits(cx),
                                  "layout_range": handle[1].cpu().numpy()})
        # Bad input fails a dispatch on both ranks alike (nothing moves, its combine gives
        # zeros) and the group goes on: the next layer is exact on both, and Buffer.check()
        # after a synchronise raises it on both, once. Rank 0: an id out of range (plain
        # calls); rank 1: an expert twice in a token (plain), then an id below -1 (hooks).
        def layer0():
            x, idx, w = _inputs(0, rank, LAYERS[0][rank])
            return tuple(_to_torch(a, device) for a in (x, idx, w))

        def run(tx, tidx, tw, hook=False, cidx=None):
            recv, count, handle, _, h = buf.low_latency_dispatch(tx, tidx, M, E, use_fp8=False,
                                                                 return_recv_hook=hook)
            if hook:
                h()
            cx, _, h = buf.low_latency_combine(recv, tidx if cidx is None else cidx, tw, handle,
                                               return_recv_hook=hook)
            if hook:
                h()
            return recv, count, handle, cx

        def outputs(recv, count, handle, cx):
            out = SimpleNamespace(recv_x=recv, recv_count=count, recv_x_scales=None,
                                  recv_src_rank=handle.src_rank, recv_src_idx=handle.src_idx)
            return {"compact": _compact(out, LX), "cx": _bits(cx)}

        def goes_on(step, hook):
            """The group goes on: the next layer (nothing raised at the call), then
            Buffer.check() raises the step's failure, once."""
            got = run(*layer0(), hook=hook)
            torch.cuda.synchronize()
            res[f"after{step}"] = outputs(*got)
            try:
                buf.check()
                res[f"bad{step}"] = "accepted"
            except EpdError as e:
                res[f"bad{step}"] = (e.code.name, e.details)
            buf.check()  # (once)

        for step, (who, bad_at) in enumerate(((0, (0, 0)), (1, (3, 1)), (1, (6, 1)))):
            hook = step == 2
            x, idx, w = _inputs(99 + step, rank, 8)
            if rank == who and step == 1:
                idx[bad_at[0], :2] = 5  # (named twice, whatever the router dropped)
            elif rank == who:
                idx[bad_at] = (E + 3, None, -3)[step]
            _, count, _, cx = run(*(_to_torch(a, device) for a in (x, idx, w)), hook=hook)
            torch.cuda.synchronize()  # (hook outputs are views: read before the next call)
            res[f"bad{step}_outputs"] = (int(count.sum()), bool((cx == 0).all()))
            goes_on(step, hook)
        # A bad entry in a combine's own top-k fails that rank's combine alone (raised at its
        # check), leaves the entry out of its sum; the other rank's is exact; a good combine of
        # the same handle after it is exact and raises nothing (its verdict was cleared); the
        # group goes on.
        for step, who, _, hook in BAD_COMBINES:
            x, idx, w = _inputs(99 + step, rank, 8)
            cidx = _spoiled(step, idx)[0] if rank == who else idx
            tx, tidx, tw = (_to_torch(a, device) for a in (x, idx, w))
            recv, _, handle, cx = run(tx, tidx, tw, hook=hook, cidx=_to_torch(cidx, device))
            torch.cuda.synchronize()
            res[f"bad{step}_cx"] = _bits(cx)
            cx, _, h = buf.low_latency_combine(recv, tidx, tw, handle, return_recv_hook=hook)
            if hook:
                h()
            torch.cuda.synchronize()
            res[f"again{step}_cx"] = _bits(cx)
            goes_on(step, hook)
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_plain_low_latency_calls_through_armed_ops(daemon) -> None:
    results = _spawn_ranks(daemon, _plain_rank, R)
    for layer, (t0, t1, fp8) in enumerate(LAYERS):
        inputs = [_inputs(layer, r, (t0, t1)[r]) for r in range(R)]
        xs, idx, w = ([i[j] for i in inputs] for j in range(3))
        exp = ref.low_latency_dispatch(xs, idx, E, M, use_fp8=fp8)
        for r in range(R):
            got = results[r]["layers"][layer]
            _check_ll(exp[r], got["compact"], LX)
            # DeepEP's handle[1]: (begin << 32) | count of each source's rows, sources in order
            count = np.array([[(idx[s] == r * LX + le).sum() for s in range(R)]
                              for le in range(LX)], np.int64)
            begin = np.where(count > 0, np.cumsum(count, axis=1) - count, 0)  # (0 if empty)
            np.testing.assert_array_equal(got["layout_range"], (begin << 32) | count)
            np.testing.assert_array_equal(got["cx"], _combined(xs, idx, w, r, not fp8),
                                          err_msg=f"layer {layer} rank {r}")
    for r in range(R):
        assert results[r]["armed"] <= 3 + 2  # the LRU bound held
    inputs = [_inputs(0, r, LAYERS[0][r]) for r in range(R)]
    xs, idx, w = ([i[j] for i in inputs] for j in range(3))
    exp = ref.low_latency_dispatch(xs, idx, E, M)
    for r in range(R):  # both ranks raised the same failures, and went on exact
        code, msg = results[r]["bad0"]
        assert code == "INVALID_ARGUMENT" and f"rank 0 passed expert id {E + 3}" in msg, msg
        assert "topk_idx[0]" in msg and "group goes on" in msg, msg
        code, msg = results[r]["bad1"]
        assert code == "INVALID_ARGUMENT", msg
        assert "rank 1's topk_idx[3] names expert 5 twice" in msg, msg
        code, msg = results[r]["bad2"]
        assert code == "INVALID_ARGUMENT", msg
        assert "rank 1 passed expert id -3 in topk_idx[6]" in msg, msg
        for step in (0, 1, 2):
            assert results[r][f"bad{step}_outputs"] == (0, True), results[r]
        for step in (0, 1, 2, 3, 4):
            _check_ll(exp[r], results[r][f"after{step}"]["compact"], LX)
            np.testing.assert_array_equal(results[r][f"after{step}"]["cx"],
                                          _combined(xs, idx, w, r, True))
    for step, who, t, _ in BAD_COMBINES:  # only the rank whose combine top-k was bad raised
        for r in range(R):
            x, i, wt = _inputs(99 + step, r, 8)
            kept = i
            if r == who:
                _, kept, ex = _spoiled(step, i)
                code, msg = results[r][f"bad{step}"]
                why = "its dispatch did not send" if step == 3 else "named twice"
                assert code == "INVALID_ARGUMENT", msg
                assert f"rank {who}'s topk_idx[{t}] names expert {ex}, {why}" in msg, msg
                assert "other ranks' combines are exact" in msg, msg
            else:
                assert results[r][f"bad{step}"] == "accepted", results[r][f"bad{step}"]
            np.testing.assert_array_equal(results[r][f"bad{step}_cx"],
                                          ll_combined(x, kept, wt), err_msg=f"step {step}")
            np.testing.assert_array_equal(results[r][f"again{step}_cx"],
                                          ll_combined(x, i, wt), err_msg=f"step {step} again")
    # With the poller, the engine timed each armed op's host hop (its detection gap and the
    # launch); on the GPU chain (--ll-chain) the engine's host launched none of them.
    from epd.server.bench import engine_host
    host = engine_host.totals(daemon.get("/metrics")[1])
    chained = {r["chained"] for r in results}
    assert len(chained) == 1, "both ranks' ops run on chains, or neither's"
    # --ll-chain (on) chains them; auto (the default) does for clients on the daemon's MPS
    # server, which the fixture's clients share when it runs one
    cfg = config.load(build_parser().parse_args(["serve", *daemon.extra]), dict(os.environ))
    assert chained == {config.chain_limit(cfg) > 0 and (
        cfg.ll_chain == "on" or (cfg.ll_chain == "auto" and bool(daemon.client_env())))}
    for name, (total, count) in host.items():
        if chained == {True}:
            assert count == 0, (name, count)
            continue
        assert count >= R * 2 * len(LAYERS), (name, count)  # a dispatch and a combine each
        assert 0 < total / count < 1.0, (name, total / count)


def _refill(tensors, seed: int, rank: int, device: int) -> None:
    """A captured layer's inputs (x, topk_idx, topk_weights) refilled from `_inputs(seed)` and
    its combine's output poisoned, before a replay."""
    import torch

    sx, sidx, sw, dest = tensors
    x, idx, w = _inputs(seed, rank, sx.shape[0])
    sx.copy_(_to_torch(x, device))
    sidx.copy_(_to_torch(idx, device))
    sw.copy_(_to_torch(w, device))
    dest.view(torch.int16).fill_(-1)


def _graph_first_rank(rank: int, socket: str, device: int, q) -> None:
    """Capture dispatch (hook) + combine into a CUDA graph with no earlier call on these
    tensors, replay with fresh inputs, check the combine bit-exactly each time."""
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    t = (M, M - 7)[rank]
    sx = torch.empty((t, H), dtype=torch.bfloat16, device=device)
    sidx = torch.empty((t, K), dtype=torch.int64, device=device)
    sw = torch.empty((t, K), dtype=torch.float32, device=device)
    dest = torch.empty((t, H), dtype=torch.bfloat16, device=device)
    res: dict = {"rank": rank, "cx": []}
    with Session(socket, client_name=f"gpu-ll-graph1-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=R, session=s, low_latency_mode=True,
                     group_name="gpu-ll-graph-first")
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            recv, _, handle, _, hook = buf.low_latency_dispatch(
                sx, sidx, M, E, use_fp8=False, return_recv_hook=True)
            hook()
            buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
        for it in range(3):
            _refill((sx, sidx, sw, dest), 200 + it, rank, device)
            graph.replay()
            torch.cuda.synchronize()
            buf.check()
            for op in buf._stream_ops.ops():
                op.check()
            res["cx"].append(_bits(dest))
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_low_latency_graph_capture_on_first_appearance(daemon) -> None:
    results = _spawn_ranks(daemon, _graph_first_rank, R)
    for it in range(3):
        inputs = [_inputs(200 + it, r, (M, M - 7)[r]) for r in range(R)]
        xs, idx, w = ([i[j] for i in inputs] for j in range(3))
        for r in range(R):
            np.testing.assert_array_equal(results[r]["cx"][it], _combined(xs, idx, w, r, True),
                                          err_msg=f"replay {it} rank {r}")


def _replay_after_release_rank(rank: int, socket: str, device: int, q) -> None:
    """A captured dispatch (hook) + combine, replayed once (exact), then the session's lease
    ends (the client cancels it; the engine tears the session down, as when it dies) and the
    graph is replayed again: its triggers must report RELEASED instead of waiting for an
    engine that no longer serves the ring."""
    import time

    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    from epd.client.stream_ops import DONE_RELEASED
    torch.cuda.set_device(device)
    t = (M, M - 7)[rank]
    x, idx, w = _inputs(300, rank, t)
    sx, sidx, sw = (_to_torch(a, device) for a in (x, idx, w))
    dest = torch.empty((t, H), dtype=torch.bfloat16, device=device)
    res: dict = {"rank": rank}
    s = Session(socket, client_name=f"gpu-ll-released-{rank}", timeout=30)
    buf = Buffer(rank=rank, num_ranks=R, session=s, low_latency_mode=True,
                 group_name="gpu-ll-graph-released")
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        recv, _, handle, _, hook = buf.low_latency_dispatch(
            sx, sidx, M, E, use_fp8=False, return_recv_hook=True)
        hook()
        buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
    graph.replay()
    torch.cuda.synchronize()
    res["cx"] = _bits(dest)
    ops = list(buf._stream_ops.ops())
    s._stream.cancel()  # the lease ends: the engine closes the session, the client releases
    end = time.monotonic() + 10
    while s._lost is None and time.monotonic() < end:
        time.sleep(0.01)
    res["lost"] = s._lost is not None
    res["released"] = [op.status() == DONE_RELEASED for op in ops]
    with torch.cuda.stream(stream):
        graph.replay()
        done = torch.cuda.Event()
        done.record(stream)
    end = time.monotonic() + 20
    while not done.query() and time.monotonic() < end:
        time.sleep(0.01)
    res["finished"] = done.query()
    res["after"] = [op.status() for op in ops]
    q.put(res)  # (before closing: a stream stuck on the old code would hang the close)
    with contextlib.suppress(Exception):  # (reported already: one report per rank)
        s.close()


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_graph_replayed_after_the_session_ended(daemon) -> None:
    from epd.client.stream_ops import DONE_RELEASED
    results = _spawn_ranks(daemon, _replay_after_release_rank, R)
    inputs = [_inputs(300, r, (M, M - 7)[r]) for r in range(R)]
    xs, idx, w = ([i[j] for i in inputs] for j in range(3))
    for r in range(R):
        got = results[r]
        np.testing.assert_array_equal(got["cx"], _combined(xs, idx, w, r, True))
        assert got["lost"] and all(got["released"]), got
        assert got["finished"], f"rank {r}: the replay after the release never finished"
        assert got["after"] and all(v == DONE_RELEASED for v in got["after"]), got["after"]


# -- two micro-batches in flight (vLLM DBO, SGLang two-batch overlap): D0 D1 C0 C1 -------------

MB_TOKENS = ((32, 12), (5, 32))  # (rank 0, rank 1) tokens of micro-batch 0 and 1


def _mb_inputs(mode: int, it: int, b: int, rank: int):
    return _inputs(300 + 20 * mode + 2 * it + b, rank, MB_TOKENS[b][rank])


def _micro_batches_rank(rank: int, socket: str, device: int, q) -> None:
    """D0 D1 C0 C1 on one Buffer: plain calls, receive hooks, and a CUDA graph of the whole
    sequence replayed with fresh inputs. Identity experts (bf16), so each combine must give
    sum_k w * x of its own micro-batch; the dispatch rows are checked too."""
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "runs": []}
    t = [MB_TOKENS[b][rank] for b in range(2)]
    with Session(socket, client_name=f"gpu-ll-mb-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=R, session=s, low_latency_mode=True,
                     group_name="gpu-ll-micro-batches")

        def compact(recv, count, handle):
            return _compact(SimpleNamespace(
                recv_x=recv, recv_count=count, recv_x_scales=None,
                recv_src_rank=handle.src_rank, recv_src_idx=handle.src_idx), LX)

        for it in range(2):  # plain calls: outputs are the caller's own
            ins = [[_to_torch(a, device) for a in _mb_inputs(0, it, b, rank)]
                   for b in range(2)]
            d = [buf.low_latency_dispatch(x, idx, M, E, use_fp8=False) for x, idx, _ in ins]
            c = [buf.low_latency_combine(d[b][0], ins[b][1], ins[b][2], d[b][2])[0]
                 for b in range(2)]
            torch.cuda.synchronize()
            buf.check()
            res["runs"].append({"mode": 0, "it": it, "cx": [_bits(v) for v in c],
                                "compact": [compact(d[b][0], d[b][1], d[b][2])
                                            for b in range(2)]})
        for it in range(2):  # receive hooks, combine outputs into the caller's tensors
            ins = [[_to_torch(a, device) for a in _mb_inputs(1, it, b, rank)]
                   for b in range(2)]
            outs = [torch.empty((t[b], H), dtype=torch.bfloat16, device=device)
                    for b in range(2)]
            d = [buf.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                          return_recv_hook=True) for x, idx, _ in ins]
            for b in range(2):
                d[b][4]()  # the receive half of micro-batch b
                buf.low_latency_combine(d[b][0], ins[b][1], ins[b][2], d[b][2],
                                        out=outs[b])
            torch.cuda.synchronize()
            buf.check()
            res["runs"].append({"mode": 1, "it": it, "cx": [_bits(v) for v in outs],
                                "compact": [compact(d[b][0], d[b][1], d[b][2])
                                            for b in range(2)]})
        # a CUDA graph of D0 D1 C0 C1 (hooks), replayed with fresh inputs
        static = [[torch.empty((t[b], H), dtype=torch.bfloat16, device=device),
                   torch.empty((t[b], K), dtype=torch.int64, device=device),
                   torch.empty((t[b], K), dtype=torch.float32, device=device)]
                  for b in range(2)]
        outs = [torch.empty((t[b], H), dtype=torch.bfloat16, device=device)
                for b in range(2)]
        for b in range(2):  # valid routing before the capture's first use
            static[b][1].fill_(-1)
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            d = [buf.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                          return_recv_hook=True) for x, idx, _ in static]
            for b in range(2):
                d[b][4]()
                buf.low_latency_combine(d[b][0], static[b][1], static[b][2], d[b][2],
                                        out=outs[b])
        for it in range(3):
            for b in range(2):
                for dst, src in zip(static[b], _mb_inputs(2, it, b, rank), strict=True):
                    dst.copy_(_to_torch(src, device))
                outs[b].view(torch.int16).fill_(-1)  # poison
            graph.replay()
            torch.cuda.synchronize()
            buf.check()
            for op in buf._stream_ops.ops():
                op.check()
            res["runs"].append({"mode": 2, "it": it, "cx": [_bits(v) for v in outs],
                                "compact": [compact(d[b][0], d[b][1], d[b][2])
                                            for b in range(2)]})
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_two_micro_batches_in_flight(daemon) -> None:
    """DeepEP's double buffer on the CUDA engine: each combine exact against its own
    micro-batch's reference, with plain calls, receive hooks and a replayed CUDA graph."""
    results = _spawn_ranks(daemon, _micro_batches_rank, R)
    runs = [(m, it) for m, n in ((0, 2), (1, 2), (2, 3)) for it in range(n)]
    for r in range(R):
        assert [(x["mode"], x["it"]) for x in results[r]["runs"]] == runs
    for i, (mode, it) in enumerate(runs):
        for b in range(2):
            inputs = [_mb_inputs(mode, it, b, r) for r in range(R)]
            xs, idx, w = ([inp[j] for inp in inputs] for j in range(3))
            exp = ref.low_latency_dispatch(xs, idx, E, M)
            for r in range(R):
                got = results[r]["runs"][i]
                _check_ll(exp[r], got["compact"][b], LX)
                np.testing.assert_array_equal(
                    got["cx"][b], _combined(xs, idx, w, r, True),
                    err_msg=f"mode {mode} iteration {it} micro-batch {b} rank {r}")


def _eager_hooks_rank(rank: int, socket: str, device: int, q) -> None:
    """A server in eager mode (vLLM's DeepEP low-latency path): every step a dispatch and a
    combine with return_recv_hook=True on fresh tensors of a new batch size. 80 steps, more
    than the session's 64 counter slots: the hook ops are kept LRU once their hooks ran (they
    were pinned, and the session ran out of slots after ~60 steps). Each step exact."""
    os.environ["EPD_LL_PLAIN_OPS"] = "4"
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "steps": []}
    with Session(socket, client_name=f"gpu-ll-eager-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=R, session=s, low_latency_mode=True,
                     group_name="gpu-ll-eager")
        for step in range(80):
            t = 1 + step % M
            x, idx, w = _inputs(200 + step, rank, t)
            tx, tidx, tw = (_to_torch(a, device) for a in (x, idx, w))
            recv, _, handle, _, hook = buf.low_latency_dispatch(tx, tidx, M, E, use_fp8=False,
                                                                return_recv_hook=True)
            hook()
            cx, _, chook = buf.low_latency_combine(recv, tidx, tw, handle,
                                                   return_recv_hook=True)
            chook()
            torch.cuda.synchronize()
            res["steps"].append(_bits(cx))
        buf.check()
        res["armed"] = len(buf._stream_ops)
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_hook_calls_of_new_batch_sizes_do_not_run_out_of_slots(daemon) -> None:
    results = _spawn_ranks(daemon, _eager_hooks_rank, R)
    for step in range(80):
        ins = [_inputs(200 + step, r, 1 + step % M) for r in range(R)]
        xs, idx, w = ([i[j] for i in ins] for j in range(3))
        for r, res in enumerate(results):
            np.testing.assert_array_equal(res["steps"][step], _combined(xs, idx, w, r, True))
    for res in results:
        assert res["armed"] <= 4 + 2, res["armed"]


# vLLM's decode capture: a graph per batch size, every MoE layer's calls in it, each layer with
# tensors of its own. 20 sizes x 4 layers x 2 calls = 160 armed ops of one group: one counter
# slot each, the session had 64 for all of them (op records: abi.OP_RECORD_BYTES).
CAPTURE_SIZES = list(range(1, 21))
CAPTURED_LAYERS = 4


def _sizes_seed(rnd: int, t: int, layer: int) -> int:
    return 5000 + 1000 * rnd + 10 * t + layer


def _many_sizes_rank(rank: int, socket: str, device: int, q) -> None:
    """Capture one graph per batch size (CAPTURE_SIZES), each with CAPTURED_LAYERS layers'
    dispatch (hook) + combine on tensors of their own, then replay every graph twice with
    fresh inputs, the outputs poisoned before each replay."""
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "cx": {}}
    with Session(socket, client_name=f"gpu-ll-sizes-{rank}", timeout=60) as s:
        buf = Buffer(rank=rank, num_ranks=R, session=s, low_latency_mode=True,
                     group_name="gpu-ll-many-sizes")
        stream = torch.cuda.Stream(device)
        graphs = {}
        for t in CAPTURE_SIZES:
            layers = [(torch.empty((t, H), dtype=torch.bfloat16, device=device),
                       torch.zeros((t, K), dtype=torch.int64, device=device),
                       torch.empty((t, K), dtype=torch.float32, device=device),
                       torch.empty((t, H), dtype=torch.bfloat16, device=device))
                      for _ in range(CAPTURED_LAYERS)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for sx, sidx, sw, dest in layers:
                    recv, _, handle, _, hook = buf.low_latency_dispatch(
                        sx, sidx, M, E, use_fp8=False, return_recv_hook=True)
                    hook()
                    buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
            graphs[t] = (graph, layers)
        res["armed"] = len(buf._stream_ops)
        res["slots"] = len({op.place[0] for op in buf._stream_ops.ops()})
        for rnd in range(2):
            for t, (graph, layers) in graphs.items():
                for layer, tensors in enumerate(layers):
                    _refill(tensors, _sizes_seed(rnd, t, layer), rank, device)
                graph.replay()
                torch.cuda.synchronize()
                res["cx"][rnd, t] = [_bits(layer[3]) for layer in layers]
        buf.check()
        for op in buf._stream_ops.ops():
            op.check()
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_a_model_captured_at_many_batch_sizes(daemon) -> None:
    results = _spawn_ranks(daemon, _many_sizes_rank, R)
    for res in results:
        assert res["armed"] == 2 * len(CAPTURE_SIZES) * CAPTURED_LAYERS, res["armed"]
        assert res["slots"] == 3, res["slots"]  # (160 ops' records in 3 slots of 64)
    for rnd in range(2):
        for t in CAPTURE_SIZES:
            for layer in range(CAPTURED_LAYERS):
                ins = [_inputs(_sizes_seed(rnd, t, layer), r, t) for r in range(R)]
                xs, idx, w = ([i[j] for i in ins] for j in range(3))
                for r, res in enumerate(results):
                    np.testing.assert_array_equal(
                        res["cx"][rnd, t][layer], _combined(xs, idx, w, r, True),
                        err_msg=f"round {rnd} size {t} layer {layer} rank {r}")
