"""The daemon hop alone: round trips of the empty operation (Ping) on the fast path and on gRPC,
and the CPU an idle engine burns while a fast-path session is open. With --ops, also
back-to-back layout, dispatch and combine of a one-rank group with tiny tensors (the fixed
host cost of a call on the fast path, cpu backend), e.g. to compare engine spin settings:

    python benchmarks/bench_transport.py [--backend cpu] [--iters 20000] [--ops 2000]
    EPD_FAST_PATH_SPIN_MAX_US=0 python benchmarks/bench_transport.py --iters 2000 --ops 2000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from epd.client import Session
from epd.server.bench.runner import provenance

# The engine CPU measurement is a test helper (tests/daemon_harness.py), not part of `epd demo`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from daemon_harness import HarnessDaemon, process_cpu_seconds


def _ops(d: HarnessDaemon, iters: int) -> dict:
    """p50/p90 of back-to-back calls of one rank (4 tokens, hidden 16, top-2 of 8 experts,
    float32 on the cpu backend), the client's CPU per call and the engine process's (its spin
    between calls included)."""
    from epd.server import reference as ref

    out = {}
    with Session(d.socket(0)) as s:
        g = s.join("bench-ops", rank=0, num_ranks=1, num_experts=8, hidden=16, num_topk=2,
                   max_tokens_per_rank=8, dtype="float32")
        rng = np.random.default_rng(0)
        idx, w = ref.random_routing(rng, 4, 8, 2, drop_prob=0.0)
        x = s.empty((4, 16), np.float32)
        x[:] = rng.standard_normal((4, 16))
        ti, tw = s.empty(idx.shape, idx.dtype), s.empty(w.shape, np.float32)
        ti[:], tw[:] = idx, w
        res = g.dispatch(x, ti, tw)
        calls = {"layout": lambda: g.get_dispatch_layout(ti),
                 "dispatch": lambda: g.dispatch(x, ti, tw),
                 "combine": lambda: g.combine(res.recv_x, res.handle)}
        for name, fn in calls.items():
            for _ in range(max(iters // 10, 10)):
                fn()
            ts = np.empty(iters)
            c0, e0 = time.process_time(), process_cpu_seconds(d.engine_pid(0))
            for i in range(iters):
                t0 = time.perf_counter()
                fn()
                ts[i] = time.perf_counter() - t0
            cpu = (time.process_time() - c0) / iters * 1e6
            engine = (process_cpu_seconds(d.engine_pid(0)) - e0) / iters * 1e6
            out[name] = {"p50_us": float(np.percentile(ts, 50) * 1e6),
                         "p90_us": float(np.percentile(ts, 90) * 1e6),
                         "client_cpu_us_per_call": cpu, "engine_cpu_us_per_call": engine}
            print(f"{name:9s} back to back: p50 {out[name]['p50_us']:.1f} us, p90 "
                  f"{out[name]['p90_us']:.1f} us, CPU per call: client {cpu:.1f} us, engine "
                  f"{engine:.1f} us")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--ops", type=int, default=0,
                    help="also time this many back-to-back calls of each operation")
    ap.add_argument("--json", default="")
    ns = ap.parse_args()
    out = {}
    with HarnessDaemon(backend=ns.backend, engines=1) as d:
        for fast in (True, False):
            with Session(d.socket(0), fast_path=fast) as s:
                n = ns.iters if fast else max(ns.iters // 10, 1000)
                ts = np.empty(n)
                for i in range(n):
                    t0 = time.perf_counter()
                    s.ping()
                    ts[i] = time.perf_counter() - t0
                ts = ts[n // 10:] * 1e6
                out[s.transport] = {"p50_us": float(np.percentile(ts, 50)),
                                    "p99_us": float(np.percentile(ts, 99)), "n": len(ts)}
                print(f"{s.transport:9s} empty round trip: p50 {out[s.transport]['p50_us']:.1f}"
                      f" us, p99 {out[s.transport]['p99_us']:.1f} us ({len(ts)} calls)")
        if ns.ops:
            out["ops"] = _ops(d, ns.ops)
        with Session(d.socket(0)) as s:
            s.ping()
            time.sleep(0.5)
            idle = d.engine_cpu_fraction(0, 3.0)
        out["idle_engine_cpu_fraction"] = idle
        print(f"idle engine with an open fast-path session: {idle:.2%} of one core")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**provenance(), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
