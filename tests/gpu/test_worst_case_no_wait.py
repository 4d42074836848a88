"""A worst-case dispatch (`num_worst_tokens`) on the CUDA engine does not wait on the host for
its receive count, as DeepEP's does not (no CPU sync): through the DeepEP facade, one Buffer
for every layer, the outputs exact against the reference; a dispatch behind a long kernel on
the caller's stream returns before that kernel ends (the exact-rows dispatch cannot); a
num_worst_tokens below a rank's receive count fails on every rank in notify, raises
INVALID_ARGUMENT at the next dispatch and leaves the group working; a call over capacity fails on
every rank without a hang (its combine is sent on every rank and skipped by the kernels),
raises TokenCapacityExceeded at the next dispatch (once per rank, that dispatch not sent), and
the next calls run exact on the grown group."""

from __future__ import annotations

import time

import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Workload

from .test_daemon import _bits, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
MAX_TOKENS = 64
LAYERS = 4
SLEEP_S = 0.3  # the long kernel ahead of the dispatch on the caller's stream


def _workload(layer: int, tokens: tuple[int, int] = (48, 57)) -> Workload:
    return Workload(num_ranks=2, tokens=list(tokens), hidden=256, num_experts=16, num_topk=4,
                    seed=9100 + layer)


def _sleep_cycles(torch, seconds: float) -> int:
    """GPU cycles of `seconds` (torch.cuda._sleep spins in cycles)."""
    rate = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate  # kHz
    return int(seconds * rate * 1000)


def _rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import EpdError, Session
    from epd.client.buffer import Buffer
    from epd.proto.errors import TokenCapacityExceeded
    torch.cuda.set_device(device)
    worst = 2 * MAX_TOKENS
    res: dict = {"rank": rank, "layers": [], "returned_s": {}, "earlier": []}
    with Session(socket, client_name=f"worst-{rank}", timeout=30) as s:
        buf = Buffer(rank=rank, num_ranks=2, session=s, group_name="gpu-worst-nowait",
                     max_tokens_per_rank=MAX_TOKENS)

        def layer(wl: Workload, sleep: bool = False, num_worst: int = worst):
            x, idx, w = wl.inputs(rank)
            tx, tidx, tw = (_to_torch(a, device) for a in (x, idx, w))
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(tidx, wl.num_experts)
            torch.cuda.synchronize(device)
            if sleep:
                torch.cuda._sleep(_sleep_cycles(torch, SLEEP_S))
            t0 = time.perf_counter()
            recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
                tx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_expert, topk_idx=tidx, topk_weights=tw,
                num_worst_tokens=num_worst)
            returned = time.perf_counter() - t0
            return recv_x, recv_idx, recv_w, list(counts), handle, returned

        for i in range(LAYERS):  # one Buffer, fresh inputs, no synchronisation between calls
            recv_x, recv_idx, recv_w, counts, handle, _ = layer(_workload(i))
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            torch.cuda.synchronize(device)
            res["layers"].append({"rows": recv_x.shape[0], "counts": counts,
                                  "recv_x": _bits(recv_x), "recv_idx": recv_idx.cpu().numpy(),
                                  "combined": _bits(combined),
                                  "combined_w": combined_w.cpu().numpy()})
        # Behind a 0.3 s kernel: the worst-case dispatch returns at once, an exact one waits.
        for name, num_worst in (("worst", worst), ("exact", 0)):
            out = layer(_workload(0), sleep=True, num_worst=num_worst)
            res["returned_s"][name] = out[-1]
            t0 = time.perf_counter()  # (the engine's combine waits for no count either)
            combined, _, _ = buf.combine(out[0], out[4], topk_weights=out[2])
            res["returned_s"][name + "_combine"] = time.perf_counter() - t0
            torch.cuda.synchronize(device)
            res["returned_s"][name + "_combined"] = _bits(combined)

        # num_worst_tokens too small (8 rows; each rank receives ~50): every rank's call fails
        # in notify, INVALID_ARGUMENT raised once at a later call, and the group goes on.
        small = _workload(LAYERS + 1)
        recv_x, _, recv_w, _, handle, _ = layer(small, num_worst=8)
        res["small"] = []
        try:  # (sent on every rank whatever its host knows by now; the kernels skip it)
            buf.combine(recv_x, handle, topk_weights=recv_w)
        except EpdError as e:
            res["small"].append(("combine", e.code.name, "num_worst_tokens=8" in e.message))
        torch.cuda.synchronize(device)
        for _ in range(2):
            try:
                got = layer(small)
                break
            except EpdError as e:
                res["small"].append(("dispatch", e.code.name, "num_worst_tokens=8" in e.message))
        recv_x, _, recv_w, _, handle, _ = got
        combined, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        torch.cuda.synchronize(device)
        res["after_small"] = (buf.max_tokens_per_rank, _bits(combined))

        # Over capacity on rank 1 (70 > 64 tokens): every rank's call fails in notify, and
        # neither host waited for it; the combine of its handle must not hang.
        over = _workload(LAYERS, tokens=(40, 70))
        recv_x, _, recv_w, _, handle, _ = layer(over)
        try:
            buf.combine(recv_x, handle, topk_weights=recv_w)
        except TokenCapacityExceeded as e:
            res["earlier"].append(("combine", e.earlier, e.tokens_needed))
        torch.cuda.synchronize(device)
        for _ in range(2):  # the failure surfaces before the next dispatch at the latest
            try:
                got = layer(over)
                break
            except TokenCapacityExceeded as e:
                res["earlier"].append(("dispatch", e.earlier, e.tokens_needed))
        recv_x, recv_idx, recv_w, counts, handle, _ = got
        combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        torch.cuda.synchronize(device)
        res["grown"] = {"cap": buf.max_tokens_per_rank, "rows": recv_x.shape[0],
                        "recv_x": _bits(recv_x), "combined": _bits(combined),
                        "combined_w": combined_w.cpu().numpy()}
        buf.destroy()
    q.put(res)


