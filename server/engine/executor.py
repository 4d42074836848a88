"""Where a session's operations run, whichever transport brought them, and how they stop.

Two objects, shared by every transport (the gRPC servicer, the fast-path ring thread) and the
stream-op poller, as uvicorn's `ServerState` is shared by its protocol implementations:

* `EngineState`, one per engine: admission (`admit()` refuses every new call with UNAVAILABLE
  once the engine drains) and the engine-wide count of calls in flight, which `drain()` waits on
  (bounded by --drain-seconds).
* `SessionExecutor`, one per session: its worker thread (gRPC calls run there, in the client's
  order), its operation lock (held while any operation runs, on any thread: a session's
  operations never overlap), the transports serving it, and `shutdown()`, the one teardown
  order of a session:

    1. stop accepting: every later call on any transport fails (ABORTED, the reason);
    2. interrupt: the engine wakes what is in flight (it raises the groups' abort words and
       releases armed stream ops; nothing is unmapped yet);
    3. stop the transports: each ring thread finishes its current operation and is joined, the
       worker runs out of queued work;
    4. release: under the operation lock, so no operation runs anywhere, the engine closes the
       comms and unmaps the regions. If an operation is still running after `QUIESCE_SECONDS`
       nothing is unmapped (the process keeps the mappings; a draining engine still removes
       its files): a comm is never closed under a running operation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import errno
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar

import grpc

from ...proto.errors import Aborted, DeadlineExceeded, EpdError, Unavailable
from ...proto.thread_names import named_initializer
from .watchdog import SlowOperations

log = logging.getLogger("epd.engine")
T = TypeVar("T")

QUIESCE_SECONDS = 30.0  # teardown: longest wait for a running operation before giving up on it
WAIT_THREADS = 4  # a session's threads for its waits off the event loop (`off_loop`)
IDLE_POLL_SECONDS = 0.01  # drain: how often the in-flight count is looked at


# OS errors that say the machine cannot serve the call now (a vanished or full shm folder, out of
# memory or descriptors): UNAVAILABLE, worth retrying elsewhere or later. Any other: INTERNAL.
_UNAVAILABLE_ERRNOS = frozenset({errno.ENOENT, errno.ENOSPC, errno.ENOMEM, errno.EMFILE,
                                 errno.ENFILE, errno.EAGAIN, errno.EDQUOT})


def as_epd_error(method: str, exc: BaseException) -> EpdError:
    """The one mapping of a handler's exception to the status a client gets, for every
    transport (gRPC unary calls, the OpenSession stream, the fast-path ring, stream ops):
    an EpdError keeps its status; an OSError becomes UNAVAILABLE (the environment: a missing
    folder, no space) or INTERNAL, with one line naming the path; anything else is a bug:
    INTERNAL, logged once with its traceback."""
    if isinstance(exc, EpdError):
        return exc
    if isinstance(exc, OSError):
        code = (grpc.StatusCode.UNAVAILABLE if exc.errno in _UNAVAILABLE_ERRNOS
                else grpc.StatusCode.INTERNAL)
        where = f": {exc.filename}" if exc.filename is not None else ""
        text = f"{method}: {exc.strerror or exc} ({type(exc).__name__}){where}"
        log.warning("%s", text)
        return EpdError(code, text)
    log.error("%s failed", method, exc_info=exc)
    return EpdError(grpc.StatusCode.INTERNAL, f"{method}: {type(exc).__name__}: {exc}")


class Transport(Protocol):
    """A transport serving one session on its own thread (the fast-path ring server)."""

    def stop(self) -> None:
        """Stop taking requests, let the current operation finish, join the thread."""


class EngineState:
    """Admission and the in-flight count of one engine, shared by all its transports."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.draining = False
        self._inflight = 0
        # perf_counter() when the last call left (the stream-op poller spins briefly while
        # the sessions serve calls: stream_ops.spin_window)
        self.last_call = 0.0
        self._lock = threading.Lock()

    @property
    def inflight(self) -> int:
        return self._inflight

    def check_open(self) -> None:
        if self.draining:
            raise Unavailable(f"engine {self.index} is draining (shutting down); no new calls")

    def enter(self) -> None:
        """A call arrives on a transport: refused (UNAVAILABLE) once the engine drains, else
        counted in flight until `leave()`."""
        with self._lock:
            self.check_open()
            self._inflight += 1

    def leave(self) -> None:
        with self._lock:
            self._inflight -= 1
        self.last_call = time.perf_counter()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """`enter()` ... `leave()` around one call."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def drain(self, seconds: float) -> int:
        """Refuse new calls, wait (at most `seconds`) for those in flight; returns how many are
        still running."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self._inflight and loop.time() < deadline:
            await asyncio.sleep(IDLE_POLL_SECONDS)
        return self._inflight


