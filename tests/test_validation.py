"""Bad input gets a precise status and changes nothing (DESIGN.md §7): after every rejected call,
a valid dispatch/combine round of the same group still gives bit-exact results.

The two ranks of the group are sessions of this process (rank 0 on engine 0, rank 1 on
engine 1), driven from threads; malformed requests are crafted as raw protobuf messages."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from ranklib import BF16, FP8, Case, case_round, check_case, comm_arrivals, join, wait_until

from epd.client import Session
from epd.client.group import Handle
from epd.client.tensors import ShmFile
from epd.proto import counter_page, dtypes
from epd.proto import fd_channel as fdc
from epd.proto.errors import EpdError, InvalidArgument
from epd.proto.v1 import epd_pb2
from epd.server import reference as ref

pytestmark = pytest.mark.slow
DAEMON_EXTRA = ["--max-handles-per-session", "64"]
SPEC = Case(group="val", num_ranks=2, num_experts=8, hidden=256, num_topk=4, tokens=(20, 24),
            max_tokens=32, drop_prob=0.2)
T, H, K, E = 20, 256, 4, 8
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
FAILED = grpc.StatusCode.FAILED_PRECONDITION
_seeds = itertools.count(1)
_names = itertools.count()


@dataclasses.dataclass
class Pair:
    sessions: list[Session]
    groups: list
    other: Session  # a third session on engine 0, in no group


def _join(args):
    s, c, r = args
    return join(s, c, r, timeout=20)


@pytest.fixture(scope="module")
def pair(daemon):
    sessions = [Session(daemon.socket(r), timeout=10) for r in range(2)]
    other = Session(daemon.socket(0), timeout=10)
    with ThreadPoolExecutor(2) as ex:
        groups = list(ex.map(_join, [(s, SPEC, r) for r, s in enumerate(sessions)]))
    yield Pair(sessions, groups, other)
    for s in [*sessions, other]:
        s.close()


def both(fn, *per_rank_args):
    with ThreadPoolExecutor(len(per_rank_args[0])) as ex:
        return list(ex.map(fn, *per_rank_args))


def valid_round(p: Pair) -> None:
    c = dataclasses.replace(SPEC, seed=next(_seeds))
    check_case(c, both(lambda s, g, r: case_round(s, g, c, r), p.sessions, p.groups, [0, 1]))


def dispatches(p: Pair) -> int:
    (st,) = p.sessions[0].stats().groups
    return st.dispatches + st.combines


def expect(code: grpc.StatusCode, text: str, fn, *args, **kw) -> EpdError:
    with pytest.raises(EpdError) as ei:
        fn(*args, **kw)
    assert ei.value.code == code, f"{ei.value.code.name}: {ei.value.details}"
    assert text in ei.value.details, f"{text!r} not in {ei.value.details!r}"
    return ei.value


def inputs(t: int = T):
    rng = np.random.default_rng(t)
    idx, w = ref.random_routing(rng, t, E, K, drop_prob=0.1)
    return ref.random_x(rng, t, H, BF16), idx, w


# ------------------------------------------------------------------------------------------------
# bad dispatch inputs through the client API
# ------------------------------------------------------------------------------------------------

def _bad(**changes):
    x, idx, w = inputs()
    args = {"x": x, "topk_idx": idx, "topk_weights": w}
    for k, v in changes.items():
        args[k] = v(args) if callable(v) else v
    return args


BAD_DISPATCH = {
    "x float32": (lambda: _bad(x=lambda a: a["x"].astype(np.float32)), INVALID,
                  "x: dtype float32"),
    "x 3-D": (lambda: _bad(x=lambda a: a["x"].reshape(T, H // 2, 2)), INVALID,
              "x: expected 2 dimensions"),
    "x 1-D": (lambda: _bad(x=lambda a: a["x"].reshape(-1)), INVALID, "x: expected 2 dimensions"),
    "hidden mismatch": (lambda: _bad(x=lambda a: a["x"][:, :128]), INVALID,
                        "x has hidden size 128"),
    "topk_idx int32": (lambda: _bad(topk_idx=lambda a: a["topk_idx"].astype(np.int32)), INVALID,
                       "topk_idx: dtype int32"),
    "topk_idx wrong k": (lambda: _bad(topk_idx=lambda a: a["topk_idx"][:, :3].copy(),
                                      topk_weights=lambda a: a["topk_weights"][:, :3].copy()),
                         INVALID, "topk_idx has shape [20, 3]"),
    "topk_idx wrong rows": (lambda: _bad(topk_idx=lambda a: a["topk_idx"][:5].copy()), INVALID,
                            "topk_idx has shape [5, 4]"),
    "weights float16": (lambda: _bad(topk_weights=lambda a: a["topk_weights"].astype(np.float16)),
                        INVALID, "topk_weights: dtype float16"),
    "weights wrong shape": (lambda: _bad(topk_weights=lambda a: a["topk_weights"][:, :2].copy()),
                            INVALID, "topk_weights has shape [20, 2]"),
    "expert id == E": (lambda: _bad(topk_idx=lambda a: np.where(
        np.arange(T * K).reshape(T, K) == 7, E, a["topk_idx"])), INVALID, "valid ids are -1"),
    "expert id < -1": (lambda: _bad(topk_idx=lambda a: np.where(
        np.arange(T * K).reshape(T, K) == 3, -2, a["topk_idx"])), INVALID, "[-2,"),
    "x_scales on bf16": (lambda: _bad(x_scales=np.ones((T, 2), np.float32)), INVALID,
                         "x_scales is only for FP8"),
    "fp8 without scales": (lambda: _bad(x=lambda a: a["x"].astype(FP8)), INVALID,
                           "FP8 dispatch needs x_scales"),
    "fp8 scales wrong shape": (lambda: _bad(x=lambda a: a["x"].astype(FP8),
                                            x_scales=np.ones((T, 3), np.float32)),
                               INVALID, "x_scales has shape [20, 3], expected [20, S] with "
                                        "1 <= S <= hidden/128 = 2"),
    "fp8 scales float16": (lambda: _bad(x=lambda a: a["x"].astype(FP8),
                                        x_scales=np.ones((T, 2), np.float16)),
                           INVALID, "x_scales: dtype float16"),
    "num_worst_tokens too big": (lambda: _bad(num_worst_tokens=65), INVALID,
                                 "num_worst_tokens=65 exceeds"),
    "negative alignment": (lambda: _bad(expert_alignment=-4), INVALID, "expert_alignment"),
    "negative timeout": (lambda: _bad(timeout=-1.0), INVALID,
                         "timeout must be a positive finite number"),
}


@pytest.mark.parametrize("name", list(BAD_DISPATCH))
def test_bad_dispatch(pair, name):
    # (More tokens than the group holds is not refused on one rank: the dispatch takes part
    # and every rank fails it together, tests/test_collective_consistency.py.)
    make, code, text = BAD_DISPATCH[name]
    before = dispatches(pair)
    expect(code, text, pair.groups[0].dispatch, **make())
    assert dispatches(pair) == before
    valid_round(pair)


def test_bad_layout_inputs(pair):
    g = pair.groups[0]
    _, idx, _ = inputs()
    expect(INVALID, "topk_idx: dtype int32", g.get_dispatch_layout, idx.astype(np.int32))
    expect(INVALID, "valid ids are -1", g.get_dispatch_layout, np.full((4, K), E, np.int64))
    _, idx33, _ = inputs(33)
    expect(INVALID, "max_tokens_per_rank=32", g.get_dispatch_layout, idx33)
    valid_round(pair)


def _garble_after_the_check(p: Pair, idx: np.ndarray, call, peer_call):
    """Start `call` on rank 0, wait until its engine checked the call and took part (its
    arrival word moved: it now waits for rank 1), overwrite `idx` (rank 0's topk_idx, in
    memory the engine reads without a copy) with ids far out of range, then make rank 1's
    call. Returns both results."""
    gid = p.groups[0].group_id
    before = comm_arrivals("", gid, 2)
    assert before is not None
    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(call)
        wait_until(lambda: (a := comm_arrivals("", gid, 2)) is not None and a[0] > before[0],
                   10, "rank 0 takes part")
        idx[...] = np.where(idx >= 0, E + 1000, -5)
        second = peer_call()
        return first.result(timeout=30), second


def test_topk_idx_changed_after_the_check(pair):
    """The cpu backend reads the topk_idx values the engine checked (its own copy), not the
    client's shared memory again: a client rewriting them after the check gets the dispatch of
    the checked values, and its peer too (before, rank 0 raised on the rewritten ids and rank 1
    waited out its deadline)."""
    g0, g1 = pair.groups
    (x0, idx0, w0), (x1, idx1, w1) = inputs(T), inputs(T - 3)
    shared = pair.sessions[0].empty(idx0.shape, idx0.dtype)
    shared[...] = idx0
    out0, out1 = _garble_after_the_check(
        pair, shared, lambda: g0.dispatch(x0, shared, w0, timeout=10),
        lambda: g1.dispatch(x1, idx1, w1, timeout=10))
    want = ref.dispatch([x0, x1], [idx0, idx1], [w0, w1], E)
    for out, rd in zip((out0, out1), want, strict=True):
        np.testing.assert_array_equal(np.asarray(out.recv_topk_idx), rd.recv_topk_idx)
        np.testing.assert_array_equal(np.asarray(out.recv_x).view(np.uint16),
                                      rd.recv_x.view(np.uint16))
    valid_round(pair)


def test_low_latency_topk_idx_changed_after_the_check(pair):
    g0, g1 = pair.groups
    rng = np.random.default_rng(next(_seeds))
    xs = [ref.random_x(rng, t, H, BF16) for t in (T, T - 3)]
    idxs = [ref.random_routing(rng, t, E, K, drop_prob=0.1)[0] for t in (T, T - 3)]
    shared = pair.sessions[0].empty(idxs[0].shape, idxs[0].dtype)
    shared[...] = idxs[0]
    out0, out1 = _garble_after_the_check(
        pair, shared, lambda: g0.low_latency_dispatch(xs[0], shared, T, timeout=10),
        lambda: g1.low_latency_dispatch(xs[1], idxs[1], T, timeout=10))
    want = ref.low_latency_dispatch(xs, idxs, E, T)
    for out, rd in zip((out0, out1), want, strict=True):
        np.testing.assert_array_equal(np.asarray(out.recv_count), rd.recv_count)
        np.testing.assert_array_equal(np.asarray(out.recv_src_idx), rd.recv_src_idx)
    valid_round(pair)


def test_cached_dispatch_misuse(pair):
    c = dataclasses.replace(SPEC, seed=next(_seeds))

    def first(s, g, r):
        inp = c.inputs(r)
        return g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])

    outs = both(first, pair.sessions, pair.groups, [0, 1])
    g = pair.groups[0]
    x, idx, w = inputs()
    expect(INVALID, "handle", g.dispatch, x[:7], handle=outs[0].handle)
    expect(INVALID, "cached dispatch takes no topk_idx", g.dispatch, x, idx, w,
           handle=outs[0].handle)
    valid_round(pair)


# ------------------------------------------------------------------------------------------------
# combine
# ------------------------------------------------------------------------------------------------

def test_bad_combine_then_the_right_one(pair):
    """Rank 0's malformed combines are rejected before the collective: afterwards both ranks
    combine the same dispatch and get the reference results."""
    c = dataclasses.replace(SPEC, seed=next(_seeds), combine_weights=True)

    def disp(s, g, r):
        inp = c.inputs(r)
        return g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])

    outs = both(disp, pair.sessions, pair.groups, [0, 1])
    from ranklib import expert_out
    ys = [expert_out(o.recv_x, None, o.recv_topk_idx, o.recv_topk_weights, r, 4)
          for r, o in enumerate(outs)]
    g, o, y = pair.groups[0], outs[0], ys[0]
    n = o.num_recv_tokens
    assert n > 1
    before = dispatches(pair)
    expect(INVALID, f"combine x has shape [{n - 1}, {H}]", g.combine, y[:-1], o.handle)
    expect(INVALID, "combine x has shape", g.combine, np.concatenate([y, y[:1]]), o.handle)
    expect(INVALID, "x: dtype float32", g.combine, y.astype(np.float32), o.handle)
    expect(INVALID, "combine topk_weights has shape", g.combine, y, o.handle,
           topk_weights=o.recv_topk_weights[:, :2].copy())
    expect(INVALID, "bias_0 has shape", g.combine, y, o.handle,
           bias_0=np.zeros((3, H), BF16))
    expect(INVALID, "bias_1: dtype float32", g.combine, y, o.handle,
           bias_1=np.zeros((T, H), np.float32))
    expect(FAILED, "handle 9999 is not known", g.combine, y,
           Handle(g, 9999, 0, 0, n))
    assert dispatches(pair) == before
    res = both(lambda g, o, y: g.combine(y, o.handle, topk_weights=o.recv_topk_weights),
               pair.groups, outs, ys)
    inputs_ = [c.inputs(r) for r in range(2)]
    disp_ref = ref.dispatch([i["x"] for i in inputs_], [i["topk_idx"] for i in inputs_],
                            [i["topk_weights"] for i in inputs_], E)
    want = ref.combine(ys, disp_ref, list(c.tokens),
                       recv_topk_weights=[d.recv_topk_weights for d in disp_ref])
    for r in range(2):
        np.testing.assert_array_equal(res[r][0].view(np.uint16), want[r][0].view(np.uint16))
        np.testing.assert_array_equal(res[r][1], want[r][1])
    valid_round(pair)


def test_released_handle(pair):
    """Handles never expire (issue 11): after 4 later dispatches the first still combines; once
    its object is collected the next dispatch releases it, and a copy of its id is refused."""
    c = dataclasses.replace(SPEC, seed=next(_seeds))

    def disp(s, g, r):
        inp = c.inputs(r)
        return [g.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"]) for _ in range(5)]

    outs = both(disp, pair.sessions, pair.groups, [0, 1])
    firsts = [o[0] for o in outs]
    both(lambda g, f: g.combine(f.recv_x, f.handle), pair.groups, firsts)
    first = firsts[0]
    stale = Handle(first.handle.group, first.handle.handle_id, 0, first.num_recv_tokens,
                   first.handle.rows)  # the id only: no finalizer
    y = np.zeros((first.num_recv_tokens, H), BF16)
    del outs, firsts, first
    gc.collect()
    valid_round(pair)  # its dispatch carries the releases
    expect(FAILED, "released", pair.groups[0].combine, y, stale)
    valid_round(pair)


# ------------------------------------------------------------------------------------------------
# raw requests: regions, offsets, strides, ids
# ------------------------------------------------------------------------------------------------

def raw_dispatch(p: Pair) -> epd_pb2.DispatchRequest:
    """A dispatch request whose tensors live in a registered region of rank 0's session."""
    s, g = p.sessions[0], p.groups[0]
    x, idx, w = inputs()
    bufs = {}
    for name, a in (("x", x), ("topk_idx", idx), ("topk_weights", w)):
        bufs[name] = s.empty(a.shape, a.dtype)
        bufs[name][...] = a
    descs = s._descs(bufs)
    req = epd_pb2.DispatchRequest(session_id=s.session_id, group_id=g.group_id,
                                  timeout_seconds=5, **descs)
    return req


