"""What an engine holds per session: its counter page, regions, group memberships and
dispatch handles; and the validation of a group spec."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...proto import abi, counter_page, dtypes
from ...proto.errors import InvalidArgument, ResourceExhausted
from ...proto.v1 import epd_pb2
from .. import service_classes
from ..backends.base import (
    CounterPage,
    GroupSpec,
    Membership,
    RankComm,
    Region,
)
from .executor import SessionExecutor

if TYPE_CHECKING:
    from .fast_path import FastPathServer
    from .stream_ops import StreamOp

GROUP_DTYPES = (epd_pb2.BFLOAT16, epd_pb2.FLOAT16, epd_pb2.FLOAT32)
"""A group's x_dtype is its combine dtype; dispatch carries it or FP8 (e4m3 + float32 scales)."""


def engine_files_prefix(index: int) -> str:
    """The prefix engine files had in the shm folder. Engines create no files there any more
    (counter pages, rings and outputs are memfds passed by descriptor); kept for the sweep."""
    return f"epd-e{index}-"


def sweep_engine_files(shm_dir: str, index: int) -> int:
    """Remove files an older engine left in the shm folder (today's engines create none: their
    shared memory is memfds, freed with the last descriptor and mapping); returns how many."""
    n = 0
    prefix = engine_files_prefix(index)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(shm_dir):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, name))
                    n += 1
    return n


def spec_from_proto(p: epd_pb2.GroupSpec) -> GroupSpec:
    """Validate a group spec; InvalidArgument names the first thing wrong."""
    if not p.name or len(p.name) > 128:
        raise InvalidArgument("group name must have 1 to 128 characters")
    checks = (("num_ranks", p.num_ranks, 1, 128), ("num_experts", p.num_experts, 1, 1 << 16),
              ("hidden", p.hidden, 1, 1 << 16), ("max_tokens_per_rank", p.max_tokens_per_rank,
                                                  1, 1 << 20),
              ("num_topk", p.num_topk, 1, 64))
    for name, value, lo, hi in checks:
        if not lo <= value <= hi:
            raise InvalidArgument(f"{name}={value} is out of range [{lo}, {hi}]")
    if p.num_experts % p.num_ranks:
        raise InvalidArgument(f"num_experts={p.num_experts} is not a multiple of "
                              f"num_ranks={p.num_ranks}")
    if p.num_experts // p.num_ranks > counter_page.MAX_LOCAL_EXPERTS:
        raise InvalidArgument(f"{p.num_experts // p.num_ranks} local experts exceed "
                              f"{counter_page.MAX_LOCAL_EXPERTS}")
    if p.num_topk > p.num_experts:
        raise InvalidArgument(f"num_topk={p.num_topk} exceeds num_experts={p.num_experts}")
    if p.x_dtype not in GROUP_DTYPES:
        raise InvalidArgument(f"x_dtype must be one of "
                              f"{sorted(dtypes.name(d) for d in GROUP_DTYPES)} (the dtype of "
                              f"combine; dispatch may also carry FP8 with scales)")
    service_classes.check_value(p.service_class)
    if p.shrink and not p.low_latency_mode:
        raise InvalidArgument("shrink (rank masking) is for low-latency groups: join with "
                              "low_latency_mode=True")
    return GroupSpec(p.name, p.num_ranks, p.num_experts, p.hidden, p.max_tokens_per_rank,
                     p.num_topk, p.x_dtype, p.low_latency_mode, p.service_class, p.shrink)


NORMAL, LOW_LATENCY = "normal", "low-latency"  # HandleInfo.kind


@dataclass
class HandleInfo:
    backend_handle: Any
    num_tokens: int
    num_recv_tokens: int
    rows_out: int
    kind: str = NORMAL  # which combine takes it
    num_max: int = 0  # low-latency: num_max_dispatch_tokens_per_rank of the dispatch
    # Stream-ordered dispatch: the counter sequence whose receive count this handle still
    # awaits (0: known; num_recv_tokens / rows_out are -1 until then), and whether it failed.
    sequence: int = 0
    failed: bool = False
    # Combines of it launched before its count was known (a worst-case dispatch, whose count
    # the client does not wait for): their bytes are counted when the count is.
    unresolved_combines: int = 0
    nbytes: int = 0  # engine memory charged to the session's handle bytes (RankComm.handle_bytes)
    # A captured dispatch's trigger's (engine/captured_calls.py): its arrays are refilled by
    # the op's next trigger, so no cached dispatch may share them
    captured: bool = False


@dataclass
class GroupMember:
    """One membership of a session: this engine's rank of one group."""

    spec: GroupSpec
    membership: Membership
    comm: RankComm
    counter_slot: int
    handles: OrderedDict[int, HandleInfo] = field(default_factory=OrderedDict)
    handle_bytes: int = 0  # the handles' nbytes, summed
    dispatch_sequence: int = 0
    stream_seq: int = 0  # the latest stream-ordered call's sequence (READY/DONE words)
    # The stream-ordered dispatch whose receive count the engine has not read yet: at most one,
    # since every dispatch reads the previous one's before the slot takes its own.
    pending: HandleInfo | None = None
    dispatches: int = 0
    combines: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    queued_calls: int = 0  # calls that ran, and how long they waited for the executor
    queue_wait_seconds: float = 0.0
    # Stream-ordered dispatch responses by their output views (ops.dispatch_response).
    described: dict[tuple, tuple] = field(default_factory=dict)
    # While it holds captured normal-mode calls: its poller ring slot's words, where a dispatch
    # that notify failed is recorded (engine/captured_calls.py)
    failure_words: Any = None

    @property
    def service_class(self) -> str:
        """'latency' or 'throughput' (the metrics' service_class label)."""
        return service_classes.name(self.spec.service_class)

    @property
    def group_id(self) -> str:
        return self.membership.group_id

    @property
    def rank(self) -> int:
        return self.membership.rank


