#!/usr/bin/env bash
# Forty-second session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   refuse42  # a stream-ordered combine one rank's engine refuses takes part pushing nothing
#             # (epd_combine_refused; the reduce reads the peers' verdicts): the normal-mode
#             # kernel tests, the stream-ordered suite (its new one-rank refusal), bad input
#             # alike, worst-case, the facade, the NVSHMEM build across logical nodes (flat and
#             # two-stage), the daemon's roundtrips
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, merge_json, layer_rows,
#  ll_rows)
case "${1:-}" in
  refuse42)
    STEP_TEST_SECONDS=150 step stream 220 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_bad_input_alike.py tests/gpu/test_worst_case_no_wait.py"
    STEP_TEST_SECONDS=90 step across 120 "tests/gpu/test_nvshmem.py -k 'normal_mode_across and (1 or 2)'"
    STEP_TEST_SECONDS=120 step kernels 120 "tests/gpu/test_intranode.py"
    STEP_TEST_SECONDS=120 step facade 100 "tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_daemon.py -k 'roundtrip or stream or combine'"
    ;;
  stages42)  # a two-stage group's dispatch one rank's engine refuses takes part (the whole
    # group's notify with the verdict, epd_wide_notify's new argument beyond 8 ranks; both
    # stages skip it): the two-stage suite across logical nodes (2, 4 and 16 ranks) and the
    # flat one; the 16-rank group through the daemons and the facade (a refused dispatch)
    STEP_TEST_SECONDS=150 step stages 240 "tests/gpu/test_nvshmem.py -k 'normal_mode_across \
        and (1 or 2 or 8)'"
    STEP_TEST_SECONDS=200 step cluster16 220 "tests/gpu/test_cuda_cluster.py -k sixteen"
    ;;
  *) echo "usage: $0 refuse42|stages42"; exit 2 ;;
esac
