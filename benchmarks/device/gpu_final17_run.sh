#!/usr/bin/env bash
# Last device call of the 2026-12-01 (second) session: the whole GPU suite, `epd bench` at D
# with the low-latency rows, and the facade's low-latency pair in probe_calls.py (plain and
# hooks). Logs and JSON under $OUT.
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 330 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEx --timeout 120 \
    --durations=5 -o addopts="" 2>&1 | grep -v " INFO " | tee "$OUT/gpu_tests.txt" | tail -30
timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 30 --low-latency \
    --json "$OUT/bench_D.json" 2>&1 | clean | tail -12
timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 200 --low-latency \
    --rows "ll plain pair,ll hook pair" --json "$OUT/probe_ll.json" 2>&1 | clean | tail -3
mkdir -p /tmp/prof
EPD_PROFILE_DIR=/tmp/prof timeout 60 python3 -P benchmarks/probe_calls.py --tokens 128 \
    --iters 100 --rows "layout,dispatch,combine" --json "$OUT/probe_D.json" 2>&1 | clean | tail -5
python3 benchmarks/pstats_top.py /tmp/prof/*.prof > "$OUT/engine_profile.txt" 2>&1
