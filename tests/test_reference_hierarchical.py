"""The reference of hierarchical normal mode over nodes (server/reference.py): two flat stages
give every rank the same rows as the flat dispatch (in forwarder order), and combine sums a
rounded partial per node, checked against an independent per-token computation."""

from __future__ import annotations

import numpy as np
import pytest

from epd.server import reference as ref

BF16 = ref.BFLOAT16


def _inputs(seed: int, tokens: list[int], e: int, k: int, h: int, drop: float = 0.1):
    rng = np.random.default_rng(seed)
    routes = [ref.random_routing(rng, t, e, k, drop_prob=drop) for t in tokens]
    xs = [ref.random_x(rng, t, h, BF16) for t in tokens]
    return xs, [r[0] for r in routes], [r[1] for r in routes], rng


def _by_source(rd: ref.RankDispatch, src_rank: np.ndarray, src_idx: np.ndarray):
    order = np.lexsort((src_idx, src_rank))
    return order, src_rank[order], src_idx[order]


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 4), (2, 2), (3, 2), (2, 4)])
def test_same_rows_as_the_flat_dispatch(nodes: int, per_node: int) -> None:
    r = nodes * per_node
    e, k, h = 8 * r, 4, 256
    tokens = [(7 * s + 3) % 19 for s in range(r)]  # uneven, one rank may send none
    xs, idx, w, _ = _inputs(30 + r, tokens, e, k, h)
    qs = [ref.quantize_fp8(x.astype(np.float32)) for x in xs]
    xq, sc = [q for q, _ in qs], [s for _, s in qs]
    flat = ref.dispatch(xq, idx, w, e, x_scales=sc, expert_alignment=4)
    hier = ref.hierarchical_dispatch(xq, idx, w, e, nodes, x_scales=sc, expert_alignment=4)
    for d in range(r):
        f, got = flat[d], hier.received(d)
        src_rank, src_idx = hier.sources(d)
        order, sr, si = _by_source(got, src_rank, src_idx)
        np.testing.assert_array_equal(sr, f.recv_src_rank)  # flat rows: by source, then token
        np.testing.assert_array_equal(si, f.recv_src_idx)
        np.testing.assert_array_equal(got.recv_x[order].view(np.uint8), f.recv_x.view(np.uint8))
        np.testing.assert_array_equal(got.recv_x_scales[order], f.recv_x_scales)
        np.testing.assert_array_equal(got.recv_topk_idx[order], f.recv_topk_idx)
        np.testing.assert_array_equal(got.recv_topk_weights[order], f.recv_topk_weights)
        assert got.num_recv_tokens_per_expert == f.num_recv_tokens_per_expert
    if nodes == 1:  # one node: the flat dispatch itself, order included
        for d in range(r):
            src_rank, src_idx = hier.sources(d)
            np.testing.assert_array_equal(src_rank, flat[d].recv_src_rank)
            np.testing.assert_array_equal(src_idx, flat[d].recv_src_idx)


@pytest.mark.parametrize(("nodes", "per_node", "bias"), [(2, 2, False), (2, 3, True),
                                                         (3, 2, True)])
def test_combine_sums_a_rounded_partial_per_node(nodes: int, per_node: int,
                                                 bias: bool) -> None:
    r = nodes * per_node
    e, k, h = 4 * r, 3, 128
    tokens = [11 + s for s in range(r)]
    xs, idx, w, rng = _inputs(50 + r, tokens, e, k, h)
    hier = ref.hierarchical_dispatch(xs, idx, w, e, nodes)
    ys = [ref.random_x(rng, hier.received(d).recv_x.shape[0], h, BF16) for d in range(r)]
    rw = [hier.received(d).recv_topk_weights for d in range(r)]
    b0 = [ref.random_x(rng, t, h, BF16) for t in tokens] if bias else None
    b1 = [ref.random_x(rng, t, h, BF16) for t in tokens] if bias else None
    got = ref.hierarchical_combine(ys, hier, tokens, recv_topk_weights=rw, bias_0=b0,
                                   bias_1=b1)
    # Independently, token by token: the rows each rank holds of it, by node then local rank.
    rows: dict[tuple[int, int], list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for d in range(r):
        src_rank, src_idx = hier.sources(d)
        for n, (s, t) in enumerate(zip(src_rank, src_idx, strict=True)):
            rows.setdefault((int(s), int(t)), []).append((d, ys[d][n], rw[d][n]))
    for s in range(r):
        out, out_w = got[s]
        assert out.dtype == BF16
        for t in range(tokens[s]):
            acc = np.zeros(h, np.float32)
            if bias:
                acc = acc + b0[s][t].astype(np.float32)
                acc = acc + b1[s][t].astype(np.float32)
            acc_w = np.zeros(k, np.float32)
            held = sorted(rows.get((s, t), []), key=lambda x: x[0])
            for node in range(nodes):
                mine = [(y, ww) for d, y, ww in held if d // per_node == node]
                if not mine:
                    continue  # (the token never went to that node)
                part = np.zeros(h, np.float32)
                part_w = np.zeros(k, np.float32)
                for y, ww in mine:
                    part = part + y.astype(np.float32)
                    part_w = part_w + ww
                acc = acc + part.astype(BF16).astype(np.float32)
                acc_w = acc_w + part_w
            np.testing.assert_array_equal(out[t].view(np.uint16), acc.astype(BF16).view(np.uint16),
                                          err_msg=f"rank {s} token {t}")
            np.testing.assert_array_equal(out_w[t], acc_w)
    # Weights come back exactly as the flat combine gives them (each k lives on one rank).
    flat = ref.dispatch(xs, idx, w, e)
    flat_ys = [np.zeros((f.recv_x.shape[0], h), BF16) for f in flat]
    flat_w = ref.combine(flat_ys, flat, tokens,
                         recv_topk_weights=[f.recv_topk_weights for f in flat])
    for s in range(r):
        np.testing.assert_array_equal(got[s][1], flat_w[s][1])


def test_ranks_must_split_into_equal_nodes() -> None:
    xs, idx, w, _ = _inputs(1, [4, 4, 4], 6, 2, 128)
    with pytest.raises(ValueError, match="equal size"):
        ref.hierarchical_dispatch(xs, idx, w, 6, 2)
