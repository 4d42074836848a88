"""Does closing a CUDA IPC mapping stall other threads' kernel launches while a kernel spins?

Why (docs/BENCHMARKS.md, sixth session): on the CUDA engine, a shrink group's survivors ran past
their deadline after a rank's process died, while the engine's teardown of that session sat in
`cudaIpcCloseMemHandle` for more than 15 s. Readings: (A) the close waits for the device to go
idle (the survivors' kernels spin for a reason of their own); (B) it also holds back other
threads' launches in the driver; (C) CuPy's `ipcCloseMemHandle` holds the GIL while the close
waits (its binding has no `nogil`), so no other Python thread of the engine runs, the poller
that would launch the peer's kernel included. The engine now closes through cuda.bindings,
which releases the GIL.

The probe: a helper process exports a buffer; this process maps it, then
  kernel K1 (stream A) spins until a flag is set or `--spin-ms` passes;
  thread T1 closes the mapping `--close-after-ms` later;
  thread T2 launches K2 (stream B), which sets the flag, `--launch-after-ms` later.
(A): K2's launch returns at once and K1 ends early; the close returns when K1 ends. (B) or (C):
K2's launch returns only after K1 gave up (K1 reports a timeout); with `--binding bindings`
(cuda.bindings, GIL released) (C) no longer stalls it, (B) still does. Run under MPS and without.

    python benchmarks/probe_ipc_close.py [--binding cupy|bindings] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import threading
import time

SPIN = r"""
extern "C" __global__ void spin(volatile unsigned* flag, long long ns, unsigned long long* out) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        if (*flag) { out[0] = 1; break; }
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if ((long long)(t - t0) > ns) { out[0] = 2; break; }
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[1] = t - t0;
}
extern "C" __global__ void set(volatile unsigned* flag) { *flag = 1; __threadfence_system(); }
"""


def _exporter(q, done) -> None:
    import cupy as cp

    buf = cp.zeros(1 << 20, cp.uint8)
    q.put(bytes(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr)))
    done.wait(60)


def probe(spin_ms: float, close_after_ms: float, launch_after_ms: float,
          binding: str = "cupy") -> dict:
    import cupy as cp

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_exporter, args=(q, done))
    p.start()
    try:
        handle = q.get(timeout=60)
        mapped = cp.cuda.runtime.ipcOpenMemHandle(handle)
        mod = cp.RawModule(code=SPIN)
        spin, setk = mod.get_function("spin"), mod.get_function("set")
        flag = cp.zeros(1, cp.uint32)
        out = cp.zeros(2, cp.uint64)
        a = cp.cuda.Stream(non_blocking=True)
        b = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device().synchronize()
        res: dict = {}

        def close() -> None:
            time.sleep(close_after_ms / 1e3)
            t = time.perf_counter()
            if binding == "cupy":
                cp.cuda.runtime.ipcCloseMemHandle(mapped)
            else:
                from cuda.bindings import runtime as cudart
                cudart.cudaIpcCloseMemHandle(mapped)
            res["close_s"] = time.perf_counter() - t
            res["close_returned_at_s"] = time.perf_counter() - t0

        def launch() -> None:
            cp.cuda.Device().use()
            time.sleep(launch_after_ms / 1e3)
            t = time.perf_counter()
            setk((1,), (1,), (flag,), stream=b)
            res["launch_s"] = time.perf_counter() - t
            b.synchronize()
            res["set_done_at_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        spin((1,), (1,), (flag, cp.int64(int(spin_ms * 1e6)), out), stream=a)
        threads = [threading.Thread(target=close), threading.Thread(target=launch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=spin_ms / 1e3 + 30)
        a.synchronize()
        o = cp.asnumpy(out)
        res["spin_outcome"] = {1: "released by K2", 2: "timed out"}.get(int(o[0]), "?")
        res["spin_s"] = float(o[1]) / 1e9
        return res
    finally:
        done.set()
        p.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spin-ms", type=float, default=3000)
    ap.add_argument("--close-after-ms", type=float, default=50)
    ap.add_argument("--launch-after-ms", type=float, default=200)
    ap.add_argument("--binding", choices=("cupy", "bindings"), default="cupy")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    res = probe(args.spin_ms, args.close_after_ms, args.launch_after_ms, args.binding)
    res["binding"] = args.binding
    res["reading"] = ("the close held back the other thread's launch (B, or C with cupy)"
                      if res["spin_outcome"] == "timed out" else
                      "the launch went through while the close was pending")
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
