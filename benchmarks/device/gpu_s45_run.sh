#!/usr/bin/env bash
# Forty-fifth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   captured45  # normal-mode dispatch and combine captured in CUDA graphs
#               # (tests/gpu/test_captured_normal.py), then the paths the change touched: the
#               # stream-ordered suite, the worst-case dispatch, the low-latency plain and
#               # graph calls, the facade
#   verify45    # after a review's mends: the captured test again (with DeepEP V2's ElasticBuffer
#               # captured) and the low-latency graph tests
#   bench45     # `epd bench` at D and P (two ranks on the one GPU: EPD's rows only), with the
#               # new row: the worst-case layer captured in a CUDA graph and replayed
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ...)
case "${1:-}" in
  captured45)
    STEP_TEST_SECONDS=150 step captured 190 "tests/gpu/test_captured_normal.py"
    STEP_TEST_SECONDS=150 step regress 300 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_worst_case_no_wait.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_deep_ep_facade.py"
    ;;
  verify45)
    STEP_TEST_SECONDS=120 step captured2 170 "tests/gpu/test_captured_normal.py \
        tests/gpu/test_ll_plain.py -k 'captured or first_appearance or micro_batches'"
    ;;
  bench45)
    timeout 400 python3 -P -m epd.server.cli bench --ranks 2 --shapes D,P --iters 60 \
        --low-latency --json "$OUT/bench45.json" 2>&1 | clean | tail -40 | tee "$OUT/bench45.txt"
    ;;
  *) echo "usage: $0 captured45|verify45|bench45"; exit 2 ;;
esac
