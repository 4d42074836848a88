#!/usr/bin/env bash
# Third device call of the third 2026-12-01 session, after the fix of the second's failures
# (epd_notify took an empty topk_idx, whose data pointer is null, for a dispatch without top-k
# and read a null per-expert array; the graph test read buffer 0's views of a dispatch into
# buffer 1): the whole GPU suite, `epd bench` at D with the low-latency rows, and the
# per-call probe of the facade's low-latency pair (client CPU per call).
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 400 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEsx --timeout 150 \
    -o addopts="" 2>&1 | grep -v " INFO " > "$OUT/gpu_tests.txt"; tail -25 "$OUT/gpu_tests.txt"
timeout 90 python3 -P -m epd.server.cli bench --shapes D --iters 30 --low-latency \
    --json "$OUT/bench_D.json" 2>&1 | clean | tail -8
timeout 70 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --low-latency \
    --json "$OUT/probe_D.json" 2>&1 | clean | tail -9
