"""What a call sends between nodes, and a model of its time on a real fabric (issue 13).

The logical-node runs on one host move their inter-node bytes over NVLink, so their timings say
nothing about a network. What they do fix is how many bytes each node pair exchanges per call,
a function of the routing and the mode's semantics:

- low-latency dispatch sends a row per (token, expert) pair whose expert lives on another node
  (as DeepEP's and EPD's low-latency kernels do: per-expert receive buffers); its combine sends
  the same pairs back as bf16 rows;
- normal (hierarchical) dispatch sends a token once per destination node over the network (the
  GPU with the same local index there forwards it over NVLink); its combine brings one reduced
  row per (token, node) back. DeepEP's internode mode, and EPD's for a group placed node-major
  with `--cuda-hierarchical stages` (and by default beyond 8 ranks; cuda_stages.py);
- normal_direct is what EPD's normal mode across nodes sends by default up to 8 ranks
  (`--cuda-hierarchical auto` or `direct`) or for a group placed otherwise (each rank puts a
  token's row straight to every destination rank on another node, its combine brings one row
  per (token, rank) back): more bytes than hierarchical whenever a token has two destination
  ranks on one node.

The model: each GPU has one NIC of `--nic-gbps` gigabytes per second (50 for 400 Gb/s), every
GPU sends at once, so a call takes at least the largest inter-node bytes of one GPU over that
bandwidth. A lower bound, without latency, congestion or the NVLink leg: clearly a model.

    python -m epd.server.bench.fabric_model [--nodes 2 --gpus-per-node 8 ...] [--json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np

from ...proto import dtypes
from .. import reference as ref

# DeepEP's published figures (its README's Performance section, mid-2025; H800, CX7 400 Gb/s IB per
# GPU, ~50 GB/s): low-latency with 128 tokens per rank, 7168 hidden, top-8, FP8 dispatch and bf16
# combine: EP -> (dispatch us, combine us); normal mode with 4096 tokens: EP -> RDMA GB/s.
DEEPEP_LOW_LATENCY_US = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314)}
DEEPEP_NORMAL_RDMA_GBPS = {16: (43, 43), 32: (58, 57), 64: (51, 50)}


@dataclass(frozen=True)
class Traffic:
    """Bytes of one call: [src node, dst node] (the diagonal is NVLink, not network) and the
    largest inter-node bytes any one GPU sends."""

    node_pair_bytes: list[list[int]]
    max_gpu_network_bytes: int

    def model_us(self, nic_gbps: float) -> float:
        return self.max_gpu_network_bytes / (nic_gbps * 1e3)


def traffic(topk_idx: list[np.ndarray], rank_nodes: list[int], num_experts: int,
            row_bytes: int, mode: str) -> Traffic:
    """Bytes each node pair sends in one call whose rank r routes `topk_idx[r]` ([T, K], -1 for
    none); `mode` "low_latency" (a row per (token, expert)), "normal" (a row per (token,
    destination node)) or "normal_direct" (a row per (token, destination rank))."""
    num_nodes = max(rank_nodes) + 1
    local = num_experts // len(rank_nodes)
    pairs = np.zeros((num_nodes, num_nodes), np.int64)
    worst = 0
    node_of = np.asarray(rank_nodes)
    for r, idx in enumerate(topk_idx):
        valid = idx >= 0
        dst_rank = np.where(valid, idx // local, -1)
        dst_node = np.where(valid, node_of[np.where(valid, dst_rank, 0)], -1)
        rows = np.zeros(num_nodes, np.int64)
        for n in range(num_nodes):
            to_n = dst_node == n
            if mode == "low_latency":
                rows[n] = to_n.sum()
            elif mode == "normal":
                rows[n] = to_n.any(axis=1).sum()
            else:  # distinct (token, rank) pairs on node n
                rows[n] = sum(int((dst_rank == d).any(axis=1).sum())
                              for d in np.flatnonzero(node_of == n))
        pairs[rank_nodes[r]] += rows * row_bytes
        worst = max(worst, int(rows.sum() - rows[rank_nodes[r]]) * row_bytes)
    return Traffic(pairs.tolist(), worst)


def row_bytes(hidden: int, fp8: bool) -> int:
    """A dispatched row: FP8 payload with a float32 scale per 128 channels, or bf16."""
    return hidden + hidden // dtypes.FP8_BLOCK * 4 if fp8 else 2 * hidden


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epd.server.bench.fabric_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank, low latency")
    p.add_argument("--normal-tokens", type=int, default=4096, help="tokens per rank, normal")
    p.add_argument("--nic-gbps", type=float, default=50.0, help="GB/s of one GPU's NIC")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    ranks = a.nodes * a.gpus_per_node
    nodes = [r // a.gpus_per_node for r in range(ranks)]
    rng = np.random.default_rng(a.seed)
    rows = []
    for mode, tokens in (("low_latency", a.ll_tokens), ("normal", a.normal_tokens),
                         ("normal_direct", a.normal_tokens)):
        idx = [ref.random_routing(rng, tokens, a.experts, a.topk)[0] for _ in range(ranks)]
        for what, fp8 in (("dispatch (FP8)", True), ("combine (bf16)", False)):
            t = traffic(idx, nodes, a.experts, row_bytes(a.hidden, fp8), mode)
            rows.append({"mode": mode, "call": what, "tokens_per_rank": tokens,
                         **asdict(t), "model_us": round(t.model_us(a.nic_gbps), 1)})
    ep = ranks
    published = {"deepep_low_latency_us": DEEPEP_LOW_LATENCY_US.get(ep),
                 "deepep_normal_rdma_gbps": DEEPEP_NORMAL_RDMA_GBPS.get(ep)}
    if a.json:
        print(json.dumps({"ep": ep, "nodes": a.nodes, "nic_gbps": a.nic_gbps, "rows": rows,
                          **published}, indent=1))
        return 0
    print(f"EP{ep} over {a.nodes} nodes, {a.experts} experts top-{a.topk}, hidden {a.hidden}, "
          f"NIC {a.nic_gbps:g} GB/s per GPU (a MODEL: bandwidth only, no latency)")
    for r in rows:
        off = sum(b for i, row in enumerate(r["node_pair_bytes"]) for j, b in enumerate(row)
                  if i != j)
        print(f"  {r['mode']:<13} {r['call']:<15} {r['tokens_per_rank']:>5} tok/rank: "
              f"network {off / 1e6:8.2f} MB per call, max per GPU "
              f"{r['max_gpu_network_bytes'] / 1e6:6.2f} MB -> model {r['model_us']:8.1f} us")
    print(f"  DeepEP published (H800, CX7): low-latency dispatch/combine us "
          f"{published['deepep_low_latency_us']}, normal RDMA GB/s "
          f"{published['deepep_normal_rdma_gbps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
