#!/usr/bin/env bash
# One device call for the daemon on GPUs: daemon GPU tests, `epd demo` on the CUDA engine, and
# the end-to-end benchmark through gRPC. Logs under $OUT.
source benchmarks/device/gpu_env.sh
MODE=${1:-all}
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  timeout 420 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_daemon.py -q -rfE -x \
      --timeout 300 -o addopts="" -s 2>&1 | tee "$OUT/daemon_tests.txt" | tail -60
fi
if [ "$MODE" = all ] || [ "$MODE" = demo ]; then
  timeout 180 python3 -P -m epd.server.cli demo --backend cuda --ranks 2 --tokens 512 \
      --hidden 2048 --experts 32 --topk 4 2>&1 | tee "$OUT/demo.txt" | tail -15
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 300 python3 -P benchmarks/bench_daemon.py --iters 30 --json "$OUT/bench_daemon.json" \
      2>&1 | tee "$OUT/bench_daemon.txt" | tail -20
fi
