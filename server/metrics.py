"""Prometheus metrics (README.md, "Metrics and health"). Base units, microsecond-scale latency
buckets.

The supervisor and every engine are separate processes behind one scrape endpoint: the supervisor
sets PROMETHEUS_MULTIPROC_DIR before any of them imports prometheus_client, so each process writes
its samples to files there and the endpoint aggregates them (prometheus_client's multiprocess
mode). Gauges say how they aggregate across processes.

Bounded label sets: every metric labelled by `group` maps the group name through
`group_label()`: a process labels at most `--max-group-label-values` distinct names (default
256; one owner, a uid, pool or tenant pool, at most a quarter of it), later ones become
group="_overflow". The cap counts every name a process has used, and
the names already in the folder when it starts (`set_group_label_cap`: an engine restarting
in a loop would otherwise add up to the cap each time), not only live groups: in
multiprocess mode prometheus_client cannot remove a series (`remove()` warns "not
implemented in multi-process mode" and drops only the in-process child; the sample stays in
the process's mmap file and keeps being exported after the process exits; the supervisor
folds a dead engine's counters and histograms into an archive file and mark_process_dead
removes its live gauges), so freeing a slot when a group ends would not bound the files, the
scrape or the memory.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from ..proto import group_names

OVERFLOW_GROUP = "_overflow"
_group_cap = 256
_group_names: set[str] = set()
_group_lock = threading.Lock()


# Held while the supervisor's endpoint collects the folder and while a dead engine's files
# are folded into the archive: a scrape sees its samples in one place or the other, never in
# both or neither (a counter that seemed to drop would read as a reset).
COLLECT_LOCK = threading.Lock()
_ARCHIVED_TYPES = ("counter", "histogram", "summary")


def _samples(path: str) -> list[tuple[str, float, float]]:
    """(key, value, timestamp) of every sample in a multiprocess file, read whole; ValueError
    for a file that cannot be read (cut short, being created, not a sample file: prometheus
    reports those as struct.error, RuntimeError, OSError...)."""
    from prometheus_client.mmap_dict import MmapedDict
    try:
        return [(k, v, ts) for k, v, ts, _ in MmapedDict.read_all_values_from_file(path)]
    except Exception as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from None


def archive_dead_process(pid: int, folder: str | None = None) -> None:
    """Fold a dead process's counter, histogram and summary files into `<type>_archive.db` of
    the multiprocess folder and remove them: its totals stay exported (counters must not go
    down), but an engine that keeps restarting no longer adds a file per start to every
    scrape. (Its live gauges are prometheus_client's mark_process_dead's.)"""
    from prometheus_client.mmap_dict import MmapedDict
    folder = folder or os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    if not folder:
        return
    with COLLECT_LOCK:
        for typ in _ARCHIVED_TYPES:
            src = os.path.join(folder, f"{typ}_{pid}.db")
            if not os.path.exists(src):
                continue
            try:  # (read whole first: a file cut short adds nothing, and is set aside)
                values = _samples(src)
            except ValueError:
                os.replace(src, src + ".unreadable")  # (not *.db: no scrape reads it)
                raise
            archive = MmapedDict(os.path.join(folder, f"{typ}_archive.db"))
            try:
                for key, value, timestamp in values:
                    old, _ts = archive.read_value(key)
                    archive.write_value(key, old + value, timestamp)
            finally:
                archive.close()
            os.unlink(src)


def set_group_label_cap(cap: int, folder: str | None = None) -> None:
    """The cap of this process's group label values. The names already in the multiprocess
    folder's files (`folder`, default PROMETHEUS_MULTIPROC_DIR: the archive of dead engines,
    the other live processes) count against it and keep their label (their series exist
    already: an active group must not move to _overflow because an engine restarted); a new
    name gets its own label only while the names known here are fewer than `cap`. So an engine
    that restarts in a loop cannot grow the node's label set past the cap."""
    global _group_cap
    _group_cap = max(0, int(cap))
    names = labels_in_folder(folder or os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
    with _group_lock:
        _group_names.update(names - {OVERFLOW_GROUP})


def labels_in_folder(folder: str, label: str = "group") -> set[str]:
    """The values of `label` in the multiprocess folder's sample files (empty without one).
    Best effort: a file another process is creating or folding right now, or one that cannot
    be read, is skipped (counting names must never stop an engine from starting)."""
    if not folder or not os.path.isdir(folder):
        return set()
    found: set[str] = set()
    for entry in os.scandir(folder):
        if not entry.name.endswith(".db"):
            continue
        with contextlib.suppress(ValueError):  # (also json's, for a key that is not JSON)
            for key, _, _ in _samples(entry.path):
                value = json.loads(key)[2].get(label)
                if isinstance(value, str):
                    found.add(value)
    return found


_OWNER_SUFFIX = re.compile(r" \((uid \d+|pool|tenant [a-z0-9-]+)\)$")


def owned_label(name: str, uid: int, shared: bool, tenant_pool: str = "") -> str:
    """The `group` label of a group named `name`, joined by `uid`: group names are each
    namespace's own (coordinator.py: a uid's, the pool of --allow-uids / --allow-gids,
    `shared`, or a tenant pool's), so two namespaces' groups of one name are two groups, and
    two series. The name (less its instance tag) with its owner: ` (tenant P)`, ` (pool)`,
    ` (uid N)`, or nothing for the daemon's own uid, unless the name itself ends like an owner
    (then it gets its own: no name can take another owner's label)."""
    base = group_names.base_name(name)
    if tenant_pool:
        return f"{base} (tenant {tenant_pool})"
    if shared:
        return f"{base} (pool)"
    if uid == os.geteuid() and not _OWNER_SUFFIX.search(base):
        return base
    return f"{base} (uid {uid})"


def owner_of(label: str) -> str:
    """The owner part of an owned label (` (uid N)`, ` (pool)`, ` (tenant P)`; "" for the
    daemon's own uid's groups)."""
    m = _OWNER_SUFFIX.search(label)
    return m.group(1) if m else ""


def owner_share(cap: int) -> int:
    """The label values one owner may take of a process's `cap`: a quarter (at least 16), so
    that one tenant's many groups cannot push every other tenant's into _overflow (a review
    did, with 260 one-rank groups)."""
    return min(cap, max(16, cap // 4))


def group_label(name: str) -> str:
    """The `group` label value for a group name: itself (less an instance tag: group_names)
    while under the cap and under its owner's share of it (`owner_share`), else _overflow."""
    name = group_names.base_name(name)
    if name in _group_names:
        return name
    with _group_lock:
        if name in _group_names:
            return name
        owner = owner_of(name)  # (counted anew: a new name is rare, a group's first call)
        if (len(_group_names) >= _group_cap or sum(
                owner_of(n) == owner for n in _group_names) >= owner_share(_group_cap)):
            return OVERFLOW_GROUP
        _group_names.add(name)
        return name


RAW_LABEL_CACHE = 4096  # label-value tuples a group-labelled metric remembers as asked for


class _GroupLabelled:
    """A metric whose first label is `group`: its values go through group_label(). Children
    asked for by position are cached by their label values: prometheus_client validates and
    converts the labels on every call, microseconds a hot-path call cannot spare (a group
    name's label never changes once given: the set of names only grows). A name over the cap
    is cached as _overflow, not as itself: the cache stays as bounded as the label set (else
    a tenant making groups of new names would grow every engine's memory without end)."""

    def labels(self, *values, **kw):
        if values and not kw:
            # By the values asked for (a facade group's name carries an instance tag, `name@tag`,
            # which the label drops: cached only by its label, every call of such a group paid
            # the mapping again); this cache is cleared when it reaches RAW_LABEL_CACHE, so
            # names a tenant makes up cannot grow it without end.
            raw = self.__dict__.setdefault("_epd_raw", {})
            child = raw.get(values)
            if child is None:
                cache = self.__dict__.setdefault("_epd_children", {})
                key = (group_label(str(values[0])), *values[1:])
                child = cache.get(key)
                if child is None:
                    child = cache[key] = super().labels(*key)
                if len(raw) >= RAW_LABEL_CACHE:
                    raw.clear()
                raw[values] = child
            return child
        if "group" in kw:
            kw["group"] = group_label(str(kw["group"]))
        return super().labels(*values, **kw)


class GroupCounter(_GroupLabelled, Counter):
    pass


# -- updates in batches, for the threads that serve calls -------------------------------------
class Batch:
    """One thread's counter increments and histogram observations, held until `flush()`. In
    multiprocess mode every update is a write into a mapped file (measured here: 2.6 µs per
    increment, 4.7 µs per observation) and a child lookup by labels a few µs more, and a call
    makes five to ten of them: as much as issue 10's host budget for the whole call. Held by
    (metric, labels), a held increment costs one dict update; the fast-path and poller threads
    apply theirs when they go idle and every few hundred calls, so a scrape lags a busy thread
    by at most that."""

    def __init__(self) -> None:
        self._inc: dict[tuple[Any, tuple], float] = {}
        self._obs: dict[tuple[Any, tuple], list[float]] = {}

    def flush(self) -> None:
        inc, self._inc = self._inc, {}
        obs, self._obs = self._obs, {}
        for (metric, labels), value in inc.items():
            metric.labels(*labels).inc(value)
        for (metric, labels), values in obs.items():
            observe_all(metric.labels(*labels), values)


def observe_all(child: Any, values: list[float]) -> None:
    """`child.observe(v)` for each of `values`, as one write per bucket touched and one to the
    sum: a flush of a busy thread holds hundreds of observations of a few series, and each
    observe is two writes into the mapped file (~5 µs). Reaches into prometheus_client's
    histogram child (`_upper_bounds`, `_buckets`, `_sum`, stable since 0.4; pinned < 1), and
    observes one by one where those are not there."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if len(values) == 1 or bounds is None or buckets is None or total is None:
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:  # the first bucket whose bound is >= v, as observe() picks it
        if v == v:  # (a NaN falls in no bucket, as with observe())
            i = bisect.bisect_left(bounds, v)
            counts[i] = counts.get(i, 0) + 1
    total.inc(math.fsum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


_thread = threading.local()


def inc(metric: Any, labels: tuple, value: float = 1.0) -> None:
    """`metric.labels(*labels).inc(value)`, held in the calling thread's batch if it has one."""
    batch: Batch | None = getattr(_thread, "batch", None)
    if batch is None:
        metric.labels(*labels).inc(value)
    else:
        key = (metric, labels)
        batch._inc[key] = batch._inc.get(key, 0.0) + value


def observe(metric: Any, labels: tuple, value: float) -> None:
    """`metric.labels(*labels).observe(value)`, held in the calling thread's batch if it has
    one."""
    batch: Batch | None = getattr(_thread, "batch", None)
    if batch is None:
        metric.labels(*labels).observe(value)
    else:
        key = (metric, labels)
        held = batch._obs.get(key)
        if held is None:
            batch._obs[key] = [value]
        else:
            held.append(value)


@contextlib.contextmanager
def batched() -> Iterator[Batch]:
    """The calling thread's metric updates go into a batch until the block ends (flushed then);
    the thread flushes it meanwhile where it chooses."""
    batch = _thread.batch = Batch()
    try:
        yield batch
    finally:
        _thread.batch = None
        batch.flush()


class GroupGauge(_GroupLabelled, Gauge):
    pass


class GroupHistogram(_GroupLabelled, Histogram):
    pass


# 5 µs .. 20 s, roughly x2 steps: collectives take tens of µs on GPUs and ms on the CPU backend.
LATENCY_BUCKETS = (5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
                   20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)

DISPATCH_SECONDS = GroupHistogram("epd_dispatch_seconds", "Dispatch latency inside the engine",
                             ["group", "path", "backend"], buckets=LATENCY_BUCKETS)
COMBINE_SECONDS = GroupHistogram("epd_combine_seconds", "Combine latency inside the engine",
                            ["group", "path", "backend"], buckets=LATENCY_BUCKETS)
LAYOUT_SECONDS = GroupHistogram("epd_layout_seconds", "get_dispatch_layout latency",
                           ["group", "path", "backend"], buckets=LATENCY_BUCKETS)
STREAM_OP_LAUNCH_SECONDS = GroupHistogram(
    "epd_stream_op_launch_seconds", "Stream-ordered calls: host time from seeing the trigger "
    "to the last kernel launched (the GPU time follows)", ["group", "kind"],
    buckets=LATENCY_BUCKETS)
STREAM_OP_DETECT_SECONDS = GroupHistogram(
    "epd_stream_op_detect_seconds", "Stream-ordered calls: the poller's gap between its look "
    "before a trigger and the look that saw it (an upper bound of the detection delay; "
    "long when the poller slept or waited for the interpreter)", ["group", "kind"],
    buckets=LATENCY_BUCKETS)
LL_CHAIN_SECONDS = Histogram(
    "epd_ll_chain_seconds", "Low-latency chain (--ll-chain), diagnostic, EPD_CHAIN_TIMELINE=1: "
    "GPU time of each part of a chained call (wait: from the previous call's finish to the "
    "trigger seen; exec, reduce, finish: the chain's kernels; launched: the poller's "
    "launches of armed ops without a chain), by the call's kind; kind host, segment "
    "topup_gap: the engine host's time between two top-ups of a chain (host time)",
    ["kind", "segment"],
    buckets=LATENCY_BUCKETS)
STREAM_POLLER_SLOW_SECONDS = Histogram(
    "epd_stream_poller_slow_seconds", "Stream-ordered calls: the engine poller's rounds longer "
    "than 1 ms beyond the wait they asked for (a nap, an idle look's period), by part (top_up: "
    "the low-latency chains' top-ups, of which enqueue: their driver calls; launch: the "
    "poller's launches of triggered ops; sleep: its sleep or yield beyond that wait, and the "
    "wait for the interpreter after it); one observation per part per slow round",
    ["part"],
    buckets=LATENCY_BUCKETS)
LL_CHAIN_STARVED = GroupCounter(
    "epd_ll_chain_starved", "Low-latency chain (--ll-chain): times a chain ran out of enqueued "
    "instances with a call waiting (the engine host's top-up was late; the call waited for it)",
    ["group"])
ENGINE_GC_PAUSE_SECONDS = Histogram(
    "epd_engine_gc_pause_seconds", "Engine: pauses of the garbage collector, which stop every "
    "thread serving calls (server/engine/gc_pauses.py)", ["generation"],
    buckets=LATENCY_BUCKETS)
REQUESTS = Counter("epd_requests", "Engine requests by method and status code",
                   ["method", "code"])
# The engine's own CPU per request (issue 10's "host CPU per call"): thread CPU time of the work
# (decode, checks, launches, encode), not the spinning of the thread that waits for the next one;
# divided by epd_requests_total of the same method it is the CPU per call.
REQUEST_CPU_SECONDS = Counter(
    "epd_request_cpu_seconds", "Engine thread CPU time spent serving requests (the work, "
    "without the waits between them), by method and path (fastpath; grpc: the operation on the "
    "session's worker, not gRPC's decoding; poller; chain: the GPU chains' top-ups, method "
    "LowLatencyChainTopUp, an instance enqueued per call a chain ran)",
    ["method", "path"])
BYTES_SENT = GroupCounter("epd_bytes_sent", "Payload bytes sent to other ranks",
                     ["group", "peer_class"])
BYTES_RECEIVED = GroupCounter("epd_bytes_received", "Payload bytes received from other ranks",
                         ["group", "peer_class"])
RECV_TOKENS = GroupCounter("epd_recv_tokens", "Token rows received by dispatch", ["group"])
EXPERT_RECV_TOKENS = GroupCounter("epd_expert_recv_tokens",
                             "(token, expert) pairs received per local expert (opt-in)",
                             ["group", "expert"])
LOAD_IMBALANCE = GroupGauge("epd_expert_load_imbalance_ratio",
                       "max / mean of (token, expert) pairs over the group's experts, last layout",
                       ["group"], multiprocess_mode="livemax")
TIMEOUTS = GroupCounter("epd_collective_timeouts", "Collectives that hit their deadline", ["group"])
ABORTS = Counter("epd_group_aborts", "Groups aborted (faults: a member's session ended while "
                 "holding it, an engine lost, a drain)", ["reason"])
LEAVES = Counter("epd_group_leaves", "Groups ended by a member's clean leave() (not an abort): "
                 "once per group, whose first leave ends it; in a shrink group, each rank "
                 "that leaves")
RANKS_MASKED = Counter("epd_ranks_masked", "Ranks of shrink groups masked instead of aborting "
                       "the group (why: gone = it went away, call = a RankMask call)", ["why"])
SESSIONS = Gauge("epd_sessions", "Open sessions", ["engine"], multiprocess_mode="livesum")
GROUPS = Gauge("epd_groups", "Group memberships held", ["engine"], multiprocess_mode="livesum")
REGIONS = Gauge("epd_regions", "Registered client regions", ["engine"],
                multiprocess_mode="livesum")
REGION_BYTES = Gauge("epd_region_bytes", "Bytes of registered client regions", ["engine"],
                     multiprocess_mode="livesum")
STREAM_OPS_ARMED = Gauge("epd_stream_ops_armed", "Armed stream-ordered calls (low-latency calls "
                         "of the facade and calls captured in CUDA graphs; at most 255 a group, "
                         "GetStats' armed_calls)", ["engine"], multiprocess_mode="livesum")
ENGINE_RESTARTS = Counter("epd_engine_restarts", "Engine processes restarted by the supervisor",
                          ["engine"])
ENGINE_START_FAILURES = Gauge(
    "epd_engine_start_failures", "Starts in a row of this engine that failed before it was "
    "ready (0 once it serves); the supervisor waits longer before each next start",
    ["engine"], multiprocess_mode="livemax")
ENGINE_UP = Gauge("epd_engine_up", "1 when the engine is serving", ["engine"],
                  multiprocess_mode="livemax")
ENGINE_INFO = Gauge("epd_engine_info", "1 per serving engine: the device it drives and the "
                    "service class whose groups it runs (any; with --class-engines latency or "
                    "throughput)", ["engine", "device", "service_class"],
                    multiprocess_mode="livemax")
BUILD_INFO = Gauge("epd_build_info", "Version and backend", ["version", "backend"],
                   multiprocess_mode="livemax")
CUDA_CLOSES_PENDING = Gauge("epd_cuda_closes_pending", "A departed client's CUDA IPC mappings "
                            "and counter pages waiting for a moment with no kernel in flight "
                            "(a close stalls the engine's other GPU work)", ["engine"],
                            multiprocess_mode="livesum")
SESSIONS_WITHOUT_MPS = Gauge("epd_sessions_without_mps", "Open sessions whose client is not on "
                             "the engine's CUDA MPS server (it works, slower: eval \"$(epd env)\" "
                             "in the client)", ["engine"], multiprocess_mode="livesum")
# Service classes (issue 14). Ranks of a group this daemon holds, by class (livesum: the
# group's ranks over all engines; 0 once none is held): join it to the per-group series with
# `* on (group) group_left (service_class) (epd_group_service_class > 0)`.
GROUP_SERVICE_CLASS = GroupGauge("epd_group_service_class", "Ranks of a group held, by its "
                                 "service class (latency or throughput)",
                                 ["group", "service_class"], multiprocess_mode="livesum")
# Engine memory a group holds (issue 14), summed over the ranks this daemon holds (0 once none).
GROUP_HELD_BYTES = GroupGauge("epd_group_held_bytes", "Engine memory (GPU heap or shared memory) "
                              "a group's ranks hold on this daemon", ["group"],
                              multiprocess_mode="livesum")
# The SMs (blocks) a group's data kernels may occupy at once, by mode (issue 14): its class's
# budget or the daemon's default, the most over the ranks this daemon holds; 0 on the cpu
# backend and once no rank is held.
GROUP_SMS = GroupGauge("epd_group_sms", "SMs (kernel blocks) a group's data kernels may occupy "
                       "at once, by mode (normal, low_latency)", ["group", "mode"],
                       multiprocess_mode="livemax")
# Pacing (issue 14): throughput calls that waited for latency work in the engine.
PACED_SECONDS = GroupCounter(
    "epd_paced_seconds", "Time throughput-class calls waited for latency-class work in "
    "the engine before starting (--throughput-pause-us bounds each wait)", ["group"])
PACED_CALLS = GroupCounter(
    "epd_paced_calls", "Throughput-class calls that waited for latency-class work",
    ["group"])
# The time a call waited for its session's executor (the worker queue and the operation lock)
# before it ran: calls of one session queue behind each other; this shows when they do.
QUEUE_WAIT_SECONDS = GroupHistogram(
    "epd_queue_wait_seconds", "Time a collective or layout call waited for its session's "
    "executor (worker queue, operation lock) before running", ["group", "service_class"],
    buckets=LATENCY_BUCKETS)
