"""Service classes on the CUDA engine (issue 14): a latency (decode, low-latency mode) group and
a throughput (prefill, normal mode) group of one daemon run at the same time; both stay exact
against the reference, the latency group's rank streams have a higher CUDA priority than the
throughput group's, and each class's kernels use its SM budget (a client's larger num_sms
request is bounded by it). Not a benchmark: the latency targets under load are measured
separately (two pools on one daemon). Run twice: one engine per GPU, then class engines
(`--class-engines`: the decode group on each GPU's latency engine)."""

from __future__ import annotations

import multiprocessing as mp
import os
from types import SimpleNamespace

import numpy as np
import pytest

from epd.proto.dtypes import BFLOAT16
from epd.server import reference as ref
from epd.server.demo import Workload

from .common import ll_combined
from .conftest import GPU_COUNT, cuda_daemon
from .test_daemon import _bits, _check_ll, _compact, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu

LATENCY_SMS, THROUGHPUT_SMS = 16, 8
POLICY = "svc-decode-*=latency, svc-prefill-*=throughput"
ROUNDS = 20
DECODE = Workload(2, [64, 51], 2048, 32, 8, seed=141, drop_prob=0.05)
PREFILL = Workload(2, [1024, 900], 4096, 16, 4, seed=142)
M = 64  # num_max_dispatch_tokens_per_rank of the decode group


@pytest.fixture(scope="module", params=[False, True], ids=["one-engine", "class-engines"])
def daemon(request):
    """`epd serve --backend cuda` with a service-class policy and per-class SM budgets, with
    --class-engines off; then with the default (auto), which a policy naming the latency
    class turns on: an engine process per GPU and class, each class its own NVSHMEM world."""
    started = cuda_daemon(("--service-class-policy", POLICY,
                           "--latency-num-sms", str(LATENCY_SMS),
                           "--throughput-num-sms", str(THROUGHPUT_SMS),
                           *(() if request.param else ("--class-engines", "off"))))
    d = next(started)
    try:
        d.class_engines = os.path.exists(d.socket(0, "latency"))
        assert d.class_engines == request.param, d.log()[-3000:]
        yield d
    finally:
        next(started, None)  # (its teardown: the daemon stopped, MPS variables restored)


def _stats(s, name: str) -> dict:
    g = next(x for x in s.stats().groups if x.name == name)
    return {"service_class": g.service_class, "stream_priority": g.stream_priority,
            "num_sms": g.num_sms, "ll_num_sms": g.ll_num_sms, "queued_calls": g.queued_calls,
            "engine": s.stats().engine_index}