def call(p: Pair, req, method: str = "Dispatch"):
    return p.sessions[0]._transport.call(method, req, 5)


def x_region_size(p: Pair, req) -> int:
    f = next(f for f in p.sessions[0]._user_regions if f.region_id == req.x.region_id)
    return f.size


def other_region(p: Pair) -> str:
    """A real region of another session on the same engine (large enough for x)."""
    p.other.empty((T, H), BF16)
    return p.other._user_regions[-1].region_id


def other_group(p: Pair) -> str:
    """The id of a live group that rank 0's session is not in."""
    g = join(p.other, _spec(f"solo-{next(_names)}", num_ranks=1, num_experts=2, tokens=(4,)),
             0, timeout=5)
    return g.group_id


RAW_BAD = {
    "region of another session": (lambda p, r: {"x": {"region_id": other_region(p)}},
                                  NOT_FOUND, "is not registered by this session"),
    "unknown region": (lambda p, r: {"x": {"region_id": "rdeadbeefdeadbeef"}}, NOT_FOUND,
                       "region 'rdeadbeefdeadbeef'"),
    "offset past the end": (lambda p, r: {"x": {"offset_bytes": x_region_size(p, r)}},
                            INVALID, "fall outside region"),
    "last byte past the end": (lambda p, r: {"x": {"offset_bytes": 256}}, INVALID,
                               "fall outside region"),
    "huge offset": (lambda p, r: {"x": {"offset_bytes": 2**64 - 256}}, INVALID,
                    "fall outside region"),
    "huge shape": (lambda p, r: {"x": {"shape": [2**62, H]}}, INVALID, ""),
    "misaligned offset": (lambda p, r: {"x": {"offset_bytes": 1}}, INVALID,
                          "not a multiple of the element size"),
    "strided last dim": (lambda p, r: {"x": {"shape": [T, H // 2], "strides": [H, 2]}},
                         INVALID, "must be contiguous"),
    "negative strides": (lambda p, r: {"x": {"strides": [-H, 1]}}, INVALID, "negative strides"),
    "strides rank": (lambda p, r: {"x": {"strides": [1]}}, INVALID, "1 strides for 2"),
    "negative dimension": (lambda p, r: {"x": {"shape": [-1, H]}}, INVALID,
                           "negative dimension"),
    # in bounds, but more than NumPy can index (were INTERNAL, with a traceback each)
    "empty, 2**63 rows": (lambda p, r: {"x": {"shape": [2**63 - 1, 0], "strides": []}},
                          INVALID, "cannot be viewed"),
    "stride past the limit": (lambda p, r: {"x": {"shape": [1, H], "strides": [2**62, 1]}},
                              INVALID, "cannot be viewed"),
    # a broadcast view: 2**38 rows in a few bytes, which the value checks would walk for hours
    "broadcast rows": (lambda p, r: {"x": {"shape": [2**38, H], "strides": [0, 1]},
                                     "topk_idx": {"shape": [2**38, K], "strides": [0, 1]},
                                     "topk_weights": {"shape": [2**38, K], "strides": [0, 1]}},
                       INVALID, "zero strides"),
    # rows that overlap: in bounds, but more elements than the region holds (the host copy
    # of topk_idx for the value checks was up to num_topk times the region)
    "overlapping rows": (lambda p, r: {"topk_idx": {"strides": [1, 1]}}, INVALID,
                         f"topk_idx: shape [{T}, {K}] with strides [1, 1] is not a layout "
                         f"of dense memory"),
    "unknown dtype": (lambda p, r: {"topk_weights": {"dtype": 99}}, INVALID,
                      "topk_weights: unknown dtype"),
    "fp8 routing weights": (lambda p, r: {"topk_weights": {"dtype": epd_pb2.FLOAT8_E4M3}},
                            INVALID, "topk_weights: dtype float8_e4m3"),
    "no routing": (lambda p, r: {"topk_idx": epd_pb2.TensorDesc()}, INVALID,
                   "needs topk_idx and topk_weights"),
    "unknown handle": (lambda p, r: {"cached_handle": 777, "topk_idx": epd_pb2.TensorDesc(),
                                     "topk_weights": epd_pb2.TensorDesc()}, FAILED,
                       "handle 777 is not known"),
    "group not joined": (lambda p, r: {"group_id": "g000000000000"}, NOT_FOUND,
                         "group 'g000000000000' is not joined"),
    "group of another session": (lambda p, r: {"group_id": other_group(p)}, NOT_FOUND,
                                 "is not joined by session"),
    "unknown session": (lambda p, r: {"session_id": "00000000deadbeef"}, NOT_FOUND,
                        "session '00000000deadbeef' is not open"),
    # refused before the dispatch takes its sequence (it took one, and published a failure)
    "ready event on the cpu backend": (lambda p, r: {"ready_event": b"\x01" * 64}, INVALID,
                                       "ready_event is for the cuda backend"),
}


@pytest.mark.parametrize("name", list(RAW_BAD))
def test_raw_bad_dispatch(pair, name):
    make, code, text = RAW_BAD[name]
    req = raw_dispatch(pair)
    for k, v in make(pair, req).items():
        if isinstance(v, dict):
            sub = getattr(req, k)
            for fk, fv in v.items():
                if isinstance(fv, list):
                    del getattr(sub, fk)[:]
                    getattr(sub, fk).extend(fv)
                else:
                    setattr(sub, fk, fv)
        elif isinstance(v, epd_pb2.TensorDesc):
            getattr(req, k).CopyFrom(v)
        else:
            setattr(req, k, v)
    before = dispatches(pair)
    seq = int(pair.groups[0]._counter[counter_page.SEQ])
    expect(code, text, call, pair, req)
    assert dispatches(pair) == before
    assert int(pair.groups[0]._counter[counter_page.SEQ]) == seq  # no sequence taken
    valid_round(pair)


def test_raw_bad_combine_and_layout_ids(pair):
    s = pair.sessions[0]
    expect(NOT_FOUND, "is not open", call, pair, epd_pb2.CombineRequest(
        session_id="ffff", group_id=pair.groups[0].group_id, handle=1), "Combine")
    expect(NOT_FOUND, "is not joined", call, pair, epd_pb2.GetDispatchLayoutRequest(
        session_id=s.session_id, group_id="gnothere"), "GetDispatchLayout")
    expect(NOT_FOUND, "is not joined", call, pair, epd_pb2.LeaveGroupRequest(
        session_id=s.session_id, group_id="gnothere"), "LeaveGroup")
    expect(NOT_FOUND, "is not registered", call, pair, epd_pb2.UnregisterRegionRequest(
        session_id=s.session_id, region_id="rnothere"), "UnregisterRegion")
    valid_round(pair)


def test_bad_region_registration(pair):
    """Host memory is a sealed memfd over the descriptor channel; RegisterRegion over gRPC
    takes CUDA IPC handles only (no path field at all)."""
    s = pair.sessions[0]
    assert "shm_path" not in epd_pb2.RegisterRegionRequest.DESCRIPTOR.fields_by_name
    expect(INVALID, "descriptor channel", call, pair, epd_pb2.RegisterRegionRequest(
        session_id=s.session_id, size_bytes=16), "RegisterRegion")
    expect(INVALID, "size_bytes must be positive", call, pair, epd_pb2.RegisterRegionRequest(
        session_id=s.session_id, size_bytes=0), "RegisterRegion")
    small = ShmFile.create(64)  # a real memfd, smaller than it claims to be
    try:
        with pytest.raises(EpdError) as ei:
            s._channel.register(small.fd, 1 << 30)
        assert ei.value.code == INVALID and "fewer than the" in ei.value.details
    finally:
        small.close()
    # sealed against writes, or opened read-only: the engine maps regions read-write (was
    # INTERNAL from the mapping's EPERM / EACCES)
    sealed = os.memfd_create("epd-test-sealed", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(sealed, 4096)
        fcntl.fcntl(sealed, fdc.F_ADD_SEALS, fdc.F_SEAL_SHRINK | fdc.F_SEAL_WRITE)
        with pytest.raises(EpdError) as ei:
            s._channel.register(sealed, 4096)
        assert ei.value.code == INVALID and "not writable" in ei.value.details, ei.value
    finally:
        os.close(sealed)
    read_only = ShmFile.create(4096)
    try:
        fd = os.open(f"/proc/self/fd/{read_only.fd}", os.O_RDONLY)
        try:
            with pytest.raises(EpdError) as ei:
                s._channel.register(fd, 4096)
            assert ei.value.code == INVALID and "not writable" in ei.value.details, ei.value
        finally:
            os.close(fd)
    finally:
        read_only.close()
    # a huge-page memfd, sealed as asked: its client can punch its pages out and take the
    # pool's free pages, and the engine's next read would be a SIGBUS (a review crashed the
    # engine so): refused as not plain shared memory (creating one needs no huge page)
    try:
        huge = os.memfd_create("epd-test-huge", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC
                               | os.MFD_HUGETLB)
    except OSError:  # (a kernel without hugetlbfs: no such memfd can be made here)
        huge = None
    if huge is not None:
        try:
            os.ftruncate(huge, 2 << 20)
            with contextlib.suppress(OSError):
                fcntl.fcntl(huge, fdc.F_ADD_SEALS, fdc.F_SEAL_SHRINK | fdc.F_SEAL_GROW)
            with pytest.raises(EpdError) as ei:
                s._channel.register(huge, 2 << 20)
            assert ei.value.code == INVALID and "MFD_HUGETLB" in ei.value.details, ei.value
        finally:
            os.close(huge)
    valid_round(pair)


# ------------------------------------------------------------------------------------------------
# joins
# ------------------------------------------------------------------------------------------------

def _spec(name, **kw):
    d = dict(num_ranks=2, num_experts=4, hidden=128, num_topk=2, tokens=(6, 9))
    d.update(kw)
    return Case(group=name, **d)


@pytest.mark.parametrize("kw,text", [
    (dict(num_experts=7), "num_experts=7 is not a multiple of num_ranks=2"),
    (dict(num_topk=5), "num_topk=5 exceeds num_experts=4"),
    (dict(hidden=0), "hidden=0 is out of range"),
    (dict(num_ranks=0), "num_ranks=0 is out of range"),
])
def test_bad_group_spec(pair, kw, text):
    expect(INVALID, text, join, pair.other, _spec(f"bad-{next(_names)}", **kw), 0, timeout=2)
    valid_round(pair)


@pytest.mark.parametrize("rank", [2, -1])
def test_rank_out_of_range(pair, rank):
    expect(INVALID, f"rank {rank} is out of range", join, pair.other,
           _spec(f"rank-{next(_names)}"), rank, timeout=2)
    valid_round(pair)


def test_bad_dtype_in_spec(pair):
    expect(INVALID, "x_dtype must be one of", pair.other.join, f"dt-{next(_names)}", rank=0,
           num_ranks=1, num_experts=2, hidden=128, max_tokens_per_rank=4, num_topk=1,
           dtype="int64", timeout=2)


def test_spec_mismatch_on_join(pair):
    """Another session asks for group 'val' (formed by the pair) with a different spec."""
    for kw in ({"hidden": 128}, {"num_experts": 16}, {"max_tokens": 64}, {"num_topk": 2}):
        expect(FAILED, "exists with a different spec", join, pair.other,
               dataclasses.replace(SPEC, **kw), 1, timeout=2)
    valid_round(pair)


@pytest.mark.parametrize("rank", [0, 1])
def test_duplicate_rank_on_join(pair, rank):
    expect(FAILED, f"rank {rank} of group 'val' is already taken", join, pair.other, SPEC, rank,
           timeout=2)
    valid_round(pair)


def test_same_session_joins_a_group_twice(pair):
    expect(FAILED, "already holds a rank of group 'val'", join, pair.sessions[0], SPEC, 1,
           timeout=2)
    valid_round(pair)


def test_join_timeout_names_missing_ranks(pair):
    c = _spec(f"lonely-{next(_names)}", num_ranks=3, num_experts=6)
    t0 = time.monotonic()
    expect(grpc.StatusCode.DEADLINE_EXCEEDED, "rank(s) [1, 2] did not join", join,
           pair.other, c, 0, timeout=1.0)
    assert time.monotonic() - t0 < 1.0 + 1.0
    # Nothing was left behind: the same name forms normally afterwards (1 rank, other spec).
    g = join(pair.other, _spec(c.group, num_ranks=1, num_experts=2, tokens=(5,)), 0, timeout=5)
    g.leave()
    valid_round(pair)


def test_client_side_handle_of_another_group(pair):
    g = pair.groups[0]
    fake = Handle(pair.groups[1], 1, 0, 0, 0)
    expect(INVALID, "belongs to another group", g.combine, np.zeros((0, H), BF16), fake)


def test_unsupported_element_type_is_rejected_client_side(pair):
    x, idx, w = inputs()
    with pytest.raises(EpdError, match="unsupported element type float64") as err:
        pair.groups[0].dispatch(x, idx, w.astype(np.float64))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    valid_round(pair)


def test_dtype_names_roundtrip():
    for name in ("bfloat16", "float16", "float32", "float8_e4m3"):
        assert dtypes.name(dtypes.from_name(name)) == name


def test_raw_handle_of_another_group_of_the_same_session(pair):
    """One session in two groups: a combine sent to group B naming group A's handle (a raw
    caller; the client refuses it itself) finds no handle, though B holds a handle made as
    many dispatches in (ids are unique in the engine, not numbered per group)."""
    s = pair.other
    specs = [_spec(f"twin-{next(_names)}", num_ranks=1, num_experts=2, tokens=(4,))
             for _ in range(2)]
    ga, gb = (join(s, c, 0, timeout=5) for c in specs)
    try:
        rng = np.random.default_rng(4)
        idx, w = ref.random_routing(rng, 4, 2, 2, drop_prob=0.0)
        x = ref.random_x(rng, 4, 128, BF16)
        oa, ob = ga.dispatch(x, idx, w), gb.dispatch(x, idx, w)
        forged = Handle(gb, oa.handle.handle_id, oa.handle.num_tokens,
                        oa.handle.num_recv_tokens, oa.handle.rows)
        expect(FAILED, f"handle {oa.handle.handle_id} is not known", gb.combine,
               oa.recv_x, forged)
        gb.combine(ob.recv_x, ob.handle)  # (B's own handle still works)
    finally:
        ga.leave()
        gb.leave()


def test_a_descriptor_whose_elements_share_positions_is_refused() -> None:
    """Interleaved aliasing: no more elements than the span holds (the count check passed it),
    yet two share a position (a review: [2, 2, 2] with strides [3, 4, 1]); the views of dense
    memory callers pass (permuted, sliced, strided) are accepted."""
    from host_region import HostRegion as Bytes

    from epd.server.engine import tensors

    def desc(shape, strides):
        return epd_pb2.TensorDesc(region_id="r", shape=shape, strides=strides,
                                  dtype=epd_pb2.FLOAT32)
    with pytest.raises(InvalidArgument, match="is not a layout of dense memory"):
        tensors.resolve(desc([2, 2, 2], [3, 4, 1]), {"r": Bytes()}, "x", ndim=3)
    for shape, strides in (([2, 3, 4], [12, 4, 1]), ([3, 2, 4], [4, 12, 1]),
                           ([2, 2, 4], [24, 8, 1]), ([4, 1, 2], [2, 1, 1])):
        tensors.resolve(desc(shape, strides), {"r": Bytes()}, "x", ndim=3)

