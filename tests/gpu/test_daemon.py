"""The CUDA engine inside the daemon: client processes with torch CUDA tensors, through gRPC,
against the NumPy reference (exact), plus failure handling. One engine per visible GPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Daemon, Workload

from .common import ll_combined
from .conftest import DAEMON_TIMEOUT, GPU_COUNT

pytestmark = pytest.mark.gpu
TIMEOUT = DAEMON_TIMEOUT  # the daemon fixture's collective deadline


def _bits(t) -> np.ndarray:
    """Host bit pattern of a torch tensor (bf16 -> uint16, fp8 -> uint8, others as is)."""
    import torch
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _i32_scales(rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random int32 scale words (any bits) of one rank, as packed UE8M0 would be."""
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(-2 ** 31, 2 ** 31, shape, dtype=np.int64).astype(np.int32)


def _doubled(rows: np.ndarray) -> np.ndarray:
    """The bf16 bits of 2 * rows (exact in bf16): what a cached dispatch of x doubled receives."""
    return (rows.astype(np.float32) * 2).astype(rows.dtype).view(np.uint16)


def _to_torch(a: np.ndarray, device: int):
    import torch

    from epd.proto import dtypes
    if a.dtype == dtypes.BFLOAT16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    if a.dtype == dtypes.FLOAT8_E4M3:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn).to(device)
    return torch.from_numpy(a.copy()).to(device)


