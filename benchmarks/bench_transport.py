"""The daemon hop alone: round trips of the empty operation (Ping) on the fast path and on gRPC,
and the CPU an idle engine burns while a fast-path session is open.

    python benchmarks/bench_transport.py [--backend cpu] [--iters 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from epd.client import Session

# The engine CPU measurement is a test helper (tests/daemon_harness.py), not part of `epd demo`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from daemon_harness import HarnessDaemon


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--iters", type=int, default=20000)
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
        with Session(d.socket(0)) as s:
            s.ping()
            time.sleep(0.5)
            idle = d.engine_cpu_fraction(0, 3.0)
        out["idle_engine_cpu_fraction"] = idle
        print(f"idle engine with an open fast-path session: {idle:.2%} of one core")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
