"""Issue 11, server side, on the CPU backend (ranks as threads with one Session each, compared
with server/reference.py):

* handles live as long as the caller holds them: Megatron's pattern (every layer's dispatch
  handle held until backward, combines in reverse order), release when the client's handle
  object is collected, the per-session budget (--max-handles-per-session);
* dispatch without top-k (DeepEP V1's topk_idx=None, routed by is_token_in_rank), its cached
  dispatch and combine;
* two low-latency micro-batches in flight (D0 D1 C0 C1).
"""

from __future__ import annotations

import gc
import itertools
import types
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from epd.client import EpdError, Session
from epd.proto import dtypes
from epd.proto.errors import FailedPrecondition
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref
from epd.server.backends.base import GroupSpec
from epd.server.engine.ops import DataPlane

pytestmark = pytest.mark.slow
BF16 = dtypes.BFLOAT16
H, K = 128, 2
_names = itertools.count()


def _run(daemon, fn, *, num_ranks: int, experts: int, max_tokens: int = 64,
         fast: bool = True):
    """One session per rank (engines round robin), a fresh group, fn(rank, session, group) on
    every rank at once; the results by rank."""
    sessions = [Session(daemon.socket(r % daemon.engines), fast_path=fast)
                for r in range(num_ranks)]
    name = f"hl-{next(_names)}"
    try:
        def rank(r: int):
            g = sessions[r].join(name, rank=r, num_ranks=num_ranks, num_experts=experts,
                                 hidden=H, max_tokens_per_rank=max_tokens, num_topk=K)
            return fn(r, sessions[r], g)
        with ThreadPoolExecutor(num_ranks) as ex:
            return list(ex.map(rank, range(num_ranks)))
    finally:
        for s in sessions:
            s.close()


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def _exact(got, want, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        (what, got.shape, want.shape, got.dtype, want.dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=what)


def _workload(seed: int, tokens: list[int], experts: int, num_ranks: int):
    rng = np.random.default_rng(seed)
    xs = [ref.random_x(rng, t, H, BF16) for t in tokens]
    rt = [ref.random_routing(rng, t, experts, K, drop_prob=0.1, num_ranks=num_ranks)
          for t in tokens]
    return xs, [r[0] for r in rt], [r[1] for r in rt]


def _expert(recv_x, layer: int):
    """A per-layer transform of the received rows (bf16 in, bf16 out)."""
    return (recv_x.astype(np.float32) * np.float32(1 + layer % 3)).astype(BF16)


def _handles(s: Session) -> int:
    return sum(g.handles for g in s.stats().groups)


# ------------------------------------------------------------------------------------------------
# handle lifetime
# ------------------------------------------------------------------------------------------------

def test_megatron_150_layers_held_then_combined_in_reverse(daemon) -> None:
    """Forward: 150 dispatches on one group, every handle held (Megatron keeps each layer's
    handle for backward); backward: combines in reverse order. Exact against the reference;
    then dropping the handles frees them in the engine."""
    num_ranks, experts, layers = 2, 8, 150
    work = [_workload(1000 + i, [12, 9], experts, num_ranks) for i in range(layers)]

    def fn(r, s, g):
        fwd = []
        for xs, idx, w in work:
            fwd.append(g.dispatch(xs[r], idx[r], w[r]))
        held = _handles(s)
        combined = [None] * layers
        for layer in reversed(range(layers)):
            out = fwd[layer]
            combined[layer] = g.combine(_expert(out.recv_x, layer), out.handle,
                                        topk_weights=out.recv_topk_weights)
        recv = [(o.recv_x, o.recv_topk_idx, o.num_recv_tokens_per_expert) for o in fwd]
        del fwd, out
        gc.collect()
        left = g.release_handles()
        return recv, combined, held, left, _handles(s)

    res = _run(daemon, fn, num_ranks=num_ranks, experts=experts)
    for layer, (xs, idx, w) in enumerate(work):
        disp = ref.dispatch(xs, idx, w, experts)
        ys = [_expert(d.recv_x, layer) for d in disp]
        comb = ref.combine(ys, disp, [len(x) for x in xs],
                           recv_topk_weights=[d.recv_topk_weights for d in disp])
        for r in range(num_ranks):
            recv_x, recv_idx, counts = res[r][0][layer]
            _exact(recv_x, disp[r].recv_x, f"layer {layer} rank {r} recv_x")
            _exact(recv_idx, disp[r].recv_topk_idx, f"layer {layer} rank {r} recv_topk_idx")
            assert counts == disp[r].num_recv_tokens_per_expert
            cx, cw = res[r][1][layer]
            _exact(cx, comb[r][0], f"layer {layer} rank {r} combined_x")
            _exact(cw, comb[r][1], f"layer {layer} rank {r} combined_topk_weights")
    for r in range(num_ranks):
        _, _, held, left, after = res[r]
        assert held == layers, f"rank {r} held {held} handles in the engine"
        assert left == 0 and after == 0, f"rank {r}: {left}/{after} handles left after release"


def test_released_handle_is_gone_and_release_rides_on_dispatch(daemon) -> None:
    """A collected handle object is released by the next dispatch (piggybacked); its id is then
    unknown (FAILED_PRECONDITION naming the release), while held ones stay usable."""
    experts = 4
    xs, idx, w = _workload(7, [10], experts, 1)

    def fn(r, s, g):
        a = g.dispatch(xs[0], idx[0], w[0])
        b = g.dispatch(xs[0], idx[0], w[0])
        stale = type(a.handle)(g, a.handle.handle_id, 0, a.handle.num_recv_tokens,
                               a.handle.rows)  # a copy of the id only: no finalizer
        assert _handles(s) == 2
        del a
        gc.collect()
        c = g.dispatch(xs[0], idx[0], w[0])  # carries the release of a
        assert _handles(s) == 2
        with pytest.raises(EpdError) as ei:
            g.combine(b.recv_x, stale)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "released" in ei.value.details
        for out in (b, c):
            cx, _ = g.combine(out.recv_x, out.handle)
            _exact(cx, ref.combine([out.recv_x], ref.dispatch(xs, idx, w, experts), [10])[0][0],
                   "combine of a held handle")
        return True

    assert _run(daemon, fn, num_ranks=1, experts=experts) == [True]


def test_a_release_list_longer_than_a_session_can_hold_is_refused(daemon) -> None:
    """ReleaseHandles (and a dispatch's release_handles) with far more ids than a session may
    hold is refused INVALID_ARGUMENT naming the limit, before any is freed (the loop would
    hold the interpreter lock every tenant's calls share); a list of ordinary length frees."""
    experts = 4
    xs, idx, w = _workload(8, [10], experts, 1)

    def fn(r, s, g):
        a = g.dispatch(xs[0], idx[0], w[0])
        b = g.dispatch(xs[0], idx[0], w[0])
        many = [a.handle.handle_id, *range(1 << 40, (1 << 40) + 70_000)]
        with pytest.raises(EpdError) as ei:
            s._call("ReleaseHandles", epd_pb2.ReleaseHandlesRequest(
                session_id=s.session_id, group_id=g.group_id, handles=many))
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert "--max-handles-per-session" in ei.value.details
        assert _handles(s) == 2  # nothing freed
        g.combine(a.recv_x, a.handle)
        resp = s._call("ReleaseHandles", epd_pb2.ReleaseHandlesRequest(
            session_id=s.session_id, group_id=g.group_id, handles=many[:1000]))
        assert resp.handles == 1 and _handles(s) == 1
        g.combine(b.recv_x, b.handle)
        return True

    assert _run(daemon, fn, num_ranks=1, experts=experts) == [True]


def test_handle_budget_is_resource_exhausted_never_reuse(daemon_factory) -> None:
    """--max-handles-per-session: the dispatch beyond it fails RESOURCE_EXHAUSTED naming the
    flag (before the collective: nothing changes), the held handles stay exact, and dropping
    one makes room."""
    experts = 4
    xs, idx, w = _workload(8, [10], experts, 1)
    want = ref.combine([ref.dispatch(xs, idx, w, experts)[0].recv_x],
                       ref.dispatch(xs, idx, w, experts), [10])[0][0]
    with daemon_factory(engines=1, extra=["--max-handles-per-session", "4"]) as d:
        def fn(r, s, g):
            held = [g.dispatch(xs[0], idx[0], w[0]) for _ in range(4)]
            with pytest.raises(EpdError) as ei:
                g.dispatch(xs[0], idx[0], w[0])
            assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-handles-per-session" in ei.value.details
            assert _handles(s) == 4
            for out in held:  # none was dropped or reused
                _exact(g.combine(out.recv_x, out.handle)[0], want, "held handle")
            held.pop(0)
            gc.collect()
            again = g.dispatch(xs[0], idx[0], w[0])
            _exact(g.combine(again.recv_x, again.handle)[0], want, "after a release")
            return _handles(s)

        assert _run(d, fn, num_ranks=1, experts=experts) == [4]


# ------------------------------------------------------------------------------------------------
# dispatch without top-k
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_dispatch_without_topk_exact(daemon, num_ranks: int) -> None:
    """DeepEP V1 with topk_idx=None: routed by is_token_in_rank, counts from
    num_tokens_per_expert (aligned), no recv_topk_*; its cached dispatch and the combine of
    both, exact against the reference."""
    experts = 4 * num_ranks
    tokens = [20 + 3 * r for r in range(num_ranks)]
    tokens[-1] = 0 if num_ranks == 4 else tokens[-1]  # a rank with no tokens
    xs, idx, _ = _workload(40 + num_ranks, tokens, experts, num_ranks)
    lays = [ref.get_dispatch_layout(i, experts, num_ranks) for i in idx]
    in_rank = [lay.is_token_in_rank for lay in lays]
    if num_ranks >= 3:  # a routing no top-k gives: rank 0's first token everywhere
        in_rank[0] = in_rank[0].copy()
        in_rank[0][0] = True
    per_expert = [lay.num_tokens_per_expert for lay in lays]
    align = 4
    xs2 = [(x.astype(np.float32) + 1).astype(BF16) for x in xs]

    def fn(r, s, g):
        out = g.dispatch(xs[r], is_token_in_rank=in_rank[r], num_tokens_per_expert=per_expert[r],
                         expert_alignment=align)
        assert out.recv_topk_idx is None and out.recv_topk_weights is None
        cx, cw = g.combine(_expert(out.recv_x, 1), out.handle)
        again = g.dispatch(xs2[r], handle=out.handle)
        cx2, _ = g.combine(_expert(again.recv_x, 2), out.handle)
        return out, cx, cw, again.recv_x, cx2

    res = _run(daemon, fn, num_ranks=num_ranks, experts=experts)
    disp = ref.dispatch(xs, None, None, experts, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, expert_alignment=align)
    disp2 = ref.dispatch(xs2, None, None, experts, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert)
    comb = ref.combine([_expert(d.recv_x, 1) for d in disp], disp, tokens)
    comb2 = ref.combine([_expert(d.recv_x, 2) for d in disp2], disp2, tokens)
    for r in range(num_ranks):
        out, cx, cw, recv2, cx2 = res[r]
        _exact(out.recv_x, disp[r].recv_x, f"rank {r} recv_x")
        _exact(out.recv_src_idx, disp[r].recv_src_idx, f"rank {r} recv_src_idx")
        assert out.num_recv_tokens_per_expert == disp[r].num_recv_tokens_per_expert
        prefix = np.cumsum([[int(m[:, d].sum()) for d in range(num_ranks)] for m in in_rank],
                           axis=0)
        np.testing.assert_array_equal(out.rank_prefix_matrix, prefix)
        _exact(cx, comb[r][0], f"rank {r} combined_x")
        assert cw is None
        _exact(recv2, disp2[r].recv_x, f"rank {r} cached recv_x")
        _exact(cx2, comb2[r][0], f"rank {r} combine of the cached dispatch")


def test_dispatch_without_topk_bad_input(daemon) -> None:
    experts = 4
    xs, idx, w = _workload(9, [6], experts, 1)
    lay = ref.get_dispatch_layout(idx[0], experts, 1)

    def fn(r, s, g):
        def code(**kw) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(EpdError) as ei:
                g.dispatch(xs[0], **kw)
            return ei.value.code, ei.value.details
        INV = grpc.StatusCode.INVALID_ARGUMENT
        c, m = code(is_token_in_rank=lay.is_token_in_rank)
        assert c == INV and "num_tokens_per_expert" in m
        c, m = code(is_token_in_rank=lay.is_token_in_rank,
                    num_tokens_per_expert=lay.num_tokens_per_expert, num_worst_tokens=8)
        assert c == INV and "num_worst_tokens" in m
        c, m = code(is_token_in_rank=np.ones((6, 2), bool),
                    num_tokens_per_expert=lay.num_tokens_per_expert)
        assert c == INV and "is_token_in_rank has shape" in m
        c, m = code(is_token_in_rank=lay.is_token_in_rank.astype(np.int32),
                    num_tokens_per_expert=lay.num_tokens_per_expert)
        assert c == INV and "is_token_in_rank" in m
        c, m = code(is_token_in_rank=lay.is_token_in_rank,
                    num_tokens_per_expert=-lay.num_tokens_per_expert - 1)
        assert c == INV and "negative" in m
        c, m = code()
        assert c == INV and "is_token_in_rank" in m
        # the group still works
        out = g.dispatch(xs[0], idx[0], w[0])
        return out.num_recv_tokens

    assert _run(daemon, fn, num_ranks=1, experts=experts) == [6 - int(
        (idx[0] < 0).all(axis=1).sum())]


def test_ranks_disagreeing_on_topk_fail_together(daemon) -> None:
    num_ranks, experts = 2, 8
    xs, idx, w = _workload(11, [8, 8], experts, num_ranks)
    lays = [ref.get_dispatch_layout(i, experts, num_ranks) for i in idx]

    def fn(r, s, g):
        with pytest.raises(EpdError) as ei:
            if r == 0:
                g.dispatch(xs[r], idx[r], w[r])
            else:
                g.dispatch(xs[r], is_token_in_rank=lays[r].is_token_in_rank,
                           num_tokens_per_expert=lays[r].num_tokens_per_expert)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "top-k routing" in ei.value.details
        out = g.dispatch(xs[r], idx[r], w[r])  # the group stays usable
        return out.num_recv_tokens

    disp = ref.dispatch(xs, idx, w, experts)
    assert _run(daemon, fn, num_ranks=num_ranks, experts=experts) == \
        [len(d.recv_x) for d in disp]


def test_backend_without_the_kernels_refuses_dispatch_without_topk() -> None:
    """Both backends route by is_token_in_rank (the cuda one in epd_notify; its GPU test is
    tests/gpu/test_daemon.py::test_daemon_dispatch_without_topk); a backend that cannot
    answers FAILED_PRECONDITION naming the mode (never wrong data)."""
    from epd.server.backends import cpu, cuda

    assert cuda.CudaBackend.supports_dispatch_without_topk is True
    assert cpu.CpuBackend.supports_dispatch_without_topk is True

    class Engine(DataPlane):
        backend = types.SimpleNamespace(name="other", supports_dispatch_without_topk=False)

    spec = GroupSpec("g", 2, 4, H, 16, K, epd_pb2.BFLOAT16, False)
    req = epd_pb2.DispatchRequest(is_token_in_rank=epd_pb2.TensorDesc(
        region_id="r", shape=[4, 2], dtype=epd_pb2.BOOL))
    with pytest.raises(FailedPrecondition,
                       match="dispatch without top-k is not implemented on the other backend"):
        Engine()._no_topk_routing(None, spec, req, 4)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# two low-latency micro-batches in flight
# ------------------------------------------------------------------------------------------------

def test_two_low_latency_micro_batches_in_flight(daemon) -> None:
    """vLLM DBO / SGLang two-batch overlap: D0 D1 C0 C1 on one group (outputs copied, the
    default), one receive buffer each (DeepEP's double buffer, which the facade alternates by
    itself). Each combine is exact against the reference of its own micro-batch."""
    num_ranks, experts, num_max = 3, 12, 16
    batches = [_workload(60, [9, 16, 0], experts, num_ranks),
               _workload(61, [14, 3, 11], experts, num_ranks)]

    def fn(r, s, g):
        outs = [g.low_latency_dispatch(xs[r], idx[r], num_max, buffer=b)
                for b, (xs, idx, _) in enumerate(batches)]
        combined = []
        for b, (out, (_, idx, w)) in enumerate(zip(outs, batches, strict=True)):
            y = (out.recv_x.astype(np.float32) * np.float32(b + 2)).astype(BF16)
            combined.append(g.low_latency_combine(y, idx[r], w[r], out.handle))
        return [(o.recv_x, o.recv_count, o.recv_src_rank, o.recv_src_idx) for o in outs], \
            combined

    res = _run(daemon, fn, num_ranks=num_ranks, experts=experts, max_tokens=num_max)
    for b, (xs, idx, w) in enumerate(batches):
        disp = ref.low_latency_dispatch(xs, idx, experts, num_max)
        ys = [(d.recv_x.astype(np.float32) * np.float32(b + 2)).astype(BF16) for d in disp]
        comb = ref.low_latency_combine(ys, disp, idx, w, experts)
        for r in range(num_ranks):
            recv_x, count, src_rank, src_idx = res[r][0][b]
            np.testing.assert_array_equal(count, disp[r].recv_count)
            _exact(recv_x, disp[r].recv_x, f"batch {b} rank {r} recv_x")  # cpu: reference order
            np.testing.assert_array_equal(src_rank, disp[r].recv_src_rank)
            np.testing.assert_array_equal(src_idx, disp[r].recv_src_idx)
            _exact(res[r][1][b], comb[r], f"batch {b} rank {r} combined")


def test_buffer_dispatch_without_topk_deepep_spelling(daemon) -> None:
    """The facade, called as DeepEP V1's test_intranode.py calls it without top-k: layout, then
    `dispatch(x, num_tokens_per_rank=, is_token_in_rank=, num_tokens_per_expert=)` and combine
    with the handle; then a top-k dispatch on the same Buffer. Exact against the reference."""
    from epd.client import Buffer

    num_ranks, experts = 2, 8
    tokens = [17, 11]
    xs, idx, w = _workload(77, tokens, experts, num_ranks)
    lays = [ref.get_dispatch_layout(i, experts, num_ranks) for i in idx]

    def rank(r: int):
        buf = Buffer(None, rank=r, num_ranks=num_ranks,
                     endpoint=daemon.socket(r % daemon.engines),
                     max_tokens_per_rank=64)
        try:
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(idx[r], experts)
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                xs[r], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_expert)
            combined, combined_w, _ = buf.combine(_expert(recv_x, 0), handle)
            with_topk = buf.dispatch(xs[r], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                     num_tokens_per_expert=n_expert, topk_idx=idx[r],
                                     topk_weights=w[r])
            return (recv_x, recv_idx, recv_w, counts, np.asarray(handle[0]), combined,
                    combined_w, with_topk[0])
        finally:
            buf.destroy()

    with ThreadPoolExecutor(num_ranks) as ex:
        res = list(ex.map(rank, range(num_ranks)))
    disp = ref.dispatch(xs, None, None, experts,
                        is_token_in_rank=[lay.is_token_in_rank for lay in lays],
                        num_tokens_per_expert=[lay.num_tokens_per_expert for lay in lays])
    comb = ref.combine([_expert(d.recv_x, 0) for d in disp], disp, tokens)
    with_k = ref.dispatch(xs, idx, w, experts)
    for r in range(num_ranks):
        recv_x, recv_idx, recv_w, counts, prefix, combined, combined_w, recv_k = res[r]
        _exact(recv_x, disp[r].recv_x, f"rank {r} recv_x")
        assert recv_idx is None and recv_w is None and combined_w is None
        assert list(counts) == disp[r].num_recv_tokens_per_expert
        want_prefix = np.cumsum([[int(lay.is_token_in_rank[:, d].sum())
                                  for d in range(num_ranks)] for lay in lays], axis=0)
        np.testing.assert_array_equal(prefix, want_prefix)  # handle[0], DeepEP's position
        _exact(combined, comb[r][0], f"rank {r} combined_x")
        _exact(recv_k, with_k[r].recv_x, f"rank {r} recv_x with top-k")
