"""Per-call latency and host CPU of normal-mode calls through the daemon (a diagnostic beside
`epd bench`): each rank a process with torch CUDA tensors, per iteration barrier, t0, the
call(s), torch.cuda.synchronize(), t1; p50 over --iters; process CPU time per call in the client
and in the engine (/proc/<pid>/stat). Ranks share GPU 0 when there is one GPU.

    python3 benchmarks/probe_calls.py --tokens 128 --iters 200 [--mps on|off] [--json out.json]
    EPD_PROBE_PROFILE=rank0.prof python3 benchmarks/probe_calls.py --low-latency \
        --rows "ll plain pair"      # rank 0's client under cProfile (benchmarks/pstats_top.py)
    python3 benchmarks/probe_calls.py --elastic --rows "v1 facade layer,v2 layer cpu-sync"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import numpy as np

from epd.server.bench.runner import provenance

BARRIER_SECONDS = 120  # (a rank that failed breaks the barrier for the others: no hang)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _rank(rank: int, ns: argparse.Namespace, socket: str, barrier, engine_pid: int,
          metrics_url: str, q) -> None:
    import torch

    from epd.client import Session, host_cpu
    from epd.server import reference as ref
    from epd.server.bench import engine_host

    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    rng = np.random.default_rng([7, rank])
    idx, w = ref.random_routing(rng, ns.tokens, ns.experts, ns.topk, drop_prob=0.0)
    tidx = torch.from_numpy(idx).to(dev)
    tw = torch.from_numpy(w).to(dev)
    x = torch.randn(ns.tokens, ns.hidden, device=dev).to(torch.bfloat16)
    res: dict = {"rank": rank}
    with Session(socket, client_name=f"probe-{rank}", timeout=30) as s:
        g = s.join("probe", rank=rank, num_ranks=ns.ranks, num_experts=ns.experts,
                   hidden=ns.hidden, max_tokens_per_rank=ns.tokens, num_topk=ns.topk,
                   timeout=30)
        out = g.dispatch(x, tidx, tw)

        def full():
            g.get_dispatch_layout(tidx)
            o = g.dispatch(x, tidx, tw)
            g.combine(o.recv_x, o.handle, topk_weights=o.recv_topk_weights)

        rows = {"layout": lambda: g.get_dispatch_layout(tidx),
                "dispatch": lambda: g.dispatch(x, tidx, tw),
                "cached dispatch": lambda: g.dispatch(x, handle=out.handle),
                "combine": lambda: g.combine(out.recv_x, out.handle,
                                             topk_weights=out.recv_topk_weights),
                "layout + dispatch + combine": full}
        calls = {"layout + dispatch + combine": 3}
        if ns.low_latency:  # the DeepEP facade's low-latency pair, FP8 dispatch + bf16 combine
            from epd.client.buffer import Buffer
            buf = Buffer(rank=rank, num_ranks=ns.ranks, session=s, low_latency_mode=True,
                         group_name="probe-ll")
            y = torch.zeros((ns.experts // ns.ranks, ns.ranks * ns.tokens, ns.hidden),
                            dtype=torch.bfloat16, device=dev)

            def ll(hook: bool):
                def pair() -> None:
                    _, _, h, _, hk = buf.low_latency_dispatch(x, tidx, ns.tokens, ns.experts,
                                                              return_recv_hook=hook)
                    if hk is not None:
                        hk()
                    _, _, hk = buf.low_latency_combine(y, tidx, tw, h, return_recv_hook=hook)
                    if hk is not None:
                        hk()
                return pair

            rows.update({"ll plain pair": ll(False), "ll hook pair": ll(True)})
            calls.update({"ll plain pair": 2, "ll hook pair": 2})
        if ns.elastic:  # a normal-mode layer through DeepEP V1's facade and V2's ElasticBuffer
            from epd.client.buffer import Buffer
            from epd.client.elastic_buffer import ElasticBuffer
            v1 = Buffer(rank=rank, num_ranks=ns.ranks, session=s, group_name="probe-v1")
            v2 = ElasticBuffer(num_max_tokens_per_rank=ns.tokens, hidden=ns.hidden,
                               num_topk=ns.topk, rank=rank, num_ranks=ns.ranks, session=s,
                               group_name="probe-v2")

            def v1_layer(worst: int = 0):
                def layer() -> None:
                    per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(tidx,
                                                                                ns.experts)
                    rx, _, rw, _, h, _ = v1.dispatch(
                        x, topk_idx=tidx, topk_weights=tw, num_tokens_per_rank=per_rank,
                        num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                        num_worst_tokens=worst)
                    v1.combine(rx, h, topk_weights=rw)
                return layer

            def v2_layer(sync: bool, expand: bool = False):
                def layer() -> None:
                    rx, _, rw, h, _ = v2.dispatch(x, topk_idx=tidx, topk_weights=tw,
                                                  num_experts=ns.experts, do_cpu_sync=sync,
                                                  do_expand=expand)
                    v2.combine(rx, h, topk_weights=rw)
                return layer

            from epd.client import elastic_layout
            by_kernel = elastic_layout._by_kernel

            def torch_handle() -> None:  # the handle's layout by torch operations, as before
                elastic_layout._by_kernel = elastic_layout.by_torch
                try:
                    v2_layer(False)()
                finally:
                    elastic_layout._by_kernel = by_kernel

            # Why did torch's compare + masked_fill cost ~280 µs of host time inside V2's
            # combine (thirty-sixth session's profile)? The same two operations alone, and
            # right after a V1 dispatch (whose stream then waits for the engine's DONE).
            ids = torch.randint(-1, 4, (ns.ranks * ns.tokens, ns.topk), device=dev)
            wts = torch.rand((ns.ranks * ns.tokens, ns.topk), device=dev)

            def mask_ops() -> None:
                wts.masked_fill(ids < 0, 0.0)

            def v1_dispatch() -> None:
                per_rank, _, per_expert, in_rank, _ = v1.get_dispatch_layout(tidx, ns.experts)
                v1.dispatch(x, topk_idx=tidx, topk_weights=tw, num_tokens_per_rank=per_rank,
                            num_tokens_per_expert=per_expert, is_token_in_rank=in_rank)

            def v1_dispatch_mask_ops() -> None:
                v1_dispatch()
                mask_ops()

            rows.update({"torch mask ops": mask_ops, "v1 dispatch": v1_dispatch,
                         "v1 dispatch + torch mask ops": v1_dispatch_mask_ops})
            calls.update({"v1 dispatch": 2, "v1 dispatch + torch mask ops": 2})
            rows.update({"v1 facade layer": v1_layer(),
                         # (num_worst_tokens: no host wait for the count, as DeepEP's)
                         "v1 facade layer worst-case": v1_layer(ns.ranks * ns.tokens),
                         "v2 layer cpu-sync": v2_layer(True),
                         "v2 layer worst-case": v2_layer(False),
                         "v2 layer torch-handle": torch_handle,
                         "v2 expanded layer": v2_layer(True, expand=True)})
            calls.update({"v1 facade layer": 3, "v1 facade layer worst-case": 3,
                          "v2 layer cpu-sync": 2,
                          "v2 layer worst-case": 2, "v2 layer torch-handle": 2,
                          "v2 expanded layer": 2})
        if ns.rows:
            rows = {k: v for k, v in rows.items() if k in ns.rows.split(",")}
        prof = None
        if rank == 0 and os.environ.get("EPD_PROBE_PROFILE"):  # cProfile of the timed rows
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        for name, fn in rows.items():
            try:
                for _ in range(ns.warmup):
                    fn()
                torch.cuda.synchronize()
            except Exception as e:  # (a row this setup cannot run: say so, keep the others)
                res[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            barrier.wait(BARRIER_SECONDS)
            times, work = [], 0.0
            c0, e0 = time.process_time(), _cpu(engine_pid)
            m0 = engine_host.read(metrics_url) if rank == 0 else None
            for _ in range(ns.iters):
                barrier.wait(BARRIER_SECONDS)
                t0 = time.perf_counter()
                tc0, s0 = time.thread_time(), host_cpu.wait_seconds()
                fn()
                work += time.thread_time() - tc0 - (host_cpu.wait_seconds() - s0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            c1, e1 = time.process_time(), _cpu(engine_pid)
            m1 = engine_host.read(metrics_url) if rank == 0 else None
            n = ns.iters * calls.get(name, 1)
            res[name] = {"p50_us": float(np.percentile(times, 50) * 1e6),
                         "p90_us": float(np.percentile(times, 90) * 1e6),
                         "client_cpu_us_per_call": (c1 - c0) / n * 1e6,
                         # the engine serves every rank of this GPU: per call of all of them
                         "engine_cpu_us_per_call": (e1 - e0) / (n * ns.ranks) * 1e6,
                         # the work alone: this thread without its spins for replies, and
                         # the engine's threads serving requests (per request, rank 0 reads)
                         "client_work_us_per_call": work / n * 1e6,
                         "engine_work_us_per_call": (
                             engine_host.work_us(engine_host.work_totals(m0),
                                                 engine_host.work_totals(m1))
                             if m0 is not None and m1 is not None else None)}
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["EPD_PROBE_PROFILE"])
    q.put(res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--mps", choices=["on", "off"], default="on")
    ap.add_argument("--low-latency", action="store_true",
                    help="add the facade's low-latency pair, plain and with hooks")
    ap.add_argument("--elastic", action="store_true",
                    help="add a normal-mode layer through DeepEP V1's facade (Buffer) and V2's "
                         "ElasticBuffer, with and without the CPU sync")
    ap.add_argument("--rows", help="comma-separated row names to run (default: all)")
    ap.add_argument("--json")
    ns = ap.parse_args()

    import grpc

    from epd.proto.v1 import epd_pb2, epd_pb2_grpc
    from epd.server.demo import Daemon

    d = Daemon(backend="cuda", engines=1, extra=["--mps", ns.mps])
    try:
        d.wait_ready(180)
        with grpc.insecure_channel(f"unix://{d.socket_dir}/node.sock") as ch:
            topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=10)
        if topo.mps_pipe_directory:  # the clients share the daemon's MPS server
            os.environ["CUDA_MPS_PIPE_DIRECTORY"] = topo.mps_pipe_directory
        ctx = mp.get_context("spawn")
        barrier, q = ctx.Barrier(ns.ranks), ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, ns, d.socket(0), barrier,
                                                 topo.engines[0].pid, d.metrics_url + "/metrics",
                                                 q))
                 for r in range(ns.ranks)]
        for p in procs:
            p.start()
        try:
            results = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
        finally:  # (a rank that failed leaves its peers at the barrier: none may outlive us)
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    finally:
        d.stop()
    r0 = results[0]
    print(f"tokens {ns.tokens} hidden {ns.hidden} top-{ns.topk} of {ns.experts}, "
          f"{ns.ranks} ranks, MPS {ns.mps} ({topo.mps_mode})")
    for name, v in r0.items():
        if name == "rank":
            continue
        if "error" in v:
            print(f"  {name:28s} failed in its warm-up: {v['error'][:300]}")
            continue
        ew = v["engine_work_us_per_call"]
        print(f"  {name:28s} p50 {v['p50_us']:8.1f} us  p90 {v['p90_us']:8.1f} us  "
              f"client CPU {v['client_cpu_us_per_call']:6.1f} us/call  engine CPU "
              f"{v['engine_cpu_us_per_call']:6.1f} us/call  work client "
              f"{v['client_work_us_per_call']:6.1f} / engine "
              f"{'-' if ew is None else f'{ew:6.1f}'} us/call")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({**provenance(), "args": vars(ns), "mps_mode": topo.mps_mode,
                       "ranks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
