"""The engine's host time per armed low-latency op, read from the daemon's /metrics.

`epd_stream_op_detect_seconds` (how late the engine's poller saw a trigger, at most) and
`epd_stream_op_launch_seconds` (its launch of the op's kernels) are the host hop of every
stream-ordered low-latency call: the part a call through the daemon pays that an in-process
library does not. Benchmarks read the totals before and after a timed phase and report the
means per op (issue 10's rows, issue 14's two pools).
"""

from __future__ import annotations

import urllib.request

HOST_METRICS = ("epd_stream_op_detect_seconds", "epd_stream_op_launch_seconds")
# The engine's work CPU (counter, all methods and paths) and its requests: their ratio over a
# phase is the engine's CPU per call, without the waits of its threads between calls.
WORK = ("epd_request_cpu_seconds", "epd_requests")
Totals = dict[str, tuple[float, float]]  # metric -> (sum of seconds, count)
GC_PAUSES = "epd_engine_gc_pause_seconds"  # the engines' collector pauses, by generation
CHAIN_SEGMENTS = "epd_ll_chain_seconds"  # the chains' GPU time by segment (a diagnostic)
CHAIN_STARVED = "epd_ll_chain_starved"  # times a chain ran dry with a call waiting
POLLER_SLOW = "epd_stream_poller_slow_seconds"  # the poller's slow rounds, by part
SCRAPE_TIMEOUT = 5.0


def totals(metrics_text: str, group: str | None = None) -> Totals:
    """(sum, count) of each HOST_METRICS histogram over its series (of `group` when given)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {m: [0.0, 0.0] for m in HOST_METRICS}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name not in HOST_METRICS:
            continue
        for s in fam.samples:
            if group is not None and s.labels.get("group") != group:
                continue
            if s.name == f"{fam.name}_sum":
                out[fam.name][0] += s.value
            elif s.name == f"{fam.name}_count":
                out[fam.name][1] += s.value
    return {m: (v[0], v[1]) for m, v in out.items()}


def read(metrics_url: str) -> str | None:
    """The daemon's /metrics text (None when it cannot be read: the figures are then missing,
    the run goes on)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=SCRAPE_TIMEOUT) as r:
            return r.read().decode()
    except OSError:
        return None


def scrape(metrics_url: str, group: str | None = None) -> Totals | None:
    """`totals` of the daemon's /metrics, or None."""
    text = read(metrics_url)
    return totals(text, group) if text is not None else None


def means_us(before: Totals | None, after: Totals | None) -> dict[str, float | None]:
    """Mean µs per op of each metric between two readings: `detect_us`, `launch_us` (None
    without readings or without armed ops in between)."""
    out: dict[str, float | None] = {}
    for m in HOST_METRICS:
        key = m.removeprefix("epd_stream_op_").removesuffix("_seconds") + "_us"
        n = after[m][1] - before[m][1] if before and after else 0
        out[key] = (after[m][0] - before[m][0]) / n * 1e6 if n else None
    return out



def counter_totals(metrics_text: str, families: tuple[str, ...]) -> dict[str, float]:
    """Each counter family's total so far, over all its series (0 for one not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(families, 0.0)
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name in out:
            out[fam.name] += sum(x.value for x in fam.samples if x.name == f"{fam.name}_total")
    return out


def work_totals(metrics_text: str) -> tuple[float, float]:
    """(engine work CPU seconds, requests) so far: the WORK counters over all their series."""
    out = counter_totals(metrics_text, WORK)
    return out[WORK[0]], out[WORK[1]]


def work_us(before: tuple[float, float] | None,
            after: tuple[float, float] | None) -> float | None:
    """The engine's work CPU per request between two readings, µs (None without readings or
    requests in between)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1e6


