"""Layout of the per-session counter page, shared by the engine (writer) and the client (reader).

The page is a sealed memfd mapped by both processes; the CUDA engine also registers it as
mapped pinned memory so the notify kernel writes it directly. It holds one slot per group
membership of the session. A writer stores the payload, fences, then stores the sequence word;
a reader spins on the sequence word reaching the value it expects, then reads the payload.

Slot layout (little-endian, 8-byte words):
    word 0      sequence (u64): the dispatch sequence number the payload belongs to
    word 1      num_recv_tokens (i64); of a dispatch notify failed on every rank, what failed
                it: the largest token count, receive count, or the bad expert id or count
    word 2      num_local_experts (i64)
    word 3      status (i64): 0 ok, otherwise an error code (the RPC carries the message)
    word 4      on error: the rank that did not arrive, or whose input failed the dispatch (-1
                when unknown), written by the GPU
    word 5..6   int32 words of stream-ordered calls (abi.SLOT32_*): done, failed sequence,
                its code and rank
    word 7      the failed call's offending value
    word 8..    num_recv_tokens_per_expert[i] (i64), aligned as requested
    last 128 B  the ready ring: int32 [abi.READY_RING] (stream-ordered calls)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import abi, host_order, spin
from .abi import NUM_SLOTS, READY_RING, SLOT_BYTES
from .abi import SLOT_HEADER as HEADER_WORDS
from .abi import SLOT_NUM_EXPERTS as NUM_EXPERTS
from .abi import SLOT_NUM_RECV as NUM_RECV
from .abi import SLOT_SEQ as SEQ
from .abi import SLOT_STATUS as STATUS
from .errors import (
    Aborted,
    DeadlineExceeded,
    EpdError,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    TokenCapacityExceeded,
    Unavailable,
)

MAX_LOCAL_EXPERTS = SLOT_BYTES // 8 - HEADER_WORDS - READY_RING // 2  # 488
PAGE_BYTES = SLOT_BYTES * NUM_SLOTS


INT32_MAX = 2**31 - 1  # (a notify's counts are int32)


def slot_words(buf: memoryview | np.ndarray, slot: int) -> np.ndarray:
    """An int64 view of one slot of a mapped page (host side)."""
    arr = np.frombuffer(buf, dtype=np.int64, count=SLOT_BYTES // 8, offset=slot * SLOT_BYTES)
    return arr


def record_offset(slot: int, record: int) -> int:
    """Byte offset in the page of an armed op's record (abi.OP_RECORD_BYTES; its words are
    abi.STREAM_*)."""
    return slot * SLOT_BYTES + record * abi.OP_RECORD_BYTES


def record_words(buf: memoryview | np.ndarray, slot: int, record: int) -> np.ndarray:
    """An int32 view of an armed op's record in a mapped page (host side)."""
    return np.frombuffer(buf, dtype=np.int32, count=abi.OP_RECORD_BYTES // 4,
                         offset=record_offset(slot, record))


def publish(words: np.ndarray, sequence: int, num_recv_tokens: int,
            per_expert: list[int] | np.ndarray, status: int = 0) -> None:
    """Host-side writer (the CPU backend, the engines' cached and refused calls): the counts,
    then the sequence, so that a reader that sees the new sequence sees the counts too."""
    n = len(per_expert)
    words[HEADER_WORDS:HEADER_WORDS + n] = per_expert
    words[NUM_RECV] = num_recv_tokens
    words[NUM_EXPERTS] = n
    words[STATUS] = status
    host_order.publish()
    words[SEQ] = sequence


def counts_in_range(num_recv_tokens: int, per_expert: list[int], max_rows: int,
                    num_experts: int | None = None) -> bool:
    """Whether counts read back could be a notify's for a receive buffer of `max_rows` rows
    (and `num_experts` local experts, or none): the page is its client's to write too, so an engine
    never sizes, counts or labels anything by it unchecked."""
    return (0 <= num_recv_tokens <= max_rows
            and (num_experts is None or len(per_expert) in (0, num_experts))  # (0: cached,
            # or refused for capacity)
            and min(per_expert, default=0) >= 0  # (per call: `min` / `max` walk a few
            and max(per_expert, default=0) <= INT32_MAX)  # hundred counts in C)


def published(words: np.ndarray, sequence: int) -> bool:
    """Whether the slot carries `sequence` (or a later one) now: `wait` returns at once."""
    return int(words[SEQ]) >= sequence


