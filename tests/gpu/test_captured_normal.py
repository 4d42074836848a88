"""Normal-mode dispatch and combine captured in a CUDA graph (client/captured_calls.py,
server/engine/captured_calls.py), through the daemon, the way a serving engine uses them: a
worst-case dispatch (num_worst_tokens) and its combine captured once on one group, replayed
with fresh inputs copied into the graph's static tensors, outputs poisoned before each replay
and compared exactly with the NumPy reference; eager calls of the same group between replays
(numbered after the replays on every rank), a second graph of another shape, a replay whose
num_worst_tokens is too small (raised once, by check(), on every rank; the group goes on), the
DeepEP facade's layout + dispatch + combine captured together, and what stays refused (a cached
dispatch, an eager handle's combine in a graph, a captured handle's combine outside one); and
DeepEP V2's ElasticBuffer without the CPU sync, plain and expanded, replayed as it runs eagerly."""

from __future__ import annotations

import numpy as np
import pytest

from epd.server import reference as ref
from epd.server.demo import Workload

from .test_daemon import _bits, _spawn_ranks, _to_torch

pytestmark = pytest.mark.gpu
MAX_TOKENS = 64
WORST = 2 * MAX_TOKENS
TOKENS_A, TOKENS_B = (48, 57), (30, 9)
REPLAYS = 4


def _workload(seed: int, tokens: tuple[int, int]) -> Workload:
    return Workload(num_ranks=2, tokens=list(tokens), hidden=256, num_experts=16, num_topk=4,
                    seed=seed)


def _expected(wl: Workload):
    xs, idx, w = (list(v) for v in zip(*wl.all_inputs(), strict=True))
    disp = ref.dispatch(xs, idx, w, wl.num_experts)
    comb = ref.combine([d.recv_x for d in disp], disp, wl.tokens,
                       recv_topk_weights=[d.recv_topk_weights for d in disp])
    return disp, comb


