"""Bounds on the gRPC calls a session has under way: a session's operations run one at a time
on its worker, and the calls behind one that waits for its peers (up to its deadline) are held
parsed in the engine's memory meanwhile. Unbounded, one tenant could grow an engine until the
OOM killer took it and every other tenant's sessions with it (an adversarial test: 3.8 MiB
ReleaseHandles requests queued behind a dispatch no peer joined grew the engine by ~10 MiB
each). Beyond either bound a call is RESOURCE_EXHAUSTED at once and changes nothing. The
fast path needs no bound: its ring has a fixed number of slots."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from google.protobuf.message import Message

from ...proto.errors import ResourceExhausted
from .state import Session

MAX_CALLS_PER_SESSION = 64  # gRPC calls of one session under way at once
MAX_BYTES_PER_UID = 64 << 20  # request bytes held by the calls under way of one uid's sessions


class CallBacklog:
    """Counts of calls under way per session and their request bytes per uid (event loop only:
    no lock)."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = {}
        self._bytes: dict[int, int] = {}

    @contextlib.contextmanager
    def hold(self, session: Session, method: str, request: Message) -> Iterator[None]:
        sid = session.session_id
        uid = session.peer[1] if session.peer is not None else -1
        calls = self._calls.get(sid, 0)
        if calls >= MAX_CALLS_PER_SESSION:
            raise ResourceExhausted(
                f"{method}: session {sid!r} has {calls} calls under way already (at most "
                f"{MAX_CALLS_PER_SESSION}: its calls run one at a time, the others wait); wait for "
                f"their answers before sending more")
        size = request.ByteSize()
        held = self._bytes.get(uid, 0)
        if held + size > MAX_BYTES_PER_UID:
            raise ResourceExhausted(
                f"{method}: the calls under way of uid {uid}'s sessions hold {held} bytes of "
                f"requests; this one's {size} would pass the engine's bound of "
                f"{MAX_BYTES_PER_UID} a uid; wait for their answers before sending more")
        self._calls[sid] = calls + 1
        self._bytes[uid] = held + size
        try:
            yield
        finally:
            decrement(self._calls, sid)
            decrement(self._bytes, uid, size)


def decrement(counts: dict, key: object, by: int = 1) -> None:
    """Take `by` off `counts[key]`, dropping the entry at zero: count dictionaries that hold
    only what is under way (also the descriptor channel's, fd_server.py)."""
    left = counts.get(key, 0) - by
    if left > 0:
        counts[key] = left
    else:  # (none left: no entry, so the dicts hold only what is under way)
        counts.pop(key, None)
