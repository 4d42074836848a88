#!/usr/bin/env bash
# One device call (2x H200) for low-latency mode: kernel tests, the daemon's low-latency test,
# the low-latency benchmark (kernels, daemon, NCCL) and a profiled normal-mode daemon benchmark.
# Every stage has its own timeout so that one stuck stage leaves time for the others.
source benchmarks/device/gpu_env.sh
PYTEST="python3 -P -m pytest -p no:cacheprovider -q -rfE -o addopts="
STAGES=${STAGES:-kernels,daemon,bench,profile}
if [[ $STAGES == *suite* ]]; then  # every GPU test (kernels, NVSHMEM, daemon)
  timeout ${SUITE_TIMEOUT:-400} $PYTEST tests/gpu --timeout 200 --durations=12 2>&1 \
      | tail -150 > "$OUT/gpu_suite.txt"; tail -30 "$OUT/gpu_suite.txt"
fi
if [[ $STAGES == *kernels* ]]; then
  timeout 170 $PYTEST tests/gpu/test_low_latency_kernels.py --timeout 120 2>&1 \
      | tee "$OUT/ll_kernels.txt" | tail -25
fi
if [[ $STAGES == *daemon* ]]; then
  timeout 170 $PYTEST tests/gpu/test_daemon.py -k "low_latency ${DAEMON_K:-}" --timeout 160 -s \
      2>&1 | tail -150 > "$OUT/daemon_ll.txt"; tail -25 "$OUT/daemon_ll.txt"
fi
if [[ $STAGES == *bench* ]]; then
  timeout 150 python3 -P benchmarks/bench_low_latency.py --iters 50 --json "$OUT/ll_bench.json" \
      2>&1 | tee "$OUT/ll_bench.txt" | tail -20
fi
if [[ $STAGES == *profile* ]]; then
  mkdir -p /tmp/prof
  EPD_PROFILE_DIR=/tmp/prof timeout 110 python3 -P benchmarks/bench_daemon.py --iters 20 \
      --json "$OUT/bench_daemon.json" 2>&1 | tail -20
  python3 - > "$OUT/profiles.txt" 2>&1 <<'PY'
import glob, pstats
for f in sorted(glob.glob("/tmp/prof/*.prof")):
    print("=" * 30, f)
    st = pstats.Stats(f)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(35)
PY
  ls -la /tmp/prof | head
fi
