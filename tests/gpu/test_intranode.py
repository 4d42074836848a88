"""Intranode kernels on real GPUs vs the NumPy reference, one process driving every rank
(ranks spread over the visible GPUs; several ranks per GPU when R > GPUs)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from .common import TIMEOUT_NS, make_inputs, roundtrip, run_dispatch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rt():
    from . import local_group

    return local_group


def group(rt, r: int, e: int, k: int, h: int, max_tokens: int, dtype=None, **kw):
    from epd.proto.dtypes import BFLOAT16

    return rt.LocalGroup(r, e, h, k, max_tokens, dtype if dtype is not None else BFLOAT16, **kw)


def test_every_kernel_loaded_before_its_first_launch() -> None:
    """The process-wide module comes back with every kernel loaded: under lazy loading a
    kernel's first launch would load it and wait for the context's running work, which
    deadlocks one thread that drives several ranks (cuda_driver.load_function)."""
    from cuda.bindings import driver as drv

    from epd.client import call_outputs, cuda_ipc, ll_trigger, received_rows
    from epd.server.backends import cuda_kernels as ck

    kernels = ck.kernels_for_device(0)
    functions = {name: ck._function_of(kernels.fn(name))
                 for name in (*kernels.NAMES, *kernels.TEMPLATES)}
    # the client's own kernels (compiled_kernel: loaded when a group is made)
    for module, name in ((ll_trigger, "epd_ll_trigger"), (call_outputs, "epd_copy_parts"),
                         (received_rows, "epd_copy_received")):
        functions[name] = cuda_ipc.compiled_kernel(module._SOURCE, name, 0)
    for name, fn in functions.items():
        err, state = drv.cuFuncIsLoaded(drv.CUfunction(fn))
        assert err == drv.CUresult.CUDA_SUCCESS, (name, err)
        assert state == drv.CUfunctionLoadingState.CU_FUNCTION_LOADING_STATE_LOADED, name


def test_a_stage_failure_is_folded_into_the_whole_group_block() -> None:
    """A two-stage group's stream-ordered call (cuda_stages.StagedRunner.launch): the
    first failure of the rail stage, else of the node stage, lands in the rank's whole-group
    control block (the one epd_call_done reads) with the stage's rank turned into the group
    rank; a failure already there is kept; the stages' bad-input words are cleared."""
    import cupy as cp

    from epd.proto import abi
    from epd.server.backends import cuda_kernels as ck

    kern = ck.kernels_for_device(0)
    words = abi.CTRL_PAYLOAD_BYTES // 8
    rank, per_node = 6, 4  # node 1, local index 2 of 2 nodes x 4 ranks

    def run(rail_err, node_err, flat_err=None):
        blocks = [cp.zeros(words, cp.uint64) for _ in range(3)]  # flat, rail, node
        for block, err in zip(blocks, (flat_err, rail_err, node_err), strict=True):
            block[abi.CTRL_CALL_ERR], block[abi.CTRL_CALL_ERR_VALUE] = 4, 99
            if err is not None:
                code, who, phase, seq = err
                block[abi.CTRL_ERR_CODE] = code
                block[abi.CTRL_ERR_RANK] = np.uint64(who & (2**64 - 1))
                block[abi.CTRL_ERR_PHASE], block[abi.CTRL_ERR_SEQ] = phase, seq
        peers = cp.zeros(8, cp.uint64)
        peers[rank] = blocks[0].data.ptr
        kern.stage_errors(peers, rank, blocks[1], blocks[2], per_node)
        cp.cuda.Device(0).synchronize()
        got = [cp.asnumpy(b) for b in blocks]
        for b in got[1:]:  # the stages' bad-input words cleared, the whole group's kept
            assert b[abi.CTRL_CALL_ERR] == 0 and b[abi.CTRL_CALL_ERR_VALUE] == 0
        assert got[0][abi.CTRL_CALL_ERR] == 4
        f = got[0]
        return (int(f[abi.CTRL_ERR_CODE]), int(np.int64(f[abi.CTRL_ERR_RANK])),
                int(f[abi.CTRL_ERR_PHASE]), int(f[abi.CTRL_ERR_SEQ]))

    dl, ab, done = abi.ERR_DEADLINE, abi.ERR_ABORTED, abi.PHASE_DISPATCH_DONE
    # rail rank 0 (node 0, local 2) -> group rank 2; node rank 3 (node 1) -> group rank 7
    assert run((dl, 0, done, 7), None) == (dl, 2, done, 7)
    assert run(None, (dl, 3, abi.PHASE_COMBINE_ENTRY, 9)) == (dl, 7, abi.PHASE_COMBINE_ENTRY, 9)
    assert run((dl, 1, done, 7), (dl, 3, done, 7)) == (dl, 6, done, 7)  # the rail's first
    assert run(None, (ab, -1, done, 5)) == (ab, -1, done, 5)  # no rank stays no rank
    assert run((dl, 0, done, 7), None, (ab, -1, 1, 3)) == (ab, -1, 1, 3)  # the first kept
    assert run(None, None) == (0, 0, 0, 0)