# When the client of the gRPC call being served stops waiting (time.monotonic()'s clock; None:
# no deadline), set by the gRPC transport for the call's task; the fast path reads its own from
# the request's ring slot. `SessionExecutor.run` takes it along.
CLIENT_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "epd_client_deadline", default=None)
# A call that gets its turn this close to its client's deadline is refused too: its answer
# would come too late, and on gRPC the engine's view of the deadline (from the call's arrival)
# lies a transit time after the client's own (a test saw the call run a few ms after its
# client gave up). At most half the time the call had left when it came here, so that a call
# of a short timeout (under 0.1 s) that gets its turn at once still runs (a review: every call
# of a timeout under 50 ms was refused on an idle session).
STALE_MARGIN_SECONDS = 0.05


def stale(deadline: float | None, waited: float, now: float) -> bool:
    """Whether a call that waited `waited` seconds for its turn, whose client stops waiting at
    `deadline` (time.monotonic()), must not run at `now`."""
    if deadline is None:
        return False
    margin = min(STALE_MARGIN_SECONDS, max(deadline - (now - waited), 0.0) / 2)
    return now >= deadline - margin


class SessionExecutor:
    """The worker, operation lock, transports and teardown of one session."""

    def __init__(self, state: EngineState, name: str,
                 thread_init: Callable[[], None] | None = None,
                 slow: SlowOperations | None = None) -> None:
        self.state = state
        self.name = name
        self.slow = slow  # the engine's watchdog of operations that run too long
        self.op_lock = threading.Lock()
        # Calls and later() work for the worker, which takes them itself (run, _pump)
        self._queue: collections.deque[_Queued] = collections.deque()
        self._queue_lock = threading.Lock()
        self._pumping = False  # (a _pump is submitted or running)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"epd-{name}",
                                         initializer=named_initializer(f"epd-{name}",
                                                                       thread_init))
        # The session's waits off the event loop (a leave's quiesce and its wait for the
        # operation lock, its teardown's steps): its own threads, not the loop's default pool
        # every session shares, where a review's tenant held all of them with leaves that
        # wait up to QUIESCE_SECONDS each, and other tenants' leaves and teardowns queued.
        self._waits = ThreadPoolExecutor(max_workers=WAIT_THREADS,
                                         thread_name_prefix=f"epd-{name}-wait",
                                         initializer=named_initializer(f"epd-{name}-wait",
                                                                       thread_init))
        self._waits_done = False  # (the teardown shut `_waits` down)
        self.transports: list[Transport] = []
        self.closing: str | None = None  # why later calls are refused
        # Seconds the running operation waited for the worker and the lock before it ran.
        self.waited = 0.0
        # Work the running operation left for after its answer (after_answer), run under the lock.
        self._after: list[Callable[[], None]] = []

    # -- running operations ------------------------------------------------------------------
    def call(self, fn: Callable[..., T], *args, answer: Callable[[T], None] | None = None,
             deadline: float | None = None) -> T:
        """Run one operation on the calling thread under the operation lock (the fast-path
        thread, the worker). The caller's transport has admitted it (EngineState.admit).
        `answer`: hands the operation's result to its client before the work it left for
        after its answer (`after_answer`) runs, still under the lock. `deadline`: when its
        client stops waiting (time.monotonic()); passed by then, it is not run."""
        return self._call(time.perf_counter(), fn, *args, answer=answer, deadline=deadline)

    def after_answer(self, fn: Callable[[], None]) -> None:
        """Called by the running operation: run `fn` once its answer is on its way, before
        the operation lock is released (so the session's next operation, on any transport,
        comes after it). `fn` handles its own failures: the client has its answer already.
        A stream-ordered call enqueues its kernels this way, overlapping the client's side
        of the call with the engine's launches (DESIGN_NOTES "Answering before launching")."""
        self._after.append(fn)

    def take_after(self) -> list[Callable[[], None]]:
        """The work after_answer() queued, taken off the list, for a caller that holds the
        operation lock outside `_call` and runs it itself (the poller firing a captured
        normal-mode call: there is no answer to wait for)."""
        after, self._after = self._after, []
        return after

    def _call(self, queued: float, fn: Callable[..., T], *args,
              answer: Callable[[T], None] | None = None, deadline: float | None = None,
              gave_up: threading.Event | None = None) -> T:
        with self.op_lock:
            # Read by the operation itself (under the lock): the per-group queueing delay.
            self.waited = time.perf_counter() - queued
            if self.closing is not None:
                raise Aborted(f"{self.name} is closing: {self.closing}")
            if gave_up is not None and gave_up.is_set():  # (nobody reads the answer)
                raise Aborted("not run: its client cancelled the call while it waited here")
            if stale(deadline, self.waited, time.monotonic()):
                # Its client has been told DEADLINE_EXCEEDED (or is about to be): run now, the
                # call would change what the client believes failed (a handle nobody holds, a
                # collective its peers pair with their next one, a region unregistered).
                raise DeadlineExceeded(
                    f"not run: the client's deadline passed, or was about to, while the call "
                    f"waited {self.waited:.3g} s here behind the session's earlier operations")
            if self.slow is not None:
                self.slow.begin(getattr(fn, "__name__", "operation"), self.name)
            try:
                result = fn(*args)
                after, self._after = self._after, []
                if answer is not None:
                    answer(result)
                for later in after:
                    try:
                        later()
                    except Exception:  # (each handles its own; the answer went out already)
                        log.exception("%s: work after an answer failed", self.name)
                return result
            finally:
                self._after.clear()  # an operation that failed leaves nothing to run
                if self.slow is not None:
                    self.slow.end()

    async def run(self, fn: Callable[..., T], *args,
                  discard: Callable[[T], object] | None = None) -> T:
        """Run one operation on the session's worker (gRPC): in the client's order, off the
        event loop. Its wait for the worker counts in `waited`; the call's client deadline
        (CLIENT_DEADLINE) goes with it.

        Calls wait in the session's own queue, which the worker takes from itself, one after
        the other (`_pump`). A call cancelled before it started (its deadline, its client)
        leaves that queue at once, and its request with it: handed to the executor at once,
        cancelled calls stayed queued there with their requests, uncounted by the backlog
        (backlog.py; a review grew an engine by 1.4 GiB with short-deadline calls behind a
        blocked dispatch). (An asyncio lock in front of the executor did the same, but every
        call queued behind another then waited for an event-loop handoff.) `discard`: given
        the result of a call whose caller was cancelled while it ran (what it made that
        nobody will hold, such as an opened region), on the event loop."""
        loop = asyncio.get_running_loop()
        gave_up = threading.Event()  # (one that started but waits for the op lock: not run)
        entry = _Queued(loop.create_future(), functools.partial(
            self._call, time.perf_counter(), fn, *args, deadline=CLIENT_DEADLINE.get(),
            gave_up=gave_up))
        self._enqueue(entry)
        try:
            return await asyncio.shield(entry.future)
        except asyncio.CancelledError:
            gave_up.set()
            with self._queue_lock, contextlib.suppress(ValueError):
                self._queue.remove(entry)  # (not started: gone, with its request)
                entry.future.cancel()
            if discard is not None:
                entry.future.add_done_callback(functools.partial(_discard_result, discard))
            raise

    def _enqueue(self, entry: _Queued) -> None:
        """Queue a call or later() work; start the worker's pump unless it runs."""
        with self._queue_lock:
            if self.closing is not None and entry.aborts_on_close:
                raise Aborted(f"{self.name} is closing: {self.closing}")
            self._queue.append(entry)
            if self._pumping:
                return
            self._pumping = True
        try:
            self.worker.submit(self._pump)
        except RuntimeError:  # (the worker is shut down: the session closed)
            with self._queue_lock:
                self._pumping = False
                with contextlib.suppress(ValueError):
                    self._queue.remove(entry)
            raise Aborted(f"{self.name} is closing: {self.closing or 'its worker stopped'}") \
                from None

    def _pump(self) -> None:
        """The worker: the queued calls, in order, until none is left."""
        while True:
            with self._queue_lock:
                if not self._queue:
                    self._pumping = False
                    return
                entry = self._queue.popleft()
            entry.run()

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """Run a blocking step of this session's (a wait for its operations, a close) on its
        own wait threads (asyncio.to_thread for one session: see `_waits`)."""
        call = functools.partial(fn, *args)
        if self._waits_done:  # (its teardown ended, and with it these threads: a leave that
            return await asyncio.to_thread(call)  # raced it finishes on the loop's shared ones)
        return await asyncio.get_running_loop().run_in_executor(self._waits, call)

    def exclusive(self, fn: Callable[[], T], timeout: float | None = None) -> T | None:
        """Run `fn` with no operation running (even while closing): teardown steps, such as
        closing a comm. Blocks; returns None, without running `fn`, if an operation still holds
        the lock after `timeout` seconds (default QUIESCE_SECONDS)."""
        timeout = QUIESCE_SECONDS if timeout is None else timeout
        if not self.op_lock.acquire(timeout=timeout):
            log.error("%s: an operation is still running after %.0f s; not releasing its "
                      "resources under it", self.name, timeout)
            return None
        try:
            return fn()
        finally:
            self.op_lock.release()

    def later(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the worker after the operations queued before it (a region a queued
        call may still read), under the operation lock: the fast path runs operations on its
        own thread, and one of those could be viewing the region (a CUDA mapping closed under
        a kernel launch faults the context every session shares). No caller waits for it: a
        failure is logged; a lock never freed (`exclusive`) leaves `fn` undone, logged."""
        future: Future = Future()
        self._enqueue(_Queued(future, functools.partial(self.exclusive, fn),
                              aborts_on_close=False))
        what = getattr(fn, "__qualname__", None) or repr(fn)
        future.add_done_callback(lambda f: self._later_done(what, f))
        return future

    def _later_done(self, what: str, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("%s: background work %s failed", self.name, what,
                      exc_info=future.exception())

    def attach(self, transport: Transport) -> None:
        self.transports.append(transport)

    # -- teardown ----------------------------------------------------------------------------
    async def shutdown(self, reason: str, interrupt: Callable[[], Awaitable[None]],
                       release: Callable[[], None]) -> None:
        """The teardown order (module docstring): refuse, interrupt, stop transports, release
        under the lock."""
        self.closing = reason
        await interrupt()
        for t in self.transports:
            await self.off_loop(t.stop)
        self.transports.clear()
        try:  # (the operation running on it was interrupted above; exclusive() waits again)
            await asyncio.wait_for(self.off_loop(self.worker.shutdown, True), QUIESCE_SECONDS)
        except TimeoutError:
            log.error("%s: its worker still runs an operation after %.0f s", self.name,
                      QUIESCE_SECONDS)

        def release_all() -> bool:
            release()
            return True
        try:
            if await self.off_loop(self.exclusive, release_all) is None:
                log.error("%s: left mapped (an operation never finished)", self.name)
        finally:
            self._waits_done = True
            self._waits.shutdown(wait=False)  # (its threads end once idle: this was the last)


def _discard_result(discard: Callable[[T], object], done: asyncio.Future) -> None:
    """A call's result nobody awaits any more (SessionExecutor.run's `discard`)."""
    if done.cancelled() or done.exception() is not None:
        return
    try:
        discard(done.result())
    except Exception:
        log.exception("discarding the result of a call its client gave up on failed")


class _Queued:
    """A call or later() work in a session's queue: run by the worker, its result (or error)
    set on `future`, an asyncio one on its loop (run) or a concurrent one (later)."""

    __slots__ = ("aborts_on_close", "future", "work")

    def __init__(self, future: asyncio.Future | Future, work: Callable[[], object],
                 aborts_on_close: bool = True) -> None:
        self.future, self.work, self.aborts_on_close = future, work, aborts_on_close

    def run(self) -> None:
        future = self.future
        if isinstance(future, Future):  # (later(): a concurrent future)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.work())
                except BaseException as e:
                    future.set_exception(e)
            return
        try:  # (a cancelled call left the queue before the pump could take it)
            result = self.work()
        except BaseException as e:
            _settle(future, None, e)
        else:
            _settle(future, result, None)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Hand a call's outcome to its waiting coroutine, on its loop (gone: nobody waits)."""
    def settle() -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    with contextlib.suppress(RuntimeError):  # (the loop is closed)
        future.get_loop().call_soon_threadsafe(settle)