def _expected(wl: Workload):
    inputs = wl.all_inputs()
    xs, idx, w = ([inp[j] for inp in inputs] for j in range(3))
    disp = ref.dispatch(xs, idx, w, wl.num_experts)
    comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    return disp, comb


def test_a_worst_case_dispatch_does_not_wait_for_its_count(daemon) -> None:
    results = _spawn_ranks(daemon, _rank, 2)
    for i in range(LAYERS):
        disp, comb = _expected(_workload(i))
        for r, res in enumerate(results):
            got, tag = res["layers"][i], f"layer {i} rank {r}"
            n = disp[r].recv_x.shape[0]
            assert got["rows"] == 2 * MAX_TOKENS and got["counts"] == [], tag
            np.testing.assert_array_equal(got["recv_x"][:n], disp[r].recv_x.view(np.uint16),
                                          tag)
            np.testing.assert_array_equal(got["recv_idx"][:n], disp[r].recv_topk_idx, tag)
            np.testing.assert_array_equal(got["combined"], comb[r][0].view(np.uint16), tag)
            np.testing.assert_array_equal(got["combined_w"], comb[r][1], tag)
    _, comb0 = _expected(_workload(0))
    for r, res in enumerate(results):
        t = res["returned_s"]
        assert t["worst"] < SLEEP_S / 3, (r, t)  # returned while the stream still slept
        assert t["worst_combine"] < SLEEP_S / 3, (r, t)
        assert t["exact"] > SLEEP_S / 2, (r, t)  # (the count waits for the kernel ahead)
        for name in ("worst_combined", "exact_combined"):
            np.testing.assert_array_equal(t[name], comb0[r][0].view(np.uint16), (r, name))
        # over capacity: raised once per rank, at the next dispatch (not sent), every rank
        assert res["earlier"] == [("dispatch", True, 70)], (r, res["earlier"])
    _, comb_small = _expected(_workload(LAYERS + 1))
    for r, res in enumerate(results):
        # one error per rank, at the next dispatch; the combine in between went through
        assert res["small"] == [("dispatch", "INVALID_ARGUMENT", True)], (r, res["small"])
        cap, combined = res["after_small"]
        assert cap == MAX_TOKENS, (r, cap)  # the same group: not aborted, not grown
        np.testing.assert_array_equal(combined, comb_small[r][0].view(np.uint16), r)
    over = _workload(LAYERS, tokens=(40, 70))
    disp, comb = _expected(over)
    for r, res in enumerate(results):
        g = res["grown"]
        n = disp[r].recv_x.shape[0]
        assert g["cap"] >= 70 and g["rows"] == 2 * MAX_TOKENS, (r, g["cap"], g["rows"])
        np.testing.assert_array_equal(g["recv_x"][:n], disp[r].recv_x.view(np.uint16), r)
        np.testing.assert_array_equal(g["combined"], comb[r][0].view(np.uint16), r)
        np.testing.assert_array_equal(g["combined_w"], comb[r][1], r)
