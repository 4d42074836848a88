#!/usr/bin/env bash
# One device call (2x H200) that checks a change end to end: the whole GPU suite, the demo on
# the CUDA engine, the low-latency daemon benchmark under a private MPS server and the fast-path
# round trip, as a regression check against the benchmark record. Logs under $OUT.
source benchmarks/device/gpu_env.sh
timeout 330 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEx --timeout 120 \
    --durations=12 -o addopts="" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
timeout 90 python3 -P -m epd.server.cli demo --backend cuda 2>&1 | tee "$OUT/demo.txt" | tail -12
[ "${1:-}" = tests ] && exit 0  # `gpu_check_run.sh tests`: the suite and the demo only
timeout 120 python3 -P benchmarks/bench_low_latency.py --iters 50 --mps --skip kernels,nccl \
    --json "$OUT/ll_bench_mps.json" 2>&1 | grep -v " INFO " | tail -10
timeout 60 python3 -P benchmarks/bench_transport.py --backend cpu --iters 20000 \
    --json "$OUT/bench_transport.json" 2>&1 | tail -4