def _rank(rank: int, socket: str, device: int, q) -> None:
    import torch

    from epd.client import EpdError, Session
    from epd.client.buffer import Buffer
    torch.cuda.set_device(device)
    res: dict = {"rank": rank, "a": [], "a2": [], "b": [], "eager": [], "facade": []}

    def outcome(call) -> str:
        try:
            call()
            torch.cuda.synchronize()
            return "OK"
        except EpdError as e:
            return f"{e.code.name}: {e.details}"

    def static(wl: Workload):
        return [_to_torch(a, device) for a in wl.inputs(rank)]

    def load(tensors, wl: Workload) -> None:
        for t, a in zip(tensors, wl.inputs(rank), strict=True):
            t.copy_(_to_torch(a, device))

    def record(out, cx, cw) -> dict:
        return {"recv_x": _bits(out.recv_x), "recv_idx": _bits(out.recv_topk_idx),
                "recv_w": _bits(out.recv_topk_weights), "src_idx": _bits(out.recv_src_idx),
                "prefix": _bits(out.rank_prefix_matrix), "cx": _bits(cx), "cw": _bits(cw)}

    with Session(socket, client_name=f"captured-{rank}", timeout=30) as s:
        g = s.join("captured-normal", rank=rank, num_ranks=2, num_experts=16, hidden=256,
                   max_tokens_per_rank=MAX_TOKENS, num_topk=4, timeout=30)
        sa = static(_workload(1, TOKENS_A))
        sb = static(_workload(1, TOKENS_B))
        warm = g.dispatch(*sa, num_worst_tokens=WORST)  # (kernels loaded before capture)
        g.combine(warm.recv_x, warm.handle, topk_weights=warm.recv_topk_weights)
        torch.cuda.synchronize()
        graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_a):
            out_a = g.dispatch(*sa, num_worst_tokens=WORST)
            cx_a, cw_a = g.combine(out_a.recv_x, out_a.handle,
                                   topk_weights=out_a.recv_topk_weights)
        with torch.cuda.graph(graph_b):
            out_b = g.dispatch(*sb, num_worst_tokens=WORST)
            cx_b, cw_b = g.combine(out_b.recv_x, out_b.handle,
                                   topk_weights=out_b.recv_topk_weights)
        # The same calls captured again (a model's layers often see the same tensors): the
        # dispatch's op is reused, the combine's is new (its input is the new graph's rows).
        ops_before = len(g._captured)
        graph_a2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_a2):
            out_a2 = g.dispatch(*sa, num_worst_tokens=WORST)
            cx_a2, cw_a2 = g.combine(out_a2.recv_x, out_a2.handle,
                                     topk_weights=out_a2.recv_topk_weights)
        res["reused"] = (out_a2.handle.op is out_a.handle.op, len(g._captured) - ops_before)
        res["captured_counts"] = (out_a.num_recv_tokens, list(out_a.num_recv_tokens_per_expert))
        for i in range(REPLAYS):
            load(sa, _workload(100 + i, TOKENS_A))
            load(sb, _workload(200 + i, TOKENS_B))
            # The engine's receive buffers poisoned through an eager dispatch's views (an eager
            # call between replays), and the graphs' own outputs poisoned too.
            junk = g.dispatch(*static(_workload(300 + i, TOKENS_B)), copy=False)
            junk.recv_x.view(torch.int16).fill_(-1)
            junk.recv_topk_idx.fill_(77)
            junk.recv_src_idx.fill_(-5)
            for t in (out_a.recv_x, out_b.recv_x, cx_a, cx_b):
                t.view(torch.int16).fill_(-3)
            graph_a.replay()
            graph_b.replay()
            graph_a.replay()  # (again: the same inputs, the same outputs)
            graph_a2.replay()
            torch.cuda.synchronize()
            res["a"].append(record(out_a, cx_a, cw_a))
            res["a2"].append(record(out_a2, cx_a2, cw_a2))
            res["b"].append(record(out_b, cx_b, cw_b))
            # An eager dispatch + combine right behind the replays, without synchronising: it
            # is numbered after them on every rank.
            graph_b.replay()
            eager = g.dispatch(*static(_workload(400 + i, TOKENS_A)), num_worst_tokens=WORST)
            ecx, ecw = g.combine(eager.recv_x, eager.handle,
                                 topk_weights=eager.recv_topk_weights)
            torch.cuda.synchronize()
            res["eager"].append(record(eager, ecx, ecw))
        res["check"] = outcome(g.check)
        # num_worst_tokens too small: the replay fails in notify on every rank; check() raises
        # it once, the next dispatch does not raise it again, and the group goes on.
        small = _workload(500, TOKENS_A)
        ss = static(small)
        graph_s = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_s):
            out_s = g.dispatch(*ss, num_worst_tokens=8)
            g.combine(out_s.recv_x, out_s.handle, topk_weights=out_s.recv_topk_weights)
        graph_s.replay()
        torch.cuda.synchronize()
        res["small_check"] = outcome(g.check)
        res["small_again"] = outcome(g.check)
        load(sa, _workload(600, TOKENS_A))
        graph_a.replay()
        res["after_small_next"] = outcome(lambda: g.dispatch(*sa, num_worst_tokens=WORST))
        torch.cuda.synchronize()
        res["after_small"] = record(out_a, cx_a, cw_a)
        # What stays refused, before anything reaches the engine's stream.
        refused = {}
        for what, call in (
                ("cached", lambda: g.dispatch(sa[0], handle=warm.handle)),
                ("exact", lambda: g.dispatch(*sa)),
                ("eager_handle", lambda: g.combine(warm.recv_x, warm.handle))):
            torch.cuda.synchronize()
            try:
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    call()
                refused[what] = "no error"
            except EpdError as e:
                refused[what] = e.code.name
        refused["outside"] = outcome(lambda: g.combine(out_a.recv_x, out_a.handle))
        res["refused"] = refused
        load(sa, _workload(700, TOKENS_A))
        graph_a.replay()
        torch.cuda.synchronize()
        res["after_refused"] = record(out_a, cx_a, cw_a)

        # The DeepEP facade: layout (the caller's own kernel), dispatch and combine captured.
        buf = Buffer(rank=rank, num_ranks=2, session=s, group_name="captured-facade",
                     max_tokens_per_rank=MAX_TOKENS)
        sf = static(_workload(1, TOKENS_A))

        def layer():
            n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(sf[1], 16)
            recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
                sf[0], num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=n_expert, topk_idx=sf[1], topk_weights=sf[2],
                num_worst_tokens=WORST)
            combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            return recv_x, recv_idx, combined, combined_w, in_rank

        layer()  # (eager first: the facade's groups joined outside the capture)
        torch.cuda.synchronize()
        graph_f = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_f):
            f_out = layer()
        for i in range(2):
            load(sf, _workload(800 + i, TOKENS_A))
            for t in (f_out[0], f_out[2]):
                t.view(torch.int16).fill_(-3)
            graph_f.replay()
            torch.cuda.synchronize()
            res["facade"].append([_bits(t) for t in f_out])
        buf.destroy()

        # DeepEP V2's ElasticBuffer without the CPU sync (vLLM's deepep_v2 decode), plain and
        # expanded: each replay equals the eager call of the same inputs, bit for bit.
        from epd.client.elastic_buffer import ElasticBuffer
        ebuf = ElasticBuffer(num_max_tokens_per_rank=MAX_TOKENS, hidden=256, num_topk=4,
                             explicitly_destroy=True, rank=rank, num_ranks=2, session=s,
                             group_name="captured-elastic")
        se = static(_workload(1, TOKENS_A))
        res["elastic"] = {}
        for expand in (False, True):
            def v2_layer(expand=expand):
                recv_x, _, recv_w, handle, _ = ebuf.dispatch(
                    se[0], topk_idx=se[1], topk_weights=se[2], num_experts=16,
                    num_max_tokens_per_rank=MAX_TOKENS, do_cpu_sync=False, do_expand=expand)
                combined, combined_w, _ = ebuf.combine(recv_x, handle, topk_weights=recv_w)
                return recv_x, combined, combined_w

            got = []
            for i in range(2):  # eager, then the same inputs replayed
                load(se, _workload(900 + i, TOKENS_A))
                got.append([_bits(t) for t in v2_layer()])
            torch.cuda.synchronize()
            graph_e = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph_e):
                e_out = v2_layer()
            replayed = []
            for i in range(2):
                load(se, _workload(900 + i, TOKENS_A))
                for t in e_out:
                    t.fill_(-3)
                graph_e.replay()
                torch.cuda.synchronize()
                replayed.append([_bits(t) for t in e_out])
            res["elastic"][expand] = (got, replayed)
        ebuf.destroy()
    q.put(res)


