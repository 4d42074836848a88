#!/usr/bin/env bash
# Thirty-seventh session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says), with .whl/old a `git archive` of server proto client cuda at a21fbb7
# (the tree before the worst-case dispatch stopped waiting for its count):
#   verify   # the new test (tests/gpu/test_worst_case_no_wait.py), then every GPU test that
#            # runs a normal-mode combine (the reduce kernel reads the handle's status now)
#   notify   # after notify took num_worst_tokens (dd1f5e6): verify's tests, then the NVSHMEM
#            # builds' normal mode across logical nodes and the daemon's roundtrips
#   review   # after a review's mends (a worst-case failure raises at the next dispatch only,
#            # the engine launches a combine of a failed one): the new test and the facade's
#            # tests (~2.5 minutes)
#   ab [ROUNDS]  # the V1 facade's layer with exact and worst-case rows and V2's layers, this
#            # tree and .whl/old alternated (2 ranks on one GPU, D)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, merge_json, layer_rows)
case "${1:-}" in
  verify)
    STEP_TEST_SECONDS=150 step nowait 170 "tests/gpu/test_worst_case_no_wait.py"
    STEP_TEST_SECONDS=200 step combines 420 "tests/gpu/test_intranode.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_elastic_buffer_gpu.py"
    ;;
  notify)
    bash "$0" verify
    STEP_TEST_SECONDS=200 step nvshmem 300 "tests/gpu/test_nvshmem.py tests/gpu/test_daemon.py \
        -k 'normal_mode or roundtrip'"
    ;;
  review)
    STEP_TEST_SECONDS=150 step review 280 "tests/gpu/test_worst_case_no_wait.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_elastic_buffer_gpu.py \
        tests/gpu/test_stream_ordered.py"
    ;;
  ab)
    ab_rounds 1 "${2:-2}" layer_rows new-first
    merge_json rows rows_ab
    ;;
  *) echo "usage: $0 verify | notify | review | ab [ROUNDS]" >&2; exit 2 ;;
esac
