"""Hierarchical normal mode on the CPU backend: what changes for a group over several nodes.

A group whose ranks span nodes, placed node-major (rank r on the group's (r // L)-th node, the
same L ranks on every node), runs DeepEP's hierarchical semantics as defined by
``reference.hierarchical_dispatch`` / ``hierarchical_combine`` (docs/DESIGN_NOTES.md, "Next:
hierarchical normal mode as two flat collectives"). The CPU backend does not run the two stages:
every rank still pulls from the others' slots in one collective, and the stages only change the
order of the rows, what recv_src_idx names, and the summation order of combine:

- **dispatch**: destination (b, j) receives the flat dispatch's rows with the sources taken in
  the order (local index i, then node a) instead of rank order. A row's recv_src_idx is its
  index in the rail list of its forwarder (b, i), which receives from sources (a, i), a
  ascending, the tokens with at least one expert on node b, in token order.
- **combine**: out = round(bias_0 + bias_1 + sum over nodes b of round(sum over b's ranks j of
  y)), fp32 throughout, nodes and local ranks ascending; weights are summed the same way, in
  fp32 without rounding.

Any other spanning placement keeps the flat semantics (rows by source rank, one rounding); the
rule is `base.Hierarchy.of`, shared with the CUDA engine.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import Hierarchy


def forwarder_rows(h: Hierarchy, me: int, node_rows: list[np.ndarray],
                   src_rows: list[np.ndarray]) -> np.ndarray:
    """recv_src_idx of destination `me`'s rows (in `source_order`): each row's index in its
    forwarder's rail list. `node_rows[s]`: source s's tokens with an expert on `me`'s node
    (ascending), `src_rows[s]`: those with an expert on `me` (a subset)."""
    ln = h.per_node
    parts = []
    for i in range(ln):
        base = 0  # rail rows of forwarder (b, i) from sources (a' < a, i)
        for a in range(h.num_nodes):
            s = a * ln + i
            parts.append(base + np.searchsorted(node_rows[s], src_rows[s]))
            base += len(node_rows[s])
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def combine_into(h: Hierarchy, acc: np.ndarray, acc_w: np.ndarray | None, dtype: np.dtype,
                 rows_from: Callable[[int], tuple[np.ndarray, np.ndarray,
                                                  np.ndarray | None] | None]) -> None:
    """Add to `acc` (fp32, the biases already in it) every node's partial sum of this
    source's tokens, rounded to `dtype` (the forwarder's NVLink stage), nodes ascending;
    `acc_w` likewise without rounding. `rows_from(d)`: (this source's tokens on d, their
    rows of d's expert output, their weights or None), or None when d holds none."""
    num_tokens = acc.shape[0]
    for b in range(h.num_nodes):
        part = np.zeros_like(acc)
        part_w = None if acc_w is None else np.zeros_like(acc_w)
        hit = np.zeros(num_tokens, dtype=bool)  # tokens with an expert on node b
        for j in range(h.per_node):  # local ranks ascending, fp32 from zero
            got = rows_from(b * h.per_node + j)
            if got is None:
                continue
            mine, y, yw = got
            part[mine] += y.astype(np.float32)
            if part_w is not None:
                part_w[mine] += yw
            hit[mine] = True
        if not hit.any():
            continue
        acc[hit] += part[hit].astype(dtype).astype(np.float32)
        if acc_w is not None:
            acc_w[hit] += part_w[hit]
