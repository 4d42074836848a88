"""server/bench/engine_host.py: the engine's host time per armed low-latency op, read from the
daemon's /metrics text (the two histograms the poller records), by group and between two
readings."""

from __future__ import annotations

from pytest import approx

from epd.server.bench import engine_host

TEXT = """\
# HELP epd_stream_op_detect_seconds gap
# TYPE epd_stream_op_detect_seconds histogram
epd_stream_op_detect_seconds_bucket{group="dec",kind="LowLatencyDispatch",le="+Inf"} 3.0
epd_stream_op_detect_seconds_count{group="dec",kind="LowLatencyDispatch"} 3.0
epd_stream_op_detect_seconds_sum{group="dec",kind="LowLatencyDispatch"} 0.00003
epd_stream_op_detect_seconds_bucket{group="dec",kind="LowLatencyCombine",le="+Inf"} 1.0
epd_stream_op_detect_seconds_count{group="dec",kind="LowLatencyCombine"} 1.0
epd_stream_op_detect_seconds_sum{group="dec",kind="LowLatencyCombine"} 0.00005
epd_stream_op_detect_seconds_bucket{group="pre",kind="LowLatencyDispatch",le="+Inf"} 5.0
epd_stream_op_detect_seconds_count{group="pre",kind="LowLatencyDispatch"} 5.0
epd_stream_op_detect_seconds_sum{group="pre",kind="LowLatencyDispatch"} 1.0
# HELP epd_stream_op_launch_seconds launch
# TYPE epd_stream_op_launch_seconds histogram
epd_stream_op_launch_seconds_bucket{group="dec",kind="LowLatencyDispatch",le="+Inf"} 4.0
epd_stream_op_launch_seconds_count{group="dec",kind="LowLatencyDispatch"} 4.0
epd_stream_op_launch_seconds_sum{group="dec",kind="LowLatencyDispatch"} 0.0002
# HELP epd_dispatch_seconds other
# TYPE epd_dispatch_seconds histogram
epd_dispatch_seconds_count{group="dec",path="grpc",backend="cpu"} 7.0
epd_dispatch_seconds_sum{group="dec",path="grpc",backend="cpu"} 9.0
"""


def test_totals_by_group_and_over_all() -> None:
    dec = engine_host.totals(TEXT, "dec")
    assert dec["epd_stream_op_detect_seconds"] == approx((0.00008, 4.0))
    assert dec["epd_stream_op_launch_seconds"] == approx((0.0002, 4.0))
    every = engine_host.totals(TEXT)
    assert every["epd_stream_op_detect_seconds"][1] == 9.0  # other families are not counted


def test_means_between_two_readings() -> None:
    before = {"epd_stream_op_detect_seconds": (0.00002, 2.0),
              "epd_stream_op_launch_seconds": (0.0001, 2.0)}
    after = engine_host.totals(TEXT, "dec")
    got = engine_host.means_us(before, after)
    assert got == {"detect_us": approx(30.0), "launch_us": approx(50.0)}
    assert engine_host.means_us(after, after) == {"detect_us": None, "launch_us": None}
    assert engine_host.means_us(None, after) == {"detect_us": None, "launch_us": None}
    assert engine_host.scrape("http://127.0.0.1:9/metrics") is None  # nothing there: no figure


WORK_TEXT = """\
# HELP epd_request_cpu_seconds_total work
# TYPE epd_request_cpu_seconds_total counter
epd_request_cpu_seconds_total{method="Dispatch",path="fastpath"} 0.003
epd_request_cpu_seconds_total{method="StreamLowLatencyDispatch",path="poller"} 0.001
# HELP epd_requests_total requests
# TYPE epd_requests_total counter
epd_requests_total{method="Dispatch",code="OK"} 90.0
epd_requests_total{method="Dispatch",code="ABORTED"} 10.0
# HELP epd_stream_op_launch_seconds launch
# TYPE epd_stream_op_launch_seconds histogram
epd_stream_op_launch_seconds_count{group="dec",kind="LowLatencyDispatch"} 4.0
epd_stream_op_launch_seconds_sum{group="dec",kind="LowLatencyDispatch"} 0.5
"""


def test_engine_work_cpu_per_request() -> None:
    after = engine_host.work_totals(WORK_TEXT)
    assert after == approx((0.004, 100.0))  # every method and path; other families ignored
    assert engine_host.work_us((0.002, 60.0), after) == approx(50.0)  # 2 ms over 40 requests
    assert engine_host.work_us(after, after) is None  # no request in between: no figure
    assert engine_host.work_us(None, after) is None
    assert engine_host.read("http://127.0.0.1:9/metrics") is None


def test_client_wait_cpu_is_counted() -> None:
    import time

    from epd.client import host_cpu

    before = host_cpu.wait_seconds()
    with host_cpu.waiting():
        t = time.thread_time()
        while time.thread_time() - t < 0.02:  # 20 ms of CPU inside the block
            pass
    assert host_cpu.wait_seconds() - before >= 0.019


GC_TEXT = """\
# HELP epd_engine_gc_pause_seconds gc
# TYPE epd_engine_gc_pause_seconds histogram
epd_engine_gc_pause_seconds_bucket{generation="0",le="+Inf"} 40.0
epd_engine_gc_pause_seconds_count{generation="0"} 40.0
epd_engine_gc_pause_seconds_sum{generation="0"} 0.002
epd_engine_gc_pause_seconds_count{generation="2"} 3.0
epd_engine_gc_pause_seconds_sum{generation="2"} 0.09
# HELP epd_requests_total requests
# TYPE epd_requests_total counter
epd_requests_total{method="Dispatch",code="OK"} 90.0
"""


