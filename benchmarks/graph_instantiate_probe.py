"""Does a CUDA driver call wait for a kernel that is still running? (device diagnostic)

The opt-in chain graphs (EPD_CHAIN_GRAPH=1) stalled in cuGraphInstantiateWithFlags while a
peer's low-latency kernel spun on the same GPU (docs/DESIGN_NOTES.md, "Chain instances as CUDA
graphs"). This times, while a one-block kernel spins for SPIN seconds on another stream, each
driver call that the chain's graph build and top-ups make: a capture, an instantiation (a
kernel node; a stream wait node), a graph's first and second launch, a plain launch, an
allocation. A call that waits for the spinner takes about SPIN seconds.

    python benchmarks/graph_instantiate_probe.py [--spin 2.0] [--json out.json]
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
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spin", type=float, default=2.0, help="the spinner's seconds")
    ap.add_argument("--json", help="write the timings here")
    ns = ap.parse_args()
    mod = cp.RawModule(code=SPIN_SRC)
    spin, touch = mod.get_function("spin"), mod.get_function("touch")
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
        "cupy allocation (64 MiB, new)": lambda: cp.cuda.runtime.free(
            cp.cuda.runtime.malloc(64 << 20)),
    }
    results: dict[str, dict[str, float]] = {}
    for idle in (True, False):
        ready = cuda_driver.Graph(capture.ptr, kernel_graph)
        if not idle:
            spin((1,), (1,), (int(ns.spin * 1e9),), stream=side)
            time.sleep(0.05)  # (running)
        got: dict[str, float] = {}
        for name, fn in steps.items():
            t0 = time.perf_counter()
            if name == "graph's first launch" or name == "graph's second launch":
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
            print(f"{label:>28} | {name:<44} {sec * 1e3:10.2f} ms", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
