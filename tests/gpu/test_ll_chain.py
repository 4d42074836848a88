"""Armed low-latency ops on the member's GPU chain (`--ll-chain on`; auto by default under MPS;
server/backends/cuda_chain.py): the client's trigger kernel publishes each call in the
member's ring and kernels enqueued ahead run it, with the collective sequence kept on the GPU.
Checked against the reference on fresh inputs each step, with outputs poisoned first: the ops
disarmed and armed again (the chain is drained and made anew, and goes on from the sequences
it handed back), the cumulative stats the chain's last kernel adds, a synchronous call of the
chained member (refused with FAILED_PRECONDITION, nothing hangs), a combine triggered on a
buffer its dispatch never filled (fails through the done word on every rank, runs nothing),
and proof that the engine's poller launched none of the chained calls."""

from __future__ import annotations

import numpy as np
import pytest

from epd.proto.dtypes import BFLOAT16
from epd.server import reference as ref

from .conftest import GPU_COUNT, cuda_daemon
from .test_daemon import _bits, _check_ll, _compact, _spawn_ranks, _to_torch
from .test_ll_plain import _combined

pytestmark = pytest.mark.gpu
R, E, K, H, M = 2, 32, 4, 2048, 32
LX = E // R
GROUP = "gpu-ll-chain"
TOKENS = (29, 32)
# step -> how it runs: armed launch, or disarm + arm again then launch
STEPS = ["armed", "armed", "rearm", "armed", "armed", "rearm", "rearm", "armed"]


@pytest.fixture(scope="module")
def daemon():
    yield from cuda_daemon(("--ll-chain",))


def _inputs(step: int, rank: int):
    rng = np.random.default_rng([4242, step, rank])
    idx, w = ref.random_routing(rng, TOKENS[rank], E, K, drop_prob=0.1)
    return ref.random_x(rng, TOKENS[rank], H, BFLOAT16), idx, w


def _chain_rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import EpdError, Session
    from epd.client.group import LowLatencyDispatchResult
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "steps": []}
    t = TOKENS[rank]
    tx = torch.empty((t, H), dtype=torch.bfloat16, device=device)
    tidx = torch.empty((t, K), dtype=torch.int64, device=device)
    tw = torch.empty((t, K), dtype=torch.float32, device=device)
    out = torch.empty((t, H), dtype=torch.bfloat16, device=device)
    stats = torch.zeros(LX, dtype=torch.int32, device=device)
    with Session(socket, client_name=f"gpu-ll-chain-{rank}", timeout=30) as s:
        g = s.join(GROUP, rank=rank, num_ranks=R, num_experts=E, hidden=H,
                   max_tokens_per_rank=M, num_topk=K, low_latency_mode=True, timeout=30)

        def arm():
            d = g.arm_low_latency_dispatch(tx, tidx, M,
                                           cumulative_local_expert_recv_stats=stats)
            # identity experts: the combine reads the dispatch's own receive buffer
            c = g.arm_low_latency_combine(d.result.recv_x, tidx, tw, d, out=out)
            return d, c

        d, c = arm()
        res["chained"] = d.chained and c.chained
        for step, how in enumerate(STEPS):
            for dst, src in zip((tx, tidx, tw), _inputs(step, rank), strict=True):
                dst.copy_(_to_torch(src, device))
            out.view(torch.int16).fill_(-1)  # poison
            if how == "rearm":
                c.disarm()
                d.disarm()
                d, c = arm()
            d.launch()
            c.launch()
            torch.cuda.synchronize()
            d.check()
            c.check()
            assert isinstance(d.result, LowLatencyDispatchResult)
            res["steps"].append({"compact": _compact(d.result, LX), "cx": _bits(out)})
        res["stats"] = stats.cpu().numpy()
        try:  # a synchronous call of the chained member: refused, changes nothing
            g.low_latency_dispatch(tx, tidx, M)
            res["sync"] = "accepted"
        except EpdError as e:
            res["sync"] = e.code.name
        # A combine triggered on buffer 1, which no dispatch of this op filled: its done word
        # fails (on every rank alike, so nothing waits), the group goes on.
        c.launch(buffer=1)
        torch.cuda.synchronize()
        try:
            c.check()
            res["stale"] = "accepted"
        except EpdError as e:
            res["stale"] = str(e)
        for dst, src in zip((tx, tidx, tw), _inputs(len(STEPS), rank), strict=True):
            dst.copy_(_to_torch(src, device))
        d.launch()
        c.launch()
        torch.cuda.synchronize()
        d.check()
        c.check()
        res["after"] = {"compact": _compact(d.result, LX), "cx": _bits(out)}
    q.put(res)


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_armed_ops_on_the_chain(daemon) -> None:
    results = _spawn_ranks(daemon, _chain_rank, R)
    stats = np.zeros((R, LX), np.int64)
    for step in [*range(len(STEPS)), len(STEPS)]:
        inputs = [_inputs(step, r) for r in range(R)]
        xs, idx, w = ([i[j] for i in inputs] for j in range(3))
        exp = ref.low_latency_dispatch(xs, idx, E, M)
        for r in range(R):
            got = (results[r]["steps"][step] if step < len(STEPS) else results[r]["after"])
            _check_ll(exp[r], got["compact"], LX)
            np.testing.assert_array_equal(got["cx"], _combined(xs, idx, w, r, True),
                                          err_msg=f"step {step} rank {r}")
            if step < len(STEPS):
                stats[r] += exp[r].recv_count
    for r in range(R):
        assert results[r]["chained"], "the engine did not put the ops on a chain"
        np.testing.assert_array_equal(results[r]["stats"], stats[r])
        assert "holds another dispatch" in results[r]["stale"], results[r]["stale"]
        assert results[r]["sync"] == "FAILED_PRECONDITION", results[r]["sync"]
    # The poller launched none of them: the chain ran every armed call.
    from epd.server.bench import engine_host
    for name, (_, count) in engine_host.totals(daemon.get("/metrics")[1]).items():
        assert count == 0, (name, count)
