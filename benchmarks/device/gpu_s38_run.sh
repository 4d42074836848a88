#!/usr/bin/env bash
# Thirty-eighth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   recheck  # what the thirty-seventh session left unrun: the worst-case test and the
#            # facade's after the second review's mends, the normal-mode kernel tests after
#            # the combine reduce kernel took recv_info, and `epd bench` at D (2 ranks on one
#            # GPU: EPD's rows only, the worst-case row among them)
#   bad      # bad input fails a dispatch on every rank alike (notify carries each source's
#            # verdict): the new facade test, the stream-ordered, local-layout and worst-case
#            # tests, the kernel tests, and the NVSHMEM build across two logical nodes
#   bad2     # then the daemon's roundtrips (every rank's ids bad: named the lowest rank) and
#            # the NVSHMEM build's normal mode across logical nodes
#   stages   # two-stage groups fail alike too (the stages skip what the whole group's notify
#            # failed), after a review's mends (epd_call_done reports a fatal failure first):
#            # the two-stage tests across logical nodes, the stream-ordered tests again
#   refused  # a dispatch one rank's engine refuses takes part (ERR_REFUSED): the stream-ordered
#            # tests with it, the bad-input and worst-case ones, the kernel tests, the facade's
#            # and NVSHMEM normal mode across logical nodes (the notify's new parameter)
#   failures # the daemon's failure scenarios (a missing rank, a killed one) after
#            # epd_call_done reports a fatal failure before a layout's bad input
#   next     # for the next session (about 9 minutes): what this one left unrun, i.e. the
#            # daemon's dispatch without top-k (every rank's failure asserted now), the
#            # low-latency suites and the daemon's graph tests as a regression check, then an
#            # A/B of the layer rows against .whl/old = `git archive d548938 server proto
#            # client cuda` (extracted), the tree before this session (notify's payload grew)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, merge_json, layer_rows)
case "${1:-}" in
  recheck)
    STEP_TEST_SECONDS=150 step review 200 "tests/gpu/test_worst_case_no_wait.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_elastic_buffer_gpu.py \
        tests/gpu/test_stream_ordered.py"
    STEP_TEST_SECONDS=150 step intranode 200 "tests/gpu/test_intranode.py"
    timeout 150 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
        --json "$OUT/bench_D.json" 2>&1 | clean | tail -30 > "$OUT/bench_D.txt"
    echo "bench rc=${PIPESTATUS[0]}"; cat "$OUT/bench_D.txt"
    ;;
  bad)
    STEP_TEST_SECONDS=150 step bad 270 "tests/gpu/test_bad_input_alike.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_local_layout.py \
        tests/gpu/test_worst_case_no_wait.py"
    STEP_TEST_SECONDS=120 step intranode 130 "tests/gpu/test_intranode.py"
    STEP_TEST_SECONDS=170 step across 190 "tests/gpu/test_cuda_cluster.py \
        -k low_latency_group_across"
    ;;
  bad2)
    STEP_TEST_SECONDS=200 step bad2 330 "tests/gpu/test_nvshmem.py tests/gpu/test_daemon.py \
        -k 'normal_mode or roundtrip'"
    ;;
  stages)
    STEP_TEST_SECONDS=200 step stages 300 "tests/gpu/test_nvshmem.py \
        tests/gpu/test_cuda_cluster.py -k 'two_stage or sixteen or stage_deadline'"
    STEP_TEST_SECONDS=150 step bad 190 "tests/gpu/test_bad_input_alike.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_local_layout.py"
    STEP_TEST_SECONDS=90 step intranode 100 "tests/gpu/test_intranode.py"
    ;;
  refused)
    STEP_TEST_SECONDS=150 step refused 180 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_bad_input_alike.py tests/gpu/test_worst_case_no_wait.py"
    STEP_TEST_SECONDS=80 step intranode 90 "tests/gpu/test_intranode.py"
    STEP_TEST_SECONDS=140 step facade 150 "tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_nvshmem.py -k 'facade or normal_mode_across'"
    ;;
  failures)
    STEP_TEST_SECONDS=100 step failures 190 "tests/gpu/test_daemon.py -k failure"
    ;;
  next)
    STEP_TEST_SECONDS=100 step notopk 110 "tests/gpu/test_daemon.py -k without_topk"
    STEP_TEST_SECONDS=150 step ll 240 "tests/gpu/test_low_latency_kernels.py \
        tests/gpu/test_ll_plain.py tests/gpu/test_daemon.py -k 'low_latency or plain'"
    ab_rounds 1 1 layer_rows new-first
    merge_json rows rows_ab
    ;;
  *) echo "usage: $0 recheck | bad | bad2 | stages | refused | failures | next" >&2; exit 2 ;;
esac
