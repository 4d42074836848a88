#!/usr/bin/env bash
# First device call of the third 2026-12-01 session: the whole GPU suite and the CUDA demo at the
# HEAD that carries the commits never run on a GPU (pacing off/unwrapped, facade split, FP8 scales
# allocated in the stream lambda, op cache skipping disarmed ops, epd_group_sms, capacity variable,
# op-cache keys/index), then `epd bench` at D with the low-latency rows.
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
git log --oneline -1 > "$OUT/head.txt" 2>/dev/null || true
timeout 400 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEsx --timeout 150 \
    -o addopts="" 2>&1 | grep -v " INFO " > "$OUT/gpu_tests.txt"; tail -30 "$OUT/gpu_tests.txt"
timeout 60 python3 -P -m epd.server.cli demo --backend cuda 2>&1 | clean > "$OUT/demo_cuda.txt"
tail -6 "$OUT/demo_cuda.txt"
timeout 110 python3 -P -m epd.server.cli bench --shapes D --iters 30 --low-latency \
    --json "$OUT/bench_D.json" 2>&1 | clean | tail -12
