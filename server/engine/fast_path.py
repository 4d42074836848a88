"""Engine side of the same-host fast path: one thread per session serving its request ring.

The thread serves every operation the registry lets a ring carry (proto/operations.py,
`ring_id`): it decodes the request with the registry's type, has the engine's `EngineState`
admit it (refused once the engine drains) and runs the engine's synchronous operation for it
(`Engine.operation(name)`) through the session's executor, under its operation lock; so the two
transports give identical results, errors (one mapping, executor.as_epd_error) and metrics
(labelled path="fastpath"). It spins for a bounded time after each request (longer after an
operation that the caller usually follows quickly: proto/spin.py SpinWindow), then sleeps on the
ring's doorbell futex; every wait has a timeout so a closed session ends the thread. The session's
teardown stops it (`stop()`: the current operation finishes and is answered, the thread is joined)
before anything the operations use is closed.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from ...proto import host_order, operations, spin
from ...proto import ring as R
from ...proto.errors import EpdError, PermissionDenied, ResourceExhausted, status_value
from ...proto.thread_names import NamedThread
from .. import metrics
from .decoding import decode
from .executor import as_epd_error
from .profiling import run_profiled

if TYPE_CHECKING:
    from .core import Engine, OperationFn
    from .state import Session

log = logging.getLogger("epd.engine")
SLEEP_SLICE = 0.1  # longest futex sleep: how fast a closed session is noticed
FLUSH_EVERY = 256  # requests between metric flushes while busy
JOIN_SECONDS = 30.0  # stop(): longest wait for the current operation to finish


class FastPathServer:
    def __init__(self, engine: Engine, session: Session, slots: int,
                 slot_bytes: int, window: spin.SpinWindow) -> None:
        self.engine, self.session = engine, session
        # A sealed memfd: the session's client fetches it over the descriptor channel.
        self.ring = R.Ring.create(slots, slot_bytes)
        self.window = window  # how long to spin for the next request (follows recent gaps)
        self._stop = False
        # Ring id -> (registry operation, the engine's function for it).
        self._ops: dict[int, tuple[operations.Operation, OperationFn]] = {
            rid: (op, engine.operation(op.name)) for rid, op in operations.BY_RING_ID.items()}
        self.thread = NamedThread(target=self._serve, daemon=True,
                                  name=f"epd-fast-{session.session_id[:6]}")
        # The thread's metric updates (request counts, their CPU, the operations' own), added
        # to Prometheus in batches when it is about to sleep, every FLUSH_EVERY requests and at
        # stop: one multiprocess update costs several microseconds, a round trip's budget.
        self._batch: metrics.Batch | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop serving (the session is closing): wake the thread, let its current operation
        finish and be answered, join it, free the ring."""
        self._stop = True
        self.ring.header[R.CLOSED] = 1
        R.futex_wake(self.ring.doorbell_addr)
        if self.thread.is_alive():
            self.thread.join(timeout=JOIN_SECONDS)
        if self.thread.is_alive():  # never unmap under it: the descriptor goes, the mapping stays
            log.error("fast path of %s did not stop", self.session.describe())
            self.ring.release_fd()
            return
        self.ring.close()

    def _running(self) -> bool:
        return not (self._stop or self.session.closed.is_set())

    def _wait_for(self, words, seq: int, after: int | None) -> bool:
        """Wait for request `seq`; `after`: the ring id of the request answered last (None:
        none yet), whose following gaps set how long to spin before sleeping."""
        ring = self.ring
        answered = time.perf_counter()
        spin_until = answered + self.window.window(after)
        while self._running():
            if words[R.S_STATE] == R.SUBMITTED and R.seq_of(words) == seq:
                host_order.consume()  # (the state seen before the request is read)
                if after is not None:
                    self.window.seen(after, time.perf_counter() - answered)
                return True
            if time.perf_counter() < spin_until:
                # Spin without holding the GIL (another session's thread of this engine may be
                # waiting for it) and without a timed sleep (spin.py: ~60 µs per look).
                spin.relax()
                continue
            self._flush_metrics()
            bell = int(ring.header[R.DOORBELL])
            ring.header[R.ENGINE_WAITING] = 1
            host_order.full()  # (that store before the state is read: the client's mirror)
            if not (words[R.S_STATE] == R.SUBMITTED and R.seq_of(words) == seq):
                R.futex_wait(ring.doorbell_addr, bell, SLEEP_SLICE)
            ring.header[R.ENGINE_WAITING] = 0
            spin_until = time.perf_counter() + self.window.base
        return False

    def _serve(self) -> None:
        with metrics.batched() as self._batch:  # (applied by _flush_metrics)
            self._serve_profiled()

    def _serve_profiled(self) -> None:
        self.engine.backend.thread_init()
        run_profiled("fast", f"engine-{os.getpid()}-{self.session.session_id[:8]}", self._loop)

    def _loop(self) -> None:
        seq, last = 1, None
        while self._running():
            words, payload, state_addr = self.ring.slot((seq - 1) % self.ring.slots)
            if not self._wait_for(words, seq, last):
                break
            data = bytes(payload[:int(words[R.S_LENGTH])])
            method = int(words[R.S_METHOD])
            deadline = R.deadline_of(words)
            last = method if method in self._ops else None  # (a client picks the number)
            slot = (words, payload, state_addr)
            failed = self._handle(method, data, functools.partial(self._answer, slot), deadline)
            if failed is not None:  # (answered already otherwise: the client may own it now)
                self._answer(slot, *failed)
            seq += 1
            if not seq % FLUSH_EVERY:
                self._flush_metrics()
        self._flush_metrics()

    def _answer(self, slot: tuple, status: int, out: bytes) -> None:
        """Write a response (or error) into the request's slot and wake the client."""
        words, payload, state_addr = slot
        if len(out) > self.ring.capacity:
            err = ResourceExhausted(R.OVERSIZE.format(len(out), self.ring.capacity))
            status, out = status_value(err.code), err.message.encode()
        payload[:len(out)] = out
        words[R.S_LENGTH] = len(out)
        words[R.S_STATUS] = status
        host_order.publish()  # (the answer before its state)
        words[R.S_STATE] = R.DONE
        R.futex_wake(state_addr)

    def _flush_metrics(self) -> None:
        if self._batch is not None:
            self._batch.flush()

    def _handle(self, ring_id: int, data: bytes, answer: Callable[[int, bytes], None],
                deadline: float | None = None) -> tuple[int, bytes] | None:
        """One request. A successful operation's response goes to `answer` as soon as it
        exists, before the work the operation left for after its answer
        (SessionExecutor.after_answer), and None is returned; a failure returns (status value,
        error message) for the caller to answer. `deadline`: its client's (the slot's)."""
        cpu0 = time.thread_time()
        entry = self._ops.get(ring_id)
        method = entry[0].name if entry is not None else "?"
        code = grpc.StatusCode.OK
        answered: list[bool] = []  # (set once the client has the response)

        def reply(resp) -> None:
            answer(0, resp.SerializeToString())
            answered.append(True)
        try:
            if entry is None:
                raise EpdError(grpc.StatusCode.UNIMPLEMENTED,
                               f"unknown fast-path operation id {ring_id}")
            op, fn = entry
            req = decode(op.name, op.request, data, "fastpath")  # INVALID_ARGUMENT if garbage
            # The same lookup (and message) as gRPC; a ring only serves its own session. Before
            # anything acts on the request's ids: a refusal while draining aborts the group
            # the request names, which must be this session's own.
            sid = getattr(req, "session_id", None)
            if sid is not None and self.engine.session(sid) is not self.session:
                raise PermissionDenied(f"session {sid!r} does not own this ring")
            state = self.engine.state
            try:
                state.enter()
            except EpdError as refused:
                self.engine.refuse(method, req, refused)
                raise
            try:
                self.session.executor.call(fn, self.session, req, "fastpath", answer=reply,
                                           deadline=deadline)
            finally:
                state.leave()
            return None
        except Exception as e:  # one mapping; a bug is logged and serving goes on
            err = as_epd_error(method, e)
            code = err.code
            # (cut to the slot at a character boundary: the client decodes it as UTF-8)
            message = err.message.encode()[:self.ring.capacity].decode(errors="ignore")
            failed = status_value(err.code), message.encode()
            # `err` may be `e`: its traceback holds this frame and the loop's, whose slot views
            # would keep the ring mapped after the session closes (a reference cycle).
            del err
            if answered:  # (the client has its answer and may own the slot again)
                log.error("fast path of %s: %s failed after its answer", self.session.describe(),
                          method)
                return None
            return failed
        finally:
            metrics.inc(metrics.REQUESTS, (method, code.name))
            metrics.inc(metrics.REQUEST_CPU_SECONDS, (method, "fastpath"),
                        time.thread_time() - cpu0)
