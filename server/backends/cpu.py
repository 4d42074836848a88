"""CPU backend: the collectives of server/reference.py between engine processes, through
shared memory.

It mirrors the GPU design: every group has one communication file (the analogue of the symmetric
heap; its layout in cpu_comm_file.py) with a slot per rank, arrival words (the analogue of
NVSHMEM signals) and an abort word.
A collective is pull-based:

    1. wait until every rank has finished reading the previous collective (so slots are free),
    2. copy this rank's inputs and its call header (kind, number, the handle's dispatch, the
       arguments that must agree) into its slot and raise its arrival word,
    3. wait for every rank's arrival (deadline + abort word); compare every rank's call header
       (any disagreement fails every rank at once: cpu_calls.py),
    4. notify: compute the receive counts from the sources' routing and publish them into the
       session's counter page; then compute the layout and copy the rows in,
    5. raise the "done reading" word.

The barrier that frees the slots (step 1) is paid by the next collective, off this one's path.
A normal-mode group over several nodes placed node-major takes its sources in DeepEP's
hierarchical order and sums a rounded partial per node in combine (cpu_hierarchical.py).
It is a real implementation used for CI and laptops; it is never used to claim GPU results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...proto import abi, counter_page, dtypes, host_order
from ...proto import fd_channel as fdc
from ...proto.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
)
from ...proto.v1 import epd_pb2
from ..reference import fma_f32, quantize_fp8  # one FP8 cast, one combine FMA (reference.py)
from . import cpu_hierarchical
from .base import (
    Array,
    Backend,
    CombineArgs,
    CombineOutputs,
    CounterPage,
    DispatchArgs,
    DispatchOutputs,
    GroupSpec,
    Hierarchy,
    LayoutOutputs,
    LowLatencyCombineArgs,
    LowLatencyCombineOutputs,
    LowLatencyDispatchArgs,
    LowLatencyDispatchOutputs,
    Membership,
    RankComm,
    Region,
    check_combine_routing,
    ll_overwritten,
)
from .cpu_calls import CallHeader, call_disagreement, capacity_overflow
from .cpu_comm_file import (
    ARRIVALS,
    ARRIVED,
    CACHED_DISPATCH,
    CALL,
    CALL_WORDS,
    COMBINE,
    DISPATCH,
    F_FP8,
    F_INT32_SCALES,
    F_NO_TOPK,
    F_WEIGHTS,
    H_KIND,
    H_REASON_LEN,
    H_REF,
    H_SEQ,
    H_STATUS,
    HEADER_BYTES,
    LL_COMBINE,
    LL_DISPATCH,
    MASK,
    MASK_SEEN,
    REASON,
    REASON_MAX,
    REJECTED,
    REJOIN,
    SCALE_COLS_SHIFT,
    TIMED_OUT,
    SlotLayout,
    abort_kind,
    comm_file_bytes,
    header_words,
    ll_max_rows,
    mask_locked,
    open_comm_file,
    read_abort,
    write_abort,
)
from .cpu_memory import OutputArena, ShmCounterPage, ShmRegion
from .cpu_plan import CpuPlanner, comm_path


@dataclass
class _Handle:
    """What combine and cached dispatch need (kept by the engine under a handle id)."""

    sequence: int
    is_token_in_rank: np.ndarray  # [T, R] this rank's tokens
    num_tokens: int
    rank_prefix: np.ndarray  # [R, R] int64: rows source s sends to destination d
    recv_src_rank: np.ndarray  # [N] as receiver: source rank of each row
    recv_src_idx: np.ndarray  # [N] source token of each row
    num_recv_tokens: int
    num_worst_tokens: int
    # [N] the recv_src_idx output: recv_src_idx, or in a hierarchical group each row's index
    # in its forwarder's rail list (cpu_hierarchical)
    shown_src_idx: np.ndarray


@dataclass
class _LowLatencyHandle:
    """What low-latency combine needs, as source and as destination of one LL dispatch."""

    sequence: int  # the dispatch collective's number (the same on every rank)
    num_tokens: int
    num_max: int
    topk_idx: np.ndarray  # [T, K] this rank's routing as dispatched
    dest: np.ndarray  # [T, K] destination rank of each pair, -1 for none
    row: np.ndarray  # [T, K] row of the pair in the destination's compacted combine input
    recv_count: np.ndarray  # [L] rows this rank received per local expert
    buffer: int = 0  # the receive buffer the dispatch filled


def layout_of(topk_idx: np.ndarray, spec: GroupSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank) of one rank's routing."""
    t = topk_idx.shape[0]
    r, e, lx = spec.num_ranks, spec.num_experts, spec.num_local_experts
    valid = topk_idx >= 0
    per_expert = np.bincount(topk_idx[valid], minlength=e).astype(np.int32)
    in_rank = np.zeros((t, r), dtype=np.bool_)
    rows, cols = np.nonzero(valid)
    in_rank[rows, topk_idx[rows, cols] // lx] = True
    return in_rank.sum(axis=0, dtype=np.int32), per_expert, in_rank


class CpuRankComm(RankComm):
    backend_name = "cpu"

    def __init__(self, spec: GroupSpec, membership: Membership) -> None:
        self.spec = spec
        self.membership = membership
        self.rank = membership.rank
        self._mm = open_comm_file(comm_path(membership.plan), comm_file_bytes(spec))
        self._header = header_words(self._mm)
        self._arrivals = self._header[ARRIVALS // 8:ARRIVALS // 8 + spec.num_ranks]
        self._slot = SlotLayout.for_spec(spec)
        self.output_region = ShmRegion(f"out-{membership.group_id}-{self.rank}",
                                       OutputArena.bytes_for(spec), create=True)
        self._out = OutputArena(self.output_region, spec)
        self._sequence = 0  # collectives this rank has started
        # The low-latency dispatch each receive buffer holds (its collective number; DeepEP's
        # double buffer, as the CUDA engine's: a combine of an overwritten one is refused).
        self._ll_filled = [0] * abi.LL_BUFFERS
        self._mask = np.frombuffer(self._mm, np.uint8, spec.num_ranks, MASK)  # shrink groups
        self._stopped: str | None = None  # this rank went away (shrink groups): why
        # A replacement taking the place of a rank that went away: it waits for the group's
        # Rejoin collective before it takes part (its collective number comes from there).
        self._rejoining = bool(spec.shrink and self._mask[self.rank] == self.MASK_GONE)
        # Normal mode over nodes placed node-major: hierarchical semantics (cpu_hierarchical);
        # every destination then takes its sources in this order (flat: rank order).
        self.hierarchy = Hierarchy.of(membership.rank_nodes)
        self._order = (self.hierarchy.source_order() if self.hierarchy is not None
                       else list(range(spec.num_ranks)))
        # the sources whose blocks precede mine on every destination
        self._before_me = np.array(self._order[:self._order.index(self.rank)], dtype=np.intp)

    # -- shared-memory plumbing ------------------------------------------------------------
    def _slot_array(self, rank: int, field: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        off = HEADER_BYTES + rank * self._slot.size + getattr(self._slot, field)
        return np.ndarray(shape, dtype=np.dtype(dtype), buffer=self._mm, offset=off)

    def _meta(self, rank: int) -> np.ndarray:
        return self._slot_array(rank, "meta", (8,), np.int64)

    def _reached(self, target: int) -> bool:
        """Every rank's arrival word is at `target` (a shrink group waits for no rank that
        went away: masked for good)."""
        if int(self._arrivals.min()) >= target:
            return True
        return self.spec.shrink and bool(((self._arrivals >= target)
                                          | (self._mask == self.MASK_GONE)).all())

    def _wait_all(self, target: int, what: str, deadline: float) -> None:
        spins = 0
        shrink = self.spec.shrink
        while True:
            if self._reached(target):
                host_order.consume()  # (the arrivals seen before the peers' slots are read)
                return
            if self._stopped is not None:
                raise Aborted(f"group {self.spec.name!r}: {self._stopped}")
            reason = read_abort(self._header)
            if reason is not None:
                # A missing rank is a deadline for every waiter, whoever noticed it first.
                if abort_kind(self._header) == TIMED_OUT:
                    raise DeadlineExceeded(f"group {self.spec.name!r}: {reason}")
                raise Aborted(f"group {self.spec.name!r} aborted: {reason}")
            spins += 1
            if spins > 200:
                if time.monotonic() > deadline:
                    late = self._arrivals < target
                    if shrink:
                        late &= self._mask != self.MASK_GONE
                    missing = [int(r) for r in np.nonzero(late)[0]]
                    reason = (f"rank(s) {missing} did not arrive at {what} "
                              f"(collective #{(target + 1) // 2}) before the deadline")
                    write_abort(self._header, reason, TIMED_OUT)
                    raise DeadlineExceeded(f"group {self.spec.name!r}: {reason}")
                time.sleep(20e-6 if spins < 5000 else 200e-6)

    def _begin(self, deadline: float, what: str) -> int:
        """Steps 1-3 of the protocol around the caller's slot writes; returns the sequence."""
        seq = self._sequence + 1
        self._wait_all(2 * seq - 2, f"{what} (previous collective's readers)", deadline)
        return seq

    def _arrive(self, seq: int, phase: int) -> None:
        # (this rank's slot writes, and its reads of the peers' slots, before its arrival:
        # a peer that sees it may overwrite what was read)
        host_order.publish()
        self._arrivals[self.rank] = 2 * seq - 2 + phase

    # -- call headers: collectives agree or fail together ------------------------------------
    # -- rank masking (shrink groups) ---------------------------------------------------------
    supports_rank_masking = True

    def _mask_seen(self, rank: int) -> np.ndarray:
        off = HEADER_BYTES + rank * self._slot.size + self._slot.meta + MASK_SEEN
        return np.ndarray((self.spec.num_ranks,), dtype=np.uint8, buffer=self._mm, offset=off)

    def _left_out(self, seq: int) -> tuple[list[int] | None, np.ndarray]:
        """After the arrival barrier of collective `seq`: (the ranks whose headers count, None
        for all; which ranks the collective leaves out). In a shrink group: those that did not
        arrive (they went away) and those that any rank that arrived saw masked, so every rank
        reaches the same set from the same words; this rank reads nothing and sends nothing
        if it is left out itself."""
        r = self.spec.num_ranks
        if not self.spec.shrink:
            return None, np.zeros(r, dtype=bool)
        arrived = self._arrivals >= 2 * seq - 1
        out = ~arrived
        ranks = [int(s) for s in np.nonzero(arrived)[0]]
        for s in ranks:
            out |= self._mask_seen(s) != self.MASK_IN
        return ranks, out

    def mask_states(self) -> list[int]:
        return [int(v) for v in self._mask]

    def set_mask(self, rank: int, state: int) -> None:
        # (the engine decided from a mask it read before: a rank marked gone since stays gone
        # until a replacement rejoins; the supervisor writes GONE under the same lock)
        with open(comm_path(self.membership.plan), "r+b") as f, mask_locked(f.fileno(), rank):
            if self._mask[rank] != self.MASK_GONE:
                self._mask[rank] = state

    def stop(self, reason: str) -> None:
        self._stopped = reason

    def _check_not_gone(self) -> None:
        """A rank masked for good (its node lost the cluster while it lived on) takes no part
        any more: its calls fail rather than return nothing. A replacement takes part once the
        group's Rejoin collective brought it in."""
        if self._rejoining:
            raise FailedPrecondition(
                f"rank {self.rank} rejoins group {self.spec.name!r}: it takes part from the "
                f"group's Rejoin collective on (Group.rejoin(), made by every rank)")
        if self.spec.shrink and self._mask[self.rank] == self.MASK_GONE:
            raise Aborted(f"rank {self.rank} of group {self.spec.name!r} was masked for good "
                          f"(it went away, or its node lost the cluster): it takes no part any "
                          f"more; a replacement joins in its place and rejoins (Group.rejoin)")

    def _leave_if_gone(self, seq: int) -> None:
        """After the arrival barrier: a rank masked for good while it waited frees its slot
        (it reads nothing) and fails its call."""
        if self.spec.shrink and self._mask[self.rank] == self.MASK_GONE:
            self._arrive(seq, 2)
            self._check_not_gone()

    # -- rejoin (a replacement for a rank that went away) ------------------------------------
    def rejoin(self, rank: int, deadline: float) -> None:
        """The Rejoin collective for `rank`. The ranks that take part make it as their next
        collective n and wait there for the replacement (whose mask says gone, so no other wait
        would); the replacement, once all of them arrived, finds n in their call headers, takes
        its place at n - 1 (its arrival word, then its mask back to taking part, so that from
        then on every wait includes it) and arrives. If it does not come before the deadline,
        the others end the call (DEADLINE_EXCEEDED) and the group goes on without it."""
        if rank == self.rank:  # (the engine checked that the group shrinks)
            if not self._rejoining:
                raise FailedPrecondition(f"rank {rank} of group {self.spec.name!r} takes part "
                                         f"already: only a replacement rejoins")
            seq = self._rejoin_number(deadline)
            host_order.publish()  # (the headers read, this rank's slot written, before)
            self._arrivals[self.rank] = 2 * seq - 2  # done with n - 1, as its peers
            host_order.publish()  # (its place taken before it counts in every wait)
            self._mask[self.rank] = self.MASK_IN
            self._rejoining = False
        else:
            if self._rejoining:
                self._check_not_gone()
            if self._mask[rank] != self.MASK_GONE:
                raise FailedPrecondition(f"rank {rank} of group {self.spec.name!r} has not gone "
                                         f"away: there is nothing to rejoin")
            seq = self._begin(deadline, "rejoin")
        self._take_part(seq, CallHeader(REJOIN, ref=rank), lambda: None)
        self._wait_all(2 * seq - 1, "rejoin", deadline)
        # The ranks making this call agree on it before any waits for the replacement: one
        # that made another collective fails with them now, not after this one's deadline
        # (which its next call, waiting for this one's slot, would have turned into an abort).
        self._agree(seq, [s for s in range(self.spec.num_ranks)
                          if s != rank and self._mask[s] != self.MASK_GONE])
        late = 0
        while int(self._arrivals[rank]) < 2 * seq - 1:  # (gone until it arrives: not waited for)
            reason = read_abort(self._header)
            if self._stopped is not None or reason is not None:
                self._arrive(seq, 2)
                raise Aborted(f"group {self.spec.name!r}: "
                              f"{self._stopped or f'aborted: {reason}'}")
            if time.monotonic() > deadline:
                self._arrive(seq, 2)
                raise DeadlineExceeded(f"group {self.spec.name!r}: rank {rank} did not come "
                                       f"back before the deadline (the group goes on without it)")
            late += 1
            time.sleep(20e-6 if late < 5000 else 200e-6)
        host_order.consume()  # (its arrival seen before its header is read)
        self._agree(seq, [s for s in range(self.spec.num_ranks)
                          if self._mask[s] != self.MASK_GONE])
        self._arrive(seq, 2)

    def _rejoin_number(self, deadline: float) -> int:
        """The replacement: the collective number of the Rejoin call the ranks that take part
        are making for it, once every one of them arrived there (a header of that call, its
        rank's arrival word at exactly that call). Not before: a rank still on its way checks
        that the replacement's rank is gone, which it stops being when the replacement comes
        in."""
        spins = 0
        while True:
            seqs = set()
            for s in range(self.spec.num_ranks):
                if s == self.rank or self._mask[s] == self.MASK_GONE:
                    continue
                w = self._call_words(s)
                seq = int(w[H_SEQ])
                if not (int(w[H_KIND]) == REJOIN and int(w[H_REF]) == self.rank
                        and int(w[H_STATUS]) == ARRIVED
                        and int(self._arrivals[s]) == 2 * seq - 1):
                    break
                seqs.add(seq)
            else:
                if len(seqs) == 1:
                    return seqs.pop()
            reason = read_abort(self._header)
            if reason is not None:
                raise Aborted(f"group {self.spec.name!r} aborted: {reason}")
            if self._stopped is not None:  # (its session closed: it must not come back)
                raise Aborted(f"group {self.spec.name!r}: {self._stopped}")
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"group {self.spec.name!r}: not every rank called "
                                       f"Rejoin for rank {self.rank} before the deadline")
            spins += 1
            time.sleep(20e-6 if spins < 5000 else 200e-6)

    def _call_words(self, rank: int) -> np.ndarray:
        off = HEADER_BYTES + rank * self._slot.size + self._slot.meta + CALL
        return np.ndarray((CALL_WORDS,), dtype=np.int64, buffer=self._mm, offset=off)

    def _take_part(self, seq: int, call: CallHeader, write_inputs) -> None:
        """Step 2 of the protocol: this rank's inputs into its slot, its call header, its
        arrival. If its own part fails here, after it claimed collective `seq` (the peers may
        already wait for it), it publishes a "rejected" header and releases them: every peer
        fails at once with FailedPrecondition naming this rank and the reason, the collective's
        number is consumed on every rank, and this rank raises its own error."""
        words = self._call_words(self.rank)
        if self.spec.shrink:  # the mask as this rank sees it, before it arrives
            self._mask_seen(self.rank)[:] = self._mask
        try:
            write_inputs()
        except Exception as e:
            raw = f"{type(e).__name__}: {e}".encode()[:REASON_MAX]
            off = HEADER_BYTES + self.rank * self._slot.size + self._slot.meta + REASON
            np.frombuffer(self._mm, np.uint8, len(raw), off)[:] = np.frombuffer(raw, np.uint8)
            words[H_REASON_LEN] = len(raw)
            call.write(words, seq, REJECTED)
            self._sequence = seq
            self._arrive(seq, 2)  # nothing of this slot will be read
            raise
        call.write(words, seq, ARRIVED)
        self._sequence = seq
        self._arrive(seq, 1)

    def _agree(self, seq: int, ranks: list[int] | None = None) -> None:
        """After the arrival barrier: compare the call headers of every rank (of `ranks`, those
        that arrived, in a shrink group). On any disagreement every rank (each reaching the
        same verdict from the same headers) frees its slot and fails with FailedPrecondition;
        the group stays usable."""
        ranks = list(range(self.spec.num_ranks)) if ranks is None else ranks
        words = [self._call_words(s).copy() for s in ranks]
        statuses = [int(w[H_STATUS]) for w in words]
        reasons = []
        for i, (s, w) in enumerate(zip(ranks, words, strict=True)):
            n = min(max(int(w[H_REASON_LEN]), 0), REASON_MAX) if statuses[i] == REJECTED else 0
            off = HEADER_BYTES + s * self._slot.size + self._slot.meta + REASON
            reasons.append(bytes(self._mm[off:off + n]).decode(errors="replace"))
        calls = [CallHeader.read(w) for w in words]
        problem = call_disagreement([int(w[H_SEQ]) for w in words], calls, statuses, reasons,
                                    ranks)
        if problem is not None:
            self._arrive(seq, 2)
            raise FailedPrecondition(f"group {self.spec.name!r}, collective #{seq}: {problem}")
        over = capacity_overflow(calls, ranks, self.spec, seq)
        if over is not None:  # no rank wrote inputs it could not hold: free the slots, all fail
            self._arrive(seq, 2)
            raise over

    # -- collectives -------------------------------------------------------------------------
    def layout(self, topk_idx: np.ndarray) -> LayoutOutputs:
        per_rank, per_expert, in_rank = layout_of(topk_idx, self.spec)
        t = topk_idx.shape[0]
        out = self._out
        r, e = self.spec.num_ranks, self.spec.num_experts
        res = LayoutOutputs(out.get("num_tokens_per_rank", (r,), np.int32),
                            out.get("num_tokens_per_expert", (e,), np.int32),
                            out.get("is_token_in_rank", (t, r), np.bool_))
        res.num_tokens_per_rank[:] = per_rank
        res.num_tokens_per_expert[:] = per_expert
        res.is_token_in_rank[:] = in_rank
        return res

    def dispatch(self, args: DispatchArgs, counter_slot: np.ndarray, sequence: int,
                 deadline: float) -> DispatchOutputs:
        spec, me = self.spec, self.rank
        r, lx, h = spec.num_ranks, spec.num_local_experts, spec.hidden
        cached: _Handle | None = args.cached
        t = args.x.shape[0]
        has_scales = args.x_scales is not None
        xdt = args.x.dtype  # the group's dtype, or FP8 (carried as bytes)
        # Scales are 4-byte words, float32 or int32 (packed UE8M0): the slot and the output
        # hold them in the call's dtype, every rank's the same (the call header says which).
        sdt = np.dtype(args.x_scales.dtype) if has_scales else np.dtype(np.float32)
        if sdt not in (np.dtype(np.float32), np.dtype(np.int32)):
            raise InvalidArgument(f"x_scales: dtype {sdt} is neither float32 nor int32")
        int32_scales = has_scales and sdt == np.int32
        k = spec.num_topk
        no_topk = cached is None and args.topk_idx is None
        flags = ((F_FP8 if has_scales else 0) | (F_NO_TOPK if no_topk else 0)
                 | (F_INT32_SCALES if int32_scales else 0)
                 | (args.x_scales.shape[1] << SCALE_COLS_SHIFT if has_scales else 0))
        # More tokens than the slot holds: this rank writes nothing and every rank fails the
        # collective together (_agree), so that all can grow the group alike.
        overflow = cached is None and t > spec.max_tokens_per_rank
        if cached is None:
            call = CallHeader(DISPATCH, flags=flags, worst=args.num_worst_tokens,
                              align=args.expert_alignment, tokens=t)
        else:  # the routing of the handle's dispatch, which must be the same one everywhere
            call = CallHeader(CACHED_DISPATCH, ref=cached.sequence, flags=flags,
                              worst=args.num_worst_tokens)
        seq = self._begin(deadline, "dispatch")

        def write_inputs() -> None:  # into this rank's slot (the "send buffer")
            if no_topk and self.hierarchy is not None:  # (rejected: the peers fail at once)
                raise self.hierarchy.no_topk_error(spec.name)
            if overflow:
                return
            meta = self._meta(me)
            meta[0], meta[1] = t, int(has_scales)
            self._slot_array(me, "x", (t, h), xdt)[:] = args.x
            if has_scales:
                sc = args.x_scales
                self._slot_array(me, "x_scales", sc.shape, sdt)[:] = sc
            if no_topk:
                self._slot_array(me, "in_rank", (t, r), np.bool_)[:] = args.is_token_in_rank
                self._slot_array(me, "per_expert", (spec.num_experts,), np.int32)[:] = \
                    args.num_tokens_per_expert
            elif cached is None:
                self._slot_array(me, "topk_idx", (t, k), np.int64)[:] = args.topk_idx
                self._slot_array(me, "topk_weights", (t, k), np.float32)[:] = args.topk_weights

        self._take_part(seq, call, write_inputs)
        self._wait_all(2 * seq - 1, "dispatch", deadline)
        self._agree(seq)

        # Notify: who sends what to whom, from every source's routing.
        hier = self.hierarchy
        if cached is None:
            src_rows: list[np.ndarray] = []
            node_rows: list[np.ndarray] = []  # hierarchical: tokens with an expert on my node
            rank_prefix = np.zeros((r, r), dtype=np.int64)
            per_expert = np.zeros(lx, dtype=np.int64)
            for s in range(r):
                ts = int(self._meta(s)[0])
                if no_topk:  # routed by is_token_in_rank; counts as the sources declare
                    sent = self._slot_array(s, "in_rank", (ts, r), np.bool_)
                    rank_prefix[s] = np.count_nonzero(sent, axis=0)
                    src_rows.append(np.nonzero(sent[:, me])[0])
                    per_expert += self._slot_array(s, "per_expert", (spec.num_experts,),
                                                   np.int32)[me * lx:(me + 1) * lx]
                    continue
                idx = self._slot_array(s, "topk_idx", (ts, k), np.int64)
                valid = idx >= 0
                dest = np.where(valid, idx // lx, -1)
                for d in range(r):
                    rank_prefix[s, d] = np.count_nonzero((dest == d).any(axis=1))
                mine = dest == me
                src_rows.append(np.nonzero(mine.any(axis=1))[0])
                if hier is not None:
                    on_node = (dest >= 0) & (dest // hier.per_node == me // hier.per_node)
                    node_rows.append(np.nonzero(on_node.any(axis=1))[0])
                per_expert += np.bincount(idx[mine] - me * lx, minlength=lx)[:lx]
            num_recv = int(rank_prefix[:, me].sum())
            align = max(args.expert_alignment, 1)
            aligned = [int(-(-c // align) * align) for c in per_expert]
            order = self._order  # rows by source in this order (flat: rank order)
            recv_src_rank = np.concatenate(
                [np.full(len(src_rows[s]), s, np.int32) for s in order]
            ) if r else np.zeros(0, np.int32)
            recv_src_idx = np.concatenate([src_rows[s] for s in order]).astype(np.int32)
            shown_src_idx = (recv_src_idx if hier is None else
                             cpu_hierarchical.forwarder_rows(hier, me, node_rows, src_rows))
            # This rank's routing as its slot holds it, the copy its peers read (the
            # client's memory could have changed since: the handle must match the counts).
            if no_topk:
                in_rank = self._slot_array(me, "in_rank", (t, r), np.bool_)
            else:
                _, _, in_rank = layout_of(self._slot_array(me, "topk_idx", (t, k), np.int64),
                                          spec)
        else:
            rank_prefix = cached.rank_prefix
            num_recv = cached.num_recv_tokens
            aligned = []
            recv_src_rank, recv_src_idx = cached.recv_src_rank, cached.recv_src_idx
            shown_src_idx = cached.shown_src_idx
            in_rank = cached.is_token_in_rank

        rows_out = num_recv
        if args.num_worst_tokens:
            if num_recv > args.num_worst_tokens:
                self._arrive(seq, 2)  # (its counts unpublished: the engine marks them failed)
                raise InvalidArgument(f"received {num_recv} tokens, more than num_worst_tokens="
                                      f"{args.num_worst_tokens}")
            rows_out = args.num_worst_tokens
        counter_page.publish(counter_slot, sequence, num_recv, aligned)

        # Data: pull the rows, block by block in source order (hierarchical: self._order).
        out = self._out
        k = spec.num_topk
        recv_x = out.get("recv_x", (rows_out, h), xdt)
        recv_scales = out.get("recv_x_scales", (rows_out, args.x_scales.shape[1]), sdt) \
            if has_scales else None
        with_topk = cached is None and not no_topk
        recv_idx = out.get("recv_topk_idx", (rows_out, k), np.int64) if with_topk else None
        recv_w = out.get("recv_topk_weights", (rows_out, k), np.float32) \
            if with_topk else None
        bytes_received = 0
        pos = 0
        for s in self._order:
            sel = recv_src_idx[recv_src_rank == s]
            n = len(sel)
            if n == 0:
                continue
            ts = int(self._meta(s)[0])
            xs = self._slot_array(s, "x", (ts, h), xdt)
            np.take(xs, sel, axis=0, out=recv_x[pos:pos + n])
            bytes_received += n * h * xdt.itemsize
            if recv_scales is not None:
                ss = self._slot_array(s, "x_scales", (ts, recv_scales.shape[1]), sdt)
                recv_scales[pos:pos + n] = ss[sel]
            if recv_idx is not None:
                idx = self._slot_array(s, "topk_idx", (ts, k), np.int64)[sel]
                w = self._slot_array(s, "topk_weights", (ts, k), np.float32)[sel]
                local = (idx >= 0) & (idx // lx == me)
                recv_idx[pos:pos + n] = np.where(local, idx - me * lx, -1)
                recv_w[pos:pos + n] = np.where(local, w, np.float32(0))
            pos += n
        self._arrive(seq, 2)

        if rows_out > num_recv:  # worst-token padding
            recv_x[num_recv:] = 0
            if recv_scales is not None:
                recv_scales[num_recv:] = 0
            if recv_idx is not None:
                recv_idx[num_recv:] = -1
                recv_w[num_recv:] = 0
        src_idx_out = out.get("recv_src_idx", (rows_out,), np.int32)
        src_idx_out[:num_recv] = shown_src_idx
        src_idx_out[num_recv:] = -1
        prefix_out = out.get("rank_prefix_matrix", (r, r), np.int32)
        prefix_out[:] = np.cumsum(rank_prefix, axis=0)
        handle = _Handle(sequence=seq, is_token_in_rank=in_rank.copy(), num_tokens=t,
                         rank_prefix=rank_prefix, recv_src_rank=recv_src_rank,
                         recv_src_idx=recv_src_idx, num_recv_tokens=num_recv,
                         num_worst_tokens=args.num_worst_tokens, shown_src_idx=shown_src_idx)
        bytes_sent = int(in_rank.sum()) * h * xdt.itemsize
        return DispatchOutputs(
            recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w, recv_src_idx=src_idx_out, rank_prefix_matrix=prefix_out,
            num_recv_tokens=num_recv, num_recv_tokens_per_expert=aligned, handle=handle,
            bytes_sent=bytes_sent, bytes_received=bytes_received)

    def combine(self, args: CombineArgs, deadline: float) -> CombineOutputs:
        spec, me = self.spec, self.rank
        r, h = spec.num_ranks, spec.hidden
        handle: _Handle = args.handle
        n = args.x.shape[0]
        has_w = args.topk_weights is not None
        # Only the rows that were really received travel back; worst-token padding stays home.
        nr = handle.num_recv_tokens
        k = args.topk_weights.shape[1] if has_w else 0
        # Every rank must combine the same dispatch (its rows sit where that dispatch put
        # them) and all or none pass topk_weights.
        call = CallHeader(COMBINE, ref=handle.sequence, flags=F_WEIGHTS if has_w else 0)
        seq = self._begin(deadline, "combine")

        def write_inputs() -> None:
            meta = self._meta(me)
            meta[0], meta[1], meta[2] = n, int(has_w), k
            self._slot_array(me, "y", (nr, h), spec.x_numpy_dtype)[:] = args.x[:nr]
            if has_w:
                self._slot_array(me, "y_weights", (nr, k), np.float32)[:] = \
                    args.topk_weights[:nr]

        self._take_part(seq, call, write_inputs)
        self._wait_all(2 * seq - 1, "combine", deadline)
        self._agree(seq)

        t = handle.num_tokens
        acc = np.zeros((t, h), dtype=np.float32)
        if args.bias_0 is not None:
            acc += args.bias_0.astype(np.float32)
        if args.bias_1 is not None:
            acc += args.bias_1.astype(np.float32)
        acc_w = np.zeros((t, k), dtype=np.float32) if has_w else None
        bytes_received = 0

        def rows_from(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
            """(my tokens on d, their rows of d's expert output, their weights): my block
            on d starts after those of the sources d takes before me."""
            nonlocal bytes_received
            mine = np.nonzero(handle.is_token_in_rank[:, d])[0]
            if len(mine) == 0:
                return None
            start = int(handle.rank_prefix[self._before_me, d].sum())
            nd = int(handle.rank_prefix[:, d].sum())
            y = self._slot_array(d, "y", (nd, h), spec.x_numpy_dtype)
            bytes_received += len(mine) * h * spec.x_numpy_dtype.itemsize
            yw = None
            if acc_w is not None:  # every rank passed them (the headers agree)
                yw = self._slot_array(d, "y_weights", (nd, k), np.float32)
                yw = yw[start:start + len(mine)]
            return mine, y[start:start + len(mine)], yw

        if self.hierarchy is not None:  # a rounded partial sum per node, nodes ascending
            cpu_hierarchical.combine_into(self.hierarchy, acc, acc_w, spec.x_numpy_dtype,
                                          rows_from)
        else:  # one fp32 sum over the destinations in rank order
            cpu_hierarchical.add_rows(acc, acc_w, rows_from, range(r))
        self._arrive(seq, 2)
        out_x = self._out.get("combined_x", (t, h), spec.x_numpy_dtype)
        out_x[:] = acc.astype(spec.x_numpy_dtype)
        out_w = None
        if acc_w is not None:
            out_w = self._out.get("combined_topk_weights", (t, k), np.float32)
            out_w[:] = acc_w
        return CombineOutputs(out_x, out_w, bytes_sent=nr * h * spec.x_numpy_dtype.itemsize,
                              bytes_received=bytes_received)

    # -- low-latency mode -------------------------------------------------------------------
    def low_latency_dispatch(self, args: LowLatencyDispatchArgs,
                             deadline: float) -> LowLatencyDispatchOutputs:
        spec, me = self.spec, self.rank
        r, lx, h, k, ne = (spec.num_ranks, spec.num_local_experts, spec.hidden, spec.num_topk,
                           spec.num_experts)
        t, m, fp8 = args.x.shape[0], args.num_max_dispatch_tokens_per_rank, args.use_fp8
        blocks = h // dtypes.FP8_BLOCK
        # Quantise on the source, once per token (local work, before taking part).
        if fp8:
            payload, scales = quantize_fp8(np.asarray(args.x), args.round_scale)
        else:
            payload, scales = args.x, None
        pdt = payload.dtype
        call = CallHeader(LL_DISPATCH, flags=F_FP8 if fp8 else 0, num_max=m)
        self._check_not_gone()
        seq = self._begin(deadline, "low-latency dispatch")

        def write_inputs() -> None:
            meta = self._meta(me)
            meta[0], meta[1], meta[2] = t, int(fp8), m
            self._slot_array(me, "x", (t, h), pdt)[:] = payload
            if scales is not None:
                self._slot_array(me, "x_scales", (t, blocks), np.float32)[:] = scales
            self._slot_array(me, "topk_idx", (t, k), np.int64)[:] = args.topk_idx

        self._take_part(seq, call, write_inputs)
        self._wait_all(2 * seq - 1, "low-latency dispatch", deadline)
        ranks, out_ranks = self._left_out(seq)  # shrink groups: masked ranks take no part
        self._agree(seq, ranks)  # num_max_dispatch_tokens_per_rank and use_fp8 too
        self._leave_if_gone(seq)
        reads = ~out_ranks & ~out_ranks[me]  # the sources this rank reads
        ts = [int(self._meta(s)[0]) if reads[s] else 0 for s in range(r)]
        idxs = [self._slot_array(s, "topk_idx", (ts[s], k), np.int64) for s in range(r)]
        # counts[s, g]: tokens of source s routed to global expert g (distinct per token)
        counts = np.zeros((r, ne), dtype=np.int64)
        for s, idx in enumerate(idxs):
            counts[s] = np.bincount(idx[idx >= 0], minlength=ne)[:ne]

        # Receive: per local expert, rows ordered by source rank, then token.
        rows_per_expert = r * m
        out = self._out
        recv_x = out.get("ll_recv_x", (lx, rows_per_expert, h), pdt)
        recv_scales = (out.get("ll_recv_x_scales", (lx, rows_per_expert, blocks), np.float32)
                       if fp8 else None)
        src_rank = out.get("ll_recv_src_rank", (lx, rows_per_expert), np.int32)
        src_idx = out.get("ll_recv_src_idx", (lx, rows_per_expert), np.int32)
        lo = me * lx
        fill = np.zeros(lx, dtype=np.int64)
        row_bytes = h * pdt.itemsize + (blocks * 4 if fp8 else 0)
        bytes_received = 0
        for s, idx in enumerate(idxs):
            tt, kk = np.nonzero((idx >= lo) & (idx < lo + lx))  # token-major order
            if len(tt) == 0:
                continue
            e = idx[tt, kk] - lo
            order = np.argsort(e, kind="stable")  # by expert; tokens stay ascending
            tt, e = tt[order], e[order]
            per = np.bincount(e, minlength=lx)
            first = np.cumsum(per) - per
            rows = fill[e] + (np.arange(len(e)) - first[e])
            recv_x[e, rows] = self._slot_array(s, "x", (ts[s], h), pdt)[tt]
            if recv_scales is not None:
                recv_scales[e, rows] = self._slot_array(s, "x_scales", (ts[s], blocks),
                                                        np.float32)[tt]
            src_rank[e, rows] = s
            src_idx[e, rows] = tt
            fill += per
            bytes_received += len(tt) * row_bytes
        self._arrive(seq, 2)

        for e in range(lx):  # rows beyond the count: zero payload, -1 source
            c = int(fill[e])
            recv_x[e, c:] = 0
            if recv_scales is not None:
                recv_scales[e, c:] = 0
            src_rank[e, c:] = -1
            src_idx[e, c:] = -1
        recv_count = out.get("ll_recv_count", (lx,), np.int32)
        recv_count[:] = fill

        # As a source: where each of my (token, k) pairs sits in its destination's compacted
        # combine input (destination's experts in order, each expert's rows as received).
        mine = np.array(args.topk_idx, dtype=np.int64, copy=True)
        total = counts.sum(axis=0).reshape(r, lx)
        expert_off = (np.cumsum(total, axis=1) - total).reshape(ne)
        before = (np.cumsum(counts, axis=0) - counts)[me]  # rows from sources < me
        # entries for experts of a rank left out (or all, if this rank is) go nowhere
        valid = (mine >= 0) & ~out_ranks[np.maximum(mine, 0) // lx] & ~out_ranks[me]
        tt, kk = np.nonzero(valid)
        g = mine[tt, kk]
        order = np.argsort(g, kind="stable")
        tt, kk, g = tt[order], kk[order], g[order]
        per = np.bincount(g, minlength=ne)[:ne]
        first = np.cumsum(per) - per
        row = np.full((t, k), -1, dtype=np.int64)
        row[tt, kk] = expert_off[g] + before[g] + (np.arange(len(g)) - first[g])
        dest = np.where(valid, mine // lx, -1)
        handle = _LowLatencyHandle(sequence=seq, num_tokens=t, num_max=m, topk_idx=mine,
                                   dest=dest, row=row, recv_count=fill.copy(),
                                   buffer=args.buffer)
        self._ll_filled[args.buffer] = seq
        return LowLatencyDispatchOutputs(
            recv_x=recv_x, recv_x_scales=recv_scales, recv_count=recv_count,
            recv_src_rank=src_rank, recv_src_idx=src_idx, num_recv_rows=int(fill.sum()),
            handle=handle, bytes_sent=len(g) * row_bytes, bytes_received=bytes_received)

    def low_latency_combine(self, args: LowLatencyCombineArgs,
                            deadline: float) -> LowLatencyCombineOutputs:
        spec, me = self.spec, self.rank
        r, lx, h = spec.num_ranks, spec.num_local_experts, spec.hidden
        handle: _LowLatencyHandle = args.handle
        if self._ll_filled[handle.buffer] != handle.sequence:
            raise FailedPrecondition(ll_overwritten(handle.sequence, handle.buffer,
                                                    self._ll_filled[handle.buffer]))
        dt = spec.x_numpy_dtype
        comb = np.asarray(args.topk_idx)
        t, k = comb.shape
        # Each entry names one of the token's dispatched experts, in any k position (checked
        # before taking part: a bad entry changes nothing).
        which = check_combine_routing(handle.topk_idx, comb)
        rows = np.take_along_axis(handle.row, which, axis=1)
        dests = np.take_along_axis(handle.dest, which, axis=1)

        counts = handle.recv_count
        pos = int(counts.sum())
        # Every rank must combine the same low-latency dispatch.
        call = CallHeader(LL_COMBINE, ref=handle.sequence)
        self._check_not_gone()
        seq = self._begin(deadline, "low-latency combine")

        def write_inputs() -> None:
            y = self._slot_array(me, "ll_y", (pos, h), dt)
            row = 0
            for e in range(lx):  # only the valid rows travel, compacted
                c = int(counts[e])
                y[row:row + c] = args.x[e, :c]
                row += c

        self._take_part(seq, call, write_inputs)
        self._wait_all(2 * seq - 1, "low-latency combine", deadline)
        ranks, out_ranks = self._left_out(seq)  # shrink groups: masked ranks take no part
        self._agree(seq, ranks)
        self._leave_if_gone(seq)

        acc = np.zeros((t, h), dtype=np.float32)
        peers = [self._slot_array(d, "ll_y", (ll_max_rows(spec), h), dt) for d in range(r)]
        bytes_received = 0
        weights = np.asarray(args.topk_weights, dtype=np.float32)
        for kk in range(k):  # k order, skipping -1, fp32 FMA (as the reference)
            tokens = np.nonzero(comb[:, kk] >= 0)[0]
            d_of, r_of = dests[tokens, kk], rows[tokens, kk]
            # an entry whose expert's rank was left out (at dispatch: dest -1; or now) adds
            # nothing; a rank left out itself reads nothing
            keep = (d_of >= 0) & ~out_ranks[np.maximum(d_of, 0)] & ~out_ranks[me]
            tokens, d_of, r_of = tokens[keep], d_of[keep], r_of[keep]
            if len(tokens) == 0:
                continue
            yk = np.empty((len(tokens), h), dtype=dt)
            for d in np.unique(d_of):
                sel = d_of == d
                yk[sel] = peers[int(d)][r_of[sel]]
            bytes_received += len(tokens) * h * dt.itemsize
            acc[tokens] = fma_f32(weights[tokens, kk][:, None], yk.astype(np.float32),
                                  acc[tokens])
        self._arrive(seq, 2)
        out = args.out if args.out is not None else self._out.get("ll_combined_x", (t, h), dt)
        out[...] = acc.astype(dt)
        return LowLatencyCombineOutputs(out, bytes_sent=pos * h * dt.itemsize,
                                        bytes_received=bytes_received)

    def abort(self, reason: str) -> None:
        write_abort(self._header, reason)

    @property
    def held_bytes(self) -> int:
        # Its slot of the group's communication memfd, and its output region.
        return self._slot.size + self.output_region.size

    def handle_bytes(self, low_latency: bool, num_tokens: int, num_topk: int) -> int:
        spec, t = self.spec, num_tokens
        if low_latency:  # _LowLatencyHandle: topk_idx, dest and row [T, K] int64, counts [L]
            return 24 * t * num_topk + 8 * spec.num_local_experts
        # _Handle: is_token_in_rank [T, R] bool, rank_prefix [R, R] int64, and three [N]
        # source rows (int32; N <= R * max_tokens_per_rank, or the collective failed)
        r = spec.num_ranks
        return t * r + 8 * r * r + 12 * spec.max_recv_tokens

    def quiesce(self, deadline: float) -> None:
        """The deferred slot-freeing barrier, taken now: peers pull from this rank's slot after
        it returned, and the abort word of its leave would fail them mid-read."""
        if not self._sequence or self._header is None:
            return
        target = 2 * self._sequence  # every rank raised "done reading" of the last collective
        while (not self._reached(target) and read_abort(self._header) is None
               and time.monotonic() < deadline):
            time.sleep(50e-6)

    def abort_reason(self) -> str | None:
        return read_abort(self._header)

    def close(self) -> None:
        self._header = self._arrivals = None  # type: ignore[assignment]
        fdc.close_mapping(self._mm)
        self.output_region.close()


class CpuBackend(Backend):
    name = "cpu"
    proto_kind = epd_pb2.CPU
    peer_class = "shm"
    supports_dispatch_without_topk = True
    agrees_on_capacity = True
    collectives_on_host = True
    inputs_on_host = True

    def __init__(self, engine_index: int = 0, allowed_dirs: tuple[str, ...] = ()):
        self.planner = CpuPlanner()
        self.engine_index = engine_index
        # No client-supplied paths at all (memory comes by descriptor): kept for callers.
        self.allowed_dirs = allowed_dirs

    def device_info(self) -> dict[str, Any]:
        return {"name": f"cpu-engine-{self.engine_index}", "uuid": f"CPU-{self.engine_index}",
                "ordinal": self.engine_index}

    def open_region(self, region_id: str, *, ipc_handle: bytes = b"",
                    size: int, device_ordinal: int = 0) -> Region:
        raise InvalidArgument("the cpu backend takes host memory as a sealed memfd sent over "
                              "the descriptor channel (FdRequest.register_memfd), not CUDA IPC "
                              "handles")

    def map_memfd(self, region_id: str, fd: int, size: int) -> Region:
        return ShmRegion(region_id, size, fd=fd)

    def open_counter_page(self) -> CounterPage:
        return ShmCounterPage()

    def attach(self, spec: GroupSpec, membership: Membership) -> RankComm:
        return CpuRankComm(spec, membership)

    def output_bytes(self, spec: GroupSpec) -> int:
        return OutputArena.bytes_for(spec)  # (a memfd of this process per membership)


def as_array(a: Array) -> np.ndarray:
    return np.asarray(a)
