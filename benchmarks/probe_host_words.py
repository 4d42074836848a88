"""How long one GPU read of the engine's host control words takes (mapped pinned host memory,
cudaHostAllocMapped | cudaHostAllocPortable, as server/backends/cuda.py allocates them), beside a
read of a device word (ld.acquire.sys): one thread, N dependent reads, %globaltimer.

    python3 benchmarks/probe_host_words.py [--reads 2000] [--json out.json]

Run it under MPS (export CUDA_MPS_PIPE_DIRECTORY of a running server) and without.
"""

from __future__ import annotations

import argparse
import ctypes
import json

import cupy as cp
import numpy as np
from cuda.bindings import runtime as cudart

SRC = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 now() {
    u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
extern "C" __global__ void reads(const volatile u64* host, const u64* dev, int n, u64* out) {
    u64 acc = 0, t0 = now();
    for (int i = 0; i < n; ++i) acc += host[acc & 1];
    u64 t1 = now();
    for (int i = 0; i < n; ++i) acc += ld_acquire_sys(dev + (acc & 1));
    u64 t2 = now();
    for (int i = 0; i < n; ++i) acc += *(const volatile u64*)(dev + (acc & 1));
    u64 t3 = now();
    out[0] = t1 - t0; out[1] = t2 - t1; out[2] = t3 - t2; out[3] = acc;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--json")
    ns = ap.parse_args()
    cp.cuda.Device(0).use()
    flags = cudart.cudaHostAllocMapped | cudart.cudaHostAllocPortable
    err, ptr = cudart.cudaHostAlloc(64, flags)
    assert err == cudart.cudaError_t.cudaSuccess, err
    err, dptr = cudart.cudaHostGetDevicePointer(ptr, 0)
    assert err == cudart.cudaError_t.cudaSuccess, err
    ctypes.memset(ptr, 0, 64)
    dev = cp.zeros(8, cp.uint64)
    out = cp.zeros(4, cp.uint64)
    k = cp.RawKernel(SRC, "reads")
    k((1,), (1,), (np.uint64(int(dptr)), dev, np.int32(10), out))  # warm
    cp.cuda.Device(0).synchronize()
    k((1,), (1,), (np.uint64(int(dptr)), dev, np.int32(ns.reads), out))
    cp.cuda.Device(0).synchronize()
    ns_host, ns_acq, ns_vol, _ = (int(v) for v in cp.asnumpy(out))
    res = {"reads": ns.reads, "host_read_ns": ns_host / ns.reads,
           "device_acquire_sys_ns": ns_acq / ns.reads, "device_volatile_ns": ns_vol / ns.reads}
    print(json.dumps(res))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f)
    cudart.cudaFreeHost(ptr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