def test_engine_gc_pauses_between_two_readings() -> None:
    after = engine_host.gc_totals(GC_TEXT)
    assert after == {"0": approx((0.002, 40.0)), "2": approx((0.09, 3.0))}
    got = engine_host.gc_between({"0": (0.001, 30.0)}, after)
    assert got["0"] == {"collections": 10.0, "pause_ms": approx(1.0)}
    assert got["2"] == {"collections": 3.0, "pause_ms": approx(90.0)}  # new since the first
    assert engine_host.gc_between(None, after) == {}


CHAIN_TEXT = """\
# HELP epd_ll_chain_seconds chain
# TYPE epd_ll_chain_seconds histogram
epd_ll_chain_seconds_count{kind="dispatch",segment="exec"} 10.0
epd_ll_chain_seconds_sum{kind="dispatch",segment="exec"} 0.0005
epd_ll_chain_seconds_count{kind="combine",segment="wait"} 9.0
epd_ll_chain_seconds_sum{kind="combine",segment="wait"} 0.0009
"""


def test_chain_segments_between_two_readings() -> None:
    after = engine_host.chain_totals(CHAIN_TEXT)
    assert after == {"dispatch/exec": approx((0.0005, 10.0)),
                     "combine/wait": approx((0.0009, 9.0))}
    got = engine_host.label_means_us({"dispatch/exec": (0.0001, 2.0),
                                      "combine/wait": (0.0009, 9.0)}, after)
    assert got == {"dispatch/exec": approx(50.0)}  # no combine in between: no figure
    assert engine_host.label_means_us(None, after) == {}


TAIL_TEXT = """\
# HELP epd_ll_chain_seconds chain
# TYPE epd_ll_chain_seconds histogram
epd_ll_chain_seconds_bucket{kind="dispatch",segment="exec",le="0.0001"} 90.0
epd_ll_chain_seconds_bucket{kind="dispatch",segment="exec",le="0.001"} 97.0
epd_ll_chain_seconds_bucket{kind="dispatch",segment="exec",le="0.005"} 100.0
epd_ll_chain_seconds_bucket{kind="dispatch",segment="exec",le="+Inf"} 100.0
epd_ll_chain_seconds_count{kind="dispatch",segment="exec"} 100.0
epd_ll_chain_seconds_sum{kind="dispatch",segment="exec"} 0.02
epd_ll_chain_seconds_bucket{kind="combine",segment="wait",le="0.0001"} 4.0
epd_ll_chain_seconds_bucket{kind="combine",segment="wait",le="0.001"} 4.0
epd_ll_chain_seconds_bucket{kind="combine",segment="wait",le="0.005"} 4.0
epd_ll_chain_seconds_bucket{kind="combine",segment="wait",le="+Inf"} 5.0
epd_ll_chain_seconds_count{kind="combine",segment="wait"} 5.0
epd_ll_chain_seconds_sum{kind="combine",segment="wait"} 9.0
# HELP epd_ll_chain_starved_total dry
# TYPE epd_ll_chain_starved_total counter
epd_ll_chain_starved_total{group="a"} 3.0
epd_ll_chain_starved_total{group="b"} 2.0
# HELP epd_stream_poller_slow_seconds slow
# TYPE epd_stream_poller_slow_seconds histogram
epd_stream_poller_slow_seconds_count{part="top_up"} 4.0
epd_stream_poller_slow_seconds_sum{part="top_up"} 0.012
epd_stream_poller_slow_seconds_count{part="sleep"} 4.0
epd_stream_poller_slow_seconds_sum{part="sleep"} 0.001
"""


def test_chain_segment_tails_between_two_readings() -> None:
    after = engine_host.chain_buckets(TAIL_TEXT)
    assert after["dispatch/exec"] == {1e-4: 90.0, 1e-3: 97.0, 5e-3: 100.0,
                                      float("inf"): 100.0}
    before = {"dispatch/exec": {1e-4: 40.0, 1e-3: 40.0, 5e-3: 40.0, float("inf"): 40.0}}
    got = engine_host.label_tails_us(before, after)
    # 60 new: 50 within 100 µs, 7 within 1 ms, 3 within 5 ms
    assert got["dispatch/exec"] == {"n": 60.0, "p50_le_us": approx(100.0),
                                    "p99_le_us": approx(5000.0), "over_1ms": 3.0}
    # new since the first reading: 4 short, 1 beyond the last bound
    assert got["combine/wait"] == {"n": 5.0, "p50_le_us": approx(100.0),
                                   "p99_le_us": float("inf"), "over_1ms": 1.0}
    assert engine_host.label_tails_us(after, after) == {}  # nothing in between: no figure
    assert engine_host.label_tails_us(None, after) == {}
    assert engine_host.chain_starved(TAIL_TEXT) == 5.0  # every group's
    assert engine_host.chain_starved(CHAIN_TEXT) == 0.0
    slow = engine_host.poller_slow(TAIL_TEXT)
    got = engine_host.label_sums_ms({"top_up": (0.002, 1.0)}, slow)
    assert got == {"top_up": {"n": 3.0, "ms": approx(10.0)},
                   "sleep": {"n": 4.0, "ms": approx(1.0)}}
    assert engine_host.label_sums_ms(slow, slow) == {}
