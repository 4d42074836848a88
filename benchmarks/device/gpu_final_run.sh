#!/usr/bin/env bash
# One device call (2x H200) for the benchmark record of issue 4, every figure from the same run:
# engine-level kernels at P and D + NCCL, normal mode through the daemon (fast path), the
# low-latency benchmark (kernels, daemon, NCCL), the same daemon part under a private MPS
# server, and the empty-operation round trip on both paths.
source benchmarks/device/gpu_env.sh
timeout 150 python3 -P benchmarks/bench_kernels.py --iters 20 --json "$OUT/bench_kernels.json" \
    2>&1 | grep -v Warning | tail -12
timeout 100 python3 -P benchmarks/bench_daemon.py --iters 30 --json "$OUT/bench_daemon.json" \
    2>&1 | tail -4
timeout 150 python3 -P benchmarks/bench_low_latency.py --iters 50 --json "$OUT/ll_bench.json" \
    2>&1 | grep "^\[" | tail -12
timeout 100 python3 -P benchmarks/bench_low_latency.py --iters 50 --mps --skip kernels,nccl \
    --json "$OUT/ll_bench_mps.json" 2>&1 | grep -v " INFO " | tail -12
timeout 60 python3 -P benchmarks/bench_transport.py --backend cpu --iters 20000 \
    --json "$OUT/bench_transport.json" 2>&1 | tail -4
