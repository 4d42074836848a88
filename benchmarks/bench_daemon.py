"""End to end through the daemon on the gRPC path: client processes (torch CUDA tensors) call
layout, dispatch and combine on a `epd serve --backend cuda` daemon; client-observed medians,
next to the engine-side time of the same calls (the daemon's own histograms).

    python benchmarks/bench_daemon.py --json out.json     # on a machine with >= 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import numpy as np

from epd.server.bench.runner import provenance
from epd.server.demo import Daemon, Workload

CONFIGS = {"P": 4096, "D": 128}


def _rank(rank: int, socket: str, wl: Workload, name: str, iters: int, q) -> None:
    try:
        import torch

        from epd.client import Session
        torch.cuda.set_device(rank)
        x, idx, w = wl.inputs(rank)
        tx = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).cuda()
        tidx, tw = torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda()
        with Session(socket, client_name=f"bench-{rank}", timeout=60) as s:
            g = s.join(name, rank=rank, num_ranks=wl.num_ranks, num_experts=wl.num_experts,
                       hidden=wl.hidden, max_tokens_per_rank=max(wl.tokens),
                       num_topk=wl.num_topk)
            times = {"layout": [], "dispatch": [], "dispatch_cached": [], "combine": [],
                     "total": []}
            prof = None
            if os.environ.get("EPD_PROFILE_DIR"):  # where the client's host time goes
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            # Every call is stream-ordered on this process's current stream and returns
            # before the GPU ran it: each phase ends when the stream is done.
            sync = torch.cuda.synchronize
            for it in range(iters + 5):
                sync()
                t0 = time.perf_counter()
                g.get_dispatch_layout(tidx, copy=False)
                sync()
                t1 = time.perf_counter()
                out = g.dispatch(tx, tidx, tw, copy=False)
                sync()
                t2 = time.perf_counter()
                g.combine(out.recv_x, out.handle, copy=False)
                sync()
                t3 = time.perf_counter()
                g.dispatch(tx, handle=out.handle, copy=False)
                sync()
                t4 = time.perf_counter()
                if it >= 5:
                    times["layout"].append(t1 - t0)
                    times["dispatch"].append(t2 - t1)
                    times["combine"].append(t3 - t2)
                    times["dispatch_cached"].append(t4 - t3)
                    times["total"].append(t3 - t0)
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(os.environ["EPD_PROFILE_DIR"],
                                             f"client-{name}-{rank}.prof"))
        q.put({"rank": rank, "median_us": {k: float(np.median(v) * 1e6)
                                           for k, v in times.items()},
               "p99_us": {k: float(np.percentile(v, 99) * 1e6) for k, v in times.items()},
               "recv_rows": int(out.num_recv_tokens)})
    except Exception as e:
        import traceback
        q.put({"rank": rank, "error": f"{e}\n{traceback.format_exc()}"})


def histogram_mean_us(metrics_text: str, metric: str, **labels: str) -> float | None:
    """Mean in microseconds of a Prometheus histogram over the samples matching `labels`
    (None when it has none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if all(s.labels.get(k) == v for k, v in labels.items()):
                if s.name == f"{metric}_sum":
                    total += s.value
                elif s.name == f"{metric}_count":
                    count += s.value
    return total / count * 1e6 if count else None


def _engine_means(metrics_text: str, group: str) -> dict[str, float]:
    means = {kind: histogram_mean_us(metrics_text, f"epd_{kind}_seconds", group=group)
             for kind in ("layout", "dispatch", "combine")}
    return {k: v for k, v in means.items() if v is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--num-sms", type=int, default=24)
    ap.add_argument("--json", default="")
    ns = ap.parse_args()
    import cupy as cp
    ngpu = cp.cuda.runtime.getDeviceCount()
    ranks = min(ngpu, 8)
    results: dict = {**provenance(), "gpus": ngpu}
    failed = False
    # (no MPS: the clients here are not put on the engines' server; bench_low_latency.py and
    # `epd bench --mps on` measure under MPS)
    with Daemon(backend="cuda", engines=ngpu, timeout_seconds=20,
                extra=["--num-sms", str(ns.num_sms), "--nvshmem-heap-bytes", str(8 << 30),
                       "--mps", "off"]) as d:
        d.wait_ready(180)
        for cfg, tokens in CONFIGS.items():
            wl = Workload(ranks, [tokens] * ranks, 7168, 256, 8, seed=1, drop_prob=0.0)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            name = f"bench-{cfg}"
            procs = [ctx.Process(target=_rank, args=(r, d.socket(r), wl, name, ns.iters, q))
                     for r in range(ranks)]
            for p in procs:
                p.start()
            got = sorted((q.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
            for p in procs:
                p.join(30)
            engine = _engine_means(d.get("/metrics")[1], name)
            results[cfg] = {"tokens_per_rank": tokens, "ranks": ranks, "clients": got,
                            "engine_mean_us": engine}
            errors = [r["error"] for r in got if "error" in r]
            if errors:  # (any rank's: no figure for a run that failed)
                print(f"{cfg}: ERROR {errors[0]}")
                failed = True
                continue
            r0 = got[0]
            m = r0["median_us"]
            print(f"config {cfg} ({tokens} tok/rank, {ranks} ranks, {ns.num_sms} SMs): client "
                  f"median layout {m['layout']:.0f} us, dispatch {m['dispatch']:.0f} us, "
                  f"combine {m['combine']:.0f} us, cached dispatch {m['dispatch_cached']:.0f} "
                  f"us, layout+dispatch+combine {m['total']:.0f} us; engine-side mean "
                  + ", ".join(f"{k} {v:.0f} us" for k, v in engine.items()))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
