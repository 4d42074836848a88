#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests and the benchmark, logs under $OUT.
source benchmarks/device/gpu_env.sh
MODE=${1:-all}
if [ "$MODE" != bench ]; then
  timeout 330 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfE --timeout 120 --durations=15 \
      -o addopts="" 2>&1 | tee "$OUT/tests.txt" | tail -40
fi
if [ "$MODE" != tests ]; then
  timeout 150 python3 -P benchmarks/bench_kernels.py --iters 20 --json "$OUT/bench.json" 2>&1 \
      | tee "$OUT/bench.txt" | tail -30
fi