@dataclass
class ChannelTicket:
    """What a descriptor-channel connection's hello left on the engine (Engine.issue_ticket),
    until OpenSession takes it or the connection closes."""
    peer: tuple[int, int, int]  # (pid, uid, gid) of the connection (SO_PEERCRED)
    alive: Callable[[], bool]  # whether that connection is still open


@dataclass
class Session:
    session_id: str
    client_name: str
    pid: int
    counter_page: CounterPage  # a sealed memfd (CounterPage.fd), fetched as "counters"
    # Runs the session's operations, whichever transport brought them, and tears it down.
    executor: SessionExecutor
    regions: dict[str, Region] = field(default_factory=dict)
    members: dict[str, GroupMember] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=lambda: list(range(counter_page.NUM_SLOTS)))
    joining: dict[str, GroupSpec] = field(default_factory=dict)  # JoinGroups under way
    # RegisterRegions under way (region id -> bytes): counted in the budgets while they open,
    # so that calls at once cannot all pass the check
    registering: dict[str, int] = field(default_factory=dict)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    teardown_done: bool = False
    events: dict[bytes, Any] = field(default_factory=dict)  # opened client events (cuda)
    fast_path: FastPathServer | None = None
    stream_ops: dict[int, StreamOp] = field(default_factory=dict)  # armed (stream_ops.py)
    # The session's secret (OpenSession answers it, only to the client that opened it): every
    # session-scoped call carries it. Never logged, never compared but in constant time.
    token: bytes = field(default=b"", repr=False)
    # (pid, uid, gid) of the client, from SO_PEERCRED of the descriptor-channel connection
    # whose ticket opened it (a session never exists without it: --max-sessions-per-uid and a
    # group's admission policy are decided on it; None only for sessions made in tests).
    peer: tuple[int, int, int] | None = None
    # That ticket (FdResponse.ticket): the connection that got it binds to this session only.
    # Never logged, compared only in constant time.
    channel_ticket: bytes = field(default=b"", repr=False)
    # Whether the client shares the engine's MPS server (Engine.session_mps, right after open;
    # None until then): a GPU chain for its armed ops pays only then (--ll-chain auto), and
    # epd_sessions_without_mps counts the sessions it is False for.
    on_engine_mps: bool | None = None
    # Armed ops' records (abi.OP_RECORD_BYTES, many to a slot): the records in use by slot (a
    # slot one op holds whole: {0}), and the free records of those slots, freed longest ago
    # first (a late write of a record's last owner's kernels would have landed long ago).
    record_slots: dict[int, set[int]] = field(default_factory=dict)
    free_records: deque[tuple[int, int]] = field(default_factory=deque)

    def take_slot(self, why: str) -> int:
        """A free counter slot, now the caller's (joins on the event loop and arms on the
        session's worker take from the same list: one pop, never a check then a pop);
        RESOURCE_EXHAUSTED `why` when none is left."""
        try:
            slot = self.free_slots.pop(0)
        except IndexError:
            raise ResourceExhausted(why) from None
        # A slot comes back with its last owner's words (a sequence N, DONE, FAIL_SEQ): the
        # new owner counts from 0, so every ">= n" look would pass at once on them.
        self.counter_page.slot(slot).view(np.uint8)[:] = 0
        return slot

    def free_record(self) -> bool:
        """Whether an armed op's record can be had without taking a slot."""
        return bool(self.free_records)

    def take_record(self, why: str, whole: bool = False) -> tuple[int, int]:
        """A zeroed record for an armed op: (slot, record), from a slot that holds records
        already, else a new one (RESOURCE_EXHAUSTED `why` when none is left). `whole`: a slot
        of its own, record 0 (a client that does not read records). Arms take records under
        the session's operation lock, as their release gives them back."""
        if not whole and self.free_records:
            slot, record = self.free_records.popleft()
            self.record_slots[slot].add(record)
            at = record * abi.OP_RECORD_BYTES
            self.counter_page.slot(slot).view(np.uint8)[at:at + abi.OP_RECORD_BYTES] = 0
            return slot, record
        slot = self.take_slot(why)
        self.record_slots[slot] = {0}
        if not whole:
            self.free_records.extend((slot, r) for r in range(1, abi.OP_RECORDS))
        return slot, 0

    def give_record(self, slot: int, record: int, refused: bool = False) -> None:
        """An op's record back; its slot goes back to the groups once it holds no op.
        `refused`: an arm that failed, which changes nothing (not even which slot or record
        the next one gets)."""
        used = self.record_slots[slot]
        used.remove(record)
        if used:
            if refused:
                self.free_records.appendleft((slot, record))
            else:
                self.free_records.append((slot, record))
        else:
            del self.record_slots[slot]
            self.free_records = deque(p for p in self.free_records if p[0] != slot)
            if refused:
                self.free_slots.insert(0, slot)
            else:
                self.free_slots.append(slot)

    @property
    def op_lock(self) -> threading.Lock:
        """Held while an operation runs, on any thread: a session's operations never overlap."""
        return self.executor.op_lock

    def describe(self) -> str:
        # The pid the descriptor channel saw (SO_PEERCRED), not the one the client claims.
        pid = self.peer[0] if self.peer is not None else self.pid
        return f"session {self.session_id} ({self.client_name or 'client'}, pid {pid})"

