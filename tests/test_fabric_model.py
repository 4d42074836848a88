"""The inter-node bytes per call of the two modes (server/bench/fabric_model.py), on routings
small enough to count by hand; and the script's table."""

from __future__ import annotations

import json

import numpy as np

from epd.server.bench import fabric_model as fm


def test_bytes_per_node_pair_by_hand() -> None:
    # 4 ranks on 2 nodes (ranks 0,1 on node 0), 8 experts (2 per rank: rank r has 2r, 2r+1).
    nodes = [0, 0, 1, 1]
    idx = [np.array([[4, 6], [0, 5], [-1, -1]]),  # rank 0: token 0 -> node 1 twice, token 1 both
           np.array([[2, 3]]),                     # rank 1: one token, node 0 only
           np.array([[0, 7], [1, 2]]),             # rank 2: node 0 and 1; node 0 twice
           np.zeros((0, 2), np.int64)]             # rank 3: no tokens
    ll = fm.traffic(idx, nodes, 8, 10, "low_latency")
    # pairs (token, expert): rank 0 -> node0 1, node1 3; rank 1 -> node0 2; rank 2 -> node0 3,
    # node1 1
    assert ll.node_pair_bytes == [[30, 30], [30, 10]]
    assert ll.max_gpu_network_bytes == 30  # rank 0 (node 1) and rank 2 (node 0), 3 rows each
    normal = fm.traffic(idx, nodes, 8, 10, "normal")
    # (token, node) pairs: rank 0 -> node0 1, node1 2; rank 1 -> node0 1; rank 2 -> node0 2,
    # node1 1
    assert normal.node_pair_bytes == [[20, 20], [20, 10]]
    assert normal.max_gpu_network_bytes == 20
    assert abs(normal.model_us(50.0) - 20 / 50e3) < 1e-12
    direct = fm.traffic(idx, nodes, 8, 10, "normal_direct")
    # (token, rank) pairs: rank 0 -> node0 1 (token 1: rank 0), node1 3 (token 0: ranks 2, 3;
    # token 1: rank 2); rank 1 -> node0 1; rank 2 -> node0 3 (token 0: rank 0; token 1: ranks 0,
    # 1), node1 1 (rank 3). Two ranks of one node cost two rows where hierarchical sends one.
    assert direct.node_pair_bytes == [[20, 30], [30, 10]]
    assert direct.max_gpu_network_bytes == 30


def test_row_bytes_and_the_report(capsys) -> None:
    assert fm.row_bytes(7168, fp8=True) == 7168 + 56 * 4
    assert fm.row_bytes(7168, fp8=False) == 2 * 7168
    assert fm.main(["--nodes", "2", "--gpus-per-node", "2", "--experts", "16", "--topk", "4",
                    "--hidden", "256", "--ll-tokens", "8", "--normal-tokens", "16",
                    "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ep"] == 4 and len(out["rows"]) == 6
    for row in out["rows"]:
        pairs = np.array(row["node_pair_bytes"])
        assert pairs.shape == (2, 2) and (pairs >= 0).all()
        assert row["model_us"] == round(row["max_gpu_network_bytes"] / 50e3, 1)
