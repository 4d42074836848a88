"""A fresh process for tests/gpu/test_graph_reserve.py (a new CUDA context, whose room for live
graphs has not grown): `python graph_room_worker.py reserve|control CHAINS SPIN_SECONDS` builds
CHAINS x 64 chain-instance graphs, kept alive, beside a kernel spinning SPIN_SECONDS, after
making the engine's room first (reserve) or not (control); prints the seconds they took and
whether the spinner still ran when they were done."""

from __future__ import annotations

import json
import sys
import time

SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def main(mode: str, chains: int, spin_seconds: float) -> dict:
    import cupy as cp
    import numpy as np

    from epd.proto import abi
    from epd.server.backends import cuda_kernels as ck
    from epd.server.backends.cuda_chain import GraphReserve, instance_graph

    kernels = ck.kernels_for_device(0)
    if mode == "reserve":
        reserve = GraphReserve(kernels, 8, chains)
        assert reserve.free == chains
    spin = cp.RawModule(code=SPIN).get_function("spin")
    side, capture = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ring = cp.zeros(abi.LL_RING_RELEASED + 1, np.uint32)
    table = cp.zeros((abi.LL_CHAIN_OPS, abi.LLX_WORDS), np.uint64)
    state = cp.zeros(abi.LLS_WORDS, np.uint64)
    entry = cp.zeros(abi.LL_RING, np.uint32)
    launches = [launch for _, launch in kernels.chain_launches(
        ring.data.ptr, table, state, 8, "Bf16", False, entry)]
    spin((1,), (1,), (int(spin_seconds * 1e9),), stream=side)
    time.sleep(0.05)
    graphs = []
    t0 = time.perf_counter()
    try:
        for _ in range(chains * abi.LL_RING):
            graphs.append(instance_graph(capture, ring.data.ptr, launches, 0))
        took = time.perf_counter() - t0
        spinning = not side.done
    finally:
        for g in graphs:
            g.close()
        side.synchronize()
    return {"took_s": took, "spinner_still_ran": spinning, "graphs": len(graphs)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))
