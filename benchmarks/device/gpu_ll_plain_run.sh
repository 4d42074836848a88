#!/usr/bin/env bash
# One device call (1 or 2 H200): the plain low-latency path's GPU tests, `epd bench` at D with
# the low-latency rows, an engine profile of the normal-mode calls (probe_calls.py at D under
# cProfile), and the two-pool benchmark (issue 14) with and without service classes and
# without MPS. Logs and JSON under $OUT (8 files at most come back).
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 240 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_ll_plain.py \
    tests/gpu/test_deep_ep_facade.py tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph \
    tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config \
    -q -rfEx --timeout 150 -o addopts="" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 30 --low-latency \
    --json "$OUT/bench_D.json" 2>&1 | clean | tail -16
mkdir -p /tmp/prof
EPD_PROFILE_DIR=/tmp/prof timeout 60 python3 -P benchmarks/probe_calls.py --tokens 128 \
    --iters 100 --mps on --json "$OUT/probe_D.json" 2>&1 | clean | tail -5
python3 benchmarks/pstats_top.py /tmp/prof/*.prof > "$OUT/engine_profile.txt" 2>&1
for v in "classes:" "noclasses:--no-classes" "nomps:--mps=off"; do
  timeout 150 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
      --prefill-iters 150 ${v#*:} --json "$OUT/two_pools_${v%%:*}.json" 2>&1 | clean | tail -6
done
