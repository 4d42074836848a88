"""What the ranks of a CPU-backend collective must agree on: each rank writes its call header
into its slot when it arrives (CallHeader), and every rank reads them all after the arrival
barrier and reaches the same verdict in the same words (call_disagreement, capacity_overflow;
docs/DESIGN_NOTES.md "Collectives agree or fail together")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...proto import counter_page
from ...proto.errors import TokenCapacityExceeded
from .base import GroupSpec
from .cpu_comm_file import (
    F_FP8,
    F_INT32_SCALES,
    F_NO_TOPK,
    F_WEIGHTS,
    H_ALIGN,
    H_FLAGS,
    H_KIND,
    H_NUM_MAX,
    H_REF,
    H_SEQ,
    H_STATUS,
    H_TOKENS,
    H_WORST,
    KIND_NAMES,
    REJECTED,
    SCALE_COLS_SHIFT,
)


@dataclass(frozen=True)
class CallHeader:
    """One rank's call of a collective, as far as the other ranks must agree with it.

    `ref` names the dispatch a handle comes from by that dispatch's collective number, which
    every rank of the group assigns identically (0: no handle). `worst`, `align` and `num_max`
    are num_worst_tokens, expert_alignment and num_max_dispatch_tokens_per_rank (0 where the
    kind has none). `tokens` is a dispatch's token count, which differs across ranks and is not
    compared: the largest decides whether the group can hold the call."""

    kind: int
    ref: int = 0
    flags: int = 0
    worst: int = 0
    align: int = 0
    num_max: int = 0
    tokens: int = 0

    @classmethod
    def read(cls, words: np.ndarray) -> CallHeader:
        return cls(int(words[H_KIND]), int(words[H_REF]), int(words[H_FLAGS]),
                   int(words[H_WORST]), int(words[H_ALIGN]), int(words[H_NUM_MAX]),
                   int(words[H_TOKENS]))

    def write(self, words: np.ndarray, seq: int, status: int) -> None:
        words[H_KIND], words[H_REF], words[H_FLAGS] = self.kind, self.ref, self.flags
        words[H_WORST], words[H_ALIGN], words[H_NUM_MAX] = self.worst, self.align, self.num_max
        words[H_TOKENS] = self.tokens
        words[H_SEQ] = seq
        words[H_STATUS] = status  # last: the header is complete

    def describe(self) -> str:
        name = KIND_NAMES.get(self.kind, f"an unknown collective (kind {self.kind})")
        return f"{name} of dispatch #{self.ref}" if self.ref else name


# The arguments that must agree, once the kinds do: (name, how to read it, how to tell it).
_AGREED_ARGS = (
    ("FP8 payload (x_scales)", lambda c: bool(c.flags & F_FP8), lambda v: "yes" if v else "no"),
    ("x_scales dtype", lambda c: ("int32" if c.flags & F_INT32_SCALES else "float32")
     if c.flags & F_FP8 else "none", str),
    ("x_scales columns", lambda c: c.flags >> SCALE_COLS_SHIFT, str),
    ("topk_weights", lambda c: bool(c.flags & F_WEIGHTS),
     lambda v: "passed" if v else "not passed"),
    ("top-k routing", lambda c: not c.flags & F_NO_TOPK,
     lambda v: "topk_idx" if v else "is_token_in_rank only"),
    ("num_worst_tokens", lambda c: c.worst, str),
    ("expert_alignment", lambda c: c.align, str),
    ("num_max_dispatch_tokens_per_rank", lambda c: c.num_max, str),
)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _by_value(values: list[Any]) -> list[tuple[Any, list[int]]]:
    """[(value, ranks holding it)] in the order of first occurrence."""
    groups: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return list(groups.items())


def call_disagreement(seqs: list[int], calls: list[CallHeader], statuses: list[int],
                      reasons: list[str], ranks: list[int] | None = None) -> str | None:
    """What the ranks' headers of one collective disagree on (None: they agree). A function of
    the headers only, so every rank reaches the same verdict with the same words. `ranks`: the
    rank of each header (default 0..n-1; a shrink group compares the ranks that arrived)."""
    ids = list(range(len(calls))) if ranks is None else ranks

    def by_value(values: list[Any]) -> list[tuple[Any, list[int]]]:
        return [(v, [ids[i] for i in rs]) for v, rs in _by_value(values)]

    rejected = [i for i, st in enumerate(statuses) if st == REJECTED]
    if rejected:
        return "; ".join(f"rank {ids[i]} rejected its {calls[i].describe()}: {reasons[i]}"
                         for i in rejected)
    if len(set(seqs)) > 1:  # cannot happen while the barrier protocol holds
        return "ranks are at different collectives: " + ", ".join(
            f"{_ranks(rs)} at #{v}" for v, rs in by_value(seqs))
    if len({(c.kind, c.ref) for c in calls}) > 1:
        return "ranks called different collectives: " + ", ".join(
            f"{_ranks(rs)} called {d}" for d, rs in by_value([c.describe() for c in calls]))
    diffs = []
    for name, get, tell in _AGREED_ARGS:
        groups = by_value([get(c) for c in calls])
        if len(groups) > 1:
            diffs.append(f"{name}: " + ", ".join(f"{tell(v)} on {_ranks(rs)}"
                                                 for v, rs in groups))
    if diffs:
        return f"{KIND_NAMES[calls[0].kind]} arguments differ across ranks: " + "; ".join(diffs)
    return None


def capacity_overflow(calls: list[CallHeader], ranks: list[int], spec: GroupSpec,
                      seq: int) -> TokenCapacityExceeded | None:
    """The error every rank raises when some rank's dispatch has more tokens than the group's
    max_tokens_per_rank (None: all fit), reached by each rank from the same headers."""
    need, who = max((c.tokens, r) for c, r in zip(calls, ranks, strict=True))
    if need <= spec.max_tokens_per_rank:
        return None
    return counter_page.capacity_error(spec.name, spec.max_tokens_per_rank, need, who,
                                       f"collective #{seq}")
