"""Engine side of the same-host fast path: one thread per session serving its request ring.

The thread runs the same synchronous operations as the gRPC transport (Engine.layout_op,
dispatch_op, combine_op, ll_dispatch_op, ll_combine_op, stats) under the session's operation
lock, so the two transports give identical results, errors and metrics (labelled
path="fastpath"). It spins for a bounded time after each request, then sleeps on the ring's
doorbell futex; every wait has a timeout so a closed session ends the thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ...proto import ring as R
from ...proto.errors import EpdError, PermissionDenied
from ...proto.v1 import epd_pb2
from .. import metrics

log = logging.getLogger("epd.engine")
_REQUESTS = {"GetDispatchLayout": epd_pb2.GetDispatchLayoutRequest,
             "Dispatch": epd_pb2.DispatchRequest, "Combine": epd_pb2.CombineRequest,
             "GetStats": epd_pb2.GetStatsRequest,
             "LowLatencyDispatch": epd_pb2.LowLatencyDispatchRequest,
             "LowLatencyCombine": epd_pb2.LowLatencyCombineRequest}
SLEEP_SLICE = 0.1  # longest futex sleep: how fast a closed session is noticed
FLUSH_EVERY = 256  # requests between metric flushes while busy


class FastPathServer:
    def __init__(self, engine, session, path: str, slots: int, slot_bytes: int,
                 spin_seconds: float) -> None:
        self.engine, self.session = engine, session
        self.ring = R.Ring(path, slots, slot_bytes, create=True)
        self.spin = spin_seconds
        self._stop = False
        self._ops = {"GetDispatchLayout": engine.layout_op, "Dispatch": engine.dispatch_op,
                     "Combine": engine.combine_op,
                     "GetStats": lambda s, req, path: engine.stats(s),
                     "LowLatencyDispatch": engine.ll_dispatch_op,
                     "LowLatencyCombine": engine.ll_combine_op}
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"epd-fast-{session.session_id[:6]}")
        # Request counts by (method, code), added to the Prometheus counter in batches (when
        # the thread is about to sleep, every FLUSH_EVERY requests, at stop): one multiprocess
        # counter update costs several microseconds, a round trip's budget.
        self._counts: dict[tuple[str, str], int] = {}

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop serving (the session is closing): wake the thread, wait for it, free the ring."""
        self._stop = True
        self.ring.header[R.CLOSED] = 1
        R.futex_wake(self.ring.doorbell_addr)
        self.thread.join(timeout=30)
        if self.thread.is_alive():
            log.error("fast path of %s did not stop", self.session.describe())
        self.ring.close(unlink=True)

    def _running(self) -> bool:
        return not (self._stop or self.session.closed.is_set())

    def _wait_for(self, words, seq: int) -> bool:
        ring = self.ring
        spin_until = time.perf_counter() + self.spin
        while self._running():
            if words[R.S_STATE] == R.SUBMITTED and R.seq_of(words) == seq:
                return True
            if time.perf_counter() < spin_until:
                continue
            self._flush_counts()
            bell = int(ring.header[R.DOORBELL])
            ring.header[R.ENGINE_WAITING] = 1
            if not (words[R.S_STATE] == R.SUBMITTED and R.seq_of(words) == seq):
                R.futex_wait(ring.doorbell_addr, bell, SLEEP_SLICE)
            ring.header[R.ENGINE_WAITING] = 0
            spin_until = time.perf_counter() + self.spin
        return False

    def _serve(self) -> None:
        self.engine.backend.thread_init()
        # EPD_PROFILE_DIR: profile this thread (cProfile is per thread) for host-overhead work.
        prof_dir = os.environ.get("EPD_PROFILE_DIR")
        if not prof_dir:
            return self._loop()
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
        try:
            self._loop()
        finally:
            prof.disable()
            prof.dump_stats(os.path.join(prof_dir, f"engine-{os.getpid()}-"
                                                   f"{self.session.session_id[:8]}.prof"))

    def _loop(self) -> None:
        seq = 1
        while self._running():
            words, payload, state_addr = self.ring.slot((seq - 1) % self.ring.slots)
            if not self._wait_for(words, seq):
                break
            method = R.METHODS[words[R.S_METHOD]] if words[R.S_METHOD] < len(R.METHODS) \
                else "?"
            data = bytes(payload[:int(words[R.S_LENGTH])])
            status, out = self._handle(method, data)
            if len(out) > self.ring.capacity:
                status, out = 8, (f"{method} response of {len(out)} bytes exceeds the ring "
                                  f"slot ({self.ring.capacity})").encode()  # RESOURCE_EXHAUSTED
            payload[:len(out)] = out
            words[R.S_LENGTH] = len(out)
            words[R.S_STATUS] = status
            words[R.S_STATE] = R.DONE
            R.futex_wake(state_addr)
            seq += 1
            if not seq % FLUSH_EVERY:
                self._flush_counts()
        self._flush_counts()

    def _flush_counts(self) -> None:
        counts, self._counts = self._counts, {}
        for (method, code), n in counts.items():
            metrics.REQUESTS.labels(method, code).inc(n)

    def _handle(self, method: str, data: bytes) -> tuple[int, bytes]:
        code = "OK"
        try:
            if method == "Ping":
                return 0, b""
            op = self._ops.get(method)
            if op is None:
                raise EpdError(None, f"unknown fast-path operation {method!r}")
            req = _REQUESTS[method].FromString(data)
            # The same lookup (and message) as gRPC; a ring only serves its own session.
            if self.engine.session(req.session_id) is not self.session:
                raise PermissionDenied(f"session {req.session_id!r} does not own this ring")
            with self.session.op_lock:
                resp = op(self.session, req, "fastpath")
            return 0, resp.SerializeToString()
        except EpdError as e:
            code = e.code.name
            return e.code.value[0], e.message.encode()[:self.ring.capacity]
        except Exception as e:  # a bug: answer INTERNAL and keep serving
            log.exception("fast path %s failed", method)
            code = "INTERNAL"
            return 13, f"{method}: {type(e).__name__}: {e}".encode()[:self.ring.capacity]
        finally:
            key = (method, code)
            self._counts[key] = self._counts.get(key, 0) + 1
