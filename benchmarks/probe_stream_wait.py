"""How fast a GPU notices a host write (a diagnostic for the low-latency chain, issue 10).

One process, one GPU. A word W and a flag F in mapped pinned host memory. Per iteration the
host enqueues on a stream "wait until W >= n" then a one-thread kernel writing F = n, sleeps
`--idle-ms` (the wait is parked that long, as a chain's pending instance is between calls),
then writes W = n and spins until it reads F == n: the wake-up latency. Variants: `wait`
(cuStreamWaitValue32), `gate` (a one-thread kernel spinning on W instead), `ready` (W
written before the enqueue: launch + write-back only).

    python3 -P benchmarks/probe_stream_wait.py --iters 200 --idle-ms 1
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from epd.server.bench.runner import provenance

SRC = r"""
extern "C" __global__ void set_flag(unsigned* f, unsigned n) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(f), "r"(n) : "memory");
}
extern "C" __global__ void gate(const unsigned* w, unsigned* f, unsigned n) {
    while (*reinterpret_cast<const volatile unsigned*>(w) < n) {}
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(f), "r"(n) : "memory");
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--idle-ms", type=float, default=1.0)
    ap.add_argument("--json")
    ns = ap.parse_args()
    import cupy as cp
    from cuda.bindings import driver

    mod = cp.RawModule(code=SRC)
    set_flag, gate = mod.get_function("set_flag"), mod.get_function("gate")
    mem = cp.cuda.alloc_pinned_memory(64)
    host = np.frombuffer(mem, np.uint32, 16)
    host[:] = 0
    dptr = mem.ptr  # pinned host memory: the same address on the device (unified addressing)
    w_dev, f_dev = dptr, dptr + 4
    stream = cp.cuda.Stream(non_blocking=True)
    out: dict = {}
    n = 0
    for variant in ("ready", "wait", "gate"):
        lat = []
        for _ in range(ns.iters):
            n += 1
            if variant == "ready":
                host[0] = n
            if variant == "gate":
                gate((1,), (1,), (np.uint64(w_dev), np.uint64(f_dev), np.uint32(n)),
                     stream=stream)
            else:
                err, = driver.cuStreamWaitValue32(
                    driver.CUstream(stream.ptr), driver.CUdeviceptr(w_dev), n,
                    driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
                assert err == driver.CUresult.CUDA_SUCCESS, err
                set_flag((1,), (1,), (np.uint64(f_dev), np.uint32(n)), stream=stream)
            time.sleep(ns.idle_ms * 1e-3)
            t0 = time.perf_counter()
            host[0] = n
            while host[1] != n:
                if time.perf_counter() - t0 > 5:
                    raise TimeoutError(f"{variant}: flag never came")
            lat.append((time.perf_counter() - t0) * 1e6)
        stream.synchronize()
        a = np.array(lat)
        out[variant] = {"p50_us": float(np.percentile(a, 50)),
                        "p99_us": float(np.percentile(a, 99)), "max_us": float(a.max())}
        print(f"{variant:6s} p50 {out[variant]['p50_us']:8.1f} us  p99 "
              f"{out[variant]['p99_us']:8.1f} us  max {out[variant]['max_us']:8.1f} us")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**provenance(), "args": vars(ns), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
