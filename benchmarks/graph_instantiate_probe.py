"""Does a CUDA driver call wait for a kernel that is still running? (device diagnostic)

The chain graphs (then opt-in, EPD_CHAIN_GRAPH=1) stalled in cuGraphInstantiateWithFlags while a
peer's low-latency kernel spun on the same GPU (docs/DESIGN_NOTES.md, "Chain instances as CUDA
graphs"). This times, while a one-block kernel spins for SPIN seconds on another stream, each
driver call that the chain's graph build and top-ups make: a capture, an instantiation (a
kernel node; a stream wait node), a graph's first and second launch, a plain launch, an
allocation. A call that waits for the spinner takes about SPIN seconds.

    python benchmarks/graph_instantiate_probe.py [--spin 1.0] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import cupy as cp

from epd.proto import cuda_driver

SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
extern "C" __global__ void touch(int* p) { p[threadIdx.x] += 1; }
// a large per-thread stack (local memory the context may have to grow for)
#define BIG(name) extern "C" __global__ void name(int* p, int n) {                     \
    volatile int a[8192];                                                             \
    for (int i = 0; i < 8192; ++i) a[(i * 7 + n) & 8191] = i + p[threadIdx.x];        \
    p[threadIdx.x] = a[n & 8191]; }
BIG(big1)
BIG(big2)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spin", type=float, default=1.0, help="the spinner's seconds")
    ap.add_argument("--json", help="write the timings here")
    ns = ap.parse_args()
    mod = cp.RawModule(code=SPIN_SRC)
    spin, touch = mod.get_function("spin"), mod.get_function("touch")
    big1, big2 = mod.get_function("big1"), mod.get_function("big2")
    buf = cp.zeros(32, cp.int32)
    flag = cp.zeros(1, cp.uint32)
    side, capture, run = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    touch((1,), (32,), (buf,), stream=side)  # (loaded, warm)
    side.synchronize()

    def kernel_graph(s: int) -> None:
        touch((1,), (32,), (buf,), stream=capture)

    def wait_graph(s: int) -> None:
        cuda_driver.stream_wait_nonzero(s, flag.data.ptr)
        touch((1,), (32,), (buf,), stream=capture)

    steps = {
        "capture + instantiate (kernel node)": lambda: cuda_driver.Graph(capture.ptr,
                                                                         kernel_graph),
        "capture + instantiate (wait node + kernel)": lambda: cuda_driver.Graph(
            capture.ptr, wait_graph),
        "graph's first launch": None, "graph's second launch": None,
        "kernel launch": lambda: touch((1,), (32,), (buf,), stream=run),
        "cudaMalloc (64 MiB)": lambda: allocs.append(cp.cuda.runtime.malloc(64 << 20)),
        "cudaFree (64 MiB)": lambda: cp.cuda.runtime.free(allocs.pop()),
        "first launch of a kernel with a 32 KiB stack": lambda: big1(
            (1,), (32,), (buf, cp.int32(3)), stream=run),
        "instantiate a graph of another 32 KiB-stack kernel": lambda: cuda_driver.Graph(
            capture.ptr, lambda s: big2((1,), (32,), (buf, cp.int32(3)), stream=capture)),
        "256 instantiations, closed at once (the slowest)": lambda: many(256, False),
        "512 instantiations kept (the slowest)": lambda: many(512, True),
        "1024 kept, after 512 were kept and closed": lambda: many(1024, True),
        "64 graphs made before the spinner, closed beside it": lambda: close_all(),
    }
    allocs: list[int] = []

    made: list[cuda_driver.Graph] = []

    def close_all() -> None:
        worst = 0.0
        for g in made:
            t0 = time.perf_counter()
            g.close()
            worst = max(worst, time.perf_counter() - t0)
        made.clear()
        print(f"   the slowest close: {worst * 1e3:.2f} ms")

    def many(n: int, keep: bool) -> None:
        """n graphs of a stream wait and four kernels (a chain instance's shape)."""
        worst, kept = (0.0, -1), []

        def instance(s: int) -> None:
            cuda_driver.stream_wait_nonzero(s, flag.data.ptr)
            for _ in range(4):
                touch((1,), (32,), (buf,), stream=capture)

        for i in range(n):
            t0 = time.perf_counter()
            g = cuda_driver.Graph(capture.ptr, instance)
            worst = max(worst, (time.perf_counter() - t0, i))
            kept.append(g) if keep else g.close()
        for g in kept:
            g.close()
        print(f"   the slowest of {n} instantiations ({'kept' if keep else 'closed'}): "
              f"#{worst[1]}, {worst[0] * 1e3:.2f} ms")
    results: dict[str, dict[str, float]] = {}
    for idle in (False, True):  # (spinning first: the kernels' first uses)
        ready = cuda_driver.Graph(capture.ptr, kernel_graph)
        got: dict[str, float] = {}
        for name, fn in steps.items():
            if name.startswith("64 graphs made"):
                made.extend(cuda_driver.Graph(capture.ptr, kernel_graph) for _ in range(64))
            if not idle:  # (a spinner of its own for each step: one that waited ended it)
                spin((1,), (1,), (int(ns.spin * 1e9),), stream=side)
                time.sleep(0.05)  # (running)
            t0 = time.perf_counter()
            if fn is None:  # the graph's launches
                ready.launch(run.ptr)
            else:
                out = fn()
                if isinstance(out, cuda_driver.Graph):
                    out.close()
            got[name] = time.perf_counter() - t0
            side.synchronize()
            run.synchronize()
        ready.close()
        label = "idle GPU" if idle else f"while a kernel spins {ns.spin:.1f} s"
        results[label] = got
        for name, sec in got.items():
            print(f"{label:>28} | {name:<52} {sec * 1e3:10.2f} ms", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
