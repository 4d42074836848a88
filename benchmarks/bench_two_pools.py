"""Two pools on one daemon (issue 14): does decode latency hold while prefill runs?

A decode pool (low-latency dispatch + combine of --decode-tokens per rank) and a prefill pool
(layout + dispatch + combine of --prefill-tokens per rank) join one daemon as two groups, each
with its own rank processes. Phases, in one run:

  1. decode alone            (p50 / p99 of the pair, host wall clock, device synchronised)
  2. prefill alone           (iterations per second)
  3. both at once            (decode p50 / p99 under load, prefill throughput under decode)

with the service classes on (decode `latency`, prefill `throughput`, via the daemon's policy)
or off (`--no-classes`: both the daemon's default). On cuda it also reads, from the daemon's
metrics at each phase's bounds, the engine's host time per armed decode op: how late the poller
saw the doorbell (`epd_stream_op_detect_seconds`, an upper bound) and how long the launch took
(`epd_stream_op_launch_seconds`), alone and under load: the host side of a miss. Targets
(issue 14): decode p50 <= 1.2x and
p99 <= 2x alone; prefill >= 0.85x alone. Ranks of a pool share GPUs round-robin (`--ranks`
per pool). The CPU backend runs it too (numpy inputs; its figures say nothing about GPUs).

    python3 benchmarks/bench_two_pools.py --backend cpu --json two_pools.json
    python3 benchmarks/bench_two_pools.py --backend cuda [--no-classes] --json two_pools.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from epd.server.bench.runner import provenance

POLICY = "decode-*=latency,prefill-*=throughput"
TARGETS = {"decode_p50_ratio": 1.2, "decode_p99_ratio": 2.0, "prefill_ratio": 0.85}


def _inputs(ns: argparse.Namespace, pool: str, rank: int, cuda: bool):
    from epd.proto import dtypes
    from epd.server import reference as ref

    tokens = ns.decode_tokens if pool == "decode" else ns.prefill_tokens
    rng = np.random.default_rng([11, rank, pool == "decode"])
    idx, w = ref.random_routing(rng, tokens, ns.experts, ns.topk, drop_prob=0.0)
    x = ref.random_x(rng, tokens, ns.hidden, dtypes.BFLOAT16)
    if not cuda:
        return x, idx, w
    import torch
    dev = rank % torch.cuda.device_count()
    tx = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).to(dev)
    return tx, torch.from_numpy(idx).to(dev), torch.from_numpy(w).to(dev)


PHASES = (("alone", ("decode",)), ("alone", ("prefill",)), ("loaded", ("decode", "prefill")))


def _rank(pool: str, rank: int, ns: argparse.Namespace, socket: str, cuda: bool, barrier,
          q) -> None:
    """One rank of one pool: runs the phases it takes part in, reports its timings."""
    try:
        from epd.client import Session
        def sync() -> None:
            pass

        if cuda:
            import torch
            torch.cuda.set_device(rank % torch.cuda.device_count())
            sync = torch.cuda.synchronize
        x, idx, w = _inputs(ns, pool, rank, cuda)
        m = ns.decode_tokens
        res: dict = {"pool": pool, "rank": rank}
        with Session(socket, client_name=f"{pool}-{rank}", timeout=60) as s:
            g = s.join(f"{pool}-pool", rank=rank, num_ranks=ns.ranks, num_experts=ns.experts,
                       hidden=ns.hidden, num_topk=ns.topk, low_latency_mode=pool == "decode",
                       max_tokens_per_rank=m if pool == "decode" else ns.prefill_tokens,
                       timeout=60)
            res["service_class"] = g.service_class

            y = None
            if pool == "decode" and cuda:  # the experts' bf16 outputs (FP8 comes in)
                import torch
                lx = ns.experts // ns.ranks
                y = torch.zeros((lx, ns.ranks * m, ns.hidden), dtype=x.dtype, device=x.device)

            ops = None
            if pool == "decode" and cuda:  # stream-ordered, as a serving engine calls it
                dop = g.arm_low_latency_dispatch(x, idx, m, use_fp8=True)
                ops = (dop, g.arm_low_latency_combine(y, idx, w, dop))
                # who runs them: the member's GPU chain (--ll-chain) or the engine's poller
                res["ll_path"] = "chain" if dop.chained else "poller"

            def step() -> None:
                if ops is not None:
                    ops[0].launch()
                    ops[1].launch()
                    sync()
                    return
                if pool == "decode":
                    out = g.low_latency_dispatch(x, idx, m, use_fp8=cuda, copy=False)
                    g.low_latency_combine(out.recv_x if y is None else y, idx, w, out.handle,
                                          copy=False)
                else:
                    g.get_dispatch_layout(idx, copy=False)
                    out = g.dispatch(x, idx, w, copy=False)
                    g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights,
                              copy=False)
                sync()

            for _ in range(ns.warmup):
                step()
            if ns.ranks_gc_freeze:  # as serving engines do once set up (vLLM after capture)
                import gc
                gc.collect()
                gc.freeze()
            for name, active in PHASES:  # every rank of both pools passes each barrier
                barrier.wait(timeout=600)
                if pool in active:  # a fixed count: a pool's ranks must make the same calls
                    samples = []
                    for _ in range(ns.decode_iters if pool == "decode" else ns.prefill_iters):
                        t0 = time.monotonic()  # system-wide: comparable across processes
                        step()
                        samples.append((t0, time.monotonic() - t0))
                    res[name] = samples
                    for op in ops or ():
                        op.check()  # a GPU-side failure is reported, not timed
                barrier.wait(timeout=600)
        q.put(res)
    except Exception as e:  # reported to the parent, never a hang
        import traceback
        q.put({"pool": pool, "rank": rank, "error": f"{e}\n{traceback.format_exc()}"})


def _overlapping(samples: list, other: list) -> list[float]:
    """Durations of the samples that started while the other pool was running."""
    if not other:
        return []
    lo, hi = other[0][0], other[-1][0] + other[-1][1]
    return [d for t, d in samples if lo <= t <= hi]


def _by_phase(title: str, phases: dict[str, dict], item: Callable[[str, Any], str]) -> None:
    """One line: each phase's items, formatted by `item(key, value)`."""
    print(f"  {title}: " + " | ".join(
        f"{phase} " + ", ".join(item(k, v) for k, v in items.items())
        for phase, items in phases.items()))