def _rank(rank: int, socket: str, device: int, wl: Workload, scenario: str, q) -> None:
    import torch

    from epd.client import EpdError, Session
    torch.cuda.set_device(device)
    x, idx, w = wl.inputs(rank)
    tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
    res: dict = {"rank": rank}
    with Session(socket, client_name=f"gpu-test-{rank}", timeout=30) as s:
        res["backend"] = s.backend
        g = s.join(f"gpu-{scenario}", rank=rank, num_ranks=wl.num_ranks,
                   num_experts=wl.num_experts, hidden=wl.hidden,
                   max_tokens_per_rank=max(max(wl.tokens), 1), num_topk=wl.num_topk,
                   timeout=30)
        if scenario == "missing" and rank == 1:
            q.put(res)
            time.sleep(TIMEOUT + 4)  # never dispatches
            return
        if scenario == "killed" and rank == 1:  # dies without a word: nothing to read
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario in ("missing", "killed"):
            t0 = time.monotonic()
            try:
                g.dispatch(tx, tidx, tw, timeout=TIMEOUT)
                res["error"] = "dispatch succeeded without its peer"
            except EpdError as e:
                res["code"], res["msg"] = e.code.name, e.details
            res["elapsed"] = time.monotonic() - t0
            q.put(res)
            return
        # Warm up, poison the output views, then run on fresh inputs and compare.
        out = g.dispatch(tx, tidx, tw, expert_alignment=4, copy=False)
        out.recv_x.view(torch.int16).fill_(-1)
        out.recv_topk_idx.fill_(77)
        torch.cuda.synchronize()
        per_rank, per_expert, in_rank = g.get_dispatch_layout(tidx)
        out = g.dispatch(tx, tidx, tw, expert_alignment=4)
        y = out.recv_x  # experts = identity, weights applied by combine's caller
        bias = _to_torch(np.full(x.shape, 0.5, x.dtype), device)
        cx, cw = g.combine(y, out.handle, topk_weights=out.recv_topk_weights, bias_0=bias)
        cached = g.dispatch(tx * 2, handle=out.handle)  # (other rows than the full one's,
        # which are still in the receive buffer: doubled, exact in bf16)
        res.update(per_rank=_bits(per_rank), per_expert=_bits(per_expert),
                   in_rank=_bits(in_rank), recv_x=_bits(out.recv_x),
                   recv_idx=_bits(out.recv_topk_idx), recv_w=_bits(out.recv_topk_weights),
                   src_idx=_bits(out.recv_src_idx), counts=out.num_recv_tokens_per_expert,
                   cx=_bits(cx), cw=_bits(cw), cached_x=_bits(cached.recv_x),
                   out_type=type(cx).__module__)
        if scenario == "full":
            worst = g.dispatch(tx, tidx, tw, num_worst_tokens=wl.num_ranks * max(wl.tokens))
            res["worst_idx"] = _bits(worst.recv_topk_idx)
            res["worst_x"] = _bits(worst.recv_x)
            xq, sc = ref.quantize_fp8(x)
            f8 = g.dispatch(_to_torch(xq, device), tidx, tw,
                            x_scales=_to_torch(sc, device))
            res["fp8_x"], res["fp8_scales"] = _bits(f8.recv_x), _bits(f8.recv_x_scales)
            # int32 scale words (vLLM's MXFP8 packed UE8M0): bit for bit, int32 back
            words = _i32_scales(rank, sc.shape)
            i8 = g.dispatch(_to_torch(xq, device), tidx, tw,
                            x_scales=_to_torch(words, device))
            i8c = g.dispatch(_to_torch(xq, device), x_scales=_to_torch(words, device),
                             handle=i8.handle)
            res["i32_dtype"] = str(i8.recv_x_scales.dtype)
            res["i32_scales"], res["i32_cached"] = (_bits(i8.recv_x_scales),
                                                    _bits(i8c.recv_x_scales))
            # Narrower scales, as DeepEP takes them: per token [T, 1] float32, packed
            # [T, H/512] int32 (DeepGEMM's UE8M0 on Blackwell); fresh and cached.
            for name, cols in (("w1", 1), ("wpack", max(sc.shape[1] // 4, 1))):
                narrow = np.ascontiguousarray(words[:, :cols])
                if name == "w1":
                    narrow = narrow.view(np.float32)
                n1 = g.dispatch(_to_torch(xq, device), tidx, tw,
                                x_scales=_to_torch(narrow, device))
                n2 = g.dispatch(_to_torch(xq, device), x_scales=_to_torch(narrow, device),
                                handle=n1.handle)
                res[name] = (_bits(n1.recv_x_scales), _bits(n2.recv_x_scales),
                             tuple(n1.recv_x_scales.shape))
            # Bad expert ids are found on the GPU (stream-ordered calls read no data on
            # the host): notify fails the call on every rank alike, naming the lowest rank
            # that passed one, and the group still works after it.
            try:
                g.dispatch(tx, tidx + wl.num_experts, tw)
                torch.cuda.synchronize()
                g.check()
                res["bad"] = "accepted"
            except EpdError as e:
                res["bad"], res["bad_msg"] = e.code.name, e.details
            again = g.dispatch(tx, tidx, tw, expert_alignment=4)
            res["again_x"] = _bits(again.recv_x)
    q.put(res)


def _run(daemon: Daemon, wl: Workload, scenario: str, ranks_per_gpu: int = 1,
         reports: int | None = None) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for r in range(wl.num_ranks):
        dev = (r // ranks_per_gpu) % GPU_COUNT
        procs.append(ctx.Process(target=_report_errors, args=(_rank, r, daemon.socket(dev),
                                                              dev, wl, scenario, q)))
    for p in procs:
        p.start()
    out = []
    try:
        while len(out) < (len(procs) if reports is None else reports):
            out.append(q.get(timeout=120))
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return out


def _check(wl: Workload, results: list[dict], full: bool) -> None:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    results = sorted(results, key=lambda r: r["rank"])
    inputs = wl.all_inputs()
    xs, idx, w = ([i[k] for i in inputs] for k in range(3))
    disp = ref.dispatch(xs, idx, w, wl.num_experts, expert_alignment=4)
    bias = [np.full(x.shape, 0.5, x.dtype) for x in xs]
    comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp], bias_0=bias)
    for r, res in enumerate(results):
        assert res["backend"] == "cuda"
        lay = ref.get_dispatch_layout(idx[r], wl.num_experts, wl.num_ranks)
        np.testing.assert_array_equal(res["per_rank"], lay.num_tokens_per_rank)
        np.testing.assert_array_equal(res["per_expert"], lay.num_tokens_per_expert)
        np.testing.assert_array_equal(res["in_rank"], lay.is_token_in_rank)
        np.testing.assert_array_equal(res["recv_x"], disp[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(res["recv_idx"], disp[r].recv_topk_idx)
        np.testing.assert_array_equal(res["recv_w"], disp[r].recv_topk_weights)
        np.testing.assert_array_equal(res["src_idx"], disp[r].recv_src_idx)
        assert res["counts"] == disp[r].num_recv_tokens_per_expert
        np.testing.assert_array_equal(res["cx"], comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(res["cw"], comb[r][1])
        np.testing.assert_array_equal(res["cached_x"], _doubled(disp[r].recv_x))
        assert res["out_type"].startswith("torch")
        if full:
            n = len(disp[r].recv_src_idx)
            worst = ref.pad_to_worst(disp[r], wl.num_ranks * max(wl.tokens))
            np.testing.assert_array_equal(res["worst_idx"], worst.recv_topk_idx)
            np.testing.assert_array_equal(res["worst_x"][:n], disp[r].recv_x.view(np.uint16))
            q = [ref.quantize_fp8(x) for x in xs]
            d8 = ref.dispatch([a for a, _ in q], idx, w, wl.num_experts,
                              x_scales=[b for _, b in q])
            np.testing.assert_array_equal(res["fp8_x"], d8[r].recv_x.view(np.uint8))
            np.testing.assert_array_equal(res["fp8_scales"], d8[r].recv_x_scales)
            words = [_i32_scales(s, b.shape) for s, (_, b) in enumerate(q)]
            d32 = ref.dispatch([a for a, _ in q], idx, w, wl.num_experts, x_scales=words)
            assert res["i32_dtype"] == "torch.int32", res["i32_dtype"]
            np.testing.assert_array_equal(res["i32_scales"], d32[r].recv_x_scales)
            np.testing.assert_array_equal(res["i32_cached"], d32[r].recv_x_scales)
            for name, cols in (("w1", 1), ("wpack", max(words[0].shape[1] // 4, 1))):
                narrow = [np.ascontiguousarray(a[:, :cols]) for a in words]
                if name == "w1":
                    narrow = [a.view(np.float32) for a in narrow]
                dn = ref.dispatch([a for a, _ in q], idx, w, wl.num_experts, x_scales=narrow)
                fresh, cached, shape = res[name]
                assert shape == dn[r].recv_x_scales.shape, (name, shape)
                for got in (fresh, cached):
                    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint32),
                                                  dn[r].recv_x_scales.view(np.uint32))
            assert res["bad"] == "INVALID_ARGUMENT", res
            assert "rank 0 passed expert id" in res["bad_msg"], res  # (every rank passed one)
            np.testing.assert_array_equal(res["again_x"], disp[r].recv_x.view(np.uint16))


@pytest.mark.parametrize("tokens,hidden,experts,topk", [
    ([128, 77], 2048, 32, 4), ([0, 7], 2048, 8, 1), ([4096, 4096], 7168, 256, 8)])
def test_daemon_roundtrip(daemon, tokens, hidden, experts, topk) -> None:
    wl = Workload(2, tokens, hidden, experts, topk, seed=sum(tokens) + hidden, drop_prob=0.05)
    full = tokens[0] == 128
    _check(wl, _run(daemon, wl, "full" if full else f"rt{hidden}-{experts}"), full)


def test_daemon_two_ranks_per_gpu(daemon) -> None:
    wl = Workload(2 * GPU_COUNT, [64] * (2 * GPU_COUNT), 2048, 8 * GPU_COUNT, 2, seed=5)
    _check(wl, _run(daemon, wl, "shared", ranks_per_gpu=2), False)


@pytest.mark.parametrize("scenario,code", [("missing", "DEADLINE_EXCEEDED"),
                                           ("killed", "ABORTED")])
def test_daemon_failure(daemon, scenario: str, code: str) -> None:
    wl = Workload(2, [64, 64], 2048, 16, 2, seed=9)
    reports = 1 if scenario == "killed" else 2
    results = [r for r in _run(daemon, wl, scenario, reports=reports)
               if r["rank"] == 0 and "code" in r]
    assert results, "rank 0 reported nothing"
    r0 = results[0]
    assert r0["code"] == code, r0
    assert "rank" in r0["msg"] and "1" in r0["msg"], r0["msg"]
    assert r0["elapsed"] < TIMEOUT + 1.5
    assert daemon.get("/readyz")[0] == 200
    # A fresh group works afterwards.
    wl2 = Workload(2, [32, 16], 2048, 16, 2, seed=10)
    _check(wl2, _run(daemon, wl2, f"after-{scenario}"), False)


# -- low-latency mode through the daemon (client processes, the fast path by default) --------

def _report_errors(target, rank: int, *args) -> None:
    """A rank process: target(rank, *args), whose last argument is the report queue; an
    exception becomes the rank's report (the parent raises it) instead of a hang."""
    try:
        target(rank, *args)
    except Exception as e:
        import traceback
        args[-1].put({"rank": rank, "error": f"{type(e).__name__}: {e}\n"
                                             f"{traceback.format_exc()}"})


def _spawn_ranks(daemon: Daemon | None, target, n: int, *args,
                 endpoints: list[str] | None = None) -> list[dict]:
    """Run target(rank, socket, device, *args, queue) for ranks 0..n-1 (rank r on GPU
    r % GPU_COUNT, on that GPU's engine of `daemon` or at `endpoints[r]`) in spawned
    processes; their reports by rank, any reported error raised."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sockets = endpoints or [daemon.socket(r % GPU_COUNT) for r in range(n)]
    procs = [ctx.Process(target=_report_errors, args=(
        target, r, sockets[r], r % GPU_COUNT, *args, q)) for r in range(n)]
    for p in procs:
        p.start()
    try:
        results = sorted((q.get(timeout=240) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


def _compact(out, lx: int) -> dict:
    """The valid rows of a low-latency dispatch, expert by expert (the full buffers are
    [L, R*m, H]: too large to ship), and whether every row beyond the count says -1."""
    counts = out.recv_count.cpu().numpy()
    res = {"counts": counts, "x": [], "scales": [], "src_rank": [], "src_idx": [],
           "tails": True}
    for le in range(lx):
        c = int(counts[le])
        res["x"].append(_bits(out.recv_x[le, :c]))
        if out.recv_x_scales is not None:
            res["scales"].append(_bits(out.recv_x_scales[le, :c]))
        res["src_rank"].append(_bits(out.recv_src_rank[le, :c]))
        res["src_idx"].append(_bits(out.recv_src_idx[le, :c]))
        res["tails"] &= bool((out.recv_src_rank[le, c:] == -1).all()
                             and (out.recv_src_idx[le, c:] == -1).all())
    return res


def _ll_rank(rank: int, socket: str, device: int, wl: Workload, m: int, q) -> None:
    import torch

    from epd.client import EpdError, Session
    torch.cuda.set_device(device)
    x, idx, w = wl.inputs(rank)
    tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
    lx = wl.num_experts // wl.num_ranks
    res: dict = {"rank": rank}
    with Session(socket, client_name=f"gpu-ll-{rank}", timeout=30) as s:
        g = s.join("gpu-ll", rank=rank, num_ranks=wl.num_ranks, num_experts=wl.num_experts,
                   hidden=wl.hidden, max_tokens_per_rank=m, num_topk=wl.num_topk,
                   low_latency_mode=True, timeout=30)
        zeros = torch.zeros((lx, wl.num_ranks * m, wl.hidden), dtype=tx.dtype,
                            device=device)
        for name, fp8, rs in (("bf16", False, False), ("fp8", True, False),
                              ("fp8r", True, True)):
            out = g.low_latency_dispatch(tx, tidx, m, use_fp8=fp8, round_scale=rs,
                                         copy=False)
            res[name] = _compact(out, lx)
            # Views stay valid until this rank's combine: the peers' next dispatch cannot
            # start before it (DeepEP's alternation), so read them first, then combine.
            g.low_latency_combine(zeros, tidx, tw, out.handle)
        # Identity experts: combine the bf16 rows as dispatched, into a poisoned `out`.
        out = g.low_latency_dispatch(tx, tidx, m, copy=False)
        dest = torch.full(tx.shape, float("nan"), dtype=tx.dtype, device=device)
        g.low_latency_combine(out.recv_x, tidx, tw, out.handle, out=dest)
        res["cx"] = _bits(dest)
        try:  # bad input is rejected before the collective and changes nothing
            g.low_latency_dispatch(tx, tidx + wl.num_experts, m)
            res["bad"] = "accepted"
        except EpdError as e:
            res["bad"] = e.code.name
        res["again"] = _compact(g.low_latency_dispatch(tx, tidx, m, copy=False), lx)
    q.put(res)


def _check_ll(exp, got: dict, lx: int) -> None:
    np.testing.assert_array_equal(got["counts"], exp.recv_count)
    assert got["tails"], "rows beyond recv_count must say -1"
    for le in range(lx):
        c = int(exp.recv_count[le])
        # the reference's order on both engines: source rank, then token
        np.testing.assert_array_equal(got["src_rank"][le], exp.recv_src_rank[le][:c])
        np.testing.assert_array_equal(got["src_idx"][le], exp.recv_src_idx[le][:c])
        np.testing.assert_array_equal(got["x"][le], exp.recv_x[le][:c].view(
            np.uint8 if exp.recv_x_scales is not None else np.uint16))
        if exp.recv_x_scales is not None:
            np.testing.assert_array_equal(got["scales"][le], exp.recv_x_scales[le][:c])


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_daemon_low_latency_decode_config(daemon) -> None:
    """Config D (128 tokens/rank, hidden 7168, top-8 of 256) through the daemon: bf16, FP8,
    FP8 with power-of-two scales, combine into `out=`, bad input rejected."""
    m = 128
    wl = Workload(2, [128, 101], 7168, 256, 8, seed=77, drop_prob=0.05)
    results = _spawn_ranks(daemon, _ll_rank, 2, wl, m)
    inputs = wl.all_inputs()
    xs, idx, w = ([i[k] for i in inputs] for k in range(3))
    lx = wl.num_experts // 2
    for name, fp8, rs in (("bf16", False, False), ("fp8", True, False), ("fp8r", True, True)):
        exp = ref.low_latency_dispatch(xs, idx, wl.num_experts, m, use_fp8=fp8, round_scale=rs)
        for r in range(2):
            _check_ll(exp[r], results[r][name], lx)
    exp = ref.low_latency_dispatch(xs, idx, wl.num_experts, m)
    for r in range(2):
        _check_ll(exp[r], results[r]["again"], lx)
        assert results[r]["bad"] == "INVALID_ARGUMENT"
        # identity experts: y row of (r, t) = x[r][t]
        np.testing.assert_array_equal(results[r]["cx"], ll_combined(xs[r], idx[r], w[r]))


# -- stream-ordered calls captured into a CUDA graph, replayed with fresh inputs --------------

GRAPH = {"ranks": 2, "experts": 32, "topk": 4, "hidden": 2048, "m": 32, "iters": 100}


def _graph_inputs(rank: int, it: int, tokens: int):
    rng = np.random.default_rng([4242, it, rank])
    idx, w = ref.random_routing(rng, tokens, GRAPH["experts"], GRAPH["topk"], drop_prob=0.1)
    from epd.proto.dtypes import BFLOAT16
    return ref.random_x(rng, tokens, GRAPH["hidden"], BFLOAT16), idx, w


def _graph_rank(rank: int, socket: str, device: int, facade: bool, q) -> None:
    """Capture dispatch + (unrelated work between the hook halves) + combine once, replay it
    GRAPH['iters'] times with fresh inputs copied into the static tensors, check every replay
    against the reference (dispatch rows as sets, combine bit-exact)."""
    import torch

    from epd.client import Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    r_count, e, k, h, m = (GRAPH[n] for n in ("ranks", "experts", "topk", "hidden", "m"))
    lx = e // r_count
    tokens = [m, m - 5]
    t = tokens[rank]
    sx = torch.empty((t, h), dtype=torch.bfloat16, device=device)
    sidx = torch.empty((t, k), dtype=torch.int64, device=device)
    sw = torch.empty((t, k), dtype=torch.float32, device=device)
    dest = torch.empty((t, h), dtype=torch.bfloat16, device=device)
    a = torch.randn(512, 512, device=device)
    torch.mm(a, a)  # cuBLAS initialises outside the capture

    def fill(it: int) -> None:
        x, idx, w = _graph_inputs(rank, it, t)
        sx.copy_(_to_torch(x, device))
        sidx.copy_(_to_torch(idx, device))
        sw.copy_(_to_torch(w, device))
        dest.view(torch.int16).fill_(-1)  # poison (NaN)

    res: dict = {"rank": rank, "failures": []}
    with Session(socket, client_name=f"gpu-graph-{rank}", timeout=30) as s:
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        fill(0)
        torch.cuda.synchronize()
        if facade:  # DeepEP's API: capture arms the calls (hook = the receive half)
            buf = Buffer(rank=rank, num_ranks=r_count, session=s, low_latency_mode=True,
                         group_name="gpu-graph-facade")
            # Warm-up step outside the capture (as with any CUDA-graph user): it arms the
            # stream-ordered calls, so the capture only records stream operations.
            recv, count, handle, _, hook = buf.low_latency_dispatch(
                sx, sidx, m, e, use_fp8=False, return_recv_hook=True)
            hook()
            buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                recv, count, handle, _, hook = buf.low_latency_dispatch(
                    sx, sidx, m, e, use_fp8=False, return_recv_hook=True)
                torch.mm(a, a)  # work overlapping the transfer
                hook()
                # Dispatch outputs are views of the receive buffer this dispatch took
                # (the other one than the warm-up's): snapshot them through the handle.
                views = {"recv_x": recv.clone(), "recv_count": count.clone(),
                         "src_rank": handle.src_rank.clone(),
                         "src_idx": handle.src_idx.clone()}
                buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
            ops = buf._stream_ops.ops()
            grp = next(iter(buf._groups.values()))
        else:
            grp = s.join("gpu-graph", rank=rank, num_ranks=r_count, num_experts=e,
                         hidden=h, max_tokens_per_rank=m, num_topk=k,
                         low_latency_mode=True, timeout=30)
            dop = grp.arm_low_latency_dispatch(sx, sidx, m)
            cop = grp.arm_low_latency_combine(dop.result.recv_x, sidx, sw, dop, out=dest)
            res_d = dop.result
            with torch.cuda.graph(graph, stream=stream):
                dop.signal()
                torch.mm(a, a)
                dop.wait()
                views = {"recv_x": res_d.recv_x.clone(), "recv_count": res_d.recv_count
                         .clone(), "src_rank": res_d.recv_src_rank.clone(),
                         "src_idx": res_d.recv_src_idx.clone()}
                cop.launch()
            ops = [dop, cop]
        t0 = time.perf_counter()
        for it in range(GRAPH["iters"]):
            if it:
                fill(it)
            graph.replay()
            torch.cuda.synchronize()
            for op in ops:
                op.check()
            inputs = [_graph_inputs(r, it, tokens[r]) for r in range(r_count)]
            xs, idxs, ws = ([inp[j] for inp in inputs] for j in range(3))
            exp = ref.low_latency_dispatch(xs, idxs, e, m)[rank]
            got = {n: _bits(v) for n, v in views.items()}
            try:
                np.testing.assert_array_equal(got["recv_count"], exp.recv_count)
                for le in range(lx):
                    c = int(exp.recv_count[le])
                    want = {key: i for i, key in enumerate(zip(
                        exp.recv_src_rank[le][:c].tolist(),
                        exp.recv_src_idx[le][:c].tolist(), strict=True))}
                    keys = list(zip(got["src_rank"][le][:c].tolist(),
                                    got["src_idx"][le][:c].tolist(), strict=True))
                    assert sorted(keys) == sorted(want), f"expert {le}"
                    np.testing.assert_array_equal(
                        got["recv_x"][le][:c], exp.recv_x[le][[want[kk] for kk in keys]]
                        .view(np.uint16))
                np.testing.assert_array_equal(_bits(dest),
                                              ll_combined(xs[rank], idxs[rank], ws[rank]))
            except AssertionError as err:
                res["failures"].append(f"replay {it}: {str(err)[:300]}")
        res["seconds"] = time.perf_counter() - t0
        if not facade:  # a bad expert id inside a replay fails that dispatch on every rank
            # alike (its combine gives zeros, nothing aborted); the next replay is exact
            from epd.client import EpdError
            fill(GRAPH["iters"])
            if rank == 0:
                sidx[0, 0] = e + 5
            graph.replay()
            torch.cuda.synchronize()
            try:
                dop.check()
                res["bad"] = "accepted"
            except EpdError as err:
                res["bad"] = (err.code.name, err.details)
            cop.check()  # (its combine: done, zeros)
            res["bad_zeros"] = bool((dest == 0).all())
            fill(0)
            graph.replay()
            torch.cuda.synchronize()
            for op in ops:
                op.check()
            x, idx, w = _graph_inputs(rank, 0, t)
            if not np.array_equal(_bits(dest), ll_combined(x, idx, w)):
                res["failures"].append("the replay after the failed one is not exact")
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
@pytest.mark.parametrize("facade", [False, True], ids=["native", "deepep-buffer"])
def test_daemon_low_latency_cuda_graph(daemon, facade: bool) -> None:
    results = _spawn_ranks(daemon, _graph_rank, GRAPH["ranks"], facade)
    for r in results:
        assert not r["failures"], r["failures"][:3]
        print(f"rank {r['rank']}: {GRAPH['iters']} replays checked in {r['seconds']:.1f} s")
    if not facade:
        for r in results:  # every rank raised the same failure
            code, msg = r["bad"]
            assert code == "INVALID_ARGUMENT", r["bad"]
            assert f"rank 0 passed expert id {GRAPH['experts'] + 5} in topk_idx[0]" in msg, msg
            assert r["bad_zeros"], r


# -- dispatch without top-k (DeepEP V1's topk_idx=None) on the CUDA engine --------------------

NO_TOPK_EXPERTS, NO_TOPK_TOKENS, NO_TOPK_HIDDEN = 16, [96, 41], 2048


def _no_topk_inputs(rank: int, layer: int):
    """x, and a routing no top-k could give (any set of ranks per token) with declared
    per-expert counts; layer 1 routes every token nowhere on rank 1."""
    from epd.proto import dtypes
    rng = np.random.default_rng(700 + 10 * layer + rank)
    t = NO_TOPK_TOKENS[rank]
    x = rng.standard_normal((t, NO_TOPK_HIDDEN)).astype(dtypes.BFLOAT16)
    in_rank = rng.random((t, 2)) < 0.6
    if layer == 1 and rank == 1:
        in_rank[:] = False
    per_expert = rng.integers(0, 50, NO_TOPK_EXPERTS).astype(np.int32)
    return x, in_rank, per_expert


def _no_topk_rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import Buffer, EpdError
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "layers": []}
    buf = Buffer(None, rank=rank, num_ranks=2, endpoint=socket, max_tokens_per_rank=128)
    try:
        held = []
        for layer in range(3):  # one Buffer, handles held across layers
            x, in_rank, per_expert = _no_topk_inputs(rank, layer)
            tx, tin, tpe = (_to_torch(a, device) for a in (x, in_rank, per_expert))
            n_rank = tin.sum(0, dtype=torch.int32)
            align = 4 if layer == 2 else 1
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                tx, num_tokens_per_rank=n_rank, is_token_in_rank=tin,
                num_tokens_per_expert=tpe, expert_alignment=align)
            combined, combined_w, _ = buf.combine(recv_x, handle)
            cached_x = buf.dispatch(tx * 2, handle=handle)[0]  # (other rows: doubled)
            held.append((recv_x, recv_idx, recv_w, list(counts), handle, combined,
                         combined_w, cached_x))
        torch.cuda.synchronize()
        for recv_x, recv_idx, recv_w, counts, handle, combined, combined_w, cx in held:
            res["layers"].append({
                "recv_x": _bits(recv_x), "none": (recv_idx, recv_w, combined_w) ==
                (None, None, None), "counts": counts,
                "prefix": _bits(handle[0]) if hasattr(handle[0], "detach")
                else np.asarray(handle[0]),
                "combined": _bits(combined), "cached_x": _bits(cx)})
        # A negative declared count is bad input found on the GPU: notify fails the call on
        # every rank alike, naming the rank and the count, and the Buffer goes on working.
        x, in_rank, per_expert = _no_topk_inputs(rank, 0)
        if rank == 0:
            per_expert[3] = -5
        tx, tin, tpe = (_to_torch(a, device) for a in (x, in_rank, per_expert))
        try:
            buf.dispatch(tx, num_tokens_per_rank=tin.sum(0, dtype=torch.int32),
                         is_token_in_rank=tin, num_tokens_per_expert=tpe)
            torch.cuda.synchronize()
            buf.check()
            res["bad"] = "accepted"
        except EpdError as e:
            res["bad"], res["bad_msg"] = e.code.name, e.details
    finally:
        buf.destroy()
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_daemon_dispatch_without_topk(daemon) -> None:
    """DeepEP V1's dispatch without top-k through the facade on the CUDA engine, as its
    test_intranode.py calls it: routing by is_token_in_rank, counts from the declared
    num_tokens_per_expert (aligned), recv_topk_* None, handle[0] the prefix matrix, cached
    dispatch and a plain-sum combine; three layers on one Buffer, exact against the
    reference."""
    results = _spawn_ranks(daemon, _no_topk_rank, 2)
    for layer in range(3):
        inputs = [_no_topk_inputs(r, layer) for r in range(2)]
        disp = ref.dispatch([i[0] for i in inputs], None, None, NO_TOPK_EXPERTS,
                            is_token_in_rank=[i[1] for i in inputs],
                            num_tokens_per_expert=[i[2] for i in inputs],
                            expert_alignment=4 if layer == 2 else 1)
        comb = ref.combine([d.recv_x for d in disp], disp, NO_TOPK_TOKENS)
        prefix = np.cumsum([i[1].sum(0) for i in inputs], axis=0)
        for r in range(2):
            got = results[r]["layers"][layer]
            np.testing.assert_array_equal(got["recv_x"], disp[r].recv_x.view(np.uint16))
            np.testing.assert_array_equal(got["cached_x"], _doubled(disp[r].recv_x))
            assert got["none"], "recv_topk_idx / weights / combined weights must be None"
            assert got["counts"] == disp[r].num_recv_tokens_per_expert, (layer, r)
            np.testing.assert_array_equal(got["prefix"], prefix)
            np.testing.assert_array_equal(got["combined"], comb[r][0].view(np.uint16))
    for r in range(2):  # (every rank: the payload carries rank 0's verdict)
        assert results[r]["bad"] == "INVALID_ARGUMENT", results[r]
        assert "rank 0 passed -5 in num_tokens_per_expert" in results[r]["bad_msg"], results[r]
