"""Low-latency (decode) mode at config D: 128 tokens/rank, hidden 7168, top-8 of 256 experts.

    python benchmarks/bench_low_latency.py --json out.json      # on a machine with >= 2 GPUs

Part 1, kernels (one process, rank r on GPU r, the ranks' streams released together by a gate
kernel): low-latency dispatch (bf16 and FP8) and combine, CUDA events, median over iterations of
the slowest rank.
Part 2, through the daemon (`epd serve --backend cuda`, one client process per GPU, the
same-host fast path): client call to result returned (the engine has synchronised its stream,
so the output is ready for any client stream), median and p99, next to the engine-side mean of
the same calls from the daemon's histograms.
Part 3: the NCCL all_to_all_single pipeline of benchmarks/bench_kernels.py at D, same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from epd.server.bench.runner import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
H, E, K, M = 7168, 256, 8, 128


def _stats(v: list[float]) -> dict[str, float]:
    return {"median_us": float(np.median(v) * 1e6), "p99_us": float(np.percentile(v, 99) * 1e6)}


def bench_kernels(iters: int, warmup: int, num_sms: int) -> dict[str, Any]:
    import cupy as cp

    from epd.proto.dtypes import BFLOAT16
    from epd.server import reference as ref
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    import local_group as rt  # LocalGroup, MappedSlot: the daemon's layout, all ranks here

    r_count = min(cp.cuda.runtime.getDeviceCount(), 8)
    g = rt.LocalGroup(r_count, E, H, K, M, BFLOAT16, low_latency=True)
    gate = rt.MappedSlot()
    flag = gate.words.view(np.int32)
    rng = np.random.default_rng(2026)
    lx = E // r_count
    dev = []
    for run in g.runners:
        idx, w = ref.random_routing(rng, M, E, K, num_ranks=r_count)
        x = ref.random_x(rng, M, H, BFLOAT16)
        with cp.cuda.Device(run.device_id), run.stream:
            dev.append({"x": cp.asarray(x.view(np.uint16)), "idx": cp.asarray(idx),
                        "w": cp.asarray(w), "out": cp.empty((M, H), cp.uint16),
                        "y": cp.full((lx, r_count * M, H), 0x3F80, cp.uint16)})  # bf16 1.0
    g.synchronize()
    out: dict[str, Any] = {"ranks": r_count, "num_sms": num_sms}
    for fp8 in (False, True):
        times: dict[str, list[float]] = {"dispatch": [], "combine": []}
        for it in range(warmup + iters):
            flag[0] = 0
            evs = []
            for r, run in enumerate(g.runners):
                d = dev[r]
                with cp.cuda.Device(run.device_id), run.stream:
                    run.k.gate(gate.ptr, stream=run.stream)
                    ev = [cp.cuda.Event() for _ in range(3)]
                    ev[0].record(run.stream)
                    run.ll_dispatch(d["x"], d["idx"], M, fp8=fp8, num_sms=num_sms)
                    ev[1].record(run.stream)
                    run.ll_combine(d["y"], d["idx"], d["w"], d["out"], M, num_sms=num_sms)
                    ev[2].record(run.stream)
                    evs.append(ev)
            flag[0] = 1
            g.synchronize()
            for run in g.runners:
                assert run.error() is None, run.error()
            if it >= warmup:
                times["dispatch"].append(max(cp.cuda.get_elapsed_time(e[0], e[1])
                                             for e in evs) * 1e-3)
                times["combine"].append(max(cp.cuda.get_elapsed_time(e[1], e[2])
                                            for e in evs) * 1e-3)
        key = "fp8" if fp8 else "bf16"
        out[key] = {k: _stats(v) for k, v in times.items()}
        print(f"[kernels] {key} dispatch {out[key]['dispatch']['median_us']:.1f} us, "
              f"combine {out[key]['combine']['median_us']:.1f} us (median of the slowest "
              f"rank, {num_sms} SMs)", flush=True)
    gate.close()
    g.close()
    return out


def _client(rank: int, socket: str, iters: int, q: Any) -> None:
    try:
        import torch

        from epd.client import Session
        from epd.proto.dtypes import BFLOAT16
        from epd.server import reference as ref
        torch.cuda.set_device(rank)
        rng = np.random.default_rng([7, rank])
        idx, w = ref.random_routing(rng, M, E, K)
        x = ref.random_x(rng, M, H, BFLOAT16)
        tx = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).cuda()
        tidx, tw = torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda()
        res: dict[str, Any] = {"rank": rank}
        with Session(socket, client_name=f"bench-ll-{rank}", timeout=60) as s:
            res["fast_path"] = type(s._transport).__name__ == "FastPathTransport"
            g = s.join("bench-ll", rank=rank, num_ranks=2, num_experts=E, hidden=H,
                       max_tokens_per_rank=M, num_topk=K, low_latency_mode=True)
            lx = E // 2
            y = torch.ones((lx, 2 * M, H), dtype=torch.bfloat16, device="cuda")
            dest = torch.empty_like(tx)
            for fp8 in (False, True):
                times: dict[str, list[float]] = {"dispatch": [], "combine": []}
                for it in range(iters + 5):
                    t0 = time.perf_counter()
                    out = g.low_latency_dispatch(tx, tidx, M, use_fp8=fp8, copy=False)
                    t1 = time.perf_counter()
                    g.low_latency_combine(y, tidx, tw, out.handle, out=dest)
                    t2 = time.perf_counter()
                    if it >= 5:
                        times["dispatch"].append(t1 - t0)
                        times["combine"].append(t2 - t1)
                res["fp8" if fp8 else "bf16"] = {k: _stats(v) for k, v in times.items()}
            # Stream-ordered (graph-capturable) calls: CUDA events on the client's stream around
            # each launch measure "stream reaches the call" to "outputs ready on the stream".
            for fp8 in (False, True):
                dop = g.arm_low_latency_dispatch(tx, tidx, M, use_fp8=fp8)
                cop = g.arm_low_latency_combine(y, tidx, tw, dop, out=dest)
                times = {"dispatch": [], "combine": [], "host_wall": []}
                for it in range(iters + 5):
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                    t0 = time.perf_counter()
                    ev[0].record()
                    dop.launch()
                    ev[1].record()
                    cop.launch()
                    ev[2].record()
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    dop.check()
                    cop.check()
                    if it >= 5:
                        times["dispatch"].append(ev[0].elapsed_time(ev[1]) * 1e-3)
                        times["combine"].append(ev[1].elapsed_time(ev[2]) * 1e-3)
                        times["host_wall"].append(t1 - t0)
                res[("fp8" if fp8 else "bf16") + "_stream"] = {k: _stats(v)
                                                              for k, v in times.items()}
                if not fp8:  # where the time goes: the host, not the stream, waits for done
                    host = {"dispatch": [], "combine": []}
                    for it in range(iters + 5):
                        for name, op in (("dispatch", dop), ("combine", cop)):
                            t0 = time.perf_counter()
                            op.signal()
                            while op.status() == 0:
                                pass
                            if it >= 5:
                                host[name].append(time.perf_counter() - t0)
                    res["bf16_stream_host_wait"] = {k: _stats(v) for k, v in host.items()}
                cop.disarm()
                dop.disarm()
        q.put(res)
    except Exception as e:
        import traceback
        q.put({"rank": rank, "error": f"{e}\n{traceback.format_exc()}"})


def bench_daemon(iters: int, num_sms: int, mps: bool = False) -> dict[str, Any]:
    import bench_daemon as bd

    from epd.server.demo import Daemon

    # Under --mps the engines use the server mps_server() started (the clients inherit its
    # pipe folder); without, no MPS at all (the daemon's own `auto` would put the engines on a
    # private server and leave the clients outside it: neither setup).
    with Daemon(backend="cuda", engines=2, timeout_seconds=20,
                extra=["--ll-num-sms", str(num_sms), "--nvshmem-heap-bytes", str(4 << 30),
                       "--mps", "on" if mps else "off"]) as d:
        d.wait_ready(180)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_client, args=(r, d.socket(r), iters, q)) for r in range(2)]
        for p in procs:
            p.start()
        got = sorted((q.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join(30)
        text = d.get("/metrics")[1]
        engine = bd._engine_means(text, "bench-ll")
        for kind in ("LowLatencyDispatch", "LowLatencyCombine"):
            mean = bd.histogram_mean_us(text, "epd_stream_op_launch_seconds", kind=kind)
            if mean is not None:
                engine[f"stream_launch_{kind}"] = mean
    for r in got:
        if "error" in r:
            raise RuntimeError(r["error"])
    res = {"clients": got, "engine_mean_us_all_calls": engine}
    for key in ("bf16", "fp8", "bf16_stream", "fp8_stream", "bf16_stream_host_wait"):
        slow = {op: max(c[key][op]["median_us"] for c in got) for op in ("dispatch", "combine")}
        res[key] = slow
        what = {"bf16": "client call to result returned",
                "bf16_stream_host_wait": "stream-ordered, the host polls done instead of the "
                                         "stream"}.get(key.replace("fp8", "bf16"),
                                                       "stream-ordered: stream reaches the call "
                                                       "-> outputs ready on the stream")
        print(f"[daemon] {key}: {what}, slowest rank median: dispatch "
              f"{slow['dispatch']:.1f} us, combine {slow['combine']:.1f} us "
              f"(fast path: {[c['fast_path'] for c in got]})", flush=True)
    print(f"[daemon] engine-side mean over all calls: {engine}", flush=True)
    return res


@contextlib.contextmanager
def mps_server():
    """A private MPS control daemon (its own pipe and log folders, so nothing else on the machine
    uses it), stopped afterwards. Yields False where MPS is not installed."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        print("[mps] nvidia-cuda-mps-control not found: skipped", flush=True)
        yield False
        return
    root = tempfile.mkdtemp(prefix="epd-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": f"{root}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{root}/log"}
    for d in env.values():
        os.makedirs(d)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    subprocess.run([exe, "-d"], check=True)
    print(f"[mps] private MPS server in {root}", flush=True)
    try:
        yield True
    finally:
        subprocess.run([exe], input=b"quit\n", timeout=30)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)  # (its pipes and logs: nothing left in /tmp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--num-sms", type=int, default=64, help="blocks of the LL kernels "
                    "(the engine's --ll-num-sms default)")
    ap.add_argument("--json", default="")
    ap.add_argument("--mps", action="store_true", help="run the daemon part under a private "
                    "CUDA MPS server (kernels of the engine and its clients run concurrently "
                    "instead of time-sliced); skipped where nvidia-cuda-mps-control is missing")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels,daemon,nccl")
    ns = ap.parse_args()
    for k, v in {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
        os.environ[k] = v
    skip = set(filter(None, ns.skip.split(",")))
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "config": {"tokens_per_rank": M, "hidden": H, "experts": E,
                                      "topk": K}}
    if "kernels" not in skip:
        res["kernels"] = bench_kernels(ns.iters, ns.warmup, ns.num_sms)
    if "daemon" not in skip:
        if ns.mps:
            with mps_server() as ok:
                if ok:
                    res["daemon_mps"] = bench_daemon(ns.iters, ns.num_sms, mps=True)
        else:
            res["daemon"] = bench_daemon(ns.iters, ns.num_sms)
    if "nccl" not in skip:
        import bench_kernels as bk
        res["nccl_pipeline_us"] = bk.bench_nccl(argparse.Namespace(iters=ns.iters), 2)
        print(f"[nccl] pipeline (P and D): {res['nccl_pipeline_us']}", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({**provenance(), **res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