@pytest.mark.parametrize("dtype,cols,pitch", [(np.int64, 8, 11), (np.float32, 4, 4 + 3),
                                               (np.int64, 1, 3), (np.float32, 8, 8)])
def test_dense_rows_on_the_kernels_stream(dtype, cols: int, pitch: int) -> None:
    """cuda_runtime.dense_rows: a row-strided top-k tensor (rows `pitch` elements apart) made
    contiguous on a non-blocking stream, every value exact; a contiguous one returned as is."""
    import cupy as cp

    from epd.server.backends.cuda_runtime import dense_rows

    rng = np.random.default_rng(pitch * cols)
    with cp.cuda.Device(0):
        stream = cp.cuda.Stream(non_blocking=True)
        backing = cp.asarray(rng.integers(-1, 1000, (37, pitch)).astype(dtype))
        a = backing[:, :cols]
        got = dense_rows(a, stream)
        stream.synchronize()
        assert got.flags.c_contiguous and got.shape == (37, cols)
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(backing)[:, :cols])
        if pitch == cols:
            assert got is a


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [0, 1, 7, 128])
def test_small_token_counts(rt, num_ranks: int, tokens: int) -> None:
    rng = np.random.default_rng(100 * num_ranks + tokens)
    g = group(rt, num_ranks, 32, 2, 2048, 128)
    roundtrip(g, rng, [tokens] * num_ranks, 32, 2, 2048, drop=0.1)


@pytest.mark.parametrize(("num_ranks", "experts", "topk", "hidden"), [
    (2, 256, 8, 7168), (2, 8, 1, 2048), (4, 64, 8, 2048), (8, 256, 8, 2048), (4, 16, 2, 7168),
])
def test_large(rt, num_ranks: int, experts: int, topk: int, hidden: int) -> None:
    rng = np.random.default_rng(experts * topk + hidden + num_ranks)
    tokens = [4096, 8192, 4096, 128, 0, 4096, 7, 1][:num_ranks]
    g = group(rt, num_ranks, experts, topk, hidden, 8192)
    roundtrip(g, rng, tokens, experts, topk, hidden, drop=0.05, bias=True, num_sms=16)


def test_uneven_and_empty_receiver(rt) -> None:
    # Rank 1's experts are never chosen: it receives nothing, others still combine.
    from epd.server import reference as ref

    rng = np.random.default_rng(7)
    r, e, k, h = 4, 32, 2, 2048
    g = group(rt, r, e, k, h, 512)
    inp = make_inputs(rng, [300, 17, 0, 512], e, k, h)
    for idx in inp["idx"]:
        idx[(idx >= 8) & (idx < 16)] = -1
    expected = ref.dispatch(inp["xs"], inp["idx"], inp["w"], e)
    assert expected[1].recv_x.shape[0] == 0
    from .common import check_dispatch, run_and_check_combine

    g.poison()
    res = run_dispatch(g, inp)
    check_dispatch(g, res, expected)
    run_and_check_combine(g, rng, res, expected, [300, 17, 0, 512], h, bias=True)


def test_skewed_router(rt) -> None:
    rng = np.random.default_rng(11)
    g = group(rt, 2, 256, 8, 7168, 4096)
    roundtrip(g, rng, [4096, 4096], 256, 8, 7168, hot_rank=0, hot_fraction=0.9, num_sms=24)


@pytest.mark.parametrize("worst", [False, True])
def test_cached_and_alignment(rt, worst: bool) -> None:
    rng = np.random.default_rng(5 + worst)
    r, tokens = 4, [128, 64, 200, 1]
    g = group(rt, r, 64, 4, 2048, 256)
    roundtrip(g, rng, tokens, 64, 4, 2048, alignment=128, cached=True,
              worst=r * 256 if worst else 0, drop=0.2)


def test_worst_tokens(rt) -> None:
    rng = np.random.default_rng(9)
    g = group(rt, 2, 16, 2, 2048, 128)
    roundtrip(g, rng, [128, 7], 16, 2, 2048, worst=256, bias=True)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_fp8(rt, num_ranks: int) -> None:
    from epd.proto.dtypes import FLOAT8_E4M3

    rng = np.random.default_rng(13)
    g = group(rt, num_ranks, 64, 8, 7168, 1024, dtype=FLOAT8_E4M3)
    roundtrip(g, rng, [1024, 333, 0, 5][:num_ranks], 64, 8, 7168, payload="fp8", cached=True)