def _check_layer(got: dict, wl: Workload, r: int, tag: str) -> None:
    disp, comb = _expected(wl)
    n = disp[r].recv_x.shape[0]
    assert got["recv_x"].shape[0] == WORST, tag
    np.testing.assert_array_equal(got["recv_x"][:n], disp[r].recv_x.view(np.uint16), tag)
    np.testing.assert_array_equal(got["recv_idx"][:n], disp[r].recv_topk_idx, tag)
    np.testing.assert_array_equal(got["recv_w"][:n], disp[r].recv_topk_weights, tag)
    np.testing.assert_array_equal(got["src_idx"][:n], disp[r].recv_src_idx, tag)
    # prefix[s][d]: rows from sources <= s received by d (DeepEP's rank_prefix_matrix)
    prefix = [[int(disp[d].src_offsets[src + 1]) for d in range(2)] for src in range(2)]
    np.testing.assert_array_equal(got["prefix"], np.array(prefix, np.int32), tag)
    np.testing.assert_array_equal(got["cx"], comb[r][0].view(np.uint16), tag)
    np.testing.assert_array_equal(got["cw"], comb[r][1], tag)


def test_captured_worst_case_dispatch_and_combine(daemon) -> None:
    results = _spawn_ranks(daemon, _rank, 2)
    for r, res in enumerate(results):
        assert res["captured_counts"] == (-1, []), r
        assert res["reused"] == (True, 1), (r, res["reused"])  # (one new op: the combine)
        for i in range(REPLAYS):
            _check_layer(res["a"][i], _workload(100 + i, TOKENS_A), r, f"a {i} rank {r}")
            _check_layer(res["a2"][i], _workload(100 + i, TOKENS_A), r, f"a2 {i} rank {r}")
            _check_layer(res["b"][i], _workload(200 + i, TOKENS_B), r, f"b {i} rank {r}")
            _check_layer(res["eager"][i], _workload(400 + i, TOKENS_A), r, f"eager {i} rank {r}")
        assert res["check"] == "OK", (r, res["check"])
        assert res["small_check"].startswith("INVALID_ARGUMENT") and \
            "num_worst_tokens=8" in res["small_check"], (r, res["small_check"])
        assert res["small_again"] == "OK", (r, res["small_again"])
        assert res["after_small_next"] == "OK", (r, res["after_small_next"])
        _check_layer(res["after_small"], _workload(600, TOKENS_A), r, f"after small rank {r}")
        refused = dict(res["refused"])
        assert refused.pop("outside").startswith("FAILED_PRECONDITION"), (r, res["refused"])
        assert refused == dict.fromkeys(("cached", "exact", "eager_handle"),
                                        "FAILED_PRECONDITION"), (r, res["refused"])
        _check_layer(res["after_refused"], _workload(700, TOKENS_A), r, f"after refused {r}")
        for i, (recv_x, recv_idx, combined, combined_w, in_rank) in enumerate(res["facade"]):
            wl = _workload(800 + i, TOKENS_A)
            disp, comb = _expected(wl)
            n = disp[r].recv_x.shape[0]
            tag = f"facade {i} rank {r}"
            np.testing.assert_array_equal(recv_x[:n], disp[r].recv_x.view(np.uint16), tag)
            np.testing.assert_array_equal(recv_idx[:n], disp[r].recv_topk_idx, tag)
            np.testing.assert_array_equal(combined, comb[r][0].view(np.uint16), tag)
            np.testing.assert_array_equal(combined_w, comb[r][1], tag)
            want_in_rank = np.zeros((wl.tokens[r], 2), bool)
            idx = wl.inputs(r)[1]
            for e in range(2):
                want_in_rank[:, e] = ((idx >= 0) & (idx // 8 == e)).any(axis=1)
            np.testing.assert_array_equal(in_rank, want_in_rank, tag)
        for expand, (eager, replayed) in res["elastic"].items():
            for i in range(2):
                # (the combined outputs: the received rows past the count are unspecified)
                for e, g in zip(eager[i][1:], replayed[i][1:], strict=True):
                    np.testing.assert_array_equal(g, e, f"elastic expand={expand} {i} rank {r}")
