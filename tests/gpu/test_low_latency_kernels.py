"""Low-latency kernels (cuda/epd_low_latency.cu) on real GPUs vs the NumPy reference, one
process driving every rank. Fresh random inputs each iteration, outputs poisoned before each
run. Dispatch rows come back in the reference's order (source rank, then token: each source's
rows contiguous, DeepEP's layout_range), compared bit-exact with their scales and source info;
combine is bit-exact."""

from __future__ import annotations

import os

import numpy as np
import pytest

from epd.proto.dtypes import BFLOAT16
from epd.server import reference as ref

from .common import TIMEOUT_NS, ll_roundtrip, raw

pytestmark = pytest.mark.gpu


def _group(r: int, e: int, k: int, h: int, m: int):
    from .local_group import LocalGroup

    return LocalGroup(r, e, h, k, m, BFLOAT16, low_latency=True)


@pytest.mark.parametrize("fp8,round_scale", [(False, False), (True, False), (True, True)])
def test_decode_config(fp8: bool, round_scale: bool) -> None:
    """Config D: 128 tokens/rank, hidden 7168, top-8 of 256 experts, two fresh rounds."""
    rng = np.random.default_rng(11 + fp8 + 2 * round_scale)
    g = _group(2, 256, 8, 7168, 128)
    for _ in range(2):
        ll_roundtrip(g, rng, [128, 128], 256, 8, 7168, 128, fp8=fp8, round_scale=round_scale)
    g.close()


@pytest.mark.parametrize("num_ranks", [2, 4, 16])
def test_uneven_dropped_and_repeated(num_ranks: int) -> None:
    """-1 entries at dispatch and at combine, fewer tokens than the maximum, an empty rank;
    16 ranks: more than a normal-mode group takes (LL_MAX_RANKS, one GPU here), whose 16
    spinning streams need as many hardware queues in this process (an engine sets 32 itself;
    not exported to every process: MPS clients with 32 each leave no room for a third)."""
    if int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")) < num_ranks:
        pytest.skip(f"{num_ranks} ranks' streams in one process need "
                    f"CUDA_DEVICE_MAX_CONNECTIONS >= {num_ranks} "
                    f"(benchmarks/device/gpu_s7_run.sh sets it)")
    rng = np.random.default_rng(40 + num_ranks)
    g = _group(num_ranks, 32, 4, 2048, 24)
    tokens = [(24, 0, 7, 19)[r % 4] for r in range(num_ranks)]
    for i in range(4):
        ll_roundtrip(g, rng, tokens, 32, 4, 2048, 24, fp8=bool(i % 2), drop=0.2,
                     combine_drop=0.1, num_sms=4 + i)
    g.close()


def _verdict(runner, buffer: int = 0) -> tuple[int, int, int, int]:
    """(code, source, token, id) of the receive buffer's header: a dispatch's verdict."""
    import cupy as cp

    from epd.proto import counter_page

    with cp.cuda.Device(runner.device_id):
        return counter_page.ll_header_verdict(
            cp.asnumpy(runner.ll_view("topk", (3,), np.uint64, buffer)))


