"""A DeepEP handle outlives the Buffer that made it (CPU daemon, ranks as threads).

DeepEP's handles are plain tensors, usable with any Buffer of the group. Megatron-LM's fused_a2a
(`get_buffer`, megatron/core/transformer/moe/fused_a2a.py) replaces its module-global Buffer
when a layer's hidden bytes grow, and the backward of an earlier layer then calls `combine` (and
the cached `dispatch`) on the new Buffer with a handle the old one made, the old Buffer being
collected meanwhile. EPD's handle names a daemon group of its Buffer: it keeps that Buffer alive
and the other Buffer runs the call on the handle's own group; an explicit destroy() of the old
Buffer ends its handles with a clear error. Every output exact against server/reference.py.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
from ranklib import ProcessGroup, assert_exact, facade_env, run_rank_threads

from epd.client.buffer import Buffer
from epd.proto import dtypes
from epd.proto.errors import FailedPrecondition, InvalidArgument
from epd.server import reference as ref

BF16 = dtypes.BFLOAT16
NUM_RANKS, EXPERTS, TOPK, LL_MAX = 2, 8, 2, 8
TOKENS = (7, 5)


@pytest.fixture
def env(daemon, monkeypatch):
    return facade_env(daemon, monkeypatch, "compat")


def run_ranks(fn) -> list:
    return run_rank_threads(fn, NUM_RANKS)


def workload(hidden: int, seed: int):
    """Per rank: x bf16 [T, H], distinct top-k expert ids int64, float32 weights."""
    rng = np.random.default_rng(seed)
    xs = [ref.random_x(rng, t, hidden, BF16) for t in TOKENS]
    rt = [ref.random_routing(rng, t, EXPERTS, TOPK, num_ranks=NUM_RANKS) for t in TOKENS]
    return xs, [r[0] for r in rt], [r[1] for r in rt]


def times2(a) -> np.ndarray:
    """The expert stand-in: bf16(2 x), exact."""
    return (np.asarray(a).astype(np.float32) * np.float32(2)).astype(BF16)


def dispatch(buf: Buffer, x, idx, w):
    n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
    return buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=n_exp, topk_idx=idx, topk_weights=w)


def test_a_handle_outlives_its_buffer_and_runs_on_another(env) -> None:
    """Megatron's Buffer replacement: layer 0 dispatches on Buffer A (normal and low-latency);
    A is dropped and collected; Buffer B (made for a larger hidden size) runs its own layer,
    then layer 0's backward: B.combine and B's cached dispatch with A's handle, and
    B.low_latency_combine with A's low-latency handle. A lives (its session open) while a
    handle of it does and goes with the last one. A handle of a destroyed Buffer, or of a
    Buffer of another group, is refused before anything runs."""
    xs, idx, w = workload(128, 61)
    xs_b, idx_b, w_b = workload(256, 62)
    grads = workload(128, 63)[0]
    barrier = threading.Barrier(NUM_RANKS)

    def rank(r, group):
        out: dict = {}
        a = Buffer(group, int(1e9))
        recv_x, _, recv_w, _, handle, _ = dispatch(a, xs[r], idx[r], w[r])
        ll_x, ll_count, ll_handle, _, _ = a.low_latency_dispatch(
            xs[r], idx[r], LL_MAX, EXPERTS, use_fp8=False)
        out["recv_x"], out["ll_count"] = np.asarray(recv_x).copy(), np.asarray(ll_count).copy()
        a_ref, a_session = weakref.ref(a), a.session
        del a
        gc.collect()
        out["a_held"] = a_ref() is not None and a_session.alive
        b = Buffer(group, int(2e9))
        others = []
        try:
            out["b_recv_x"] = np.asarray(dispatch(b, xs_b[r], idx_b[r], w_b[r])[0]).copy()
            cx, cw, _ = b.combine(times2(recv_x), handle, topk_weights=recv_w)
            out["cx"], out["cw"] = np.asarray(cx).copy(), np.asarray(cw).copy()
            out["cached"] = np.asarray(b.dispatch(grads[r], handle=handle)[0]).copy()
            y = b.get_next_low_latency_combine_buffer(ll_handle)  # (A's: A combines it)
            y[...] = times2(ll_x)
            out["ll_cx"] = np.asarray(b.low_latency_combine(y, idx[r], w[r], ll_handle)[0]).copy()
            # a handle of a destroyed Buffer: a clear error, whichever Buffer is called
            c = Buffer(group, int(1e9))
            others.append(c)
            c_handle = dispatch(c, xs[r], idx[r], w[r])[4]
            c.destroy()
            with pytest.raises(FailedPrecondition, match="destroyed"):
                b.combine(times2(recv_x), c_handle)
            with pytest.raises(FailedPrecondition, match="destroyed"):
                c.combine(times2(recv_x), c_handle)
            with pytest.raises(FailedPrecondition, match="destroyed"):
                b.dispatch(xs[r], handle=c_handle)
            # a Buffer of another group (another group object) refuses A's handles
            d = Buffer(ProcessGroup(r, NUM_RANKS), int(1e9))
            others.append(d)
            with pytest.raises(InvalidArgument, match="another group"):
                d.combine(times2(recv_x), handle)
            with pytest.raises(InvalidArgument, match="another group"):
                d.low_latency_combine(y, idx[r], w[r], ll_handle)
            barrier.wait()  # (every rank's calls on A's groups are done)
            del handle, ll_handle, y, c_handle
            gc.collect()
            out["a_gone"] = a_ref() is None and not a_session.alive
        finally:
            for o in others:
                o.destroy()
            b.destroy()
        return out

    res = run_ranks(rank)
    disp = ref.dispatch(xs, idx, w, EXPERTS)
    comb = ref.combine([times2(d.recv_x) for d in disp], disp, list(TOKENS),
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    disp_b = ref.dispatch(xs_b, idx_b, w_b, EXPERTS)
    cached = ref.dispatch(grads, idx, w, EXPERTS)
    ll = ref.low_latency_dispatch(xs, idx, EXPERTS, LL_MAX)
    ll_comb = ref.low_latency_combine([times2(d.recv_x) for d in ll], ll, idx, w, EXPERTS)
    for r, out in enumerate(res):
        assert out["a_held"], f"rank {r}: A was collected (or its session closed) under a handle"
        assert out["a_gone"], f"rank {r}: A outlived its last handle"
        assert_exact(out["recv_x"], disp[r].recv_x, f"rank {r} recv_x")
        assert_exact(out["b_recv_x"], disp_b[r].recv_x, f"rank {r} B's own dispatch")
        assert_exact(out["cx"], comb[r][0], f"rank {r} combine on B, A's handle")
        assert_exact(out["cw"], comb[r][1], f"rank {r} combined weights on B, A's handle")
        assert_exact(out["cached"], cached[r].recv_x, f"rank {r} cached dispatch on B")
        assert_exact(out["ll_count"], ll[r].recv_count, f"rank {r} low-latency counts")
        assert_exact(out["ll_cx"], ll_comb[r], f"rank {r} low-latency combine on B")
