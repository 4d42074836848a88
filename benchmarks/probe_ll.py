"""Diagnostic: low-latency kernel phases at config D, timed separately (push / reduce), over
block counts. Not part of the benchmark record; used to find where combine time goes."""

from __future__ import annotations

import numpy as np


def main() -> None:
    import cupy as cp

    from epd.proto.dtypes import BFLOAT16
    from epd.server import reference as ref
    from epd.server.backends import cuda_runtime as rt

    H, E, K, M = 7168, 256, 8, 128
    g = rt.LocalGroup(2, E, H, K, M, BFLOAT16, low_latency=True)
    gate = rt.MappedSlot()
    flag = gate.words.view(np.int32)
    rng = np.random.default_rng(1)
    dev = []
    for run in g.runners:
        idx, w = ref.random_routing(rng, M, E, K, num_ranks=2)
        x = ref.random_x(rng, M, H, BFLOAT16)
        with cp.cuda.Device(run.device_id), run.stream:
            dev.append({"x": cp.asarray(x.view(np.uint16)), "idx": cp.asarray(idx),
                        "w": cp.asarray(w), "out": cp.empty((M, H), cp.uint16),
                        "y": cp.full((E // 2, 2 * M, H), 0x3F80, cp.uint16)})
    g.synchronize()
    for sms in (16, 32, 64, 128):
        ts = {"dispatch": [], "push": [], "reduce": []}
        for it in range(25):
            flag[0] = 0
            evs = []
            for r, run in enumerate(g.runners):
                d = dev[r]
                lay = run.ll
                o = lay.offsets
                with cp.cuda.Device(run.device_id), run.stream:
                    run.k.gate(gate.ptr, stream=run.stream)
                    ev = [cp.cuda.Event() for _ in range(4)]
                    ev[0].record(run.stream)
                    run.ll_dispatch(d["x"], d["idx"], M, num_sms=sms)
                    ev[1].record(run.stream)
                    run.seq["ll_combine"] += 1
                    seq = run.seq["ll_combine"]
                    y = d["y"]
                    run.k.fn("epd_ll_combine_push")(
                        (sms,), (512,),
                        (y, np.int64(y.strides[1]), np.int64(y.strides[0]), np.int64(H * 2),
                         np.int32(lay.num_local_experts), np.int32(2), np.int32(r), np.int32(M),
                         np.int32(K), run.peers, np.int64(o["src_rank"]), np.int64(o["src_idx"]),
                         np.int64(o["src_k"]), np.int64(o["recv_count"]), np.int64(o["comb"]),
                         np.uint64(seq), np.int64(10**10)))
                    ev[2].record(run.stream)
                    run.k.fn("epd_ll_combine_reduce<Bf16>")(
                        (sms,), (512,),
                        (d["out"], np.int64(H), d["idx"], d["w"], np.int64(K), np.int32(M),
                         np.int32(K), np.int32(H), np.int32(2), np.int32(r), run.peers,
                         np.int64(o["comb"]), np.int64(o["topk"]), np.uint64(seq),
                         np.int64(10**10)))
                    ev[3].record(run.stream)
                    evs.append(ev)
            flag[0] = 1
            g.synchronize()
            if it >= 5:
                for j, name in enumerate(("dispatch", "push", "reduce")):
                    ts[name].append(max(cp.cuda.get_elapsed_time(e[j], e[j + 1]) for e in evs))
        print(f"sms {sms}: " + ", ".join(f"{k} {np.median(v) * 1e3:.1f} us"
                                         for k, v in ts.items()), flush=True)
        for run in g.runners:
            assert run.error() is None, run.error()


if __name__ == "__main__":
    main()
