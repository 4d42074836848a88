#!/usr/bin/env bash
# Last device call of the 2026-12-01 (second) session, after the engine's abort-read fix: the
# GPU tests the session's changes touch (plain low-latency calls, stream-ordered normal mode,
# failure paths, NVSHMEM with two PEs on one GPU under MPS), `epd bench` at D with the
# low-latency rows, and probe_calls.py (normal mode and the facade's low-latency pair).
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 260 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_nvshmem.py \
    tests/gpu/test_ll_plain.py tests/gpu/test_stream_ordered.py \
    tests/gpu/test_daemon.py::test_daemon_failure tests/gpu/test_daemon.py::test_daemon_two_ranks_per_gpu \
    -q -rfEsx --timeout 200 -o addopts="" 2>&1 | grep -v " INFO " | tee "$OUT/gpu_tests.txt" | tail -25
timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 30 --low-latency \
    --json "$OUT/bench_D.json" 2>&1 | clean | tail -12
timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --low-latency \
    --json "$OUT/probe_D.json" 2>&1 | clean | tail -9
timeout 100 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
    --prefill-iters 150 --json "$OUT/two_pools_classes.json" 2>&1 | clean | tail -6
