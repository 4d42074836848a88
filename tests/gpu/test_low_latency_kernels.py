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


def test_bad_expert_id_is_reported_not_fatal_to_the_gpu() -> None:
    import cupy as cp

    from epd.server.backends import cuda_kernels as ck

    rng = np.random.default_rng(5)
    g = _group(2, 16, 2, 256, 8)
    xs = [ref.random_x(rng, 8, 256, BFLOAT16) for _ in range(2)]
    bad = np.full((8, 2), 3, np.int64)
    bad[:, 1] = 99  # out of range
    for s, runner in enumerate(g.runners):
        with cp.cuda.Device(runner.device_id), runner.stream:
            runner.ll_dispatch(cp.asarray(raw(xs[s])), cp.asarray(bad), 8,
                               timeout_ns=TIMEOUT_NS, num_sms=2)
    g.synchronize()
    assert g.runners[0].error()[0] == ck.ERR_BAD_INPUT
    g.close()
