"""Issue 13 as a daemon: two logical nodes — two `epd serve --backend cuda --cuda-cluster`
daemons, one engine each — form one NVSHMEM world (node 0 forms it once node 1 holds a lease),
and a group with one rank on each node runs through the DeepEP facade, its rank on the other
node reached through NVSHMEM's device API: low-latency mode exact against the reference over
several steps (bf16 and FP8) and replayed from a CUDA graph, and normal mode (layout with
num_tokens_per_rdma_rank, dispatch, combine, cached dispatch, FP8) exact too; a bad expert id
fails that call with INVALID_ARGUMENT and the group goes on. Then node 1's daemon is stopped:
node 0 loses the world and stops its engine (a PE cannot be replaced); started again, both
nodes run in world 2 and a new group is exact again.

One GPU: both engines on GPU 0 under one MPS server with half the threads each (NVSHMEM's
several-PEs-per-GPU mode); two GPUs: one node per GPU."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

from epd.proto.dtypes import BFLOAT16
from epd.server import reference as ref

from .conftest import GPU_COUNT
from .test_daemon import _bits, _check_ll, _compact, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
R, E, K, H, M = 2, 16, 4, 2048, 16
LX = E // R
TOKENS = (16, 11)


def _inputs(step: int, rank: int, tokens: tuple[int, ...] = TOKENS, experts: int = E,
            topk: int = K, hidden: int = H, seed: int = 7):
    rng = np.random.default_rng([seed, step, rank])
    idx, w = ref.random_routing(rng, tokens[rank], experts, topk, drop_prob=0.1)
    return ref.random_x(rng, tokens[rank], hidden, BFLOAT16), idx, w


def _rank(rank: int, socket_path: str, device: int, group: str, q) -> None:
    import torch

    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "steps": []}
    buf = Buffer(None, rank=rank, num_ranks=R, endpoint=socket_path, low_latency_mode=True,
                 group_name=group, timeout=30)
    for step in range(3):
        x, idx, w = (_to_torch(a, device) for a in _inputs(step, rank))
        fp8 = step == 1
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)
        y = recv if not fp8 else _dequant_free_y(recv, device)
        cx, _, _ = buf.low_latency_combine(y, idx, w, handle)
        torch.cuda.synchronize()
        scales = recv[1] if fp8 else None
        res["steps"].append({"compact": _compact(SimpleNamespace(
            recv_x=recv[0] if fp8 else recv, recv_count=count, recv_x_scales=scales,
            recv_src_rank=handle.src_rank, recv_src_idx=handle.src_idx), LX),
            "cx": _bits(cx), "y": _bits(y) if fp8 else None})
    res["graph"] = _graph_replays(buf, rank, device)
    res["normal"] = _normal_mode(buf, rank, device)
    buf.destroy()
    q.put(res)


GRAPH_STEPS = (20, 21, 22)


def _graph_replays(buf, rank: int, device: int) -> list[dict]:
    """The low-latency pair across the nodes captured once in a CUDA graph (a warm-up call
    outside the capture arms it, as any graph user does) and replayed on fresh inputs: the
    dispatch's views snapshotted inside the graph, the combine into a poisoned `out`."""
    import torch
    t = TOKENS[rank]
    sx = torch.empty((t, H), dtype=torch.bfloat16, device=device)
    sidx = torch.empty((t, K), dtype=torch.int64, device=device)
    sw = torch.empty((t, K), dtype=torch.float32, device=device)
    dest = torch.empty((t, H), dtype=torch.bfloat16, device=device)

    def fill(step: int) -> None:
        for dst, a in zip((sx, sidx, sw), _inputs(step, rank), strict=True):
            dst.copy_(_to_torch(a, device))
        dest.view(torch.int16).fill_(-1)  # poison (NaN)

    fill(GRAPH_STEPS[0])
    recv, _, handle, _, hook = buf.low_latency_dispatch(sx, sidx, M, E, use_fp8=False,
                                                         return_recv_hook=True)
    hook()
    buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
    torch.cuda.synchronize()
    stream, graph = torch.cuda.Stream(device), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        recv, count, handle, _, hook = buf.low_latency_dispatch(sx, sidx, M, E, use_fp8=False,
                                                                return_recv_hook=True)
        hook()
        views = SimpleNamespace(recv_x=recv.clone(), recv_count=count.clone(),
                                recv_x_scales=None, recv_src_rank=handle.src_rank.clone(),
                                recv_src_idx=handle.src_idx.clone())
        buf.low_latency_combine(recv, sidx, sw, handle, out=dest)
    out = []
    for step in GRAPH_STEPS:
        fill(step)
        graph.replay()
        torch.cuda.synchronize()
        out.append({"compact": _compact(views, LX), "cx": _bits(dest)})
    del graph
    return out


