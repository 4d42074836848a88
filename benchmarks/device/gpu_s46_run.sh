#!/usr/bin/env bash
# Forty-sixth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   records46   # armed ops' words as records of shared counter slots, 255 ops a group: a model
#               # captured at 20 batch sizes x 4 layers (160 low-latency ops of one group), the
#               # normal-mode captured calls (with the forty-fifth session's unrun mends), the
#               # low-latency graph and hook tests, the stream-ordered suite (as time allows)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ...)
case "${1:-}" in
  records46)
    STEP_TEST_SECONDS=200 step sizes 230 "tests/gpu/test_ll_plain.py"
    STEP_TEST_SECONDS=120 step captured 150 "tests/gpu/test_captured_normal.py"
    STEP_TEST_SECONDS=100 step regress 120 "tests/gpu/test_stream_ordered.py"
    ;;
  *) echo "usage: $0 records46"; exit 2 ;;
esac
