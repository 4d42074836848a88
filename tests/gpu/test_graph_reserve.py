"""The chains' graphs are instantiated in room the engine made while the device was idle
(server/backends/cuda_chain.GraphReserve): a context's room for live graph executables grows
in steps, and a growth waits for every running kernel, so a chain built while a peer's
low-latency kernel spun for it stalled until that kernel's deadline (docs/DESIGN_NOTES.md,
"Chain instances as CUDA graphs"). With the room made first, a chain's worth of graphs beside
a spinning kernel takes milliseconds."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SPIN_SECONDS = 2.0
SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def test_chain_graphs_built_beside_a_running_kernel_do_not_wait_for_it() -> None:
    import cupy as cp

    from epd.proto import abi, cuda_driver
    from epd.server.backends import cuda_kernels as ck
    from epd.server.backends.cuda_chain import GraphReserve

    kernels = ck.kernels_for_device(0)
    chains = 4
    reserve = GraphReserve(kernels, 8, chains)
    assert reserve.free == chains
    assert [reserve.take() for _ in range(chains + 1)] == [True] * chains + [False]
    for _ in range(chains):
        reserve.give()

    spin = cp.RawModule(code=SPIN).get_function("spin")
    side, capture = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ring = cp.zeros(abi.LL_RING_RELEASED + 1, np.uint32)
    table = cp.zeros((abi.LL_CHAIN_OPS, abi.LLX_WORDS), np.uint64)
    state = cp.zeros(abi.LLS_WORDS, np.uint64)
    entry = cp.zeros(abi.LL_RING, np.uint32)
    launches = [launch for _, launch in kernels.chain_launches(
        ring.data.ptr, table, state, 8, "Bf16", False, entry)]

    def instance(stream: int) -> None:
        cuda_driver.stream_wait_nonzero(stream, ring.data.ptr)
        for launch in launches:
            launch(capture)

    graphs: list[cuda_driver.Graph] = []
    spin((1,), (1,), (int(SPIN_SECONDS * 1e9),), stream=side)
    time.sleep(0.05)
    t0 = time.perf_counter()
    try:
        for _ in range(chains * abi.LL_RING):  # every chain's graphs, kept alive
            graphs.append(cuda_driver.Graph(capture.ptr, instance))
        took = time.perf_counter() - t0
        assert not side.done, "the spinner ended first: the timing says nothing"
    finally:
        for g in graphs:
            g.close()
        side.synchronize()
    assert took < SPIN_SECONDS / 4, f"{len(graphs)} graphs took {took:.3f} s beside the spinner"
