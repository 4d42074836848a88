"""Prometheus metrics (README.md, "Metrics and health"). Base units, microsecond-scale latency
buckets.

The supervisor and every engine are separate processes behind one scrape endpoint: the supervisor
sets PROMETHEUS_MULTIPROC_DIR before any of them imports prometheus_client, so each process writes
its samples to files there and the endpoint aggregates them (prometheus_client's multiprocess
mode). Gauges say how they aggregate across processes.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# 5 µs .. 20 s, roughly x2 steps: collectives take tens of µs on GPUs and ms on the CPU backend.
LATENCY_BUCKETS = (5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
                   20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)

DISPATCH_SECONDS = Histogram("epd_dispatch_seconds", "Dispatch latency inside the engine",
                             ["group", "path", "backend"], buckets=LATENCY_BUCKETS)
COMBINE_SECONDS = Histogram("epd_combine_seconds", "Combine latency inside the engine",
                            ["group", "path", "backend"], buckets=LATENCY_BUCKETS)
LAYOUT_SECONDS = Histogram("epd_layout_seconds", "get_dispatch_layout latency",
                           ["group", "path", "backend"], buckets=LATENCY_BUCKETS)
STREAM_OP_LAUNCH_SECONDS = Histogram(
    "epd_stream_op_launch_seconds", "Stream-ordered calls: host time from seeing the doorbell "
    "to the last kernel launched (the GPU time follows)", ["group", "kind"],
    buckets=LATENCY_BUCKETS)
REQUESTS = Counter("epd_requests", "Engine requests by method and status code",
                   ["method", "code"])
BYTES_SENT = Counter("epd_bytes_sent", "Payload bytes sent to other ranks",
                     ["group", "peer_class"])
BYTES_RECEIVED = Counter("epd_bytes_received", "Payload bytes received from other ranks",
                         ["group", "peer_class"])
RECV_TOKENS = Counter("epd_recv_tokens", "Token rows received by dispatch", ["group"])
EXPERT_RECV_TOKENS = Counter("epd_expert_recv_tokens",
                             "(token, expert) pairs received per local expert (opt-in)",
                             ["group", "expert"])
LOAD_IMBALANCE = Gauge("epd_expert_load_imbalance_ratio",
                       "max / mean of (token, expert) pairs over the group's experts, last layout",
                       ["group"], multiprocess_mode="livemax")
TIMEOUTS = Counter("epd_collective_timeouts", "Collectives that hit their deadline", ["group"])
ABORTS = Counter("epd_group_aborts", "Groups aborted", ["reason"])
SESSIONS = Gauge("epd_sessions", "Open sessions", ["engine"], multiprocess_mode="livesum")
GROUPS = Gauge("epd_groups", "Group memberships held", ["engine"], multiprocess_mode="livesum")
REGIONS = Gauge("epd_regions", "Registered client regions", ["engine"],
                multiprocess_mode="livesum")
REGION_BYTES = Gauge("epd_region_bytes", "Bytes of registered client regions", ["engine"],
                     multiprocess_mode="livesum")
ENGINE_RESTARTS = Counter("epd_engine_restarts", "Engine processes restarted by the supervisor",
                          ["engine"])
ENGINE_UP = Gauge("epd_engine_up", "1 when the engine is serving", ["engine"],
                  multiprocess_mode="livemax")
BUILD_INFO = Gauge("epd_build_info", "Version and backend", ["version", "backend"],
                   multiprocess_mode="livemax")