@pytest.mark.parametrize("case", ["range", "duplicate", "both"])
def test_bad_expert_ids_fail_the_dispatch_alike_and_the_group_goes_on(case: str) -> None:
    """A source's bad ids (out of range, or an expert twice in a token) fail the dispatch on
    every rank alike: no error in the control block (nothing aborted), every rank's header
    names the lowest such source, its token and id, no rank received a row (counts 0, outputs
    poisoned before stay untouched), the combine of it gives zeros, and the next calls are exact."""
    import cupy as cp

    from epd.proto import abi

    rng = np.random.default_rng(5 + len(case))
    r, e, k, h, m = 2, 16, 2, 256, 8
    g = _group(r, e, k, h, m)
    ll_roundtrip(g, rng, [8, 8], e, k, h, m)  # (one good call first)
    idxs = [ref.random_routing(rng, m, e, k)[0] for _ in range(r)]
    want = None
    if case in ("range", "both"):
        idxs[1][5, 1] = 99  # out of range, rank 1 token 5
        want = (abi.ERR_BAD_INPUT, 1, 5, 99)
    if case in ("duplicate", "both"):
        idxs[0][3, 1] = idxs[0][3, 0] = 7  # expert 7 twice, rank 0 token 3: the lowest rank
        want = (abi.ERR_BAD_DUPLICATE, 0, 3, 7)
    xs = [ref.random_x(rng, m, h, BFLOAT16) for _ in range(r)]
    ins = {}
    for s, runner in enumerate(g.runners):
        with cp.cuda.Device(runner.device_id), runner.stream:
            ins[s] = (cp.asarray(raw(xs[s])), cp.asarray(idxs[s]))
            runner.ll_view("recv_count", (e // r,), np.int32).fill(-7)
    g.synchronize()
    for s, runner in enumerate(g.runners):
        with cp.cuda.Device(runner.device_id), runner.stream:
            runner.ll_dispatch(*ins[s], m, timeout_ns=TIMEOUT_NS, num_sms=2)
    g.synchronize()
    for s, runner in enumerate(g.runners):
        assert runner.error() is None, (s, runner.error())  # not aborted
        assert _verdict(runner) == want, (s, _verdict(runner))
        with cp.cuda.Device(runner.device_id):
            counts = cp.asnumpy(runner.ll_view("recv_count", (e // r,), np.int32))
        np.testing.assert_array_equal(counts, 0)
    # Its combine moves nothing and sums nothing: zeros (every rank, alike).
    outs = {}
    for s, runner in enumerate(g.runners):
        with cp.cuda.Device(runner.device_id), runner.stream:
            y = cp.zeros((e // r, r * m, h), cp.uint16)
            outs[s] = cp.full((m, h), 0xFFFF, cp.uint16)
            w = cp.asarray(np.ones((m, k), np.float32))
            runner.ll_combine(y, ins[s][1], w, outs[s], m, timeout_ns=TIMEOUT_NS, num_sms=2)
    g.synchronize()
    for s, runner in enumerate(g.runners):
        assert runner.error() is None, (s, runner.error())
        np.testing.assert_array_equal(cp.asnumpy(outs[s]), 0)
    for i in range(2):  # the group goes on, both receive buffers, exact; the verdict clears
        ll_roundtrip(g, rng, [8, 5], e, k, h, m, fp8=bool(i), buffer=i)
        for runner in g.runners:
            assert _verdict(runner, i) == (0, 0, 0, 0)
    g.close()


@pytest.mark.parametrize("case", ["num_max", "fp8"])
def test_ranks_that_disagree_fail_the_dispatch_alike(case: str) -> None:
    """Rank 1 passes another num_max (4 where rank 0 passes 8) or use_fp8: every rank's header
    names rank 1 with its arguments and rank 0's (ERR_DISAGREE), nothing aborted, no rank
    received a row, and the next calls are exact (before, each rank laid its rows out by its
    own num_max and format: wrong rows, or a row past the m it counted, which aborted)."""
    import cupy as cp

    from epd.proto import abi, counter_page

    rng = np.random.default_rng(71 + len(case))
    r, e, k, h, m = 2, 16, 2, 256, 8
    g = _group(r, e, k, h, m)
    ll_roundtrip(g, rng, [8, 8], e, k, h, m)  # (one good call first)
    ms = [m, 4] if case == "num_max" else [m, m]
    fp8 = [False, case == "fp8"]
    idxs = [ref.random_routing(rng, 4, e, k)[0] for _ in range(r)]
    xs = [ref.random_x(rng, 4, h, BFLOAT16) for _ in range(r)]
    ins = {}
    for s, runner in enumerate(g.runners):
        with cp.cuda.Device(runner.device_id), runner.stream:
            ins[s] = (cp.asarray(raw(xs[s])), cp.asarray(idxs[s]))
            runner.ll_view("recv_count", (e // r,), np.int32).fill(-7)
    g.synchronize()
    for s, runner in enumerate(g.runners):
        with cp.cuda.Device(runner.device_id), runner.stream:
            runner.ll_dispatch(*ins[s], ms[s], fp8=fp8[s], timeout_ns=TIMEOUT_NS, num_sms=2)
    g.synchronize()
    value = int(fp8[1]) | int(fp8[0]) << 1 | 0 << 8 | ms[0] << 32
    for s, runner in enumerate(g.runners):
        assert runner.error() is None, (s, runner.error())  # not aborted
        assert _verdict(runner) == (abi.ERR_DISAGREE, 1, ms[1], value), (s, _verdict(runner))
        with cp.cuda.Device(runner.device_id):
            counts = cp.asnumpy(runner.ll_view("recv_count", (e // r,), np.int32))
        np.testing.assert_array_equal(counts, 0)
    err = counter_page.ll_verdict_error("dispatch #2", *_verdict(g.runners[0]), e)
    assert err.code.name == "FAILED_PRECONDITION" and "rank 1" in err.message, err
    for i in range(2):  # the group goes on, both receive buffers, exact; the verdict clears
        ll_roundtrip(g, rng, [8, 5], e, k, h, m, fp8=bool(i), buffer=i)
        for runner in g.runners:
            assert _verdict(runner, i) == (0, 0, 0, 0)
    g.close()


def test_a_combines_bad_entry_fails_its_rank_alone() -> None:
    """A combine's own top-k naming an expert its dispatch did not send that token to, one
    expert twice, or an id outside [-1, E): that rank's combine records the entry as its
    verdict (read and cleared by the done kernel of a stream-ordered combine), leaves it out of
    the sum and aborts nothing; the other rank's combine is exact, and the next calls too."""
    from epd.proto import abi

    rng = np.random.default_rng(77)
    r, e, k, h, m = 2, 16, 4, 256, 8

    def spoil(cases):
        def run(comb_idx, idxs):
            sent, kept, verdicts = [c.copy() for c in comb_idx], [c.copy() for c in comb_idx], {}
            for s, (code, t, ex) in cases.items():
                if code == abi.ERR_BAD_DUPLICATE:  # the last entry names the first's expert
                    sent[s][t, k - 1] = ex = int(sent[s][t, 0])
                    kept[s][t, k - 1] = -1
                else:
                    ex = ex if ex is not None else next(
                        x for x in range(e) if x not in idxs[s][t])
                    sent[s][t, 1], kept[s][t, 1] = ex, -1
                verdicts[s] = (code, s, t, ex)
            return sent, kept, verdicts
        return run

    g = _group(r, e, k, h, m)
    ll_roundtrip(g, rng, [8, 8], e, k, h, m)
    for i, cases in enumerate((
            {0: (abi.ERR_NOT_DISPATCHED, 2, None), 1: (abi.ERR_BAD_DUPLICATE, 3, None)},
            {1: (abi.ERR_BAD_INPUT, 5, e + 7)},
            {0: (abi.ERR_BAD_INPUT, 6, -3)})):
        ll_roundtrip(g, rng, [8, 8], e, k, h, m, buffer=i % 2, spoil=spoil(cases))
    for i in range(2):
        ll_roundtrip(g, rng, [8, 6], e, k, h, m, fp8=bool(i), buffer=i)
    g.close()