def test_counter_slot(rt) -> None:
    from epd.proto import counter_page
    from epd.server import reference as ref

    rng = np.random.default_rng(3)
    r, e, k, h = 2, 16, 2, 2048
    g = group(rt, r, e, k, h, 128)
    inp = make_inputs(rng, [100, 50], e, k, h)
    expected = ref.dispatch(inp["xs"], inp["idx"], inp["w"], e, expert_alignment=4)
    slots = [rt.MappedSlot() for _ in range(r)]
    try:
        run_dispatch(g, inp, alignment=4, slots=slots)
        for d in range(r):
            got = counter_page.wait(slots[d].words, 1, 1.0)
            assert got == (expected[d].recv_x.shape[0], expected[d].num_recv_tokens_per_expert)
            assert slots[d].words[counter_page.STATUS] == 0
    finally:
        for s in slots:
            s.close()


def test_missing_rank_deadline_then_other_group_works(rt) -> None:
    import cupy as cp

    from epd.server.backends import cuda_kernels as ck

    rng = np.random.default_rng(21)
    r, e, k, h = 2, 16, 2, 2048
    g = group(rt, r, e, k, h, 64)
    inp = make_inputs(rng, [64, 64], e, k, h)
    slot = rt.MappedSlot()
    try:
        runner = g.runners[0]  # rank 1 never arrives
        with cp.cuda.Device(runner.device_id), runner.stream:
            t0 = time.monotonic()
            runner.dispatch(cp.asarray(inp["xs"][0].view(np.uint16)), None,
                            cp.asarray(inp["idx"][0]), cp.asarray(inp["w"][0]),
                            timeout_ns=200_000_000, counter_slot_ptr=slot.ptr)
            runner.stream.synchronize()
            elapsed = time.monotonic() - t0
        err = runner.error()
        assert err is not None and err[0] == ck.ERR_DEADLINE and err[1] == 1, err
        assert err[2] == "notify"
        assert slot.words[0] == 1 and slot.words[3] == ck.ERR_DEADLINE and slot.words[4] == 1
        assert elapsed < 5.0
    finally:
        slot.close()
    # A fresh group on the same devices still works (the context is not poisoned).
    g2 = group(rt, r, e, k, h, 128)
    roundtrip(g2, rng, [128, 3], e, k, h)


def test_abort_releases_waiters(rt) -> None:
    import cupy as cp

    from epd.server.backends import cuda_kernels as ck

    rng = np.random.default_rng(22)
    g = group(rt, 2, 16, 2, 2048, 64)
    inp = make_inputs(rng, [64, 64], 16, 2, 2048)
    runner = g.runners[0]
    with cp.cuda.Device(runner.device_id), runner.stream:
        t0 = time.monotonic()
        runner.dispatch(cp.asarray(inp["xs"][0].view(np.uint16)), None,
                        cp.asarray(inp["idx"][0]), cp.asarray(inp["w"][0]),
                        timeout_ns=TIMEOUT_NS * 4)
        time.sleep(0.05)
        runner.abort()
        runner.stream.synchronize()
        assert time.monotonic() - t0 < 5.0
    err = runner.error()
    assert err is not None and err[0] == ck.ERR_ABORTED, err


def test_layout_kernel_and_notify_layout(rt) -> None:
    import cupy as cp

    from epd.server import reference as ref
    from epd.server.backends import cuda_kernels as ck

    rng = np.random.default_rng(31)
    # (16 and 64 ranks: two-stage normal-mode groups and low-latency groups beyond MAX_RANKS)
    for t, e, k, r in [(0, 8, 1, 2), (1000, 256, 8, 8), (4096, 64, 2, 4), (2048, 256, 8, 16),
                       (777, 128, 8, 64)]:
        idx, _ = ref.random_routing(rng, t, e, k, drop_prob=0.1, num_ranks=r)
        want = ref.get_dispatch_layout(idx, e, r)
        kern = ck.kernels_for_device(0)
        with cp.cuda.Device(0):  # outputs poisoned: the kernel zeroes the counts, sets itr
            out = (cp.full(r, -1, cp.int32), cp.full(e, -1, cp.int32),
                   cp.full((t, r), 0xFF, cp.uint8).view(cp.bool_))
            ntpr, ntpe, itr = kern.layout(cp.asarray(idx), e, r, out=out)
            cp.cuda.Device(0).synchronize()
        np.testing.assert_array_equal(cp.asnumpy(ntpr), want.num_tokens_per_rank)
        np.testing.assert_array_equal(cp.asnumpy(ntpe), want.num_tokens_per_expert)
        np.testing.assert_array_equal(cp.asnumpy(itr).view(np.uint8),
                                      want.is_token_in_rank.astype(np.uint8))