def wait(words: np.ndarray, sequence: int, timeout: float,
         stop: Callable[[], bool] | None = None) -> tuple[int, list[int]] | None:
    """Spin (then back off) until the slot carries `sequence`; None on timeout, or once
    `stop()` is true. The spin lets go of the GIL at every look (spin.py: the engine's other
    sessions need it)."""
    def ready() -> bool:
        return published(words, sequence) or (stop is not None and stop())
    if not spin.wait_until(ready, timeout) or int(words[SEQ]) < sequence:
        return None
    host_order.consume()  # (the sequence seen before the counts are read)
    n = int(words[NUM_EXPERTS])
    return int(words[NUM_RECV]), words[HEADER_WORDS:HEADER_WORDS + n].tolist()


# -- stream-ordered normal-mode calls (abi.SLOT32_*) -------------------------------------------
RELEASED = 0xFE  # failure code the client writes itself when its session or engine is gone


@dataclass(frozen=True)
class StreamFailure:
    """The latest failed stream-ordered call of a membership, as its last kernel reported it."""

    seq: int  # the call's stream sequence
    code: int  # abi.ERR_* (or RELEASED)
    phase: int  # abi.PHASE_* of a deadline
    rank: int  # bad input: the rank that passed it; deadline: the missing rank; abort: who left
    value: int  # bad input: the expert id; deadline: the collective's sequence

    @property
    def fatal(self) -> bool:
        """The group cannot go on (a bad input fails that call, not the group)."""
        return self.code not in (abi.ERR_BAD_INPUT, abi.ERR_BAD_COUNT, abi.ERR_REFUSED)

    @property
    def check_only(self) -> bool:
        """Raised by Group.check() alone: a combine a peer's engine refused (that peer raised
        at the call; this rank raising at a later call, before sending it, would leave it one
        collective behind)."""
        return self.code == abi.ERR_REFUSED

    def error(self, group: str, num_experts: int | None = None) -> EpdError:
        where = f"group {group!r}, call #{self.seq}"
        if self.code in (abi.ERR_BAD_INPUT, abi.ERR_BAD_COUNT):
            bad = _bad_value(self.code, self.rank, self.value, num_experts)
            what = "the entry was skipped" if self.code == abi.ERR_BAD_INPUT else "taken as 0"
            return InvalidArgument(f"{where}: {bad}; {what} and the group goes on")
        if self.code == abi.ERR_REFUSED:
            return FailedPrecondition(
                f"{where}: rank {self.rank}'s engine refused its part of the combine (that "
                f"rank's caller got the reason); this rank's combined output of that call is "
                f"zeros, and the group goes on")
        if self.code == abi.ERR_DEADLINE:
            phase = abi.PHASE_NAMES.get(self.phase, "a collective")
            return DeadlineExceeded(f"{where}: rank {self.rank} did not arrive at {phase} "
                                    f"(collective #{self.value}) before the deadline; the "
                                    f"group is aborted")
        if self.code == abi.ERR_WORST_OVERFLOW:
            return ResourceExhausted(f"{where}: received more tokens than num_worst_tokens; the "
                                     f"group is aborted")
        if self.code == RELEASED:
            return Unavailable(f"{where}: the session or engine went away")
        who = f" (rank {self.rank} left or failed)" if self.rank >= 0 else ""
        return Aborted(f"{where}: the group was aborted{who}")


def capacity_error(group: str, max_tokens: int, needed: int, rank: int,
                   call: str, earlier: bool = False) -> TokenCapacityExceeded:
    """The error of a dispatch (`call`: "dispatch #n") that a rank's token count failed on
    every rank: the largest count (`needed`; a notify kernel leaves it in the slot's NUM_RECV)
    and the rank that passed it (ERR_RANK). `earlier`: TokenCapacityExceeded.earlier."""
    err = TokenCapacityExceeded(
        f"group {group!r}, {call}: rank {rank} dispatched {needed} tokens, more "
        f"than its max_tokens_per_rank={max_tokens}; no rank's dispatch ran (join a group with "
        f"a larger capacity and call again)", tokens_needed=needed)
    err.earlier = earlier
    return err


def _bad_value(code: int, rank: int, value: int, num_experts: int | None) -> str:
    if code == abi.ERR_REFUSED:
        return (f"rank {rank}'s engine refused its part of the call (that rank's caller got "
                f"the reason)")
    if code == abi.ERR_BAD_COUNT:
        return (f"rank {rank} passed {value} in num_tokens_per_expert (a dispatch without "
                f"top-k); counts must be >= 0")
    valid = f"[0, {num_experts})" if num_experts else "[0, num_experts)"
    return f"rank {rank} passed expert id {value} in topk_idx; valid ids are -1 (none) and {valid}"


