"""An engine's session teardown goes to the end when a step fails: a comm whose close raises
(a broken CUDA context, a backend bug) must not leave the session counted against
--max-sessions, its other groups open or its peers' ranks held."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from epd.proto.errors import Aborted
from epd.server.engine import core
from epd.server.engine.executor import EngineState, SessionExecutor
from epd.server.engine.state import Session
from epd.server.engine.stream_ops import StreamOps


class _Comm:
    def __init__(self, name: str, log: list[str], fail_close: bool) -> None:
        self.name, self.log, self.fail_close = name, log, fail_close
        self.spec = types.SimpleNamespace(shrink=False)

    def abort_reason(self) -> None:
        return None

    def abort(self, text: str) -> None:
        self.log.append(f"abort {self.name}")

    def release_stream(self, slot: object) -> None:
        self.log.append(f"release {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")
        if self.fail_close:
            raise RuntimeError(f"{self.name}: the context is gone")


def _member(name: str, slot: int, log: list[str], fail_close: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(group_id=name, rank=0, counter_slot=slot,
                                 spec=types.SimpleNamespace(name=name, shrink=False),
                                 comm=_Comm(name, log, fail_close))


def test_a_failing_step_does_not_stop_the_teardown() -> None:
    log: list[str] = []
    released: list[str] = []
    engine = core.Engine.__new__(core.Engine)
    engine.sessions = {}
    engine.stream_ops = StreamOps(types.SimpleNamespace(index=0))
    engine.backend = types.SimpleNamespace(close_events=lambda events: log.append("events"))
    engine._refresh_gauges = lambda: None

    async def release_rank(member, text, left=False) -> None:
        released.append(member.group_id)
    engine._release_rank = release_rank
    page = types.SimpleNamespace(slot=lambda i: i, close=lambda: log.append("page"))
    region = types.SimpleNamespace(borrowed=False, region_id="r1",
                                   close=lambda: log.append("region"))

    async def run() -> None:
        s = Session("s" * 16, "client", 1, page, SessionExecutor(EngineState(0), "s0"))
        s.members = {"a": _member("a", 0, log, fail_close=True),
                     "b": _member("b", 1, log, fail_close=False)}
        s.regions = {"r1": region}
        engine.sessions[s.session_id] = s
        await engine.close_session(s, "went away")
        assert engine.sessions == {}
        assert not s.members and not s.regions
    asyncio.run(run())
    # every step ran though closing group a failed, and both ranks went back to the node
    assert log == ["abort a", "release a", "abort b", "release b", "close a", "close b",
                   "region", "page", "events"], log
    assert released == ["a", "b"]


class _SlowBackend:
    """attach() waits until the test lets it finish (a CUDA attach takes seconds)."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.go = log, threading.Event()

    def attach(self, spec: object, membership: object) -> _Comm:
        assert self.go.wait(10)
        return _Comm("attached", self.log, fail_close=False)


def test_an_attach_its_join_left_is_closed_once_then_released() -> None:
    """A join that goes away while its rank attaches (cancelled by its client, or its
    session's teardown stopped waiting) leaves no comm open, and its rank is released only once
    the comm is closed (a release lets the group's memory go): the attach closes its comm when
    it ends and then releases; a comm the attach had made already the join closes, then
    releases; a join gone before the attach began has nothing to close."""
    with ThreadPoolExecutor(1) as worker:
        # gone while attaching: the attach closes its comm, then the release
        log: list[str] = []
        backend, handoff = _SlowBackend(log), core.AttachHandoff()
        fut = worker.submit(handoff.attach, backend, None, None)
        assert _wait_running(handoff)
        assert handoff.abandon(lambda: log.append("released")) == (None, True)
        backend.go.set()
        with pytest.raises(Aborted, match="went away while its rank attached"):
            fut.result(10)
        assert log == ["close attached", "released"]

        # gone after the attach made its comm: the join takes it (closes, then releases)
        log = []
        backend, handoff = _SlowBackend(log), core.AttachHandoff()
        backend.go.set()
        comm = worker.submit(handoff.attach, backend, None, None).result(10)
        assert handoff.abandon(lambda: log.append("released")) == (comm, False) and log == []
        assert handoff.abandon(lambda: None) == (None, False)  # (once)

        # gone before the worker began: nothing attached, nothing to close
        log = []
        backend, handoff = _SlowBackend(log), core.AttachHandoff()
        backend.go.set()
        assert handoff.abandon(lambda: log.append("released")) == (None, False)
        with pytest.raises(Aborted, match="before its rank attached"):
            worker.submit(handoff.attach, backend, None, None).result(10)
        assert log == []

        # an attach that fails after its join went: released all the same
        log = []
        handoff = core.AttachHandoff()
        failing = _SlowBackend(log)
        failing.attach = lambda spec, m: (failing.go.wait(10), 1 / 0)  # type: ignore[method-assign]
        fut = worker.submit(handoff.attach, failing, None, None)
        assert _wait_running(handoff)
        handoff.abandon(lambda: log.append("released"))
        failing.go.set()
        with pytest.raises(ZeroDivisionError):
            fut.result(10)
        assert log == ["released"]

    # a join that stays: its comm, open
    log = []
    backend = _SlowBackend(log)
    backend.go.set()
    assert core.AttachHandoff().attach(backend, None, None).name == "attached" and log == []


def _wait_running(handoff: core.AttachHandoff) -> bool:
    deadline = time.monotonic() + 10
    while not handoff._running:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
