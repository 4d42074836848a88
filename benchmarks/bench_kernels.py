"""Benchmark of EPD's intranode kernels against the NVLink ceiling and a torch NCCL pipeline.

    python benchmarks/bench_kernels.py [--iters 30] [--json out.json]

Part 1 (one process, all ranks; rank r on GPU r): for configs P (4096 tokens/rank) and D (128),
hidden 7168, top-8 of 256 experts, bf16, score-based router: per-phase times (layout, notify,
dispatch, combine) by CUDA events, the ranks' streams released together by a gate kernel,
median over iterations of the slowest rank; with 24 SMs and with all SMs. Also the time from the
gate to the counts visible in mapped host memory, and to notify completion, and the
bidirectional NVLink ceiling (every GPU stores into its peer at once with a 16-byte copy kernel).
Part 2 (one process per GPU, torch.distributed NCCL): layout + split exchange with host sync +
all_to_all_single + permute + all_to_all_single back + index_add.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from epd.server.bench.runner import provenance

ROOT = Path(__file__).resolve().parents[1]
H, E, K = 7168, 256, 8
CONFIGS = {"P": 4096, "D": 128}


def _median(v: list[float]) -> float:
    return float(statistics.median(v)) if v else float("nan")


def bench_epd(args: argparse.Namespace) -> dict[str, Any]:
    import cupy as cp

    from epd.proto.dtypes import BFLOAT16
    from epd.server import reference as ref
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    import local_group as rt  # LocalGroup, MappedSlot: the daemon's layout, all ranks here

    ndev = cp.cuda.runtime.getDeviceCount()
    r_count = args.ranks or ndev
    out: dict[str, Any] = {"ranks": r_count, "devices": ndev}
    gate = rt.MappedSlot()
    gate_flag = gate.words.view(np.int32)
    slots = [rt.MappedSlot() for _ in range(r_count)]

    for name, tokens in CONFIGS.items():
        g = rt.LocalGroup(r_count, E, H, K, tokens, BFLOAT16)
        rng = np.random.default_rng(2026)
        routes = [ref.random_routing(rng, tokens, E, K, num_ranks=r_count) for _ in range(r_count)]
        xs = [ref.random_x(rng, tokens, H, BFLOAT16) for _ in range(r_count)]
        expected = ref.dispatch(xs, [i for i, _ in routes], [w for _, w in routes], E)
        dev_in = []
        for r, run in enumerate(g.runners):
            with cp.cuda.Device(run.device_id), run.stream:
                n = expected[r].recv_x.shape[0]
                dev_in.append({
                    "x": cp.asarray(xs[r].view(np.uint16)),
                    "idx": cp.asarray(routes[r][0]), "w": cp.asarray(routes[r][1]),
                    "y": cp.asarray(ref.random_x(rng, n, H, BFLOAT16).view(np.uint16)),
                    "out": cp.empty((tokens, H), cp.uint16),
                    "out_w": cp.empty((tokens, K), cp.float32),
                })
        g.synchronize()
        for run in g.runners:
            cp.cuda.Device(run.device_id).synchronize()
        recv_rows = [e.recv_x.shape[0] for e in expected]
        # Rows crossing NVLink in each direction s -> d (s != d), payload + metadata bytes.
        cross = {f"{s}->{d}": int(np.diff(expected[d].src_offsets)[s])
                 for s in range(r_count) for d in range(r_count) if s != d}
        row_meta = H * 2 + K * 12 + 8
        for sms in (24, args.max_sms):
            times: dict[str, list[float]] = {k: [] for k in
                                             ("layout", "notify", "dispatch", "combine", "total",
                                              "cached_dispatch", "host_counts", "host_notify")}
            for it in range(args.warmup + args.iters):
                gate_flag[0] = 0
                evs = []
                res = []
                for r, run in enumerate(g.runners):
                    d = dev_in[r]
                    with cp.cuda.Device(run.device_id), run.stream:
                        s = run.stream
                        run.k.gate(gate.ptr, stream=s)
                        ev = [cp.cuda.Event() for _ in range(5)]
                        ev[0].record(s)
                        run.k.layout(d["idx"], E, r_count, stream=s)
                        ev[1].record(s)
                        handle = rt.ck.DispatchHandle.allocate(tokens, r_count, E // r_count)
                        run.seq["notify"] += 1
                        run.k.notify(d["idx"], E, r_count, r, run.peers, run.seq["notify"],
                                     handle, timeout_ns=rt.DEFAULT_TIMEOUT_NS,
                                     counter_slot_ptr=slots[r].ptr, stream=s)
                        ev_notify = cp.cuda.Event(block=False, disable_timing=True)
                        ev_notify.record(s)
                        ev[2].record(s)
                        run.seq["dispatch"] += 1
                        run.k.dispatch(d["x"], None, d["idx"], d["w"], g.layout, r, run.peers,
                                       handle, run.seq["dispatch"],
                                       timeout_ns=rt.DEFAULT_TIMEOUT_NS, num_sms=sms, stream=s)
                        ev[3].record(s)
                        dres = rt.DispatchResult(handle, 0, True)
                        run.combine(d["y"], dres, d["out"], recv_topk_weights=None,
                                    num_sms=sms)
                        ev[4].record(s)
                        evs.append((ev, ev_notify))
                        res.append(dres)
                seq = g.runners[0].seq["notify"]
                t0 = time.perf_counter()
                gate_flag[0] = 1
                while slots[0].words[0] < seq:
                    pass
                t1 = time.perf_counter()
                while not evs[0][1].done:
                    pass
                t2 = time.perf_counter()
                g.synchronize()
                for run in g.runners:
                    assert run.error() is None, run.error()
                if it < args.warmup:
                    continue
                times["host_counts"].append((t1 - t0) * 1e6)
                times["host_notify"].append((t2 - t0) * 1e6)
                per = {k: 0.0 for k in ("layout", "notify", "dispatch", "combine", "total")}
                for ev, _ in evs:
                    per["layout"] = max(per["layout"], cp.cuda.get_elapsed_time(ev[0], ev[1]))
                    per["notify"] = max(per["notify"], cp.cuda.get_elapsed_time(ev[1], ev[2]))
                    per["dispatch"] = max(per["dispatch"], cp.cuda.get_elapsed_time(ev[2], ev[3]))
                    per["combine"] = max(per["combine"], cp.cuda.get_elapsed_time(ev[3], ev[4]))
                    per["total"] = max(per["total"], cp.cuda.get_elapsed_time(ev[0], ev[4]))
                for k, v in per.items():
                    times[k].append(v * 1e3)
                # Cached dispatch alone (reuses this iteration's handles).
                gate_flag[0] = 0
                cev = []
                for r, run in enumerate(g.runners):
                    d = dev_in[r]
                    with cp.cuda.Device(run.device_id), run.stream:
                        run.k.gate(gate.ptr, stream=run.stream)
                        a, b = cp.cuda.Event(), cp.cuda.Event()
                        a.record(run.stream)
                        run.dispatch(d["x"], None, None, None, cached=res[r], num_sms=sms)
                        b.record(run.stream)
                        cev.append((a, b))
                gate_flag[0] = 1
                g.synchronize()
                times["cached_dispatch"].append(
                    max(cp.cuda.get_elapsed_time(a, b) for a, b in cev) * 1e3)
            med = {k: _median(v) for k, v in times.items()}
            med["p90_total"] = float(np.percentile(times["total"], 90))
            disp_s = med["dispatch"] * 1e-6
            comb_s = med["combine"] * 1e-6
            max_cross = max(cross.values()) if cross else 0
            med["dispatch_logical_GBps"] = recv_rows[0] * H * 2 / disp_s / 1e9
            med["combine_logical_GBps"] = recv_rows[0] * H * 2 / comb_s / 1e9
            med["dispatch_nvlink_GBps_per_dir"] = max_cross * row_meta / disp_s / 1e9
            med["combine_nvlink_GBps_per_dir"] = max_cross * (H * 2 + K * 4) / comb_s / 1e9
            med["layout_notify_dispatch_combine"] = (med["layout"] + med["notify"] +
                                                     med["dispatch"] + med["combine"])
            out[f"{name}_sms{sms}"] = med
            print(f"[epd] {name} sms={sms}: " + ", ".join(f"{k}={v:.1f}" for k, v in med.items()),
                  flush=True)
        out[f"{name}_recv_rows"] = recv_rows
        out[f"{name}_cross_rows"] = cross
        g.close()
        del g

    # Bidirectional NVLink ceiling: every GPU stores 1 GiB into the next one at once.
    if ndev >= 2:
        nbytes = 1 << 30
        bufs = []
        for dv in range(ndev):
            with cp.cuda.Device(dv):
                bufs.append((cp.ones(nbytes // 4, cp.int32), cp.zeros(nbytes // 4, cp.int32),
                             cp.cuda.Stream(non_blocking=True)))
                cp.cuda.Device(dv).synchronize()

        res_t = []
        for it in range(8):
            gate_flag[0] = 0
            evs = []
            for dv in range(ndev):
                with cp.cuda.Device(dv):
                    src, _, s = bufs[dv]
                    dst = bufs[(dv + 1) % ndev][1]
                    k = rt.bench_kernels_for_device(dv)
                    k.gate(gate.ptr, stream=s)
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record(s)
                    k.copy16(src, int(dst.data.ptr), nbytes, num_sms=args.max_sms, stream=s)
                    b.record(s)
                    evs.append((a, b, s))
            gate_flag[0] = 1
            for _, _, s in evs:
                s.synchronize()
            if it >= 2:
                res_t.append(max(cp.cuda.get_elapsed_time(a, b) for a, b, _ in evs) * 1e-3)
        out["ceiling_GBps_per_dir"] = nbytes / _median(res_t) / 1e9
        print(f"[epd] bidirectional ceiling per direction: {out['ceiling_GBps_per_dir']:.1f} GB/s",
              flush=True)
    gate.close()
    for s in slots:
        s.close()
    return out


def _nccl_worker(rank: int, world: int, init_file: str, iters: int, q: Any) -> None:
    import torch
    import torch.distributed as dist

    from epd.proto.dtypes import BFLOAT16
    from epd.server import reference as ref

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    results = {}
    L = E // world
    for name, tokens in CONFIGS.items():
        rng = np.random.default_rng(1000 + rank)
        idx_np, _ = ref.random_routing(rng, tokens, E, K, num_ranks=world)
        x = torch.from_numpy(ref.random_x(rng, tokens, H, BFLOAT16).view(np.int16)).view(
            torch.bfloat16).cuda()
        idx = torch.from_numpy(idx_np).cuda()
        ts = []
        for it in range(5 + iters):
            dist.barrier()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            # layout
            rank_of = torch.where(idx >= 0, idx // L, torch.full_like(idx, world))
            in_rank = torch.zeros(tokens, world + 1, dtype=torch.bool, device="cuda")
            in_rank.scatter_(1, rank_of, True)
            in_rank = in_rank[:, :world]
            send_counts = in_rank.sum(0).to(torch.int64)
            # split exchange with host sync
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            sc, rc = send_counts.tolist(), recv_counts.tolist()
            # permute: tokens grouped by destination rank
            perm = torch.cat([torch.nonzero(in_rank[:, d]).flatten() for d in range(world)])
            send_x = x.index_select(0, perm)
            recv_x = torch.empty(sum(rc), H, dtype=x.dtype, device="cuda")
            dist.all_to_all_single(recv_x, send_x, rc, sc)
            # (experts would run here) and back
            back = torch.empty_like(send_x)
            dist.all_to_all_single(back, recv_x, sc, rc)
            out = torch.zeros(tokens, H, dtype=torch.float32, device="cuda")
            out.index_add_(0, perm, back.float())
            out = out.to(torch.bfloat16)
            b.record()
            torch.cuda.synchronize()
            if it >= 5:
                ts.append(a.elapsed_time(b) * 1e3)
        results[name] = _median(ts)
    q.put((rank, results))
    dist.destroy_process_group()


def bench_nccl(args: argparse.Namespace, world: int) -> dict[str, float]:
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init_file = tempfile.mktemp(prefix="epd_nccl_")
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, init_file, args.iters, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=300) for _ in procs]
    finally:  # (a failed worker must leave neither processes nor the init file behind)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init_file)
    # The pipeline's time is the slowest rank's.
    return {name: max(r[1][name] for r in got) for name in CONFIGS}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=0)
    ap.add_argument("--max-sms", type=int, default=132)
    ap.add_argument("--json", default="")
    ap.add_argument("--skip-nccl", action="store_true")
    args = ap.parse_args()
    for k, v in {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
                 "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}.items():
        os.environ[k] = v
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    res["epd"] = bench_epd(args)
    if not args.skip_nccl and res["epd"]["devices"] >= 2:
        res["nccl_pipeline_us"] = bench_nccl(args, res["epd"]["devices"])
        print(f"[nccl] pipeline: {res['nccl_pipeline_us']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({**provenance(), **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