def bad_input_error(group: str, call: str, words: np.ndarray,
                    num_experts: int | None = None) -> EpdError:
    """The error of a dispatch (`call`) that notify failed on every rank because a rank passed
    a bad expert id or count (ERR_BAD_INPUT / ERR_BAD_COUNT in the slot `words`: that rank in
    ERR_RANK, its first bad value in NUM_RECV): INVALID_ARGUMENT; or because a rank's engine
    refused its part (ERR_REFUSED): FAILED_PRECONDITION, this caller's input being fine."""
    status = int(words[STATUS])
    bad = _bad_value(status, int(words[abi.SLOT_ERR_RANK]), int(words[NUM_RECV]), num_experts)
    kind = FailedPrecondition if status == abi.ERR_REFUSED else InvalidArgument
    return kind(f"group {group!r}, {call}: {bad}; no rank's dispatch ran and the group goes on")


def worst_overflow_error(group: str, call: str, rank: int, received: int,
                         num_worst: int) -> InvalidArgument:
    """The error of a dispatch (`call`) that notify failed on every rank because `rank` would
    receive `received` rows, more than the call's num_worst_tokens (ERR_WORST_OVERFLOW; the
    slot's ERR_RANK and NUM_RECV)."""
    return InvalidArgument(
        f"group {group!r}, {call}: rank {rank} receives {received} tokens, more than "
        f"num_worst_tokens={num_worst}; no rank's dispatch ran and the group goes on (every "
        f"rank must pass a num_worst_tokens that each rank's receive count fits, e.g. "
        f"num_ranks * max tokens per rank)")


# Statuses notify writes alike on every rank: the call fails, nothing moved, the group goes on.
ALIKE = (abi.ERR_CAPACITY, abi.ERR_WORST_OVERFLOW, abi.ERR_BAD_INPUT, abi.ERR_BAD_COUNT,
         abi.ERR_REFUSED)


def alike_failure(words: np.ndarray, group: str, call: str, max_tokens: int, num_worst: int = 0,
                  num_experts: int | None = None, earlier: bool = False) -> EpdError | None:
    """The error of a dispatch (`call`) whose notify failed it on every rank alike, from the
    slot `words` (status, ERR_RANK, NUM_RECV: what failed it); None for any other status (a
    deadline or abort, which the rank's own failure words name). The client's stream-ordered
    dispatch and the engine's synchronous one raise the same."""
    status, rank, value = int(words[STATUS]), int(words[abi.SLOT_ERR_RANK]), int(words[NUM_RECV])
    if status == abi.ERR_CAPACITY:
        return capacity_error(group, max_tokens, value, rank, call, earlier)
    if status == abi.ERR_WORST_OVERFLOW:
        return worst_overflow_error(group, call, rank, value, num_worst)
    if status in ALIKE:
        return bad_input_error(group, call, words, num_experts)
    return None


# a low-latency call's verdicts: a dispatch's (bad ids: every rank), a combine's (its own top-k)
LL_VERDICTS = (abi.ERR_BAD_INPUT, abi.ERR_BAD_DUPLICATE, abi.ERR_NOT_DISPATCHED,
               abi.ERR_DISAGREE)


def ll_header_verdict(header: np.ndarray) -> tuple[int, int, int, int]:
    """(code, source, token, expert id) of a low-latency receive buffer's header (its first
    three uint64 words, `LL_TOPK_HEADER`: left-out set, verdict = code | source << 8 | token <<
    32, id); zeros: the call there had no verdict (its other words are not read then)."""
    v = int(header[1])
    if not v & 0xFF:
        return 0, 0, 0, 0
    return v & 0xFF, (v >> 8) & 0xFF, v >> 32, int(header[:3].view(np.int64)[2])


