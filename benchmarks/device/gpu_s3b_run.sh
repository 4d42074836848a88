#!/usr/bin/env bash
# Second device call of the third 2026-12-01 session: the whole GPU suite after the received-rows
# copy-out, CUDA dispatch without top-k and the double low-latency receive buffer (new tests:
# tests/gpu/test_received_rows.py, test_daemon.py::test_daemon_dispatch_without_topk,
# test_ll_plain.py::test_two_micro_batches_in_flight), then `epd bench` at D with the
# low-latency rows (the plain row is where the copy-out shows).
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 430 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEsx --timeout 150 \
    -o addopts="" 2>&1 | grep -v " INFO " > "$OUT/gpu_tests.txt"; tail -40 "$OUT/gpu_tests.txt"
timeout 100 python3 -P -m epd.server.cli bench --shapes D --iters 30 --low-latency \
    --json "$OUT/bench_D.json" 2>&1 | clean | tail -12
