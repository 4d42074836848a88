"""Tests of the executable specification (epd.server.reference): hand-worked examples written out
from DESIGN.md section 6, and hypothesis-checked invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd.proto.dtypes import BFLOAT16, FLOAT8_E4M3
from epd.server import reference as ref

F32 = np.float32

# ------------------------------------------------------------------------------------------
# The hand-worked example: 2 ranks, 4 experts (L = 2: experts 0,1 on rank 0; 2,3 on rank 1).
#   rank 0: t0 -> [0, 3] w [.75, .25]   (ranks 0 and 1)
#           t1 -> [1, -1] w [1, 0]      (rank 0 only)
#           t2 -> [2, 3] w [.5, .5]     (rank 1 only, two experts there)
#   rank 1: t0 -> [-1, -1]              (nowhere)
#           t1 -> [3, 0] w [.625, .375] (ranks 1 and 0)
# ------------------------------------------------------------------------------------------
IDX = [np.array([[0, 3], [1, -1], [2, 3]], dtype=np.int64),
       np.array([[-1, -1], [3, 0]], dtype=np.int64)]
W = [np.array([[0.75, 0.25], [1.0, 0.0], [0.5, 0.5]], dtype=F32),
     np.array([[0.0, 0.0], [0.625, 0.375]], dtype=F32)]
X = [np.array([[1, 2], [3, 4], [5, 6]], dtype=F32).astype(BFLOAT16),
     np.array([[7, 8], [9, 10]], dtype=F32).astype(BFLOAT16)]


def test_layout_hand_example() -> None:
    lay0 = ref.get_dispatch_layout(IDX[0], 4, 2)
    np.testing.assert_array_equal(lay0.num_tokens_per_rank, [2, 2])
    np.testing.assert_array_equal(lay0.num_tokens_per_expert, [1, 1, 1, 2])
    np.testing.assert_array_equal(lay0.is_token_in_rank, [[True, True], [True, False],
                                                          [False, True]])
    assert lay0.num_tokens_per_rank.dtype == np.int32
    assert lay0.num_tokens_per_expert.dtype == np.int32
    lay1 = ref.get_dispatch_layout(IDX[1], 4, 2)
    np.testing.assert_array_equal(lay1.num_tokens_per_rank, [1, 1])
    np.testing.assert_array_equal(lay1.num_tokens_per_expert, [1, 0, 0, 1])
    np.testing.assert_array_equal(lay1.is_token_in_rank, [[False, False], [True, True]])


def test_dispatch_hand_example() -> None:
    d0, d1 = ref.dispatch(X, IDX, W, 4)
    # rank 0 receives (s0,t0), (s0,t1), (s1,t1)
    np.testing.assert_array_equal(d0.recv_x.astype(F32), [[1, 2], [3, 4], [9, 10]])
    assert d0.recv_x.dtype == BFLOAT16
    assert d0.recv_x_scales is None
    np.testing.assert_array_equal(d0.recv_topk_idx, [[0, -1], [1, -1], [-1, 0]])
    assert d0.recv_topk_idx.dtype == np.int64
    np.testing.assert_array_equal(d0.recv_topk_weights, [[0.75, 0], [1, 0], [0, 0.375]])
    assert d0.recv_topk_weights.dtype == F32
    assert d0.num_recv_tokens_per_expert == [2, 1]
    np.testing.assert_array_equal(d0.recv_src_rank, [0, 0, 1])
    np.testing.assert_array_equal(d0.recv_src_idx, [0, 1, 1])
    np.testing.assert_array_equal(d0.src_offsets, [0, 2, 3])
    assert d0.recv_src_rank.dtype == np.int32 and d0.src_offsets.dtype == np.int64
    # rank 1 receives (s0,t0), (s0,t2), (s1,t1); (s0,t2) once although it has two experts there
    np.testing.assert_array_equal(d1.recv_x.astype(F32), [[1, 2], [5, 6], [9, 10]])
    np.testing.assert_array_equal(d1.recv_topk_idx, [[-1, 1], [0, 1], [1, -1]])
    np.testing.assert_array_equal(d1.recv_topk_weights, [[0, 0.25], [0.5, 0.5], [0.625, 0]])
    assert d1.num_recv_tokens_per_expert == [1, 3]
    np.testing.assert_array_equal(d1.recv_src_rank, [0, 0, 1])
    np.testing.assert_array_equal(d1.recv_src_idx, [0, 2, 1])
    np.testing.assert_array_equal(d1.src_offsets, [0, 2, 3])


@pytest.mark.parametrize(("alignment", "expected"), [(1, ([2, 1], [1, 3])),
                                                     (2, ([2, 2], [2, 4])),
                                                     (4, ([4, 4], [4, 4])),
                                                     (3, ([3, 3], [3, 3]))])
def test_dispatch_alignment_hand_example(alignment: int, expected: tuple) -> None:
    d0, d1 = ref.dispatch(X, IDX, W, 4, expert_alignment=alignment)
    assert (d0.num_recv_tokens_per_expert, d1.num_recv_tokens_per_expert) == expected
    assert d0.recv_x.shape[0] == 3  # only the count is rounded, rows are not padded


def test_dispatch_without_topk_hand_example() -> None:
    """DeepEP V1's topk_idx=None: routed by is_token_in_rank alone (the hand example's layout),
    the same rows in the same order, no recv_topk_*, counts summed from the sources'
    num_tokens_per_expert; combine sums the rows without weights."""
    lays = [ref.get_dispatch_layout(i, 4, 2) for i in IDX]
    in_rank = [lay.is_token_in_rank for lay in lays]
    per_expert = [lay.num_tokens_per_expert for lay in lays]
    with_topk = ref.dispatch(X, IDX, W, 4)
    for align in (1, 2):
        without = ref.dispatch(X, None, None, 4, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, expert_alignment=align)
        for a, b in zip(with_topk, without, strict=True):
            np.testing.assert_array_equal(a.recv_x.astype(F32), b.recv_x.astype(F32))
            np.testing.assert_array_equal(a.recv_src_rank, b.recv_src_rank)
            np.testing.assert_array_equal(a.recv_src_idx, b.recv_src_idx)
            np.testing.assert_array_equal(a.src_offsets, b.src_offsets)
            assert b.recv_topk_idx is None and b.recv_topk_weights is None
        want = ([2, 1], [1, 3]) if align == 1 else ([2, 2], [2, 4])
        assert tuple(d.num_recv_tokens_per_expert for d in without) == want
    # A routing no top-k could give: rank 1's t0 goes to both ranks, counts as declared.
    in_rank2 = [in_rank[0], np.array([[True, True], [False, False]])]
    per_expert2 = [per_expert[0], np.array([5, 0, 0, 7], dtype=np.int32)]
    d0, d1 = ref.dispatch(X, None, None, 4, is_token_in_rank=in_rank2,
                          num_tokens_per_expert=per_expert2)
    np.testing.assert_array_equal(d0.recv_x.astype(F32), [[1, 2], [3, 4], [7, 8]])
    np.testing.assert_array_equal(d1.recv_x.astype(F32), [[1, 2], [5, 6], [7, 8]])
    assert (d0.num_recv_tokens_per_expert, d1.num_recv_tokens_per_expert) == ([6, 1], [1, 9])
    ys = [np.array([[1, 1], [2, 2], [3, 3]], dtype=F32),
          np.array([[10, 10], [20, 20], [30, 30]], dtype=F32)]
    (out0, w0), (out1, w1) = ref.combine(ys, [d0, d1], [3, 2])
    np.testing.assert_array_equal(out0, [[11, 11], [2, 2], [20, 20]])
    np.testing.assert_array_equal(out1, [[33, 33], [0, 0]])
    assert w0 is None and w1 is None
    with pytest.raises(ValueError, match="is_token_in_rank"):
        ref.dispatch(X, None, None, 4)
    with pytest.raises(ValueError, match="without top-k"):
        ref.dispatch(X, IDX, W, 4, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match="bool"):
        ref.dispatch(X, None, None, 4, is_token_in_rank=[m.astype(np.int32) for m in in_rank],
                     num_tokens_per_expert=per_expert)


def test_combine_hand_example() -> None:
    disp = ref.dispatch(X, IDX, W, 4)
    ys = [np.array([[1, 1], [2, 2], [3, 3]], dtype=F32),
          np.array([[10, 10], [20, 20], [30, 30]], dtype=F32)]
    (out0, w0), (out1, w1) = ref.combine(ys, disp, [3, 2], recv_topk_weights=[
        d.recv_topk_weights for d in disp])
    np.testing.assert_array_equal(out0, [[11, 11], [2, 2], [20, 20]])
    np.testing.assert_array_equal(out1, [[0, 0], [33, 33]])
    assert out0.dtype == F32
    np.testing.assert_array_equal(w0, [[0.75, 0.25], [1, 0], [0.5, 0.5]])
    np.testing.assert_array_equal(w1, [[0, 0], [0.625, 0.375]])
    assert w0.dtype == F32
    # without recv_topk_weights there are no combined weights
    assert ref.combine(ys, disp, [3, 2])[0][1] is None


def test_combine_biases_hand_example() -> None:
    disp = ref.dispatch(X, IDX, W, 4)
    ys = [np.array([[1, 1], [2, 2], [3, 3]], dtype=F32),
          np.array([[10, 10], [20, 20], [30, 30]], dtype=F32)]
    b0 = [np.full((3, 2), 100, dtype=F32), np.array([[1, -1], [0, 0]], dtype=F32)]
    b1 = [np.full((3, 2), 0.5, dtype=F32).astype(BFLOAT16), np.ones((2, 2), dtype=BFLOAT16)]
    (out0, _), (out1, _) = ref.combine(ys, disp, [3, 2], bias_0=b0, bias_1=b1)
    np.testing.assert_array_equal(out0, [[111.5, 111.5], [102.5, 102.5], [120.5, 120.5]])
    # token (1, 0) was routed nowhere: it gets the biases only
    np.testing.assert_array_equal(out1, [[2, 0], [34, 34]])
    (out0, _), (out1, _) = ref.combine(ys, disp, [3, 2], bias_0=b0)
    np.testing.assert_array_equal(out1, [[1, -1], [33, 33]])


def test_combine_bf16_rounding() -> None:
    """fp32 accumulation then one round-to-nearest-even cast to bf16 (8 significant bits)."""
    idx = [np.array([[0, 1]] * 4, dtype=np.int64), np.zeros((0, 2), dtype=np.int64)]
    w = [np.full((4, 2), 0.5, dtype=F32), np.zeros((0, 2), dtype=F32)]
    x = [np.ones((4, 1), dtype=BFLOAT16), np.zeros((0, 1), dtype=BFLOAT16)]
    disp = ref.dispatch(x, idx, w, 2)  # experts 0 on rank 0, 1 on rank 1; every token on both
    e8, e9 = 2.0 ** -8, 2.0 ** -9
    y0 = np.array([[1.0], [1.0], [1.0 + 2 * e8], [1.0]], dtype=F32).astype(BFLOAT16)
    y1 = np.array([[e8], [e8], [e8], [3 * e9]], dtype=F32).astype(BFLOAT16)
    b0 = [np.array([[0.0], [e8], [0.0], [0.0]], dtype=F32), np.zeros((0, 1), dtype=F32)]
    (out, _), _ = ref.combine([y0, y1], disp, [4, 0], bias_0=b0)
    assert out.dtype == BFLOAT16
    expected = [1.0,              # 1 + 2^-8: a tie, to even -> 1
                1.0 + 2 * e8,     # 2^-8 + 1 + 2^-8 exact in fp32 (stepwise bf16 would give 1)
                1.0 + 4 * e8,     # 1.0078125 + 2^-8: a tie, to even (mantissa ...10) -> up
                1.0 + 2 * e8]     # 1 + 3 * 2^-9 above the midpoint -> up
    np.testing.assert_array_equal(out.astype(F32)[:, 0], expected)


def test_combine_adds_in_ascending_rank_order() -> None:
    """fp32: (2^24 + 1) + 1 == 2^24, whereas 1 + 1 + 2^24 == 2^24 + 2."""
    idx = [np.array([[2, 0, 1]], dtype=np.int64), np.zeros((0, 3), np.int64),
           np.zeros((0, 3), np.int64)]
    w = [np.ones((1, 3), F32), np.zeros((0, 3), F32), np.zeros((0, 3), F32)]
    x = [np.ones((1, 1), F32), np.zeros((0, 1), F32), np.zeros((0, 1), F32)]
    disp = ref.dispatch(x, idx, w, 3)
    ys = [np.array([[2.0 ** 24]], F32), np.array([[1.0]], F32), np.array([[1.0]], F32)]
    (out, _), _, _ = ref.combine(ys, disp, [1, 0, 0])
    assert out[0, 0] == 2.0 ** 24
    ys = [np.array([[1.0]], F32), np.array([[1.0]], F32), np.array([[2.0 ** 24]], F32)]
    (out, _), _, _ = ref.combine(ys, disp, [1, 0, 0])
    assert out[0, 0] == 2.0 ** 24 + 2


def test_rank_receiving_nothing_and_zero_tokens() -> None:
    idx = [np.array([[0, 1], [1, -1]], np.int64), np.zeros((0, 2), np.int64)]
    w = [np.full((2, 2), 0.5, F32), np.zeros((0, 2), F32)]
    x = [np.ones((2, 3), BFLOAT16), np.zeros((0, 3), BFLOAT16)]
    d0, d1 = ref.dispatch(x, idx, w, 4, expert_alignment=8)
    assert d0.num_recv_tokens_per_expert == [8, 8]
    assert d1.recv_x.shape == (0, 3) and d1.recv_x.dtype == BFLOAT16
    assert d1.recv_topk_idx.shape == (0, 2) and d1.recv_topk_weights.shape == (0, 2)
    assert d1.recv_src_rank.shape == (0,) and d1.recv_src_idx.shape == (0,)
    assert d1.num_recv_tokens_per_expert == [0, 0]
    np.testing.assert_array_equal(d1.src_offsets, [0, 0, 0])
    ys = [d0.recv_x, d1.recv_x]
    (out0, _), (out1, _) = ref.combine(ys, [d0, d1], [2, 0])
    np.testing.assert_array_equal(out0.astype(F32), np.ones((2, 3)))
    assert out1.shape == (0, 3) and out1.dtype == BFLOAT16

    lay = ref.get_dispatch_layout(np.zeros((0, 2), np.int64), 4, 2)
    assert lay.is_token_in_rank.shape == (0, 2)
    np.testing.assert_array_equal(lay.num_tokens_per_rank, [0, 0])
    np.testing.assert_array_equal(lay.num_tokens_per_expert, [0, 0, 0, 0])


def test_all_zero_tokens() -> None:
    x = [np.zeros((0, 4), F32)] * 2
    idx = [np.zeros((0, 3), np.int64)] * 2
    w = [np.zeros((0, 3), F32)] * 2
    disp = ref.dispatch(x, idx, w, 4, expert_alignment=4)
    for d in disp:
        assert d.recv_x.shape == (0, 4)
        assert d.num_recv_tokens_per_expert == [0, 0]
    res = ref.combine([d.recv_x for d in disp], disp, [0, 0],
                      recv_topk_weights=[d.recv_topk_weights for d in disp])
    for out, cw in res:
        assert out.shape == (0, 4) and cw.shape == (0, 3)
    ll = ref.low_latency_dispatch(x, idx, 4, 2)
    assert all(int(d.recv_count.sum()) == 0 for d in ll)
    out = ref.low_latency_combine([d.recv_x for d in ll], ll, idx, w, 4)
    assert all(o.shape == (0, 4) for o in out)


def test_fp8_carried_bit_exactly() -> None:
    rng = np.random.default_rng(7)
    # every byte pattern, NaNs (0x7f, 0xff) and -0 (0x80) included
    raw = [rng.integers(0, 256, (5, 256), dtype=np.uint8), np.arange(512, dtype=np.uint16)
           .astype(np.uint8).reshape(2, 256)]
    xs = [r.view(FLOAT8_E4M3) for r in raw]
    scales = [rng.random((5, 2), dtype=F32), rng.random((2, 2), dtype=F32)]
    idx = [ref.random_routing(rng, 5, 4, 2, num_ranks=2)[0],
           np.array([[0, 2], [3, -1]], np.int64)]
    w = [np.ones((5, 2), F32), np.ones((2, 2), F32)]
    for d in ref.dispatch(xs, idx, w, 4, x_scales=scales):
        assert d.recv_x.dtype == FLOAT8_E4M3
        assert d.recv_x_scales is not None and d.recv_x_scales.dtype == F32
        for row, (s, t) in enumerate(zip(d.recv_src_rank, d.recv_src_idx, strict=True)):
            np.testing.assert_array_equal(d.recv_x[row].view(np.uint8), raw[s][t])
            np.testing.assert_array_equal(d.recv_x_scales[row], scales[s][t])


def test_fp8_int32_scales_carried_bit_exactly() -> None:
    """vLLM's MXFP8 dispatch: int32 scale words (4 packed UE8M0 bytes), any bits, travel with
    their rows unchanged and come back int32, with and without top-k and with padding."""
    rng = np.random.default_rng(11)
    xs = [rng.integers(0, 256, (n, 256), dtype=np.uint8).view(FLOAT8_E4M3) for n in (5, 3)]
    words = [rng.integers(-2 ** 31, 2 ** 31, (n, 2), dtype=np.int64).astype(np.int32)
             for n in (5, 3)]
    idx = [ref.random_routing(rng, 5, 4, 2, num_ranks=2)[0],
           np.array([[0, 2], [3, -1], [-1, -1]], np.int64)]
    w = [np.ones((5, 2), F32), np.ones((3, 2), F32)]
    in_rank = [np.array([[1, 0], [1, 1], [0, 1], [0, 0], [1, 1]], bool),
               np.array([[0, 1], [1, 0], [1, 1]], bool)]
    per_expert = [np.zeros(4, np.int32), np.zeros(4, np.int32)]
    for disp in (ref.dispatch(xs, idx, w, 4, x_scales=words),
                 ref.dispatch(xs, None, None, 4, x_scales=words, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert)):
        for d in disp:
            assert d.recv_x_scales is not None and d.recv_x_scales.dtype == np.int32
            assert d.recv_x_scales.shape == (len(d.recv_src_idx), 2)
            for row, (s, t) in enumerate(zip(d.recv_src_rank, d.recv_src_idx, strict=True)):
                np.testing.assert_array_equal(d.recv_x_scales[row], words[s][t])
            p = ref.pad_to_worst(d, len(d.recv_src_idx) + 2)
            assert p.recv_x_scales.dtype == np.int32
            np.testing.assert_array_equal(p.recv_x_scales[-2:], 0)
    with pytest.raises(ValueError, match="mix dtypes"):
        ref.dispatch(xs, idx, w, 4, x_scales=[words[0], words[1].view(F32)])
    with pytest.raises(ValueError, match="floating or int32"):
        ref.dispatch(xs, idx, w, 4, x_scales=[words[0].astype(np.int64), words[1]])


def test_pad_to_worst() -> None:
    d0, d1 = ref.dispatch(X, IDX, W, 4, expert_alignment=2)
    p = ref.pad_to_worst(d0, 5)
    assert p.recv_x.shape == (5, 2) and p.recv_x.dtype == BFLOAT16
    np.testing.assert_array_equal(p.recv_x[:3].astype(F32), d0.recv_x.astype(F32))
    np.testing.assert_array_equal(p.recv_x[3:].astype(F32), 0)
    np.testing.assert_array_equal(p.recv_topk_idx, [[0, -1], [1, -1], [-1, 0], [-1, -1],
                                                    [-1, -1]])
    np.testing.assert_array_equal(p.recv_topk_weights[3:], 0)
    np.testing.assert_array_equal(p.recv_src_rank, [0, 0, 1, -1, -1])
    np.testing.assert_array_equal(p.recv_src_idx, [0, 1, 1, -1, -1])
    assert p.num_recv_tokens_per_expert == d0.num_recv_tokens_per_expert
    np.testing.assert_array_equal(p.src_offsets, d0.src_offsets)
    assert ref.pad_to_worst(d0, 3).recv_x.shape == (3, 2)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        ref.pad_to_worst(d0, 2)
    # combine over padded outputs: padding rows (any content) are ignored
    p1 = ref.pad_to_worst(d1, 4)
    ys = [np.full((5, 2), 7, F32), np.full((4, 2), 1, F32)]
    ys[0][:3] = [[1, 1], [2, 2], [3, 3]]
    ys[1][:3] = [[10, 10], [20, 20], [30, 30]]
    (out0, cw0), (out1, _) = ref.combine(ys, [p, p1], [3, 2], recv_topk_weights=[
        p.recv_topk_weights, p1.recv_topk_weights])
    np.testing.assert_array_equal(out0, [[11, 11], [2, 2], [20, 20]])
    np.testing.assert_array_equal(out1, [[0, 0], [33, 33]])
    np.testing.assert_array_equal(cw0, W[0])


def test_pad_to_worst_fp8_scales() -> None:
    rng = np.random.default_rng(3)
    q, sc = ref.quantize_fp8(ref.random_x(rng, 3, 128, BFLOAT16))
    idx = [np.array([[0], [1], [0]], np.int64)]
    (d,) = ref.dispatch([q], idx, [np.ones((3, 1), F32)], 2, x_scales=[sc])
    p = ref.pad_to_worst(d, 4)
    assert p.recv_x_scales.shape == (4, 1)
    np.testing.assert_array_equal(p.recv_x_scales[:3], sc)
    assert p.recv_x_scales[3, 0] == 0
    np.testing.assert_array_equal(p.recv_x[3].view(np.uint8), 0)


# ------------------------------------------------------------------------------------------
# quantize_fp8 and low-latency mode, by hand
# ------------------------------------------------------------------------------------------

def test_quantize_fp8_hand_example() -> None:
    x = np.zeros((3, 256), F32)
    x[0, :3] = [448, -224, 1]          # block amax 448 -> scale 1, q == x
    x[0, 128:130] = [896, -1]          # amax 896 -> scale 2
    x[1, :2] = [300, 150]              # amax 300 -> scale 300/448; round_scale -> 1
    # row 2 all zero: amax clamped to 1e-4
    q, sc = ref.quantize_fp8(x)
    assert q.dtype == FLOAT8_E4M3 and sc.dtype == F32 and sc.shape == (3, 2)
    np.testing.assert_array_equal(sc[0], [1, 2])
    assert sc[1, 0] == F32(300) / F32(448)
    assert sc[2, 0] == F32(1e-4) / F32(448)
    np.testing.assert_array_equal(q[0, :3].astype(F32), [448, -224, 1])
    np.testing.assert_array_equal(q[0, 128:130].astype(F32), [448, -0.5])
    assert q[1, 0].astype(F32) == 448
    np.testing.assert_array_equal(q[2].astype(F32), 0)
    q, sc = ref.quantize_fp8(x, round_scale=True)
    np.testing.assert_array_equal(sc[:2], [[1, 2], [1, 2.0 ** -22]])
    np.testing.assert_array_equal(q[1, :2].astype(F32), [288, 144])  # e4m3 rounding of 300, 150
    assert sc[2, 0] == 2.0 ** -22  # 1e-4/448 = 2.23e-7 -> 2^-22 = 2.38e-7
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.quantize_fp8(np.ones((1, 100), F32))


def test_low_latency_hand_example() -> None:
    ll0, ll1 = ref.low_latency_dispatch(X, IDX, 4, 3)
    assert ll0.recv_x.shape == (2, 6, 2) and ll0.recv_x.dtype == BFLOAT16
    assert ll0.recv_x_scales is None
    np.testing.assert_array_equal(ll0.recv_count, [2, 1])
    np.testing.assert_array_equal(ll0.recv_src_rank[0], [0, 1, -1, -1, -1, -1])
    np.testing.assert_array_equal(ll0.recv_src_idx[0], [0, 1, -1, -1, -1, -1])
    np.testing.assert_array_equal(ll0.recv_src_rank[1], [0, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(ll0.recv_src_idx[1], [1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(ll0.recv_x[0, :2].astype(F32), [[1, 2], [9, 10]])
    np.testing.assert_array_equal(ll0.recv_x[0, 2:].astype(F32), 0)
    np.testing.assert_array_equal(ll1.recv_count, [1, 3])
    np.testing.assert_array_equal(ll1.recv_src_rank[1, :3], [0, 0, 1])
    np.testing.assert_array_equal(ll1.recv_src_idx[1, :3], [0, 2, 1])
    np.testing.assert_array_equal(ll1.recv_src_idx[0, :1], [2])
    np.testing.assert_array_equal(ll1.recv_x[1, :3].astype(F32), [[1, 2], [5, 6], [9, 10]])

    # expert e outputs (e + 1) * x; out = sum_k w_k (e_k + 1) x
    ys = []
    for d, ll in enumerate((ll0, ll1)):
        factor = np.array([2 * d + 1, 2 * d + 2], F32)[:, None, None]
        ys.append(ll.recv_x.astype(F32) * factor)
    out0, out1 = ref.low_latency_combine(ys, [ll0, ll1], IDX, W, 4)
    assert out0.dtype == F32
    np.testing.assert_array_equal(out0, [[0.75 * 1 * 1 + 0.25 * 4 * 1, 0.75 * 2 + 0.25 * 8],
                                         [2 * 3, 2 * 4],
                                         [0.5 * 3 * 5 + 0.5 * 4 * 5, 0.5 * 3 * 6 + 0.5 * 4 * 6]])
    np.testing.assert_array_equal(out1, [[0, 0], [0.625 * 4 * 9 + 0.375 * 1 * 9,
                                                  0.625 * 4 * 10 + 0.375 * 1 * 10]])


def _exact_fma_f32(a: float, b: float, c: float) -> np.float32:
    """a * b + c rounded once to float32, from exact rational arithmetic."""
    from fractions import Fraction
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if v == 0:
        return np.float32(float(a) * float(b) + float(c))  # (the signed zero of IEEE's rule)
    lo = np.float32(float(v))  # a float64 near v, rounded to float32: within one ulp of RN(v)
    best = min((np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))),
               key=lambda q: (abs(Fraction(float(q)) - v),
                              int(np.array(q, np.float32).view(np.int32)) & 1))
    return np.float32(best)


def test_fma_f32_rounds_once() -> None:
    # 2^24 + 2 + (1 + 2^-23)(1 - 2^-23) = 2^24 + 3 - 2^-46: just below a float32 midpoint. The
    # float64 sum rounds onto the midpoint, and float32's tie to even then gives 2^24 + 4; the
    # once-rounded result is 2^24 + 2.
    a, b, c = np.float32(1 + 2 ** -23), np.float32(1 - 2 ** -23), np.float32(2 ** 24 + 2)
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == 2 ** 24 + 4
    assert ref.fma_f32(a, b, c) == 2 ** 24 + 2 == _exact_fma_f32(a, b, c)
    # the fused product: w * y + acc differs from round(round(w * y) + acc) here
    w, y, acc = np.float32(0.1), np.float32(3.3), np.float32(1e-8)
    assert ref.fma_f32(w, y, acc) == _exact_fma_f32(w, y, acc)
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(4000) * np.exp2(rng.integers(-30, 30, 4000))).astype(F32)
    b = rng.standard_normal(4000).astype(F32)
    c = np.concatenate([(a * b)[:2000] * np.float32(-1.0000001),  # cancellation
                        rng.standard_normal(2000).astype(F32)]).astype(F32)
    got = ref.fma_f32(a, b, c)
    want = np.array([_exact_fma_f32(*t) for t in zip(a, b, c, strict=True)], F32)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    assert np.any(got != (a * b + c))  # (not the unfused sum: the inputs exercise the rounding)
    special = ref.fma_f32(np.array([np.inf, 3e38, np.nan, -0.0], F32),
                          np.array([1, 10, 1, 1], F32), np.array([1, 0, 0, 0.0], F32))
    assert special[0] == np.inf and special[1] == np.inf and np.isnan(special[2])
    assert special[3] == 0 and not np.signbit(special[3])  # -0 + +0 is +0


def test_low_latency_combine_fuses_each_term() -> None:
    """Each k adds w * y with one rounding, as DeepEP's compiled `acc += float(x) * w`."""
    rng = np.random.default_rng(11)
    t, h, k, experts = 64, 128, 4, 8
    routes = [ref.random_routing(rng, t, experts, k, drop_prob=0.1) for _ in range(2)]
    idx, ws = [r[0] for r in routes], [r[1] for r in routes]
    xs = [ref.random_x(rng, t, h, dtype=F32) for _ in range(2)]
    disp = ref.low_latency_dispatch(xs, idx, experts, t)
    ys = [d.recv_x * np.float32(1.37) for d in disp]
    out = ref.low_latency_combine(ys, disp, idx, ws, experts)
    unfused_differs = False
    for s in range(2):  # the same sum, term by term, with the exact FMA
        acc, plain = np.zeros((t, h), F32), np.zeros((t, h), F32)
        for kk in range(k):
            for tok in range(t):
                e = int(idx[s][tok, kk])
                if e < 0:
                    continue
                d, le = divmod(e, experts // 2)
                row = int(np.nonzero((disp[d].recv_src_rank[le] == s)
                                     & (disp[d].recv_src_idx[le] == tok))[0][0])
                acc[tok] = ref.fma_f32(ws[s][tok, kk], ys[d][le, row], acc[tok])
                plain[tok] = plain[tok] + ws[s][tok, kk] * ys[d][le, row]
        np.testing.assert_array_equal(out[s].view(np.int32), acc.view(np.int32))
        unfused_differs |= not np.array_equal(out[s], plain)
    assert unfused_differs  # (rounding the product apart gives other sums: the test can fail)


def test_low_latency_fp8_dispatch() -> None:
    rng = np.random.default_rng(11)
    xs = [ref.random_x(rng, 4, 256, BFLOAT16) for _ in range(2)]
    idx = [ref.random_routing(rng, 4, 4, 2, num_ranks=2)[0] for _ in range(2)]
    for round_scale in (False, True):
        for ll in ref.low_latency_dispatch(xs, idx, 4, 4, use_fp8=True, round_scale=round_scale):
            assert ll.recv_x.dtype == FLOAT8_E4M3 and ll.recv_x_scales.shape == (2, 8, 2)
            for e in range(2):
                for row in range(int(ll.recv_count[e])):
                    s, t = ll.recv_src_rank[e, row], ll.recv_src_idx[e, row]
                    q, sc = ref.quantize_fp8(xs[s][t:t + 1], round_scale)
                    np.testing.assert_array_equal(ll.recv_x[e, row].view(np.uint8),
                                                  q[0].view(np.uint8))
                    np.testing.assert_array_equal(ll.recv_x_scales[e, row], sc[0])
    with pytest.raises(ValueError, match="multiple of 128"):
        ref.low_latency_dispatch([np.ones((1, 64), BFLOAT16)], [np.zeros((1, 1), np.int64)],
                                 2, 2, use_fp8=True)


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------

def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        ref.get_dispatch_layout(IDX[0], 5, 2)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        ref.dispatch(X, IDX, W, 3)
    with pytest.raises(ValueError, match=r"out of range \[-1, 4\)"):
        ref.get_dispatch_layout(np.array([[0, 4]]), 4, 2)
    with pytest.raises(ValueError, match="out of range"):
        ref.dispatch(X, [IDX[0], np.array([[-2, 0], [1, 1]])], W, 4)
    with pytest.raises(ValueError, match="shape"):
        ref.dispatch(X, [IDX[0][:2], IDX[1]], W, 4)
    with pytest.raises(ValueError, match="topk_weights"):
        ref.dispatch(X, IDX, [W[0][:, :1], W[1]], 4)
    with pytest.raises(ValueError, match="one per rank"):
        ref.dispatch(X, IDX[:1], W, 4)
    with pytest.raises(ValueError, match="multiple of 128"):
        x8 = [np.zeros((3, 64), FLOAT8_E4M3), np.zeros((2, 64), FLOAT8_E4M3)]
        ref.dispatch(x8, IDX, W, 4, x_scales=[np.ones((3, 1), F32), np.ones((2, 1), F32)])
    with pytest.raises(ValueError, match="x_scales"):
        x8 = [np.zeros((3, 128), FLOAT8_E4M3), np.zeros((2, 128), FLOAT8_E4M3)]
        ref.dispatch(x8, IDX, W, 4, x_scales=[np.ones((3, 2), F32), np.ones((2, 1), F32)])
    with pytest.raises(ValueError, match="expert_alignment"):
        ref.dispatch(X, IDX, W, 4, expert_alignment=0)
    with pytest.raises(ValueError, match="dtype"):
        ref.dispatch([x.astype(np.int32) for x in X], IDX, W, 4)
    disp = ref.dispatch(X, IDX, W, 4)
    with pytest.raises(ValueError, match=r"ys\[1\]"):
        ref.combine([d.recv_x for d in disp[:1]] + [np.zeros((2, 2), BFLOAT16)], disp, [3, 2])
    with pytest.raises(ValueError, match="bias_0"):
        ref.combine([d.recv_x for d in disp], disp, [3, 2],
                    bias_0=[np.zeros((3, 3), F32), np.zeros((2, 2), F32)])
    with pytest.raises(ValueError, match="source index"):
        ref.combine([d.recv_x for d in disp], disp, [3, 1])
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        ref.low_latency_dispatch(X, IDX, 4, 2)
    with pytest.raises(ValueError, match="twice"):
        ref.low_latency_dispatch(X, [IDX[0], np.array([[1, 1], [0, -1]])], 4, 3)


# ------------------------------------------------------------------------------------------
# generators
# ------------------------------------------------------------------------------------------

def test_random_routing() -> None:
    rng = np.random.default_rng(0)
    idx, w = ref.random_routing(rng, 50, 16, 4)
    assert idx.dtype == np.int64 and w.dtype == F32 and idx.shape == w.shape == (50, 4)
    assert all(len(set(row)) == 4 for row in idx.tolist())
    np.testing.assert_allclose(w.sum(axis=1), 1, rtol=1e-6)
    assert (w > 0).all() and ((idx >= 0) & (idx < 16)).all()
    idx, w = ref.random_routing(rng, 400, 16, 4, drop_prob=0.5)
    assert 0.35 < (idx == -1).mean() < 0.65
    np.testing.assert_array_equal(w[idx == -1], 0)
    idx, w = ref.random_routing(rng, 100, 16, 2, hot_rank=2, hot_fraction=0.3, num_ranks=4)
    on_hot = ((idx // 4) == 2).all(axis=1)
    assert on_hot.sum() >= 30
    idx, _ = ref.random_routing(rng, 100, 16, 4, hot_rank=1, hot_fraction=1.0, num_ranks=4)
    assert ((idx // 4) == 1).all()
    idx, w = ref.random_routing(rng, 0, 8, 2)
    assert idx.shape == (0, 2) and w.shape == (0, 2)
    with pytest.raises(ValueError, match="num_topk"):
        ref.random_routing(rng, 4, 8, 9)
    with pytest.raises(ValueError, match="hot_rank"):
        ref.random_routing(rng, 4, 8, 5, hot_rank=0, hot_fraction=0.5, num_ranks=2)


def test_random_x() -> None:
    rng = np.random.default_rng(0)
    for dt in (BFLOAT16, np.float16, np.float32):
        x = ref.random_x(rng, 3, 5, dt)
        assert x.dtype == np.dtype(dt) and x.shape == (3, 5)
        assert np.any(x.astype(F32) != 0)
    assert ref.random_x(rng, 0, 5, BFLOAT16).shape == (0, 5)
    with pytest.raises(ValueError, match="dtype"):
        ref.random_x(rng, 3, 5, np.int32)


# ------------------------------------------------------------------------------------------
# invariants (hypothesis)
# ------------------------------------------------------------------------------------------

@st.composite
def workloads(draw: st.DrawFn, hidden: int | None = None, distinct: bool = False) -> dict:
    """A random multi-rank workload: ranks, experts, per-rank tokens, routing, weights and x."""
    num_ranks = draw(st.integers(1, 4))
    local = draw(st.integers(1, 3))
    num_experts = num_ranks * local
    num_topk = draw(st.integers(1, min(num_experts, 4)))
    hidden = hidden or draw(st.integers(1, 6))
    tokens = draw(st.lists(st.integers(0, 6), min_size=num_ranks, max_size=num_ranks))
    drop = draw(st.sampled_from([0.0, 0.3, 1.0]))
    use_router = distinct or draw(st.booleans())
    dtype = draw(st.sampled_from([BFLOAT16, np.dtype(np.float16), np.dtype(np.float32)]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    idx, w, xs = [], [], []
    for t in tokens:
        if use_router:
            i, wt = ref.random_routing(rng, t, num_experts, num_topk, drop_prob=drop)
        else:  # arbitrary ids, duplicates allowed
            i = rng.integers(-1, num_experts, (t, num_topk)).astype(np.int64)
            wt = rng.random((t, num_topk), dtype=F32)
        idx.append(i)
        w.append(wt)
        xs.append(ref.random_x(rng, t, hidden, dtype))
    return dict(num_ranks=num_ranks, local=local, num_experts=num_experts, num_topk=num_topk,
                tokens=tokens, idx=idx, w=w, xs=xs)


def _ranks_of(idx_row: np.ndarray, local: int) -> set[int]:
    return {int(e) // local for e in idx_row if e >= 0}


@settings(max_examples=80, deadline=None)
@given(wl=workloads(), alignment=st.integers(1, 5))
def test_dispatch_invariants(wl: dict, alignment: int) -> None:
    R, L, idx, w, xs = wl["num_ranks"], wl["local"], wl["idx"], wl["w"], wl["xs"]
    layouts = [ref.get_dispatch_layout(i, wl["num_experts"], R) for i in idx]
    disp = ref.dispatch(xs, idx, w, wl["num_experts"], expert_alignment=alignment)
    unaligned = ref.dispatch(xs, idx, w, wl["num_experts"])
    assert len(disp) == R
    for d, (rd, ru) in enumerate(zip(disp, unaligned, strict=True)):
        n = rd.recv_x.shape[0]
        assert n == sum(int(lay.num_tokens_per_rank[d]) for lay in layouts)
        # counts: layout sums, recv_topk_idx occurrences, alignment rounding up
        for e in range(L):
            pairs = sum(int(lay.num_tokens_per_expert[d * L + e]) for lay in layouts)
            assert ru.num_recv_tokens_per_expert[e] == pairs
            assert pairs == int((rd.recv_topk_idx == e).sum())
            aligned = rd.num_recv_tokens_per_expert[e]
            assert aligned % alignment == 0 and pairs <= aligned < pairs + alignment
        # row order: (src_rank, src_idx) strictly increasing, consistent with src_offsets
        keys = list(zip(rd.recv_src_rank.tolist(), rd.recv_src_idx.tolist(), strict=True))
        assert keys == sorted(set(keys))
        assert rd.src_offsets.shape == (R + 1,)
        for s in range(R):
            lo, hi = rd.src_offsets[s], rd.src_offsets[s + 1]
            assert (rd.recv_src_rank[lo:hi] == s).all()
            expected = [t for t in range(wl["tokens"][s]) if d in _ranks_of(idx[s][t], L)]
            assert rd.recv_src_idx[lo:hi].tolist() == expected
        # row contents
        for row, (s, t) in enumerate(keys):
            np.testing.assert_array_equal(rd.recv_x[row].view(np.uint8),
                                          xs[s][t].view(np.uint8))
            for k in range(wl["num_topk"]):
                e = idx[s][t, k]
                if e >= 0 and e // L == d:
                    assert rd.recv_topk_idx[row, k] == e - d * L
                    assert rd.recv_topk_weights[row, k] == w[s][t, k]
                else:
                    assert rd.recv_topk_idx[row, k] == -1
                    assert rd.recv_topk_weights[row, k] == 0


@settings(max_examples=80, deadline=None)
@given(wl=workloads())
def test_dispatch_combine_roundtrip(wl: dict) -> None:
    L, idx, w, xs = wl["local"], wl["idx"], wl["w"], wl["xs"]
    disp = ref.dispatch(xs, idx, w, wl["num_experts"])
    ys = [rd.recv_x.astype(F32) for rd in disp]
    res = ref.combine(ys, disp, wl["tokens"],
                      recv_topk_weights=[rd.recv_topk_weights for rd in disp])
    for s, (out, cw) in enumerate(res):
        assert out.dtype == F32 and out.shape == xs[s].shape
        n_ranks = np.array([len(_ranks_of(row, L)) for row in idx[s]], dtype=F32)
        np.testing.assert_array_equal(out, xs[s].astype(F32) * n_ranks[:, None])
        valid = idx[s] >= 0
        np.testing.assert_array_equal(cw[valid], w[s][valid])
        np.testing.assert_array_equal(cw[~valid], 0)
    # padding every rank to a worst case changes nothing
    worst = max([rd.recv_x.shape[0] for rd in disp]) + 2
    padded = [ref.pad_to_worst(rd, worst) for rd in disp]
    ys_p = [np.concatenate([y, np.full((worst - y.shape[0], y.shape[1]), 9, F32)]) for y in ys]
    for (out, _), (out_p, _) in zip(res, ref.combine(ys_p, padded, wl["tokens"]), strict=True):
        np.testing.assert_array_equal(out, out_p)


@settings(max_examples=60, deadline=None)
@given(wl=workloads(), max_extra=st.integers(0, 3))
def test_low_latency_invariants(wl: dict, max_extra: int) -> None:
    R, L, E, idx, w, xs = (wl["num_ranks"], wl["local"], wl["num_experts"], wl["idx"], wl["w"],
                           wl["xs"])
    for s in range(R):  # low-latency mode needs distinct experts per token
        for t in range(wl["tokens"][s]):
            seen: set[int] = set()
            for k in range(wl["num_topk"]):
                if idx[s][t, k] in seen:
                    idx[s][t, k] = -1
                seen.add(int(idx[s][t, k]))
    max_tokens = max(wl["tokens"]) + max_extra or 1
    lls = ref.low_latency_dispatch(xs, idx, E, max_tokens)
    for d, ll in enumerate(lls):
        assert ll.recv_x.shape == (L, R * max_tokens, xs[0].shape[1])
        for e in range(L):
            expected = {(s, t) for s in range(R) for t in range(wl["tokens"][s])
                        if d * L + e in idx[s][t].tolist()}
            n = int(ll.recv_count[e])
            got = list(zip(ll.recv_src_rank[e, :n].tolist(), ll.recv_src_idx[e, :n].tolist(),
                           strict=True))
            assert len(got) == len(set(got)) and set(got) == expected
            for row, (s, t) in enumerate(got):
                np.testing.assert_array_equal(ll.recv_x[e, row].view(np.uint8),
                                              xs[s][t].view(np.uint8))
            assert (ll.recv_src_rank[e, n:] == -1).all() and (ll.recv_src_idx[e, n:] == -1).all()
            np.testing.assert_array_equal(ll.recv_x[e, n:].astype(F32), 0)
    # combine: expert e scales its input by (e + 1); reverse each buffer's row order to show
    # that the combine finds rows by (src_rank, src_idx), not by position
    ys, shuffled = [], []
    for d, ll in enumerate(lls):
        y = ll.recv_x.astype(F32) * (np.arange(L, dtype=F32) + d * L + 1)[:, None, None]
        perm_ll = ref.LowLatencyDispatch(ll.recv_x.copy(), None, ll.recv_count,
                                         ll.recv_src_rank.copy(), ll.recv_src_idx.copy())
        for e in range(L):
            n = int(ll.recv_count[e])
            y[e, :n] = y[e, :n][::-1]
            perm_ll.recv_src_rank[e, :n] = ll.recv_src_rank[e, :n][::-1]
            perm_ll.recv_src_idx[e, :n] = ll.recv_src_idx[e, :n][::-1]
        ys.append(y)
        shuffled.append(perm_ll)
    outs = ref.low_latency_combine(ys, shuffled, idx, w, E)
    for s, out in enumerate(outs):
        assert out.dtype == F32 and out.shape == xs[s].shape
        for t in range(wl["tokens"][s]):
            acc = np.zeros(xs[s].shape[1], F32)
            for k in range(wl["num_topk"]):
                e = int(idx[s][t, k])
                if e >= 0:
                    acc = ref.fma_f32(w[s][t, k], xs[s][t].astype(F32) * F32(e + 1), acc)
            np.testing.assert_array_equal(out[t], acc)
    # same routing through ys of bf16: the result is cast once, to bf16
    outs_bf = ref.low_latency_combine([y.astype(BFLOAT16) for y in ys], shuffled, idx, w, E)
    assert all(o.dtype == BFLOAT16 for o in outs_bf)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), tokens=st.integers(0, 5),
       round_scale=st.booleans())
def test_quantize_fp8_invariants(seed: int, tokens: int, round_scale: bool) -> None:
    rng = np.random.default_rng(seed)
    x = ref.random_x(rng, tokens, 256, BFLOAT16).astype(F32) * F32(rng.uniform(1e-3, 1e3))
    q, sc = ref.quantize_fp8(x, round_scale)
    assert q.shape == (tokens, 256) and sc.shape == (tokens, 2)
    qf = q.astype(F32)
    assert np.isfinite(qf).all() and (np.abs(qf) <= 448).all()
    if round_scale:
        np.testing.assert_array_equal(np.log2(sc), np.round(np.log2(sc)))
    deq = qf.reshape(tokens, 2, 128) * sc[:, :, None]
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of the block amax scale
    amax = np.abs(x.reshape(tokens, 2, 128)).max(axis=2, initial=0)[:, :, None]
    assert (np.abs(deq - x.reshape(tokens, 2, 128)) <= amax * 2.0 ** -3 + 1e-30).all()


def test_layout_tokens_per_node():
    """num_tokens_per_rdma_rank (DeepEP): tokens with >=1 expert on a node, nodes of
    ranks_per_node consecutive ranks; None on one node."""
    rng = np.random.default_rng(13)
    idx, _ = ref.random_routing(rng, 40, 16, 3, drop_prob=0.2)
    lay = ref.get_dispatch_layout(idx, 16, 4, num_ranks_per_node=2)
    dest_node = np.where(idx >= 0, idx // 4 // 2, -1)
    want = [int((dest_node == n).any(axis=1).sum()) for n in range(2)]
    assert lay.num_tokens_per_rdma_rank.dtype == np.int32
    assert lay.num_tokens_per_rdma_rank.tolist() == want
    assert ref.tokens_per_node(lay.is_token_in_rank, [0, 0, 1, 1]).tolist() == want
    assert ref.get_dispatch_layout(idx, 16, 4).num_tokens_per_rdma_rank is None
    assert ref.get_dispatch_layout(idx, 16, 4, num_ranks_per_node=4).num_tokens_per_rdma_rank \
        is None
    with pytest.raises(ValueError, match="not a multiple"):
        ref.get_dispatch_layout(idx, 16, 4, num_ranks_per_node=3)