def _layout_dispatch(buf, x, idx, w, num_experts: int):
    """DeepEP's layout, then a dispatch with every layout output (the callers' spellings):
    (the layout's four tensors, dispatch's six outputs)."""
    n_rank, n_node, n_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank,
                       num_tokens_per_rdma_rank=n_node, is_token_in_rank=in_rank,
                       num_tokens_per_expert=n_expert)
    return (n_rank, n_node, n_expert, in_rank), out


def _normal_mode(buf, rank: int, device: int) -> dict:
    """DeepEP's normal-mode calls on the group over both nodes (the caller's spellings)."""
    import torch

    from epd.client import EpdError
    out: dict = {}
    x, idx, w = (_to_torch(a, device) for a in _inputs(10, rank))
    (n_rank, n_node, n_expert, in_rank), (recv_x, recv_idx, recv_w, counts, handle, _) = \
        _layout_dispatch(buf, x, idx, w, E)
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    x2 = _to_torch(_inputs(11, rank)[0], device)
    again, *_ = buf.dispatch(x2, handle=handle)  # cached: the same routing, new rows
    xq, sc = ref.quantize_fp8(_inputs(12, rank)[0])
    f8, *_ = buf.dispatch((_to_torch(xq, device), _to_torch(sc, device)), topk_idx=idx,
                          topk_weights=w, num_tokens_per_rank=n_rank,
                          is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
    torch.cuda.synchronize()
    out.update(n_node=n_node.cpu().numpy(), counts=list(counts), recv_x=_bits(recv_x),
               recv_idx=recv_idx.cpu().numpy(), recv_w=recv_w.cpu().numpy(),
               combined=_bits(combined), combined_w=combined_w.cpu().numpy(),
               again=_bits(again), f8_x=_bits(f8[0]), f8_scales=f8[1].cpu().numpy())
    try:  # an expert id out of range, found on the GPU: that call fails, the group goes on
        bad = idx.clone()
        bad[0, 0] = E + 3
        buf.dispatch(x, topk_idx=bad, topk_weights=w, num_tokens_per_rank=n_rank,
                     is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
        torch.cuda.synchronize()
        buf.dispatch(x, handle=handle)  # (a stream-ordered failure reports by the next call)
        out["bad"] = "accepted"
    except EpdError as e:
        out["bad"] = f"{e.code.name}: {e.details}"
    after, *_ = buf.dispatch(x, handle=handle)
    torch.cuda.synchronize()
    out["after"] = _bits(after)
    return out


def _dequant_free_y(recv, device: int):
    """Expert outputs for an FP8 dispatch: any bf16 rows of the right shape (fixed bits)."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(5)
    return torch.randn(recv[0].shape, generator=g).to(torch.bfloat16).to(device)


def _check(results: list[dict]) -> None:
    plain = [(step, step, "steps") for step in range(3)]
    replays = [(step, i, "graph") for i, step in enumerate(GRAPH_STEPS)]
    for step, at, where in plain + replays:
        fp8 = step == 1
        xs, idx, w = zip(*(_inputs(step, r) for r in range(R)), strict=True)
        disp = ref.low_latency_dispatch(list(xs), list(idx), E, M, use_fp8=fp8)
        ys = ([results[r][where][at]["y"].view(BFLOAT16) for r in range(R)] if fp8
              else [d.recv_x for d in disp])
        combined = ref.low_latency_combine(ys, disp, list(idx), list(w), E)
        for r in range(R):
            got = results[r][where][at]
            _check_ll(disp[r], got["compact"], LX)
            np.testing.assert_array_equal(got["cx"], combined[r].view(np.uint16),
                                          err_msg=f"{where} step {step} rank {r}")
    xs, idx, w = zip(*(_inputs(10, r) for r in range(R)), strict=True)
    disp = ref.dispatch(list(xs), list(idx), list(w), E)
    comb = ref.combine([d.recv_x for d in disp], disp, list(TOKENS),
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    again = ref.dispatch([_inputs(11, r)[0] for r in range(R)], list(idx), list(w), E)
    q = [ref.quantize_fp8(_inputs(12, r)[0]) for r in range(R)]
    f8 = ref.dispatch([a for a, _ in q], list(idx), list(w), E, x_scales=[b for _, b in q])
    per_node = [ref.get_dispatch_layout(i, E, R, num_ranks_per_node=1).num_tokens_per_rdma_rank
                for i in idx]
    for r in range(R):
        got = results[r]["normal"]
        np.testing.assert_array_equal(got["n_node"], per_node[r])
        assert got["counts"] == disp[r].num_recv_tokens_per_expert, got["counts"]
        np.testing.assert_array_equal(got["recv_x"], disp[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(got["recv_idx"], disp[r].recv_topk_idx)
        np.testing.assert_array_equal(got["recv_w"].view(np.uint32),
                                      disp[r].recv_topk_weights.view(np.uint32))
        np.testing.assert_array_equal(got["combined"], comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(got["combined_w"].view(np.uint32),
                                      comb[r][1].view(np.uint32))
        np.testing.assert_array_equal(got["again"], again[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(got["f8_x"], f8[r].recv_x.view(np.uint8))
        np.testing.assert_array_equal(got["f8_scales"], f8[r].recv_x_scales)
        assert got["bad"].startswith("INVALID_ARGUMENT") and "expert id" in got["bad"], got
        np.testing.assert_array_equal(got["after"], disp[r].recv_x.view(np.uint16))


@contextlib.contextmanager
def _env(**kw: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in kw}
    os.environ.update(kw)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Nodes:
    """Two logical-node daemons; node i's engine on GPU i (two GPUs) or both on GPU 0 under one
    MPS server (one GPU)."""

    def __init__(self, root: str, mps_env: dict[str, str]) -> None:
        self.root, self.mps_env = root, mps_env
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.address = f"127.0.0.1:{s.getsockname()[1]}"
        self.token = os.path.join(root, "token")
        with open(self.token, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
        os.chmod(self.token, 0o600)
        self.nodes: list = [None, None]

    def start(self, rank: int, extra: tuple[str, ...] = ()):
        from epd.server.demo import Daemon
        gpu = rank if GPU_COUNT >= 2 else 0
        env = dict(self.mps_env, CUDA_VISIBLE_DEVICES=str(gpu), NVSHMEM_REMOTE_TRANSPORT="none",
                   NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", NVSHMEM_DISABLE_NVLS="1")
        with _env(**env):
            d = Daemon(backend="cuda", engines=1, timeout_seconds=4.0, extra=[
                "--num-nodes", "2", "--node-rank", str(rank), "--cluster-address", self.address,
                "--cluster-token-file", self.token, "--cluster-heartbeat-seconds", "1",
                "--cuda-cluster", "--nvshmem-heap-bytes", str(2 << 30),
                "--mps", "auto" if self.mps_env else "off", *extra])
        self.nodes[rank] = d
        return d

    def stop(self) -> None:
        for d in self.nodes:
            if d is not None:
                print(d.log()[-3000:])
                d.stop()


@contextlib.contextmanager
def _logical_nodes() -> Iterator[tuple[_Nodes, dict[str, str]]]:
    """Two logical-node daemons' harness (not started) and the MPS variables of their clients:
    one GPU each on two GPUs, else both on GPU 0 under one private MPS server."""
    if GPU_COUNT < 1:
        pytest.skip("needs a GPU")
    from epd.proto.v1 import epd_pb2
    from epd.server.mps import Mps, MpsError

    root = tempfile.mkdtemp(prefix="epd-xn-")  # short: the MPS pipe path is a socket path
    mps = None
    mps_env: dict[str, str] = {}
    try:
        if GPU_COUNT < 2:
            mps = Mps("on", root, "cuda", epd_pb2.CUDA)
            try:
                mps.start()
            except MpsError as e:
                pytest.skip(f"needs MPS: {e}")
            mps_env = {k: v for k, v in mps.env().items() if k.startswith("CUDA_MPS")}
            mps_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "50"
        nodes = _Nodes(root, mps_env)
        try:
            yield nodes, {k: v for k, v in mps_env.items() if k.startswith("CUDA_MPS_PIPE")}
        finally:
            nodes.stop()
    finally:
        if mps is not None:
            mps.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_low_latency_group_across_two_logical_nodes(tmp_path) -> None:
    with _logical_nodes() as (nodes, clients):
        for r in (0, 1):
            nodes.start(r)
        for d in nodes.nodes:
            d.wait_ready(240)  # (engines start once the world over both nodes is formed)
        with _env(**clients):
            _check(_spawn_ranks(None, _rank, R, "xnode",
                                endpoints=[d.socket(0) for d in nodes.nodes]))
        # node 1 goes away: the world is lost on node 0 too; node 1 back: world 2
        nodes.nodes[1].stop()
        nodes.nodes[1] = None
        nodes.start(1)
        for d in nodes.nodes:
            d.wait_ready(240)
        assert "world 2" in nodes.nodes[0].log() and "lost" in nodes.nodes[0].log()
        with _env(**clients):
            _check(_spawn_ranks(None, _rank, R, "xnode-again",
                                endpoints=[d.socket(0) for d in nodes.nodes]))


# Normal mode beyond MAX_RANKS: 2 logical nodes x 8 ranks in two stages (epd_wide_notify).
W, WE, WK, WH, WT = 16, 64, 4, 2048, 64
WREFUSER = 13  # its engine refuses one dispatch (float16 weights): node 1, local index 5
WTOKENS = tuple((64, 37, 0, 51, 64, 9, 22, 40)[r % 8] for r in range(W))


def _wide_inputs(step: int, rank: int):
    return _inputs(step, rank, WTOKENS, WE, WK, WH, seed=9)


def _wide_rank(rank: int, socket_path: str, device: int, group: str, q) -> None:
    """One rank of the 16-rank group: DeepEP's normal-mode calls, two steps on one Buffer."""
    import torch

    from epd.client.buffer import Buffer
    device = rank // 8 if GPU_COUNT >= 2 else 0  # (node-major: node b's ranks on its GPU)
    torch.cuda.set_device(device)
    buf = Buffer(None, rank=rank, num_ranks=W, endpoint=socket_path, group_name=group,
                 timeout=60, max_tokens_per_rank=WT)
    res: dict = {"rank": rank, "steps": []}
    for step in range(2):
        x, idx, w = (_to_torch(a, device) for a in _wide_inputs(step, rank))
        layout, (recv_x, recv_idx, recv_w, counts, handle, _) = _layout_dispatch(
            buf, x, idx, w, WE)
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        x2 = _to_torch(_wide_inputs(step + 10, rank)[0], device)
        again, *_ = buf.dispatch(x2, handle=handle)  # cached
        torch.cuda.synchronize()
        res["steps"].append({
            "layout": [a.cpu().numpy() for a in layout],
            "counts": list(counts), "recv_x": _bits(recv_x), "recv_idx": recv_idx.cpu().numpy(),
            "recv_w": recv_w.cpu().numpy(), "prefix": handle[0].cpu().numpy(),
            "combined": _bits(combined), "combined_w": combined_w.cpu().numpy(),
            "again": _bits(again)})
    # A dispatch WREFUSER's engine refuses takes part all the same (the whole group's notify
    # with the verdict, both stages skip it): that rank gets the reason, every other one a
    # failure naming it, at once (not at the 60 s deadline); the group goes on, exact.
    import time

    from epd.client import EpdError
    x, idx, w = (_to_torch(a, device) for a in _wide_inputs(0, rank))
    t0 = time.perf_counter()
    try:
        _layout_dispatch(buf, x, idx, w.half() if rank == WREFUSER else w, WE)
        res["refused"] = "OK"
    except EpdError as e:
        res["refused"] = f"{e.code.name}: {e.details}"
    res["refused_s"] = time.perf_counter() - t0
    _, (recv_x, _, recv_w, _, handle, _) = _layout_dispatch(buf, x, idx, w, WE)
    combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    torch.cuda.synchronize()
    res["after_refusal"] = _bits(combined)
    buf.destroy()
    q.put(res)


def _check_wide(results: list[dict]) -> None:
    for step in range(2):
        xs, idx, w = (list(v) for v in zip(*(_wide_inputs(step, r) for r in range(W)),
                                            strict=True))
        hier = ref.hierarchical_dispatch(xs, idx, w, WE, 2)
        rds = [hier.received(r) for r in range(W)]
        comb = ref.hierarchical_combine([rd.recv_x for rd in rds], hier, list(WTOKENS),
                                        recv_topk_weights=[rd.recv_topk_weights for rd in rds])
        again = ref.hierarchical_dispatch([_wide_inputs(step + 10, r)[0] for r in range(W)],
                                          idx, w, WE, 2)
        for r in range(W):
            got, rd, what = results[r]["steps"][step], rds[r], f"step {step} rank {r}"
            lay = ref.get_dispatch_layout(idx[r], WE, W, num_ranks_per_node=8)
            for a, b in zip(got["layout"], (lay.num_tokens_per_rank, lay.num_tokens_per_rdma_rank,
                                            lay.num_tokens_per_expert, lay.is_token_in_rank),
                            strict=True):
                np.testing.assert_array_equal(a, b, err_msg=what)
            assert got["counts"] == list(rd.num_recv_tokens_per_expert), what
            np.testing.assert_array_equal(got["recv_x"], rd.recv_x.view(np.uint16), what)
            np.testing.assert_array_equal(got["recv_idx"], rd.recv_topk_idx, what)
            np.testing.assert_array_equal(got["recv_w"].view(np.uint32),
                                          rd.recv_topk_weights.view(np.uint32), what)
            src = hier.sources(r)[0]
            np.testing.assert_array_equal(  # (the rank prefix matrix's column of this rank)
                got["prefix"][:, r], np.cumsum(np.bincount(src[src >= 0], minlength=W)), what)
            np.testing.assert_array_equal(got["combined"], comb[r][0].view(np.uint16), what)
            np.testing.assert_array_equal(got["combined_w"].view(np.uint32),
                                          comb[r][1].view(np.uint32), what)
            np.testing.assert_array_equal(got["again"],
                                          again.received(r).recv_x.view(np.uint16), what)
    for r, res in enumerate(results):
        if r == WREFUSER:
            assert res["refused"].startswith("INVALID_ARGUMENT"), res["refused"]
            assert "topk_weights" in res["refused"], res["refused"]
        else:
            assert res["refused"].startswith("FAILED_PRECONDITION"), (r, res["refused"])
            assert f"rank {WREFUSER}'s engine refused its part" in res["refused"], r
        assert res["refused_s"] < 30, (r, res["refused_s"])
        np.testing.assert_array_equal(res["after_refusal"], results[r]["steps"][0]["combined"])


def test_sixteen_rank_normal_mode_in_two_stages_across_two_logical_nodes(tmp_path) -> None:
    """Beyond MAX_RANKS = 8: a normal-mode group of 2 logical nodes x 8 ranks (DeepEP's
    Buffer, one per client process, eight per daemon) runs in two stages, as the default
    --cuda-hierarchical auto decides for it: layout with
    num_tokens_per_rdma_rank, dispatch, combine, cached dispatch, twice, every output exact
    against reference.hierarchical_dispatch / hierarchical_combine and the rank prefix
    matrix's column; then a dispatch one rank's engine refuses fails on every rank at once,
    and the next layer is exact. On one GPU the data kernels get 4 blocks a rank
    (--num-sms), so that all of a stage's ranks stay resident while they wait for each other,
    and the clients take two hardware queues each (the MPS pool is shared)."""
    with _logical_nodes() as (nodes, clients):
        for r in (0, 1):
            nodes.start(r, ("--cuda-hierarchical", "auto", "--num-sms", "4"))  # (the default)
        for d in nodes.nodes:
            d.wait_ready(240)
        with _env(**clients, CUDA_DEVICE_MAX_CONNECTIONS="2"):
            socks = [nodes.nodes[r // 8].socket(0) for r in range(W)]
            _check_wide(_spawn_ranks(None, _wide_rank, W, "wide", endpoints=socks))


# A stage's own failure through a stream-ordered call's done word: 2 logical nodes x 2 ranks.
XR, XE, XK, XH, XT = 4, 16, 4, 1024, 32
SKIPPER = 3  # node 1, local index 1: rail rank 1 of local index 1, node rank 1 of node 1


def _skip_rank(rank: int, socket_path: str, device: int, group: str, q) -> None:
    """Every rank dispatches; rank SKIPPER then makes no combine (it sleeps past its peers'
    deadline), the others combine and report how their next call ends."""
    import time

    import torch

    from epd.client import EpdError
    from epd.client.buffer import Buffer
    device = rank // 2 if GPU_COUNT >= 2 else 0
    torch.cuda.set_device(device)
    buf = Buffer(None, rank=rank, num_ranks=XR, endpoint=socket_path, group_name=group,
                 timeout=5, max_tokens_per_rank=XT)
    rng = np.random.default_rng([3, rank])
    idx, w = ref.random_routing(rng, XT, XE, XK)
    x, idx, w = (_to_torch(a, device) for a in (ref.random_x(rng, XT, XH, BFLOAT16), idx, w))
    _, (recv_x, _, recv_w, _, handle, _) = _layout_dispatch(buf, x, idx, w, XE)
    torch.cuda.synchronize()
    res: dict = {"rank": rank}
    if rank == SKIPPER:
        time.sleep(15)
        res["outcome"] = "skipped"
    else:
        try:
            buf.combine(recv_x, handle, topk_weights=recv_w)
            torch.cuda.synchronize()
            buf.dispatch(x, handle=handle)  # (a stream-ordered failure reports by the next call)
            torch.cuda.synchronize()
            res["outcome"] = "ok"
        except EpdError as e:
            res["outcome"] = f"{e.code.name}: {e.details}"
    with contextlib.suppress(EpdError):
        buf.destroy()
    q.put(res)


def test_a_stage_deadline_reaches_the_caller_naming_the_group_rank(tmp_path) -> None:
    """A two-stage group's combine waits in its stages' own control blocks; when rank 3 makes
    none, rank 2's node stage (where rank 3 is node rank 1) and rank 1's rail stage (where it
    is rail rank 1) reach their deadline. The failure is folded into the whole-group block
    (epd_stage_errors), so the callers' next call raises DEADLINE_EXCEEDED naming group rank
    3, not the stage's rank 1 (a peer may see the group's abort first: ABORTED)."""
    with _logical_nodes() as (nodes, clients):
        for r in (0, 1):
            nodes.start(r, ("--cuda-hierarchical", "stages", "--num-sms", "8"))
        for d in nodes.nodes:
            d.wait_ready(240)
        with _env(**clients):
            socks = [nodes.nodes[r // 2].socket(0) for r in range(XR)]
            got = {r["rank"]: r["outcome"]
                   for r in _spawn_ranks(None, _skip_rank, XR, "stagefail", endpoints=socks)}
    for r in (1, 2):
        assert got[r].startswith(("DEADLINE_EXCEEDED", "ABORTED")), got
    named = [got[r] for r in (1, 2) if got[r].startswith("DEADLINE_EXCEEDED")]
    assert named and all(f"rank {SKIPPER} did not arrive" in o for o in named), got
