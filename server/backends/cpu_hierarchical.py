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
rule is `base.Hierarchy.of`, shared with the CUDA engine. `add_rows` is the one summation of
combine: the flat sum is it over every rank, the hierarchical one over each node's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


RowsFrom = Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray | None] | None]


def add_rows(acc: np.ndarray, acc_w: np.ndarray | None, rows_from: RowsFrom,
             ranks: Iterable[int]) -> np.ndarray:
    """Add, in the order of `ranks`, each destination's rows of this source's tokens to `acc`
    (fp32) and their weights to `acc_w`; returns which tokens got any. `rows_from(d)`: (this
    source's tokens on d, their rows of d's expert output, their weights or None), or None
    when d holds none."""
    hit = np.zeros(acc.shape[0], dtype=bool)
    for d in ranks:
        got = rows_from(d)
        if got is None:
            continue
        mine, y, yw = got
        acc[mine] += y.astype(np.float32)
        if acc_w is not None:
            acc_w[mine] += yw
        hit[mine] = True
    return hit


def combine_into(h: Hierarchy, acc: np.ndarray, acc_w: np.ndarray | None, dtype: np.dtype,
                 rows_from: RowsFrom) -> None:
    """Add to `acc` (fp32, the biases already in it) every node's partial sum of this
    source's tokens, rounded to `dtype` (the forwarder's NVLink stage), nodes ascending;
    `acc_w` likewise without rounding (`rows_from` as for `add_rows`)."""
    for b in range(h.num_nodes):
        part = np.zeros_like(acc)  # local ranks ascending, fp32 from zero
        part_w = None if acc_w is None else np.zeros_like(acc_w)
        hit = add_rows(part, part_w, rows_from, range(b * h.per_node, (b + 1) * h.per_node))
        if not hit.any():
            continue
        acc[hit] += part[hit].astype(dtype).astype(np.float32)
        if acc_w is not None:
            acc_w[hit] += part_w[hit]