def by_label(metrics_text: str, family: str,
             label: str | tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(sum, count) of a histogram family so far, by the value of one of its labels (of
    several, joined by "/")."""
    labels = (label,) if isinstance(label, str) else label
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != family:
            continue
        for x in fam.samples:
            part = {f"{family}_sum": 0, f"{family}_count": 1}.get(x.name)
            if part is not None:
                key = "/".join(x.labels.get(n, "?") for n in labels)
                out.setdefault(key, [0.0, 0.0])[part] += x.value
    return {v: (t[0], t[1]) for v, t in sorted(out.items())}


def gc_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(pause seconds, collections) of the engines' garbage collector so far, by generation."""
    return by_label(metrics_text, GC_PAUSES, "generation")


def chain_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(GPU seconds, instances) of the low-latency chains' segments so far, by "kind/segment"
    (EPD_CHAIN_TIMELINE)."""
    return by_label(metrics_text, CHAIN_SEGMENTS, ("kind", "segment"))


def label_means_us(before: dict[str, tuple[float, float]] | None,
                   after: dict[str, tuple[float, float]] | None) -> dict[str, float]:
    """Mean µs per observation of each label value between two readings (those observed)."""
    return {v: secs / n * 1e6 for v, secs, n in _between(before, after) if n > 0}


def gc_between(before: dict[str, tuple[float, float]] | None,
               after: dict[str, tuple[float, float]] | None) -> dict[str, dict[str, float]]:
    """Per generation, the collections and their total pause (ms) between two readings."""
    return {g: {"collections": n, "pause_ms": secs * 1e3}
            for g, secs, n in _between(before, after)}



Buckets = dict[str, dict[float, float]]  # label value -> {upper bound (s): cumulative count}


def buckets_by_label(metrics_text: str, family: str,
                     label: str | tuple[str, ...]) -> Buckets:
    """The cumulative bucket counts of a histogram family so far, by label value (as
    `by_label`): what a tail is read from, where the sums give only means."""
    labels = (label,) if isinstance(label, str) else label
    from prometheus_client.parser import text_string_to_metric_families

    out: Buckets = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != family:
            continue
        for x in fam.samples:
            if x.name == f"{family}_bucket":
                key = "/".join(x.labels.get(n, "?") for n in labels)
                le = float(x.labels["le"])
                row = out.setdefault(key, {})
                row[le] = row.get(le, 0.0) + x.value
    return out


def chain_buckets(metrics_text: str) -> Buckets:
    """`buckets_by_label` of the chains' segments (EPD_CHAIN_TIMELINE), by "kind/segment"."""
    return buckets_by_label(metrics_text, CHAIN_SEGMENTS, ("kind", "segment"))


TAIL_US = 1000.0  # an observation above this is counted as the tail's


def label_tails_us(before: Buckets | None, after: Buckets | None,
                   quantiles: tuple[float, ...] = (0.5, 0.99)) -> dict[str, dict[str, float]]:
    """Between two readings, per label value: each quantile as the upper bound (µs) of the
    bucket it falls in (`p50_le_us`, `p99_le_us`; inf beyond the last bound), the observations
    (`n`) and those above TAIL_US (`over_1ms`, exact where TAIL_US is a bucket bound)."""
    if before is None or after is None:
        return {}
    out = {}
    for key, row in sorted(after.items()):
        old = before.get(key, {})
        bounds = sorted(row)
        cum = [row[b] - old.get(b, 0.0) for b in bounds]
        n = cum[-1] if cum else 0.0
        if n <= 0:
            continue
        tail: dict[str, float] = {"n": n}
        for q in quantiles:
            bound = next(b for b, c in zip(bounds, cum, strict=True) if c >= q * n)
            tail[f"p{round(q * 100)}_le_us"] = bound * 1e6
        below = max((c for b, c in zip(bounds, cum, strict=True) if b * 1e6 <= TAIL_US),
                    default=0.0)
        tail["over_1ms"] = n - below
        out[key] = tail
    return out


def chain_starved(metrics_text: str) -> float:
    """Times the chains ran dry with a call waiting so far, over every group."""
    return counter_totals(metrics_text, (CHAIN_STARVED,))[CHAIN_STARVED]


def poller_slow(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(seconds, slow rounds) of the engine poller's rounds over 1 ms so far, by part."""
    return by_label(metrics_text, POLLER_SLOW, "part")


def label_sums_ms(before: dict[str, tuple[float, float]] | None,
                  after: dict[str, tuple[float, float]] | None) -> dict[str, dict[str, float]]:
    """Between two readings, per label value: the observations (`n`) and their total (`ms`)."""
    return {v: {"n": n, "ms": secs * 1e3} for v, secs, n in _between(before, after) if n > 0}


def _between(before: dict[str, tuple[float, float]] | None,
             after: dict[str, tuple[float, float]] | None) -> list[tuple[str, float, float]]:
    """(label value, seconds, observations) added between two (sum, count) readings; none
    without both readings."""
    if before is None or after is None:
        return []
    return [(v, secs - before.get(v, (0.0, 0.0))[0], n - before.get(v, (0.0, 0.0))[1])
            for v, (secs, n) in after.items()]
