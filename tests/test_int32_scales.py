"""FP8 dispatch with int32 scale words (issue 11: vLLM's MXFP8 high-throughput path sends packed
UE8M0 scales as int32 [T, H/128], 4 exponent bytes per word), and scales of any width S
(1 <= S <= H/128, every rank's the same), as DeepEP takes them. The daemon carries them as
opaque 4-byte columns, bit for bit, and returns recv_x_scales int32; all ranks of a call must
use the same scale dtype (else every rank fails with FAILED_PRECONDITION).

Two ranks, sessions of this process on two engines of the cpu backend, driven from threads."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from ranklib import Case, join

from epd.client import Session
from epd.proto.errors import EpdError
from epd.server import reference as ref

E, H, K = 8, 256, 2
TOKENS = (14, 19)
_names = itertools.count()


@pytest.fixture
def groups(daemon):
    sessions = [Session(daemon.socket(r), timeout=10.0) for r in range(2)]
    try:
        case = Case(group=f"i32-{next(_names)}", num_ranks=2, num_experts=E, hidden=H,
                    num_topk=K, tokens=TOKENS, max_tokens=32)
        with ThreadPoolExecutor(2) as ex:
            yield list(ex.map(lambda r: join(sessions[r], case, r, timeout=20), range(2)))
    finally:
        for s in sessions:
            s.close()


def both(fn, groups):
    def one(r):
        try:
            return fn(r, groups[r])
        except EpdError as e:
            return e
    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(one, range(2)))


def inputs(seed: int):
    """Per rank: FP8 payload (every byte pattern), random int32 scale words (any bits, NaN
    patterns as float32 included), top-k routing with dropped entries."""
    rng = np.random.default_rng(seed)
    xs, words, idx, w = [], [], [], []
    for t in TOKENS:
        xs.append(rng.integers(0, 256, (t, H), dtype=np.uint8).view(ref.FLOAT8_E4M3))
        words.append(rng.integers(-2 ** 31, 2 ** 31, (t, H // 128), dtype=np.int64)
                     .astype(np.int32))
        i, ww = ref.random_routing(rng, t, E, K, num_ranks=2, drop_prob=0.2)
        idx.append(i)
        w.append(ww)
    return xs, words, idx, w


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


@pytest.mark.parametrize("worst", [0, 40])
def test_int32_scales_dispatch_and_cached_exact(groups, worst):
    xs, words, idx, w = inputs(seed=5 + worst)
    disp = ref.dispatch(xs, idx, w, E, x_scales=words)
    if worst:
        disp = [ref.pad_to_worst(d, worst) for d in disp]

    def fn(r, g):
        fresh = g.dispatch(xs[r], idx[r], w[r], x_scales=words[r], num_worst_tokens=worst)
        fresh_x, fresh_s = np.array(fresh.recv_x), np.array(fresh.recv_x_scales)
        cached = g.dispatch(xs[r], x_scales=words[r], handle=fresh.handle,
                            num_worst_tokens=worst)
        return fresh_x, fresh_s, np.array(cached.recv_x), np.array(cached.recv_x_scales)

    for r, out in enumerate(both(fn, groups)):
        assert not isinstance(out, EpdError), f"rank {r}: {out.code.name}: {out.details}"
        for name, x, s in (("dispatch", out[0], out[1]), ("cached", out[2], out[3])):
            assert s.dtype == np.int32, (name, s.dtype)
            assert x.shape == disp[r].recv_x.shape and s.shape == disp[r].recv_x_scales.shape
            np.testing.assert_array_equal(bits(x), bits(disp[r].recv_x), f"{name} x rank {r}")
            np.testing.assert_array_equal(bits(s), bits(disp[r].recv_x_scales),
                                          f"{name} scales rank {r}")


def test_float32_scales_still_float32(groups):
    xs, words, idx, w = inputs(seed=9)
    fl = [a.view(np.float32) for a in words]  # the same bits as float32 scales
    disp = ref.dispatch(xs, idx, w, E, x_scales=fl)
    res = both(lambda r, g: g.dispatch(xs[r], idx[r], w[r], x_scales=fl[r]), groups)
    for r, out in enumerate(res):
        assert not isinstance(out, EpdError), f"rank {r}: {out.code.name}: {out.details}"
        assert np.asarray(out.recv_x_scales).dtype == np.float32
        np.testing.assert_array_equal(bits(out.recv_x_scales), bits(disp[r].recv_x_scales))


def test_scale_dtype_mismatch_fails_every_rank(groups):
    xs, words, idx, w = inputs(seed=13)
    scales = [words[0], words[1].view(np.float32)]  # rank 0 int32, rank 1 float32

    def fn(r, g):
        return g.dispatch(xs[r], idx[r], w[r], x_scales=scales[r])

    res = both(fn, groups)
    for r, out in enumerate(res):
        assert isinstance(out, EpdError), f"rank {r} answered OK"
        assert out.code == grpc.StatusCode.FAILED_PRECONDITION, (r, out.code, out.details)
        assert "x_scales dtype: int32 on rank 0, float32 on rank 1" in out.details, out.details
    # the group stays usable: a matching call afterwards works (fresh, then cached with a
    # mismatch, which fails together as well)
    ok = both(lambda r, g: g.dispatch(xs[r], idx[r], w[r], x_scales=words[r]), groups)
    assert not any(isinstance(o, EpdError) for o in ok), ok
    res = both(lambda r, g: g.dispatch(xs[r], x_scales=scales[r], handle=ok[r].handle), groups)
    for out in res:
        assert isinstance(out, EpdError) and out.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "x_scales dtype" in out.details, out.details


@pytest.mark.parametrize(("cols", "dtype"), [(1, np.float32), (H // 512 or 1, np.int32),
                                           (H // 128 - 1, np.float32)])
def test_scales_of_any_width_up_to_hidden_over_128(groups, cols, dtype):
    """DeepEP takes scales of any width S and returns recv_x_scales [N, S]: per token
    ([T, 1], vLLM's per_act_token), packed UE8M0 words ([T, H/512] int32, DeepGEMM on
    Blackwell), or any S up to the receive buffers' H/128 columns a row; fresh and cached,
    exact bit for bit."""
    xs, words, idx, w = inputs(seed=21 + cols)
    sc = [np.ascontiguousarray(a[:, :cols]).view(dtype) for a in words]
    disp = ref.dispatch(xs, idx, w, E, x_scales=sc)

    def fn(r, g):
        fresh = g.dispatch(xs[r], idx[r], w[r], x_scales=sc[r])
        fresh_s = np.array(fresh.recv_x_scales)
        cached = g.dispatch(xs[r], x_scales=sc[r], handle=fresh.handle)
        return np.array(fresh.recv_x), fresh_s, np.array(cached.recv_x_scales)

    for r, out in enumerate(both(fn, groups)):
        assert not isinstance(out, EpdError), f"rank {r}: {out.code.name}: {out.details}"
        x, fresh_s, cached_s = out
        assert disp[r].recv_x_scales.shape == (x.shape[0], cols)
        np.testing.assert_array_equal(bits(x), bits(disp[r].recv_x))
        for s in (fresh_s, cached_s):
            assert s.dtype == np.dtype(dtype) and s.shape == (x.shape[0], cols)
            np.testing.assert_array_equal(bits(s), bits(disp[r].recv_x_scales))


def test_scale_widths_differ_across_ranks_fails_every_rank(groups):
    xs, words, idx, w = inputs(seed=31)
    sc = [words[0][:, :1].copy(), words[1][:, :2].copy()]
    res = both(lambda r, g: g.dispatch(xs[r], idx[r], w[r], x_scales=sc[r]), groups)
    for r, out in enumerate(res):
        assert isinstance(out, EpdError), f"rank {r} answered OK"
        assert out.code == grpc.StatusCode.FAILED_PRECONDITION, (r, out.code, out.details)
        assert "x_scales columns: 1 on rank 0, 2 on rank 1" in out.details, out.details
    ok = both(lambda r, g: g.dispatch(xs[r], idx[r], w[r], x_scales=words[r]), groups)
    assert not any(isinstance(o, EpdError) for o in ok), ok


@pytest.mark.parametrize("cols", [0, H // 128 + 1])
def test_scales_wider_than_the_buffers_or_empty_are_refused(groups, cols):
    xs, words, idx, w = inputs(seed=37)
    sc = np.zeros((xs[0].shape[0], cols), np.int32)
    with pytest.raises(EpdError, match=rf"x_scales has shape \[{xs[0].shape[0]}, {cols}\], "
                                       rf"expected \[{xs[0].shape[0]}, S\] with 1 <= S <= "
                                       rf"hidden/128 = {H // 128}") as e:
        groups[0].dispatch(xs[0], idx[0], w[0], x_scales=sc)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    ok = both(lambda r, g: g.dispatch(xs[r], idx[r], w[r], x_scales=words[r]), groups)
    assert not any(isinstance(o, EpdError) for o in ok), ok


def test_other_scale_dtypes_rejected_before_the_collective(groups):
    xs, words, idx, w = inputs(seed=17)
    with pytest.raises(EpdError, match="x_scales: dtype int64") as e:
        groups[0].dispatch(xs[0], idx[0], w[0], x_scales=words[0].astype(np.int64))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_column_major_scales_through_the_facade(daemon):
    """DeepEP's test_intranode passes FP8 scales column-major (`scales.T.contiguous().T`), which
    DeepEP's kernels read as they are: the facade gives the engine dense rows (the engine's
    kernels copy whole rows) and the received scales are exact."""
    import torch

    from epd.client.buffer import Buffer
    from epd.client.tensors import rows_dense
    from epd.proto import dtypes

    col = torch.arange(12, dtype=torch.float32).view(4, 3).T.contiguous().T  # strides (1, 4)
    dense = rows_dense(col)
    assert dense.stride() == (3, 1) and torch.equal(dense, col)
    assert rows_dense(dense) is dense and rows_dense(None) is None
    npcol = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(4, 3))
    assert rows_dense(npcol).flags.c_contiguous and (rows_dense(npcol) == npcol).all()

    inputs = []
    for r in range(2):
        rng = np.random.default_rng(600 + r)
        idx, w = ref.random_routing(rng, TOKENS[r], E, K, drop_prob=0.0)
        xq, sc = ref.quantize_fp8(ref.random_x(rng, TOKENS[r], H, dtypes.BFLOAT16))
        inputs.append((xq, sc, idx, w))

    def rank(r: int):
        xq, sc, idx, w = inputs[r]
        buf = Buffer(None, rank=r, num_ranks=2, endpoint=daemon.socket(r),
                     max_tokens_per_rank=32)
        try:
            tsc = torch.from_numpy(sc).T.contiguous().T
            assert tsc.stride(-1) != 1
            tidx = torch.from_numpy(idx)
            n_rank, _, n_exp, in_rank, _ = buf.get_dispatch_layout(tidx, E)
            recv = buf.dispatch((torch.from_numpy(xq.view(np.uint8)).view(torch.float8_e4m3fn),
                                 tsc), num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=n_exp, topk_idx=tidx,
                                topk_weights=torch.from_numpy(w))[0]
            return recv[1].numpy()
        finally:
            buf.destroy()

    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(rank, range(2)))
    want = ref.dispatch([i[0] for i in inputs], [i[2] for i in inputs], [i[3] for i in inputs],
                        E, x_scales=[i[1] for i in inputs])
    for r in range(2):
        np.testing.assert_array_equal(got[r], want[r].recv_x_scales)