def _decode_rank(rank: int, socket: str, device: int, q) -> None:
    """Low-latency dispatch + combine (identity experts) ROUNDS times, class by policy."""
    try:
        import torch

        from epd.client import Session
        torch.cuda.set_device(device)
        wl = DECODE
        x, idx, w = wl.inputs(rank)
        tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
        lx = wl.num_experts // wl.num_ranks
        res: dict = {"rank": rank, "kind": "decode"}
        with Session(socket, client_name=f"svc-decode-{rank}", timeout=30) as s:
            g = s.join("svc-decode-gpu", rank=rank, num_ranks=wl.num_ranks,
                       num_experts=wl.num_experts, hidden=wl.hidden, max_tokens_per_rank=M,
                       num_topk=wl.num_topk, low_latency_mode=True, timeout=60)
            res["class"] = g.service_class
            dest = torch.empty_like(tx)
            for _ in range(ROUNDS):
                out = g.low_latency_dispatch(tx, tidx, M, copy=False)
                res["dispatch"] = _compact(out, lx)
                dest.fill_(float("nan"))
                g.low_latency_combine(out.recv_x, tidx, tw, out.handle, out=dest)
                res["cx"] = _bits(dest)
            res["stats"] = _stats(s, "svc-decode-gpu")
        q.put(res)
    except Exception as e:
        import traceback
        q.put({"rank": rank, "kind": "decode",
               "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def _prefill_rank(rank: int, socket: str, device: int, q) -> None:
    """Normal dispatch + combine ROUNDS times as throughput, asking for more SMs than its
    budget (bounded by the daemon)."""
    try:
        import torch

        from epd.client import Session
        torch.cuda.set_device(device)
        wl = PREFILL
        x, idx, w = wl.inputs(rank)
        tx, tidx, tw = _to_torch(x, device), _to_torch(idx, device), _to_torch(w, device)
        res: dict = {"rank": rank, "kind": "prefill"}
        with Session(socket, client_name=f"svc-prefill-{rank}", timeout=30) as s:
            g = s.join("svc-prefill-gpu", rank=rank, num_ranks=wl.num_ranks,
                       num_experts=wl.num_experts, hidden=wl.hidden,
                       max_tokens_per_rank=max(wl.tokens), num_topk=wl.num_topk,
                       timeout=60, service_class="throughput")
            res["class"] = g.service_class
            for _ in range(ROUNDS):
                out = g.dispatch(tx, tidx, tw, num_sms=64)
                cx, cw = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights,
                                   num_sms=64)
            res.update(recv_x=_bits(out.recv_x), recv_idx=_bits(out.recv_topk_idx),
                       cx=_bits(cx), cw=_bits(cw))
            res["stats"] = _stats(s, "svc-prefill-gpu")
        q.put(res)
    except Exception as e:
        import traceback
        q.put({"rank": rank, "kind": "prefill",
               "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_latency_and_throughput_groups_concurrently(daemon) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    classes = daemon.class_engines
    procs = [ctx.Process(target=fn, args=(
        r, daemon.socket(r % GPU_COUNT, "latency" if classes and fn is _decode_rank else ""),
        r % GPU_COUNT, q)) for fn in (_decode_rank, _prefill_rank) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    decode = sorted((r for r in results if r["kind"] == "decode"), key=lambda r: r["rank"])
    prefill = sorted((r for r in results if r["kind"] == "prefill"), key=lambda r: r["rank"])

    # exact against the reference, both groups
    inputs = DECODE.all_inputs()
    xs, idx, w = ([i[k] for i in inputs] for k in range(3))
    lx = DECODE.num_experts // DECODE.num_ranks
    exp = ref.low_latency_dispatch(xs, idx, DECODE.num_experts, M)
    for r, res in enumerate(decode):
        _check_ll(exp[r], res["dispatch"], lx)
        # identity experts
        np.testing.assert_array_equal(res["cx"], ll_combined(xs[r], idx[r], w[r]))
    inputs = PREFILL.all_inputs()
    xs, idx, w = ([i[k] for i in inputs] for k in range(3))
    disp = ref.dispatch(xs, idx, w, PREFILL.num_experts)
    comb = ref.combine([d.recv_x for d in disp], disp, PREFILL.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    for r, res in enumerate(prefill):
        np.testing.assert_array_equal(res["recv_x"], disp[r].recv_x.view(np.uint16))
        np.testing.assert_array_equal(res["recv_idx"], disp[r].recv_topk_idx)
        np.testing.assert_array_equal(res["cx"], comb[r][0].view(np.uint16))
        np.testing.assert_array_equal(res["cw"], comb[r][1])

    # classes, stream priorities and SM budgets as the engine applied them
    from epd.proto.v1 import epd_pb2
    for res in decode:
        st = res["stats"]
        assert res["class"] == "latency" and st["service_class"] == epd_pb2.LATENCY, res
        assert (st["num_sms"], st["ll_num_sms"]) == (LATENCY_SMS, LATENCY_SMS), st
        assert st["queued_calls"] == 2 * ROUNDS, st
    for res in prefill:
        st = res["stats"]
        assert res["class"] == "throughput" and st["service_class"] == epd_pb2.THROUGHPUT
        assert (st["num_sms"], st["ll_num_sms"]) == (THROUGHPUT_SMS, THROUGHPUT_SMS), st
    lat = {res["stats"]["stream_priority"] for res in decode}
    thr = {res["stats"]["stream_priority"] for res in prefill}
    assert len(lat) == 1 and len(thr) == 1, (lat, thr)
    # CUDA priorities: lower is more urgent; throughput has the least (the default, 0)
    assert max(lat) < min(thr) == 0, (lat, thr)
    # class engines: decode on the latency engines (after the GPUs' throughput engines)
    if classes:
        gpus = {r % GPU_COUNT for r in range(2)}
        assert {r["stats"]["engine"] for r in decode} == {GPU_COUNT + g for g in gpus}
        assert {r["stats"]["engine"] for r in prefill} == gpus

    from prometheus_client.parser import text_string_to_metric_families
    status, body = daemon.get("/metrics")
    assert status == 200
    seen = {(s.name, s.labels.get("group"), s.labels.get("service_class"))
            for fam in text_string_to_metric_families(body) for s in fam.samples}
    assert ("epd_group_service_class", "svc-decode-gpu", "latency") in seen
    assert ("epd_queue_wait_seconds_count", "svc-prefill-gpu", "throughput") in seen


def _facade_rank(rank: int, socket: str, device: int, socket_dir: str, q) -> None:
    """DeepEP's Buffer as a decode server builds it (no class, no endpoint: its device's
    default socket); the policy makes its group latency. Three low-latency dispatch + combine
    steps (identity experts) on one Buffer, and the socket its session ended on."""
    import torch

    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    wl = DECODE
    res: dict = {"rank": rank, "steps": []}
    buf = Buffer(None, rank=rank, num_ranks=wl.num_ranks, socket_dir=socket_dir,
                 low_latency_mode=True, group_name="svc-decode-facade", timeout=60)
    for step in range(3):
        x, idx, w = (_to_torch(a, device) for a in _facade_inputs(rank, step))
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, wl.num_experts,
                                                             use_fp8=False)
        cx, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        torch.cuda.synchronize()
        res["steps"].append({"compact": _compact(SimpleNamespace(
            recv_x=recv, recv_count=count, recv_x_scales=None, recv_src_rank=handle.src_rank,
            recv_src_idx=handle.src_idx), wl.num_experts // wl.num_ranks), "cx": _bits(cx)})
    res["endpoint"] = buf.session.endpoint
    buf.destroy()
    q.put(res)


def _facade_inputs(rank: int, step: int):
    rng = np.random.default_rng([151, step, rank])
    t = DECODE.tokens[rank]
    idx, w = ref.random_routing(rng, t, DECODE.num_experts, DECODE.num_topk, drop_prob=0.05)
    return ref.random_x(rng, t, DECODE.hidden, BFLOAT16), idx, w


@pytest.mark.skipif(GPU_COUNT < 1, reason="needs a GPU")
def test_deepep_buffer_lands_on_its_class_engine(daemon) -> None:
    """The DeepEP facade as frameworks use it: exact over three steps; with class engines its
    session has moved to the latency engine's socket at the first call."""
    results = _spawn_ranks(daemon, _facade_rank, 2, daemon.socket_dir)
    classes = daemon.class_engines
    lx = DECODE.num_experts // DECODE.num_ranks
    for step in range(3):
        xs, idx, w = (list(v) for v in zip(*(_facade_inputs(r, step) for r in range(2)),
                                           strict=True))
        disp = ref.low_latency_dispatch(xs, idx, DECODE.num_experts, M)
        combined = ref.low_latency_combine([d.recv_x for d in disp], disp, idx, w,
                                           DECODE.num_experts)
        for r, res in enumerate(results):
            _check_ll(disp[r], res["steps"][step]["compact"], lx)
            np.testing.assert_array_equal(res["steps"][step]["cx"],
                                          combined[r].view(np.uint16))
    for r, res in enumerate(results):
        assert res["endpoint"] == daemon.socket(r % GPU_COUNT, "latency" if classes else ""), \
            res["endpoint"]
