#!/usr/bin/env bash
# Thirtieth session's GPU runs (one H100 or H200, whichever is lent; carry .whl). Run from a
# `git archive` of HEAD carried in .whl: mkdir /tmp/head && tar -xzf .whl/head.tar.gz -C
# /tmp/head && cp -r .whl /tmp/head && cd /tmp/head && bash benchmarks/device/gpu_s30_run.sh verify
#   verify  # the session's changes on a GPU: the trigger kernel alone (an entry published, a
#           # full ring failing at its deadline, a release ending that wait), and sessions
#           # opened through their descriptor channel's hello on every daemon test's path
#           # (the daemon roundtrips, normal and low-latency, the facade)
#   min     # the trigger's tests and two daemon tests (one normal, one low-latency)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
case "${1:-}" in
  verify)
    STEP_TEST_SECONDS=150 step verify 300 "tests/gpu/test_ll_trigger.py tests/gpu/test_daemon.py \
        tests/gpu/test_deep_ep_facade.py"
    ;;
  min)  # the least of it, when little device time is left
    STEP_TEST_SECONDS=80 step min 170 "tests/gpu/test_ll_trigger.py \
        tests/gpu/test_daemon.py::test_daemon_two_ranks_per_gpu \
        tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config"
    ;;
  *) echo "usage: $0 verify|min" >&2; exit 2 ;;
esac
