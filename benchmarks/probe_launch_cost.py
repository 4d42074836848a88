"""Host CPU of the driver calls the engine makes per normal-mode call (a diagnostic, issue 10).

The engine's profile (py-spy, tenth session) put 50-150 µs of its thread's time on single
driver calls: `cuStreamWaitValue32` and the kernel launches queued behind it. This probe times
those calls alone, in one process, per iteration (µs of wall time of the enqueue, p50/p90):
  - `launch`: three launches of an empty kernel on a stream;
  - `wait+launch`: a `cuStreamWaitValue32(word >= n)` on a word the host writes only after
    the enqueue (the engine's normal-mode pattern: the client's READY comes later), then the
    three launches;
  - `ready+launch`: the same with the word written before the enqueue (the wait passes);
  - `gate+launch`: a one-thread kernel spinning on the word instead of the stream wait.
Each with one thread, then with `--threads` threads on their own streams at once (the
engine's sessions), with a thread polling `cuStreamQuery` beside them (its poller), and with
the threads taking one lock around each iteration's enqueue (`serial`: the engine's
`serial_enqueue`).
Run it under MPS and without (the caller sets the environment).

    python3 -P benchmarks/probe_launch_cost.py --iters 400 [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time

import numpy as np

from epd.server.bench.runner import provenance

SRC = r"""
extern "C" __global__ void empty_kernel(int x) {}
extern "C" __global__ void gate(const unsigned* w, unsigned n) {
    while (*reinterpret_cast<const volatile unsigned*>(w) < n) {}
}
"""


def run(variant: str, iters: int, threads: int, poller: bool,
        serial: bool = False) -> list[float]:
    import cupy as cp
    from cuda.bindings import driver

    mod = cp.RawModule(code=SRC)
    empty, gate = mod.get_function("empty_kernel"), mod.get_function("gate")
    geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    times: list[float] = []
    lock = threading.Lock()
    enqueue = threading.Lock() if serial else contextlib.nullcontext()
    stop = threading.Event()

    def worker(i: int) -> None:
        cp.cuda.Device(0).use()
        mem = cp.cuda.alloc_pinned_memory(64)
        host = np.frombuffer(mem, np.uint32, 16)
        host[:] = 0
        stream = cp.cuda.Stream(non_blocking=True)
        mine = []
        for n in range(1, iters + 1):
            if variant == "ready+launch":
                host[0] = n
            t0 = time.perf_counter()
            with enqueue:
                if variant in ("wait+launch", "ready+launch"):
                    err, = driver.cuStreamWaitValue32(driver.CUstream(stream.ptr),
                                                      driver.CUdeviceptr(mem.ptr), n, geq)
                    assert err == driver.CUresult.CUDA_SUCCESS, err
                elif variant == "gate+launch":
                    gate((1,), (1,), (np.uint64(mem.ptr), np.uint32(n)), stream=stream)
                for _ in range(3):
                    empty((1,), (32,), (np.int32(n),), stream=stream)
            mine.append((time.perf_counter() - t0) * 1e6)
            host[0] = n
            stream.synchronize()
        with lock:
            times.extend(mine)

    def poll() -> None:
        cp.cuda.Device(0).use()
        s = cp.cuda.Stream(non_blocking=True)
        while not stop.is_set():
            s.done  # noqa: B018 (cuStreamQuery)
            time.sleep(0)

    p = threading.Thread(target=poll, daemon=True) if poller else None
    if p is not None:
        p.start()
    ws = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="")
    ap.add_argument("--json")
    ns = ap.parse_args()
    import cupy as cp
    cp.cuda.Device(0).use()
    run("launch", 20, 1, False)  # warm: compile, context
    out = {}
    for threads, poller, serial in ((1, False, False), (ns.threads, False, False),
                                    (ns.threads, True, False), (ns.threads, False, True),
                                    (ns.threads, True, True)):
        for variant in ("launch", "wait+launch", "ready+launch", "gate+launch"):
            t = np.array(run(variant, ns.iters, threads, poller, serial))
            key = (f"{variant} threads={threads}{' +poller' if poller else ''}"
                   f"{' serial' if serial else ''}")
            out[key] = {"p50_us": float(np.percentile(t, 50)),
                        "p90_us": float(np.percentile(t, 90))}
            print(f"{ns.label} {key:36s} p50 {out[key]['p50_us']:8.1f}  p90 "
                  f"{out[key]['p90_us']:8.1f} us", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**provenance(), "args": vars(ns), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