def _samples(rank0: dict) -> dict:
    """Rank 0's (start, µs) of every call by pool and phase, starts in ms from the first one:
    when a tail's calls ran against the other pool's (the JSON's raw record)."""
    t0 = min(r[p][0][0] for r in rank0.values() for p in ("alone", "loaded") if r.get(p))
    return {pool: {p: [[round((t - t0) * 1e3, 3), round(d * 1e6, 1)] for t, d in r[p]]
                   for p in ("alone", "loaded") if r.get(p)}
            for pool, r in rank0.items()}


def _summary(times: list[float]) -> dict:
    a = np.asarray(times) * 1e6

    def pct(q: float) -> float | None:
        return float(np.percentile(a, q)) if len(a) else None
    # (p90, mean and max beside the targets' percentiles: the shape of a tail)
    return {"n": len(a), "p50_us": pct(50), "p90_us": pct(90), "p99_us": pct(99),
            "mean_us": float(a.mean()) if len(a) else None,
            "max_us": float(a.max()) if len(a) else None,
            "over_1ms": int((a > 1000.0).sum()),  # (a tail's size: the stalled calls)
            "per_s": len(a) / max(float(np.sum(a)) * 1e-6, 1e-9)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ranks", type=int, default=2, help="ranks per pool")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--decode-iters", type=int, default=2000, help="decode pairs per phase")
    ap.add_argument("--prefill-iters", type=int, default=100, help="prefill layers per phase")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-classes", action="store_true", help="no service-class policy")
    ap.add_argument("--mps", choices=["auto", "on", "off"], default="auto",
                    help="the daemon's --mps (cuda): its engines and the pools on MPS or not")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="a flag for the daemon, e.g. --serve-arg=--throughput-pause-us=0")
    ap.add_argument("--ranks-gc-freeze", action="store_true",
                    help="each rank freezes its objects out of the garbage collector after "
                         "its warm-up calls (gc.freeze, as vLLM does after start-up)")
    ap.add_argument("--daemon-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable of the daemon (and its private MPS server) "
                         "only, not of the pools' ranks (repeatable)")
    ap.add_argument("--split-daemons", action="store_true",
                    help="the prefill pool on a second daemon on the same GPUs, under the "
                         "first one's MPS server: the pools' launches in separate engine "
                         "processes (the metrics read are the decode daemon's)")
    ap.add_argument("--class-engines", action="store_true",
                    help="the daemon's --class-engines: the decode pool on each device's "
                         "latency engine, prefill on its throughput engine (one daemon, one "
                         "engine process per device and class)")
    ap.add_argument("--json")
    ns = ap.parse_args()

    from epd.server.bench import engine_host
    from epd.server.demo import Daemon
    cuda = ns.backend == "cuda"
    extra = [] if ns.no_classes else ["--service-class-policy", POLICY]
    if cuda:
        extra += ["--mps", ns.mps]
    extra += ns.serve_arg
    if ns.class_engines and ns.no_classes:
        ap.error("--class-engines needs the classes (the policy puts decode on the latency "
                 "engines)")
    # explicit either way: the daemon's default (auto) turns them on under the policy
    extra += ["--class-engines", "on" if ns.class_engines else "off"]
    engines = 0 if cuda else 2
    if cuda:
        import cupy
        engines = cupy.cuda.runtime.getDeviceCount()
    for item in ns.daemon_env:
        if not item.partition("=")[1]:
            ap.error(f"--daemon-env {item!r}: expected NAME=VALUE")

    def start(more_env: dict[str, str]) -> Daemon:
        saved = dict(os.environ)
        os.environ.update(more_env)
        os.environ.update(item.split("=", 1) for item in ns.daemon_env)
        try:
            return Daemon(backend=ns.backend, engines=engines, timeout_seconds=30, extra=extra)
        finally:  # (the daemon took its copy; the ranks start from the environment as it was)
            os.environ.clear()
            os.environ.update(saved)

    d = start({})
    d_prefill = None  # --split-daemons
    procs = []
    try:
        d.wait_ready(180)
        if ns.split_daemons:  # (its engines find the first one's MPS server: "node" mode)
            d_prefill = start(d.client_env())
            d_prefill.wait_ready(180)
        os.environ.update(d.client_env())  # the pools share the daemon's MPS server
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        # Phase starts and ends: both pools' ranks, and this process, which reads the
        # daemon's metrics at each phase's bounds.
        barrier = ctx.Barrier(2 * ns.ranks + 1)
        for pool in ("decode", "prefill"):
            daemon = d_prefill if pool == "prefill" and d_prefill is not None else d
            for r in range(ns.ranks):
                cls = "latency" if ns.class_engines and pool == "decode" else ""
                procs.append(ctx.Process(target=_rank, args=(
                    pool, r, ns, daemon.socket(r % max(engines, 1), cls), cuda, barrier, q)))
        for p in procs:
            p.start()
        host: dict[str, dict] = {}
        gc_pauses: dict[str, dict] = {}  # the engines' collector, per phase
        chain: dict[str, dict] = {}  # --ll-chain with EPD_CHAIN_TIMELINE=1: its GPU segments
        chain_tails: dict[str, dict] = {}  # (their p50 / p99 bucket bounds: where a tail is)
        starved: dict[str, float] = {}  # times the chains ran dry with a call waiting
        slow_rounds: dict[str, dict] = {}  # the poller's rounds over 1 ms: where it was

        def reading():
            text = engine_host.read(d.metrics_url + "/metrics")
            return ((engine_host.totals(text, "decode-pool"), engine_host.gc_totals(text),
                     engine_host.chain_totals(text), engine_host.chain_buckets(text),
                     engine_host.chain_starved(text), engine_host.poller_slow(text))
                    if text is not None else (None,) * 6)
        try:
            for i, (name, active) in enumerate(PHASES):
                barrier.wait(timeout=600)
                if i == 0:  # (after the warm-up calls)
                    last = reading()
                barrier.wait(timeout=600)
                now = reading()
                if "decode" in active:
                    host[name] = engine_host.means_us(last[0], now[0])
                label = name if name == "loaded" else f"{active[0]}_alone"
                gc_pauses[label] = engine_host.gc_between(last[1], now[1])
                if "decode" in active:
                    chain[name] = engine_host.label_means_us(last[2], now[2])
                    chain_tails[name] = engine_host.label_tails_us(last[3], now[3])
                    if last[4] is not None and now[4] is not None:
                        starved[name] = now[4] - last[4]
                    slow_rounds[name] = engine_host.label_sums_ms(last[5], now[5])
                last = now
        except threading.BrokenBarrierError:  # a rank failed: its error comes through q
            pass
        results = [q.get(timeout=1800) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if d_prefill is not None:  # (before the daemon whose MPS server it uses)
            d_prefill.stop()
        d.stop()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"bench_two_pools: a rank failed: {errors[0]}")
        return 1
    rank0 = {r["pool"]: r for r in results if r["rank"] == 0}
    dec, pre = rank0["decode"], rank0["prefill"]
    dec_alone = _summary([d for _, d in dec["alone"]])
    pre_alone = _summary([d for _, d in pre["alone"]])
    # Under load: only what ran while the other pool ran (the pools finish at different times).
    dec_loaded = _summary(_overlapping(dec["loaded"], pre["loaded"]))
    pre_loaded = _summary(_overlapping(pre["loaded"], dec["loaded"]))
    if not dec_loaded["n"] or not pre_loaded["n"]:
        print("bench_two_pools: the pools did not overlap; raise --decode-iters")
        return 1
    ratios = {"decode_p50_ratio": dec_loaded["p50_us"] / dec_alone["p50_us"],
              "decode_p99_ratio": dec_loaded["p99_us"] / dec_alone["p99_us"],
              "prefill_ratio": pre_loaded["per_s"] / pre_alone["per_s"]}
    ll_path = dec.get("ll_path", "synchronous")
    how = "synchronous calls" if ll_path == "synchronous" else f"armed ops on the {ll_path}"
    print(f"backend {ns.backend}, {ns.ranks} ranks per pool, classes "
          f"{'off' if ns.no_classes else POLICY}: decode {rank0['decode']['service_class']} "
          f"({how}), prefill {rank0['prefill']['service_class']}")
    print(f"  decode pair   alone p50 {dec_alone['p50_us']:9.1f} us p99 {dec_alone['p99_us']:9.1f}"
          f" | under prefill p50 {dec_loaded['p50_us']:9.1f} p99 {dec_loaded['p99_us']:9.1f}")
    print("  decode tails  " + " | ".join(
        f"{name} p90 {d['p90_us']:.1f} mean {d['mean_us']:.1f} max {d['max_us']:.1f} us, "
        f"{d['over_1ms']} of {d['n']} over 1 ms"
        for name, d in (("alone", dec_alone), ("under prefill", dec_loaded))))
    print(f"  prefill       alone {pre_alone['per_s']:8.1f}/s | under decode "
          f"{pre_loaded['per_s']:8.1f}/s")
    if all(v is not None for h in host.values() for v in h.values()) and host:
        print("  decode op, engine host µs (mean): " + " | ".join(
            f"{phase} detect {h['detect_us']:.1f} launch {h['launch_us']:.1f}"
            for phase, h in host.items()))
    if any(gc_pauses.values()):
        _by_phase("engine gc", gc_pauses,
                  lambda g, v: f"gen{g} {v['collections']:.0f}x {v['pause_ms']:.1f} ms")
    if any(chain.values()):
        _by_phase("decode chain, GPU µs per instance (mean)", chain,
                  lambda seg, us: f"{seg} {us:.1f}")
        _by_phase("decode chain, GPU µs p50/p99 (bucket bounds), >1 ms", chain_tails,
                  lambda seg, t: f"{seg} {t['p50_le_us']:.0f}/{t['p99_le_us']:.0f} "
                                 f"{t['over_1ms']:.0f}")
    if any(starved.values()) or any(chain.values()):
        print("  decode chain ran dry: " + " | ".join(f"{phase} {n:.0f}x"
                                                     for phase, n in starved.items()))
    if any(slow_rounds.values()):
        _by_phase("poller rounds > 1 ms, count and ms per part", slow_rounds,
                  lambda part, v: f"{part} {v['n']:.0f}x {v['ms']:.1f}")
    for k, v in ratios.items():
        ok = v <= TARGETS[k] if k.startswith("decode") else v >= TARGETS[k]
        print(f"  {k:18s} {v:6.2f}  target {'<=' if k.startswith('decode') else '>='} "
              f"{TARGETS[k]}  {'pass' if ok else 'MISS'}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**provenance(), "args": vars(ns),
                       "decode": {"alone": dec_alone, "loaded": dec_loaded},
                       "prefill": {"alone": pre_alone, "loaded": pre_loaded},
                       "ratios": ratios, "targets": TARGETS, "decode_engine_host": host,
                       "engine_gc": gc_pauses, "decode_chain_us": chain,
                       "decode_chain_tails": chain_tails, "decode_chain_starved": starved,
                       "poller_slow_rounds": slow_rounds,
                       "samples": _samples(rank0),
                       "classes": {p: rank0[p]["service_class"] for p in rank0},
                       "decode_ll_path": ll_path}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
