"""A group member's low-latency chain on the CUDA engine: armed ops run without the engine's
host (cuda/epd_low_latency.cu, "The chain"; docs/DESIGN_NOTES.md).

The client's trigger kernel publishes the member's k-th low-latency collective in a ring in the
member's chain slot of the counter page (mapped host memory): `ring[k % LL_RING] = entry`, then
`tail = k + 1`. The chain stream holds instances `wait(tail >= k + 1); exec; reduce; finish`,
enqueued ahead of time; each reads the entry and the op's descriptor (its packed kernel
arguments, in device memory) and takes the collective's sequence from the member's device
state. The engine's host only keeps `DEPTH` instances enqueued ahead of the ring's head (the
stream-op poller calls `top_up`): no host look, no interpreter and no launch between the
client's trigger and the kernels.

The last kernel logs the entry (LL_RING_LOG, where the host reads which op ran), clears
ring[j] and publishes the head from the member's device state (LLS_K), so that an instance can
also be one CUDA graph launch (`--ll-chain-graphs`, on by default): LL_RING graphs, one per
ring position j, each a stream wait for ring[j] to be nonzero (published) and the kernels with
k = j; a top-up is then one driver call per call where a stream wait on the tail and four
launches are five.
The driver grows a context's room for live graph executables in steps, and a growth waits for
every kernel running on the device (a peer's low-latency kernel spinning for this rank
included), so the graphs are only instantiated in room the engine made before it served
(`GraphReserve`).

What the host still does: write a descriptor when an op is armed and clear it when disarmed
(an entry carries the descriptor's generation, so a stale entry runs nothing), and drain the
pending instances when the member's last op goes (`close`), handing the sequences back to
the runner. `--ll-chain auto` (the default) chains a member whose client shares the engine's
MPS server, outside shrink groups (stream_ops.chain_wanted): on one H200 under MPS it took a
sixth off a graph-replayed decode pair. What it costs: a p99 tail when the host's top-up
stalls behind another pool's work in the same engine process (class engines remove it); a
15x slower pair without MPS (auto leaves those members on the poller); a parked chain can hold
up other streams of the engine that share its hardware queue (at most `--ll-chain-members`
chains per engine of 32 queues); and a chained member refuses synchronous low-latency calls
(docs/DESIGN_NOTES.md, "The low-latency chain, built and measured"; docs/BENCHMARKS.md,
nineteenth and twenty-seventh sessions).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...proto import abi, cuda_driver, host_order, spin
from ...proto.errors import FailedPrecondition, ResourceExhausted
from .. import metrics
from . import cuda_kernels as ck

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the CPU-only install never builds a chain
    cp = None

log = logging.getLogger("epd.engine")
# Instances enqueued ahead of the head: the triggers in flight that need no host. When the
# host's top-up is late by more than DEPTH / 2 pairs the chain runs dry and the next call waits
# for it (counted in epd_ll_chain_starved_total). With a prefill pool on the same engine, 8
# (about 1 ms of decode) ran dry once per prefill layer; 64, the ring's size, only when the
# host's driver calls stalled about 10 ms (docs/BENCHMARKS.md, nineteenth session).
# EPD_CHAIN_DEPTH: an A/B switch (2..LL_RING; more would let the drain's released entries
# overwrite pending ones in the ring).
_depth = os.environ.get("EPD_CHAIN_DEPTH", "")
DEPTH = min(max(int(_depth), 2), abi.LL_RING) if _depth.isdigit() else abi.LL_RING
# Diagnostic (docs/GPU_NOTES.md): CUDA events around each instance's wait and kernels, their
# GPU times into epd_ll_chain_seconds{segment}, read back by the poller off the call's path.
TIMELINE = os.environ.get("EPD_CHAIN_TIMELINE", "") not in ("", "0")
TRAITS = {"Bf16": 0, "F16": 1, "F32": 2}
_lingering: list[LowLatencyChain] = []  # closed with kernels still queued: freed when done
_lingering_lock = threading.Lock()  # (closes on sessions' threads, prunes on the poller's)


_launched: list[tuple[str, Any, Any]] = []  # TIMELINE: the poller's launches not yet read


def time_launch(kind: str, start: Any, end: Any) -> None:
    """TIMELINE, the poller's path: observe the launches whose events have completed as
    segment "launched" (their GPU time, start to end), then hold this one."""
    while _launched and _launched[0][2].done:
        k, a, b = _launched.pop(0)
        metrics.observe(metrics.LL_CHAIN_SECONDS, (k, "launched"),
                        cp.cuda.get_elapsed_time(a, b) * 1e-3)
    _launched.append((kind, start, end))


@dataclass
class ChainOp:
    index: int  # descriptor row
    kind: int  # abi.LLX_DISPATCH / LLX_COMBINE
    entry: int  # index | generation << 16 (the trigger adds buffer << 8)


def instance_graph(capture: Any, wait_ptr: int, launches: list[Any], k: int) -> Any:
    """One chain instance as a CUDA graph (captured on stream `capture`): wait until the
    word at `wait_ptr` is nonzero (its ring entry published), then `launches` with k."""
    def enqueue(stream: int) -> None:
        cuda_driver.stream_wait_nonzero(stream, wait_ptr)
        for launch in launches:
            launch.set(ck.CHAIN_K, k)
            launch(capture)

    return cuda_driver.Graph(capture.ptr, enqueue)


class GraphReserve:
    """Room for the chains' CUDA graphs, made while the device is idle.

    The driver keeps room for a number of live graph executables per context and grows it in
    steps (on an H200: at the 32nd, then past 512 once 512 had been made); a growth waits for
    every kernel running on the device to end (benchmarks/graph_instantiate_probe.py). A chain
    built while a peer's low-latency kernel spun for this rank stalled in
    cuGraphInstantiateWithFlags until that kernel's deadline, holding the driver's lock
    against every other thread of the engine (docs/DESIGN_NOTES.md, "Chain instances as CUDA
    graphs"). The room stays once grown, so before the engine serves, this instantiates
    `chains` x LL_RING graphs of an instance's shape (the chain's own kernels on scratch
    buffers; never launched) and frees them; a chain then takes LL_RING of that room or
    enqueues its instances by launches."""

    def __init__(self, kernels: Any, num_sms: int, chains: int) -> None:
        self._lock = threading.Lock()
        self.free = 0
        ring = cp.zeros(abi.LL_RING_RELEASED + 1, np.uint32)
        table = cp.zeros((abi.LL_CHAIN_OPS, abi.LLX_WORDS), np.uint64)
        state = cp.zeros(abi.LLS_WORDS, np.uint64)
        entry = cp.zeros(abi.LL_RING, np.uint32)
        launches = [launch for _, launch in kernels.chain_launches(
            ring.data.ptr, table, state, num_sms, "Bf16", False, entry)]
        capture = cp.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        graphs = []
        try:
            for _ in range(chains * abi.LL_RING):
                graphs.append(instance_graph(capture, ring.data.ptr, launches, 0))
        finally:
            for g in graphs:
                g.close()
        self.free = chains
        log.info("room for %d chains' graphs (%d) made in %.1f ms", chains, len(graphs),
                 (time.perf_counter() - t0) * 1e3)

    def take(self) -> bool:
        with self._lock:
            if self.free <= 0:
                return False
            self.free -= 1
            return True

    def give(self) -> None:
        with self._lock:
            self.free += 1


class LowLatencyChain:
    def __init__(self, runner: Any, kernels: Any, ring_words: np.ndarray, ring_ptr: int,
                 num_sms: int, priority: int, gate: bool = False,
                 trait: str | None = None, group: str = "",
                 reserve: GraphReserve | None = None) -> None:
        """`ring_words`: the chain slot as int32 host words; `ring_ptr`: its device address;
        `gate`: wait for the tail in a spinning one-thread kernel, not a stream wait;
        `reserve`: the engine's room for graphs (instances as graph launches where it has
        LL_RING left; None: launches); `trait`:
        the element type of the member's combines (its group's dtype), whose reduce kernel
        alone the chain launches (None, or EPD_CHAIN_REDUCE=generic: the one for any type);
        `group`: the group's name (its metrics)."""
        self.group = group
        if os.environ.get("EPD_CHAIN_REDUCE", "") == "generic":  # (A/B switches, the
            trait = None                                         # chain's timeline says)
        self.trait = trait
        split = os.environ.get("EPD_CHAIN_EXEC", "") == "split"
        # Every block of every kernel reading the entry from mapped host memory cost ~100 µs
        # per kernel; fetched once into device memory the chain matched the poller alone
        # (docs/BENCHMARKS.md, fourteenth and nineteenth sessions). EPD_CHAIN_ENTRY=ring: the
        # old reads, for A/B runs.
        on_device = os.environ.get("EPD_CHAIN_ENTRY", "") != "ring"
        self.runner, self.words, self.ring_ptr = runner, ring_words, ring_ptr
        self.tail_ptr = ring_ptr + 4 * abi.LL_RING_TAIL
        with cp.cuda.Device(runner.device_id):
            self.table = cp.zeros((abi.LL_CHAIN_OPS, abi.LLX_WORDS), np.uint64)
            state = [runner.seq["ll_dispatch"], runner.seq["ll_combine"], *runner.ll_filled,
                     0]  # (LLS_K: no instance finished yet)
            assert len(state) == abi.LLS_WORDS
            self.state = cp.asarray(np.array(state, np.uint64))
            self.stream = cp.cuda.Stream(non_blocking=True, priority=priority)
            self.side = cp.cuda.Stream(non_blocking=True)
            self.entry_copy = cp.zeros(abi.LL_RING, np.uint32) if on_device else None
            named = kernels.chain_launches(ring_ptr, self.table, self.state, num_sms, trait,
                                           split, self.entry_copy)
            self.segments = ("wait", *(name for name, _ in named))  # (the timeline's)
            self.launches = [launch for _, launch in named]
            self.gate = kernels.chain_gate(ring_ptr) if gate else None
            # (the engine gives no reserve with the timeline or the gate kernel, whose
            # launches graphs cannot be; a lingering chain done by now gives its room back)
            if _lingering:
                _prune()
            self.reserve = reserve if reserve is not None and reserve.take() else None
            if reserve is not None and self.reserve is None:
                log.info("group %r: the chain enqueues its instances by launches (the "
                         "engine's room for graphs is taken: --ll-chain-members)", group)
            self.graphs = self._build_graphs(group) if self.reserve is not None else None
        self.words[:abi.LL_RING_RELEASED + 1] = 0
        self.ops: dict[int, ChainOp] = {}
        self._free = list(range(abi.LL_CHAIN_OPS))
        self.enqueued = 0
        self.depth = DEPTH  # (instances kept enqueued ahead: the poller's nap reads it)
        self.seen = 0  # the head at the last top_up
        # the last top_up's time in the driver calls that enqueue instances (the poller
        # reports it in a slow round: epd_stream_poller_slow_seconds{part="enqueue"})
        self.enqueue_seconds = 0.0
        self.closed = False
        self._released = False  # (no kernel of the chain can write its slot any more)
        self._callbacks: list[Callable[[], None]] = []  # on_released's
        self._lock = threading.Lock()  # top_up (the poller) against close
        # TIMELINE: instance k's events (after its wait and after each kernel), and the
        # event after the last instance read back (the start of the next one's wait)
        self._events: dict[int, list[Any]] = {}
        self._last_finish: Any = None
        self._looked: float | None = None  # TIMELINE: the host's previous top_up
        try:
            self.top_up()
        except BaseException:
            # (no ring holds this chain: drain what was enqueued, then its graphs and room go,
            # at once or once its stream is done)
            with contextlib.suppress(Exception):
                self.close(1.0)
            raise
        if self.enqueue_seconds > 1.0:  # (the graphs' first launches upload them)
            log.warning("group %r: the chain's first %d instances took %.1f s to enqueue",
                        group, DEPTH, self.enqueue_seconds)

    # -- descriptors (arm / disarm) -------------------------------------------------------
    def add(self, prepared: Any, done_ptr: int, gen: int,
            source: ChainOp | None = None) -> ChainOp:
        """Write the descriptor of an armed op (cuda.py's _PreparedDispatch/_PreparedCombine),
        of generation `gen` (1..0xFFFF: the engine's, stream_ops.StreamOps._next_gen)."""
        if not self._free:
            raise ResourceExhausted(f"a member's chain holds at most {abi.LL_CHAIN_OPS} ops")
        idx = self._free.pop(0)
        d = np.zeros(abi.LLX_WORDS, np.uint64)
        d[abi.LLX_GEN], d[abi.LLX_DONE] = gen, done_ptr
        d[abi.LLX_BUFFER_STRIDE] = self.runner.ll.buffer_stride
        if source is None:  # a dispatch
            kind, args = abi.LLX_DISPATCH, prepared.launch.values()
            stats = prepared.stats
            if stats is not None:
                d[abi.LLX_STATS] = stats.data.ptr
                d[abi.LLX_STATS_STRIDE] = stats.strides[0] // stats.itemsize
        else:
            kind = abi.LLX_COMBINE
            push, reduce = prepared.launches
            args = push.values()
            d[abi.LLX_ARGS2:abi.LLX_ARGS2 + len(reduce.values())] = reduce.values()
            d[abi.LLX_SOURCE] = source.index
            trait = ck._trait_for(prepared.args.x.dtype)
            if self.trait is not None and trait != self.trait:  # (the engine checks x's dtype)
                raise FailedPrecondition(f"a {trait} combine on a chain built for "
                                         f"{self.trait} combines")
            d[abi.LLX_TRAIT] = TRAITS[trait]
        d[abi.LLX_ARGS:abi.LLX_ARGS + len(args)] = args
        d[abi.LLX_KIND] = kind
        self._write(idx, d)
        op = ChainOp(idx, kind, idx | gen << 16)
        self.ops[idx] = op
        return op

    def remove(self, op: ChainOp) -> None:
        """The op is disarmed: its descriptor runs nothing any more (an entry still naming it
        finishes without touching memory), and the row can be reused with a new generation."""
        self._write(op.index, np.zeros(abi.LLX_WORDS, np.uint64))
        self.ops.pop(op.index, None)
        self._free.append(op.index)

    def _write(self, idx: int, words: np.ndarray) -> None:
        with cp.cuda.Device(self.runner.device_id):
            self.table[idx].set(words, stream=self.side)
            self.side.synchronize()

    # -- the instances --------------------------------------------------------------------
    def _word(self, i: int) -> int:
        return int(self.words[i]) & 0xFFFFFFFF

    def top_up(self) -> list[int]:
        """Keep DEPTH instances enqueued ahead of the head; returns the kinds of the entries
        the chain finished since the last call (for the request counters)."""
        if _lingering:  # (a closed chain's slot goes back once its stream is done)
            _prune()
        with self._lock:
            self.enqueue_seconds = 0.0
            head, kinds = self._finished()
            if head == self.enqueued & 0xFFFFFFFF and self.busy():
                # (ran dry, a call waits)
                metrics.inc(metrics.LL_CHAIN_STARVED, (self.group,))
            if TIMELINE:
                now = time.perf_counter()
                if self._looked is not None:
                    metrics.observe(metrics.LL_CHAIN_SECONDS, ("host", "topup_gap"),
                                    now - self._looked)
                self._looked = now
            if self._events:
                self._read_timeline()
            if self.closed or (self.enqueued - head) & 0xFFFFFFFF >= DEPTH:
                return kinds
            t0 = time.perf_counter()
            with cp.cuda.Device(self.runner.device_id):
                while (self.enqueued - head) & 0xFFFFFFFF < DEPTH:
                    self._enqueue(self.enqueued)
                    self.enqueued += 1
            self.enqueue_seconds = time.perf_counter() - t0
            return kinds

    def finished(self) -> list[int]:
        """The kinds of the entries the chain finished since the last look (top_up's, or
        this: a disarm counts its op's last calls before the op's descriptor goes)."""
        with self._lock:
            return self._finished()[1]

    def _finished(self) -> tuple[int, list[int]]:
        """(Under self._lock.) The head, and the kinds of the entries finished before it
        since the last look, read from the last kernel's log."""
        head = self._word(abi.LL_RING_HEAD)
        host_order.consume()  # (the head read before the log the last kernel wrote)
        done = (head - self.seen) & 0xFFFFFFFF
        kinds = []
        for i in range(min(done, abi.LL_RING)):
            op = self.ops.get(self._word(abi.LL_RING_LOG + (self.seen + i) % abi.LL_RING)
                              & 0xFF)
            if op is not None:
                kinds.append(op.kind)
        self.seen = head
        return head, kinds

    def _build_graphs(self, group: str) -> list[cuda_driver.Graph] | None:
        """The LL_RING instance graphs (k is the ring position in their kernels: they read
        only ring[k % LL_RING], and the last one takes the head from the member's state), or
        None where capturing fails (the launches then). A graph's kernels run at the priority
        of the stream it is launched into, the chain's (no per-node priorities)."""
        capture = cp.cuda.Stream(non_blocking=True)
        graphs: list[cuda_driver.Graph] = []
        t0 = time.perf_counter()
        try:
            for j in range(abi.LL_RING):  # (instance k waits for ring[k % LL_RING])
                graphs.append(instance_graph(capture, self.ring_ptr + 4 * j, self.launches,
                                             j))
        except Exception as e:
            log.warning("the low-latency chain of group %r enqueues its instances one launch "
                        "at a time: capturing them failed (%s)", group, e)
            for g in graphs:
                g.close()
            self._give_back()
            return None
        took = time.perf_counter() - t0
        slow = max(graphs, key=lambda g: g.capture_seconds + g.instantiate_seconds)
        log.log(logging.WARNING if took > 1.0 else logging.INFO,
                "group %r: the chain's %d graphs built in %.1f ms (slowest: capture %.1f ms, "
                "instantiate %.1f ms)", group, len(graphs), took * 1e3,
                slow.capture_seconds * 1e3, slow.instantiate_seconds * 1e3)
        return graphs

    def _close_graphs(self) -> None:
        """(Once the chain's stream is done: no launch of them is pending.)"""
        for g in self.graphs or ():
            g.close()
        if self.graphs is not None:
            self._give_back()
        self.graphs = None

    def _give_back(self) -> None:
        if self.reserve is not None:
            self.reserve.give()
            self.reserve = None

    def _enqueue(self, k: int) -> None:
        if self.graphs is not None:
            self.graphs[k % abi.LL_RING].launch(self.stream.ptr)
            return
        if self.gate is not None:
            self.gate.set(ck.CHAIN_K, (k + 1) & 0xFFFFFFFF)
            self.gate(self.stream)
        else:
            cuda_driver.stream_wait_geq(self.stream.ptr, self.tail_ptr, (k + 1) & 0xFFFFFFFF)
        events = self._events.setdefault(k, []) if TIMELINE else None
        try:
            if events is not None:
                events.append(self._record())
            for launch in self.launches:
                launch.set(ck.CHAIN_K, k)
                launch(self.stream)
                if events is not None:
                    events.append(self._record())
        except BaseException:
            # Part of instance k is enqueued: enqueueing it again would run its collective
            # twice (and its finish would count twice in the head). The chain takes no more
            # instances, and k counts as enqueued, so that the drain releases its entry and
            # its wait passes (else the stream would stay parked for good); its pending calls
            # fail at their deadlines.
            self.closed = True
            self.enqueued = k + 1
            log.error("group %r: the low-latency chain stopped: instance %d was enqueued in "
                      "part", self.group, k)
            raise

    def _record(self) -> Any:
        e = cp.cuda.Event()
        e.record(self.stream)
        return e

    def _read_timeline(self) -> None:
        """Observe the segments of the instances the chain has finished (in order; an
        instance whose last event has not completed yet waits for the next look)."""
        for k in sorted(self._events):
            ev = self._events[k]  # (recorded in stream order: the last one done, all done)
            if len(ev) < len(self.segments) or not ev[-1].done:
                break
            del self._events[k]
            op = self.ops.get(self._word(abi.LL_RING_LOG + k % abi.LL_RING)
                              & 0xFF)  # (a diagnostic: k + 64 may have logged over it)
            kind = ("released" if op is None else
                    "dispatch" if op.kind == abi.LLX_DISPATCH else "combine")
            starts = [self._last_finish, *ev[:-1]]
            for name, a, b in zip(self.segments, starts, ev, strict=True):
                if a is not None:
                    metrics.observe(metrics.LL_CHAIN_SECONDS, (kind, name),
                                    cp.cuda.get_elapsed_time(a, b) * 1e-3)
            self._last_finish = ev[-1]

    def busy(self) -> bool:
        """A trigger was published that the chain has not finished."""
        return self._word(abi.LL_RING_TAIL) != self._word(abi.LL_RING_HEAD)

    def _to_runner(self) -> None:
        """The chain's sequences and buffer fills back to the runner (after the drain): the
        poller's or a synchronous call's launches go on from them."""
        with cp.cuda.Device(self.runner.device_id):
            s = cp.asnumpy(self.state, stream=self.side)
        self.runner.seq["ll_dispatch"], self.runner.seq["ll_combine"] = int(s[0]), int(s[1])
        self.runner.ll_filled[:] = [int(v) for v in
                                    s[abi.LLS_FILLED:abi.LLS_FILLED + abi.LL_BUFFERS]]

    # -- teardown -------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """Drain: publish a released entry for every pending instance, wait for the chain to
        pass them (the group's abort word ends a kernel stuck waiting for a peer). Once the
        chain's kernels are done with its ring slot (at once when it drained, else when its
        stream is done) the `on_released` callbacks run: a lingering chain's instances still
        write the slot, and given to another ring or call before that, they would clear its
        words."""
        with self._lock:
            self.closed = True
        tail = self._word(abi.LL_RING_TAIL)
        ahead = (self.enqueued - tail) & 0xFFFFFFFF  # instances no trigger has reached yet
        if ahead <= DEPTH:  # (else the tail is past every instance: each has its entry)
            for i in range(ahead):
                self.words[(tail + i) % abi.LL_RING] = abi.LL_ENTRY_RELEASED
            host_order.publish()  # (the entries before the tail)
            self.words[abi.LL_RING_TAIL] = np.int32(np.uint32(self.enqueued & 0xFFFFFFFF))
        end = self.enqueued & 0xFFFFFFFF
        if self.graphs is not None:  # graph instances wait on their entries, not the tail:
            # every pending position still 0 gets one (an entry the trigger published before
            # its tail, and a client's 0, would otherwise leave an instance parked for good)
            head = self._word(abi.LL_RING_HEAD)
            host_order.consume()  # (the head before the entries the last kernel cleared)
            for i in range(min((end - head) & 0xFFFFFFFF, abi.LL_RING)):
                pos = (head + i) % abi.LL_RING
                if self._word(pos) == 0:
                    self.words[pos] = abi.LL_ENTRY_RELEASED
        if self._drained(lambda: self._word(abi.LL_RING_HEAD) == end, timeout,
                         "did not drain"):
            self.stream.synchronize()
            self._close_graphs()
            self._to_runner()  # a later chain, or a host-launched call, goes on from here
            self._release_slot()
        _prune()

    def on_released(self, callback: Callable[[], None]) -> None:
        """Call `callback` once no kernel of the chain can write its ring slot any more."""
        with self._lock:
            if not self._released:
                self._callbacks.append(callback)
                return
        callback()

    def _release_slot(self) -> None:
        with self._lock:
            self._released = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def _drained(self, done: Callable[[], bool], timeout: float, what: str) -> bool:
        """Until `done()` within `timeout`; else the chain lingers, its buffers kept until its
        stream is done (a kernel stuck for a peer ends at the group's abort word)."""
        if spin.wait_until(done, timeout, spin=0.0, nap=0.0005):
            return True
        log.warning("a low-latency chain %s within %.1f s; its buffers are kept until its "
                    "stream is done", what, timeout)
        with _lingering_lock:
            _lingering.append(self)
        return False


def _prune() -> None:
    """Free the lingering chains whose streams are done (their ring slots go back now)."""
    with _lingering_lock:
        done = [c for c in _lingering if c.stream.done]
        _lingering[:] = [c for c in _lingering if c not in done]
    for c in done:
        c._close_graphs()
        c._release_slot()
