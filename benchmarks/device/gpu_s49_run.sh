#!/usr/bin/env bash
# Forty-ninth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   first49  # the forty-eighth session's last tree on a GPU (its bench settle, the poller's
#            # mends after 9e6be47): gpu_s48_run.sh final48, then tests/gpu/test_ll_plain.py
#            # (not run since the forty-seventh session)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, bench, ...)
case "${1:-}" in
  first49)
    bash benchmarks/device/gpu_s48_run.sh final48
    STEP_TEST_SECONDS=90 step ll_plain 110 "tests/gpu/test_ll_plain.py"
    ;;
  *) echo "usage: $0 first49"; exit 2 ;;
esac
