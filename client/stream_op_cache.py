"""The armed low-latency operations of one DeepEP `Buffer`, by the tensors they read.

Every low-latency call on the cuda backend goes through an armed op (client/stream_ops.py): a
call whose tensors were seen before costs a trigger kernel and a stream wait, and no round trip
to the daemon. Tensors are named by address *and* CUDA buffer id, so an allocation freed and
replaced at the same address arms a new op instead of reading through a stale mapping.

Two kinds of entries:
- **pinned**: ops used while a CUDA graph was captured. A graph bakes in the op's counter record,
  so these stay armed for the Buffer's life.
- **plain**: ops of plain calls and of calls with a receive hook, kept least-recently-used, at
  most `limit`. Evicting one disarms it (its counter record goes back to the session); that waits
  until the op's last trigger has passed on the GPU (an event recorded behind it), so no
  trigger is ever dropped. A call with a hook holds its op until the hook ran (the hook
  enqueues the op's receive half; an event is recorded behind it then). A combine is evicted
  with the dispatch it reads. (Hook ops were pinned: a server in eager mode, whose every new
  batch size is a new call, ran out of the session's counter slots after ~60 steps; an op now
  takes a record of a slot, and a group holds at most 255 ops.)

Failures the GPU reports in a plain op's done word raise `EpdError` at the Buffer's next
low-latency call once that trigger is known to be complete (the plain call's asynchronous error,
as with the normal-mode stream-ordered calls), or at `Buffer.check()`. One kind is raised at a
fixed call instead: a dispatch that a source's bad ids failed on every rank (its verdict; the
group goes on) raises at `Buffer.check()` only, from the ops' sticky verdict words, all taken
at once and before any failure of the rank's own, so that every rank raises at the same call.
Raised at a later call once seen complete, a rank whose GPU ran ahead would raise one call
before its peers, and a caller that goes on from the error would be a collective off them. A
plain call that sees one logs it once (a serving loop that never calls check() is not left
silent).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ..proto.errors import DeadlineExceeded, EpdError
from . import cuda_ipc
from .stream_ops import StreamOp, is_verdict

log = logging.getLogger("epd.client")

DEFAULT_LIMIT = 16  # plain ops per Buffer (a group holds at most 255 armed ops, pinned included)


@dataclass
class Entry:
    key: tuple
    op: StreamOp
    pinned: bool
    source: Entry | None = None  # a combine's dispatch entry
    event: Any = None  # cuda_ipc.StreamEvent recorded behind the op's last plain trigger
    triggers: int = 0
    reported: int = 0  # the trigger whose failure was raised
    holds: int = 0  # calls with a receive hook that has not run yet (not evicted meanwhile)
    reported_status: int = 0  # the done word whose failure check_all raised
    verdict_logged: int = 0  # the done word of a dispatch's verdict a plain call logged
    users: list[Entry] = field(default_factory=list)  # combines reading this dispatch


class StreamOpCache:
    def __init__(self, device: int, limit: int = DEFAULT_LIMIT,
                 new_event: Callable[[int], Any] = cuda_ipc.StreamEvent) -> None:
        self.device, self.limit = device, limit
        self._new_event = new_event
        self._entries: OrderedDict[tuple, Entry] = OrderedDict()
        self._by_op: dict[int, Entry] = {}  # op_id -> entry (a combine finds its dispatch)
        self._unchecked: list[Entry] = []  # plain entries triggered since their last check
        # by op kind ("dispatch", "combine"): the first verdict taken and not raised yet (an
        # evicted op's, or a combine's behind a dispatch's)
        self._kept_verdicts: dict[str, EpdError] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, *, pin: bool, hold: bool = False) -> Entry | None:
        """The armed entry of `key` (None: none); `pin` pins it for good, `hold` until
        `release()`."""
        e = self._entries.get(key)
        if e is None:
            return None
        if e.op.armed:
            self._entries.move_to_end(key)
            if pin:
                self._pin(e)
            if hold:
                e.holds += 1
            return e
        self._forget(e)  # disarmed elsewhere (its group left)
        return None

    def arm(self, key: tuple, arm: Callable[[], StreamOp], *, pin: bool, capturing: bool,
            source: Entry | None = None, hold: bool = False) -> Entry | None:
        """Arm a new op with `arm()`, evicting plain ops first while the cache is full or the
        engine has no room for another (RESOURCE_EXHAUSTED: the group's 255 ops, the session's
        records or --max-stream-ops-per-session). Nothing is evicted while a graph is captured
        (the wait for an op's last trigger is no capturable work). None when a plain call finds
        no room (it then takes the synchronous path); RESOURCE_EXHAUSTED for a pinned one."""
        while (not pin and not capturing and self._plain_count() >= self.limit
               and self._evict_one(keep=source)):
            pass
        while True:
            try:
                op = arm()
                break
            except EpdError as err:
                exhausted = err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                if exhausted and not capturing and self._evict_one(keep=source):
                    continue
                if exhausted and not pin:
                    return None
                raise
        e = self._entries[key] = Entry(key, op, pinned=False, source=source)
        self._by_op[op.op_id] = e
        if source is not None:
            source.users.append(e)
        if pin:
            self._pin(e)
        if hold:
            e.holds += 1
        return e

    def release(self, e: Entry, stream: int | None) -> None:
        """A receive hook of a call on `e` ran, enqueuing the op's receive half on `stream`:
        the op may be evicted once that has passed (an event recorded behind it). None: the
        call failed before anything was enqueued."""
        e.holds = max(e.holds - 1, 0)
        if stream is None:
            return
        if e.event is None:
            e.event = self._new_event(self.device)
        e.event.record(stream)

    def ops(self) -> list[StreamOp]:
        """The armed ops, least recently used first."""
        return [e.op for e in self._entries.values()]

    def entry_of(self, op: StreamOp) -> Entry | None:
        e = self._by_op.get(op.op_id)
        return e if e is not None and e.op is op else None

    def triggered(self, e: Entry, stream: int) -> None:
        """A plain trigger of `e` was enqueued on `stream` (with whatever reads its outputs)."""
        if e.event is None:
            e.event = self._new_event(self.device)
        e.event.record(stream)
        e.triggers += 1
        if e not in self._unchecked:
            self._unchecked.append(e)

    def check(self, *, wait: bool = False) -> None:
        """Raise the first failure of a completed plain trigger not raised yet. With `wait`,
        waits for the triggers in flight first (Buffer.check after a synchronise: immediate).
        A dispatch's verdict is left to `check_all` (without `wait`, logged once)."""
        pending: list[Entry] = []
        failure: EpdError | None = None
        for e in self._unchecked:
            if not e.op.armed:  # its slot may serve another op now: nothing to read there
                continue
            if e.event is None or not (e.event.done() or (wait and e.event.wait())):
                pending.append(e)
                continue
            status = e.op.status()
            if is_verdict(status):
                if not wait and e.verdict_logged != status:
                    e.verdict_logged = status
                    log.warning("%s (raised at Buffer.check())", e.op.error(status))
                continue
            err = e.op.error(status)
            if err is not None and e.reported != e.triggers and failure is None:
                e.reported, e.reported_status = e.triggers, status  # (not again at check_all)
                failure = err
        self._unchecked = pending
        if failure is not None:
            raise failure

    def take_verdicts(self) -> None:
        """After the caller's stream is synchronised (its hooks called), once its plain
        triggers have passed (waited for here: at once then): raise one error if any verdict
        was recorded since the last take, taking them all. Every rank raises here exactly when
        some dispatch failed (bad ids, every rank alike) since its last check, whichever of its
        ops recorded it (how its tensors map to ops is its own), before any failure of its own;
        a combine's verdict (its own top-k: this rank's alone) comes after the dispatches' (at
        the next check when both are there)."""
        for e in self._unchecked:
            if e.op.armed and e.event is not None:
                e.event.wait()
        kept = self._kept_verdicts
        for e in self._entries.values():
            if e.op.armed:
                err = e.op.take_verdict()
                if err is not None:
                    kept.setdefault(e.op.kind, err)
        failure = kept.pop("dispatch", None) or kept.pop("combine", None)
        if failure is not None:
            raise failure

    def check_all(self) -> None:
        """After the caller's stream is synchronised (and every hook called): raise the first
        failure any armed op's done word holds and that was not raised yet (hook and graph ops
        too, whose triggers no event follows); verdicts are `take_verdicts`'."""
        failure: EpdError | None = None
        for e in self._entries.values():
            if not e.op.armed or failure is not None:
                continue
            status = e.op.status()
            err = None if is_verdict(status) else e.op.error(status)
            if err is not None and e.reported_status != status:
                e.reported_status = status
                failure = err
        if failure is not None:
            raise failure

    def clear(self) -> None:
        """Forget every entry (the Buffer leaves its groups, which disarms their ops)."""
        self._entries.clear()
        self._by_op.clear()
        self._unchecked.clear()
        self._kept_verdicts.clear()

    # -- internals ---------------------------------------------------------------------------
    def _plain_count(self) -> int:
        return sum(1 for e in self._entries.values() if not e.pinned)

    def _pin(self, e: Entry) -> None:
        e.pinned = True
        if e.source is not None:
            e.source.pinned = True

    def _evict_one(self, keep: Entry | None = None) -> bool:
        """Disarm the least recently used plain dispatch (with its combines) or plain combine;
        never `keep` (the dispatch a combine being armed reads)."""
        for e in list(self._entries.values()):
            if (e.pinned or e.holds or e is keep
                    or any(u.pinned or u.holds for u in e.users)):
                continue
            self._drop(e)
            return True
        return False

    def _drop(self, e: Entry) -> None:
        for u in list(e.users):
            self._drop(u)
        if e.event is not None and not e.event.wait():  # its last trigger has passed, so
            # nothing will fire it again (disarmed under a pending trigger, the caller's stream
            # would wait for a done word no one writes)
            raise DeadlineExceeded(
                f"stream op {e.op.op_id} cannot be evicted: its last trigger has not passed "
                f"within {cuda_ipc.EVENT_WAIT_SECONDS:g} s (the stream it was enqueued on is "
                f"held by work before it)")
        err = e.op.take_verdict()  # (final: its last trigger has passed)
        if err is not None:
            self._kept_verdicts.setdefault(e.op.kind, err)
        with contextlib.suppress(EpdError):  # the session may be gone already
            e.op.disarm()
        if e.source is not None and e in e.source.users:
            e.source.users.remove(e)
        self._forget(e)

    def _forget(self, e: Entry) -> None:
        if self._entries.get(e.key) is e:
            del self._entries[e.key]
        if self._by_op.get(e.op.op_id) is e:
            del self._by_op[e.op.op_id]
        if e in self._unchecked:
            self._unchecked.remove(e)
