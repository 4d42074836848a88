"""Edge cases where EPD must match DeepEP V1 exactly, checked against models written here from
DeepEP's kernels (deepseek-ai/DeepEP, csrc/kernels/intranode.cu, layout.cu, internode_ll.cu,
utils.cuh), not from server/reference.py: the reference, and the CPU daemon where it computes
something itself (low-latency FP8 quantisation), are compared with them bit for bit."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from epd.client import Session
from epd.proto import dtypes
from epd.server import reference as ref

BF16, FP8, F32 = dtypes.BFLOAT16, dtypes.FLOAT8_E4M3, np.float32
_names = itertools.count()


# ------------------------------------------------------------------------------------------------
# models of DeepEP's kernels
# ------------------------------------------------------------------------------------------------

def deepep_ll_fp8(x: np.ndarray, round_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """DeepEP's low-latency FP8 cast of bf16 rows (internode_ll.cu dispatch, "FP8 cast": amax
    starts at kFP8Margin = 1e-4, per 128 channels; utils.cuh calculate_fp8_scales): without
    round_scale scale_inv = amax * kFinfoAmaxInvE4M3 (the float 1/448.0f) and the values are
    multiplied by scale = 448.0f / amax; with it, e = ceil(log2(amax * (1/448.0f))) from the
    float's bits (fast_log2_ceil), scale_inv = 2^e, scale = 2^-e. The cast is
    __nv_cvt_float2_to_fp8x2(..., __NV_SATFINITE, __NV_E4M3): round to nearest, saturate."""
    t, h = x.shape
    blocks = x.astype(F32).reshape(t, h // 128, 128)
    amax = np.maximum(np.abs(blocks).max(axis=2, initial=0.0), F32(1e-4)).astype(F32)
    inv448 = F32(1.0) / F32(448.0)
    if round_scale:
        bits = (amax * inv448).astype(F32).view(np.uint32)
        e = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
        scale = np.ldexp(F32(1.0), -e).astype(F32)
        scale_inv = np.ldexp(F32(1.0), e).astype(F32)
    else:
        scale_inv = (amax * inv448).astype(F32)
        scale = (F32(448.0) / amax).astype(F32)
    v = (blocks * scale[:, :, None]).astype(F32)
    q = np.clip(v, -448.0, 448.0).astype(FP8)
    return q.reshape(t, h), scale_inv


# ------------------------------------------------------------------------------------------------
# low-latency FP8 quantisation (a difference found: EPD divided, DeepEP multiplies)
# ------------------------------------------------------------------------------------------------

def _bf16_rows(seed: int, tokens: int, hidden: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((tokens, hidden)) * rng.uniform(1e-3, 50, (tokens, 1)))
    return x.astype(F32).astype(BF16)


@pytest.mark.parametrize("round_scale", [False, True])
def test_reference_quantises_as_deepep_low_latency_kernel(round_scale: bool) -> None:
    """Scales and e4m3 bits of ``quantize_fp8`` equal DeepEP's, for random rows and for every
    positive bf16 value as a block's amax (scale_inv = amax * fl(1/448) differs from the
    correctly rounded amax / 448 in about half the blocks, and x * fl(448/amax) from
    x / (amax/448) in a few values)."""
    x = _bf16_rows(3, 64, 1024)
    every = np.arange(1, 0x7F80, dtype=np.uint16).view(BF16).astype(F32)
    amax_rows = np.zeros((every.size, 128), F32)
    amax_rows[:, 0] = every
    amax_rows[:, 1] = -every * F32(0.3)
    for rows in (x, amax_rows.astype(BF16)):
        q, sc = ref.quantize_fp8(rows, round_scale)
        want_q, want_sc = deepep_ll_fp8(rows, round_scale)
        np.testing.assert_array_equal(sc.view(np.uint32), want_sc.view(np.uint32))
        np.testing.assert_array_equal(q.view(np.uint8), want_q.view(np.uint8))


def test_reference_low_latency_fp8_dispatch_rows_as_deepep() -> None:
    """The rows and scales ``low_latency_dispatch(use_fp8=True)`` delivers are DeepEP's cast of
    the source token (each (token, expert) row a copy of the token's one cast)."""
    xs = [_bf16_rows(s, 5, 256) for s in range(2)]
    idx = [np.array([[0, 3], [1, -1], [2, 0], [-1, -1], [3, 1]], np.int64),
           np.array([[2, 1], [0, 3], [3, -1], [1, 2], [0, 2]], np.int64)]
    seen = []
    for dst, d in enumerate(ref.low_latency_dispatch(xs, idx, 4, 8, use_fp8=True)):
        local = d.recv_count.shape[0]
        for e in range(local):
            for row in range(int(d.recv_count[e])):
                s, t = int(d.recv_src_rank[e, row]), int(d.recv_src_idx[e, row])
                q, sc = deepep_ll_fp8(xs[s][t:t + 1], False)
                assert d.recv_x[e, row].view(np.uint8).tobytes() == q.view(np.uint8).tobytes()
                assert d.recv_x_scales[e, row].tobytes() == sc[0].tobytes()
                seen.append((s, t, dst * local + e))
    # every (token, expert) pair of the routing was delivered once, where it was sent (the
    # loops above could not fail on rows that never came, or on a wrong source mapping)
    want = [(s, t, int(e)) for s, i in enumerate(idx) for t in range(len(i)) for e in i[t]
            if e >= 0]
    assert sorted(seen) == sorted(want) and len(want) == 16


@pytest.mark.slow
@pytest.mark.parametrize("round_scale", [False, True])
def test_cpu_daemon_low_latency_fp8_as_deepep(daemon, round_scale: bool) -> None:
    """Through the CPU daemon: every received FP8 row and its scales are DeepEP's cast of the
    source token."""
    num_ranks, experts, topk, hidden, num_max = 2, 4, 2, 512, 8
    xs = [_bf16_rows(10 + r, 6, hidden) for r in range(num_ranks)]
    rng = np.random.default_rng(11)
    idx = [np.stack([rng.choice(experts, topk, replace=False) for _ in range(6)]).astype(np.int64)
           for _ in range(num_ranks)]
    sessions = [Session(daemon.socket(r % daemon.engines)) for r in range(num_ranks)]
    name = f"edges-ll-{next(_names)}"
    try:
        def rank(r: int):
            g = sessions[r].join(name, rank=r, num_ranks=num_ranks, num_experts=experts,
                                 hidden=hidden, max_tokens_per_rank=num_max, num_topk=topk)
            out = g.low_latency_dispatch(xs[r], idx[r], num_max, use_fp8=True,
                                         round_scale=round_scale)
            return (np.asarray(out.recv_x).copy(), np.asarray(out.recv_x_scales).copy(),
                    np.asarray(out.recv_count).copy(), np.asarray(out.recv_src_rank).copy(),
                    np.asarray(out.recv_src_idx).copy())
        with ThreadPoolExecutor(num_ranks) as ex:
            got = list(ex.map(rank, range(num_ranks)))
    finally:
        for s in sessions:
            s.close()
    seen = []
    for dst, (recv_x, scales, count, src_rank, src_idx) in enumerate(got):
        for e in range(count.shape[0]):
            for row in range(int(count[e])):
                s, t = int(src_rank[e, row]), int(src_idx[e, row])
                q, sc = deepep_ll_fp8(xs[s][t:t + 1], round_scale)
                assert recv_x[e, row].view(np.uint8).tobytes() == q.view(np.uint8).tobytes()
                np.testing.assert_array_equal(scales[e, row].view(np.uint32),
                                              sc[0].view(np.uint32))
                seen.append((s, t, dst * count.shape[0] + e))
    # each (token, expert) pair once, at the expert it was sent to (not only as many rows)
    want = [(s, t, int(e)) for s in range(num_ranks) for t in range(6) for e in idx[s][t]]
    assert sorted(seen) == sorted(want) and len(want) == num_ranks * 6 * topk


# ------------------------------------------------------------------------------------------------
# normal mode edges (matching; kept as regression checks against DeepEP's kernel logic)
# ------------------------------------------------------------------------------------------------

def test_normal_dispatch_combine_edges_as_deepep() -> None:
    """Repeated experts and ranks in a token's top-k, all -1 rows, a rank with no tokens,
    expert_alignment, num_worst_tokens, and combine with both biases in bf16.

    DeepEP: layout.cu counts (token, k) pairs per expert (a repeated expert twice) and a token
    once per rank; intranode.cu:369-378 maps recv_topk_idx to e - rank*L or -1 and zeroes the
    weight where it is -1; notify_dispatch (intranode.cu:73) rounds each local expert's sum up to
    expert_alignment; rows by source rank (rank_prefix_matrix) then token; intranode.cu:522-531
    sets the padding rows' recv_topk_idx to -1; combine (intranode.cu:959-981) starts from
    float(bias_0) + float(bias_1), adds each rank's bf16 row in ascending rank order in fp32 and
    casts once; combined weights (intranode.cu:1013-1018) from 0 in ascending rank order."""
    num_ranks, experts, hidden, align = 3, 6, 128, 4
    local = experts // num_ranks
    rng = np.random.default_rng(21)
    idx = [np.array([[0, 0, 3], [1, 1, 1], [-1, -1, -1], [5, 4, -1], [2, -1, 0]], np.int64),
           np.zeros((0, 3), np.int64),
           np.array([[4, 5, 2], [-1, 3, 3], [0, 1, 5]], np.int64)]
    xs = [rng.standard_normal((len(i), hidden)).astype(F32).astype(BF16) for i in idx]
    ws = [rng.random(i.shape).astype(F32) for i in idx]
    out = ref.dispatch(xs, idx, ws, experts, expert_alignment=align)
    for d, rd in enumerate(out):
        rows = [(s, t) for s in range(num_ranks) for t in range(len(idx[s]))
                if ((idx[s][t] >= d * local) & (idx[s][t] < (d + 1) * local)).any()]
        assert [(int(a), int(b)) for a, b in zip(rd.recv_src_rank, rd.recv_src_idx,
                                                 strict=True)] == rows
        for n, (s, t) in enumerate(rows):
            here = (idx[s][t] >= d * local) & (idx[s][t] < (d + 1) * local)
            np.testing.assert_array_equal(rd.recv_topk_idx[n],
                                          np.where(here, idx[s][t] - d * local, -1))
            np.testing.assert_array_equal(rd.recv_topk_weights[n], np.where(here, ws[s][t], 0))
            assert rd.recv_x[n].tobytes() == xs[s][t].tobytes()
        pairs = [int(sum((i == d * local + e).sum() for i in idx)) for e in range(local)]
        assert rd.num_recv_tokens_per_expert == [-(-p // align) * align for p in pairs]
        padded = ref.pad_to_worst(rd, len(rows) + 3)
        assert (padded.recv_topk_idx[len(rows):] == -1).all()

    ys = [rng.standard_normal(rd.recv_x.shape).astype(F32).astype(BF16) for rd in out]
    b0 = [rng.standard_normal((len(i), hidden)).astype(F32).astype(BF16) for i in idx]
    b1 = [rng.standard_normal((len(i), hidden)).astype(F32).astype(BF16) for i in idx]
    got = ref.combine(ys, out, [len(i) for i in idx],
                      recv_topk_weights=[rd.recv_topk_weights for rd in out], bias_0=b0, bias_1=b1)
    for s in range(num_ranks):
        for t in range(len(idx[s])):
            acc = b0[s][t].astype(F32) + b1[s][t].astype(F32)
            acc_w = np.zeros(3, F32)
            for d, rd in enumerate(out):  # ascending rank
                hit = np.nonzero((rd.recv_src_rank == s) & (rd.recv_src_idx == t))[0]
                for n in hit:
                    acc = (acc + ys[d][n].astype(F32)).astype(F32)
                    acc_w = (acc_w + rd.recv_topk_weights[n]).astype(F32)
            assert got[s][0][t].tobytes() == acc.astype(BF16).tobytes()
            assert got[s][1][t].tobytes() == acc_w.tobytes()