def ll_verdict_error(what: str, code: int, source: int, token: int, value: int,
                     num_experts: int | None = None, combine: bool = False) -> EpdError:
    """The error of a low-latency dispatch (`what`) that a source's bad ids failed on every
    rank (its verdict, read from the receive buffer's header or the op's done word): rank
    `source`'s token `token` named expert `value` out of range (ERR_BAD_INPUT) or twice
    (ERR_BAD_DUPLICATE). Nothing moved: every rank's outputs of the call are empty and the
    combine of its handle gives zeros; the group goes on. With `combine`: a combine's own
    top-k (this rank's alone) named an expert out of range, twice, or one its dispatch did not
    send that token to (ERR_NOT_DISPATCHED); its output leaves the entry out. ERR_DISAGREE:
    rank `source` passed num_max `token` and use_fp8 `value & 1` where the lowest rank of the
    call, `value >> 8 & 0xFF`, passed `value >> 32` and `value >> 1 & 1` (FAILED_PRECONDITION,
    as the CPU backend's refusal of a collective whose ranks disagree)."""
    if code == abi.ERR_DISAGREE and not combine:
        first = (value >> 8) & 0xFF
        return FailedPrecondition(
            f"{what}: the ranks passed different arguments: rank {source} "
            f"num_max_dispatch_tokens_per_rank={token}, use_fp8={bool(value & 1)}; rank {first} "
            f"{value >> 32}, use_fp8={bool(value >> 1 & 1)} (they must be the same on every "
            f"rank); no rank's dispatch moved a row (its outputs are empty and its combine "
            f"gives zeros) and the group goes on")
    if combine:
        valid = f"[0, {num_experts})" if num_experts else "[0, num_experts)"
        why = {abi.ERR_NOT_DISPATCHED: "its dispatch did not send that token to it",
               abi.ERR_BAD_DUPLICATE: "named twice (low-latency mode takes distinct experts "
                                      "per token)"}.get(
            code, f"out of range (valid ids are -1 (none) and {valid})")
        return InvalidArgument(f"{what}: rank {source}'s topk_idx[{token}] names expert "
                               f"{value}, {why}; this rank's combined output leaves that entry "
                               f"out, the other ranks' combines are exact and the group goes on")
    if code == abi.ERR_BAD_DUPLICATE:
        bad = (f"rank {source}'s topk_idx[{token}] names expert {value} twice (low-latency mode "
               f"takes distinct experts per token)")
    else:
        valid = f"[0, {num_experts})" if num_experts else "[0, num_experts)"
        bad = (f"rank {source} passed expert id {value} in topk_idx[{token}]; valid ids are -1 "
               f"(none) and {valid}")
    return InvalidArgument(f"{what}: {bad}; no rank's dispatch moved a row (its outputs are "
                           f"empty and its combine gives zeros) and the group goes on")


def stream_failure(words: np.ndarray) -> StreamFailure | None:
    """The latest failure recorded in a slot (int64 words), or None."""
    w32 = words.view(np.int32)
    while True:
        host_order.consume()  # (a DONE or READY the caller saw before this read)
        seq = int(w32[abi.SLOT32_FAIL_SEQ]) & 0xFFFFFFFF
        if not seq:
            return None
        host_order.consume()  # (the sequence before the failure's words)
        code = int(w32[abi.SLOT32_FAIL_CODE]) & 0xFFFFFFFF
        f = StreamFailure(seq, code & 0xFF, code >> 8, int(w32[abi.SLOT32_FAIL_RANK]),
                          int(words[abi.SLOT_FAIL_VALUE]))
        host_order.consume()  # (those words before the sequence is read again)
        if int(w32[abi.SLOT32_FAIL_SEQ]) & 0xFFFFFFFF == seq:  # not rewritten meanwhile
            return f


def seq_reached(value: int, seq: int) -> bool:
    """Whether a 32-bit sequence word holding `value` has reached `seq` (cyclic, as
    cuStreamWaitValue32's GEQ compares); 0 means never written."""
    return value != 0 and ((value - seq) & 0xFFFFFFFF) < 1 << 31


def stream_ready(words: np.ndarray, seq: int) -> bool:
    """Whether the client's stream wrote READY of stream call `seq` (it reached the call)."""
    ready = int(words.view(np.int32)[abi.SLOT32_READY + seq % READY_RING]) & 0xFFFFFFFF
    return seq_reached(ready, seq)


def stream_done(words: np.ndarray) -> int:
    """The latest stream sequence whose last kernel ran (host view)."""
    return int(words.view(np.int32)[abi.SLOT32_DONE]) & 0xFFFFFFFF


def release_stream(words: np.ndarray, last_seq: int) -> None:
    """Client side, when its session or engine is gone: record the release as a failure and
    let any stream waiting for DONE of a call up to `last_seq` go on."""
    if not last_seq or seq_reached(stream_done(words), last_seq):
        return
    fail_stream(words, last_seq, RELEASED, -1)


def fail_stream(words: np.ndarray, seq: int, code: int, rank: int) -> None:
    """Record call `seq` as failed with `code` (abi.ERR_*, or RELEASED) from the host and let
    a stream waiting for its DONE go on: what the call's last kernel would have written, for a
    call whose kernels never ran (the engine answered, then could not launch them)."""
    w32 = words.view(np.int32)
    w32[abi.SLOT32_FAIL_CODE] = code
    w32[abi.SLOT32_FAIL_RANK] = rank
    words[abi.SLOT_FAIL_VALUE] = 0
    host_order.publish()  # (the failure's words before its sequence, that before DONE)
    w32[abi.SLOT32_FAIL_SEQ] = np.int32(np.uint32(seq))
    host_order.publish()
    w32[abi.SLOT32_DONE] = np.int32(np.uint32(seq))
