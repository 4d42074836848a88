#!/usr/bin/env bash
# Fortieth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   combine  # a bad entry in a low-latency combine's own top-k (an expert its dispatch did not
#            # send the token to, or one twice) fails that rank's combine alone instead of
#            # aborting the group: the kernel tests (every roundtrip now asserts no verdict),
#            # the facade's plain and hook calls on the default path, the chain and the poller,
#            # the daemon's graph replays, the NVSHMEM build across two logical nodes; and
#            # next40's one failure again (test_mps_gpu: epd env's exports, a stale test)
#   combine2 # the same after the first run's and a review's mends, and the other low-latency
#            # suites (chain, graph reserve, framework replays, elastic buffer)
#   combine3 # the kernel and NVSHMEM tests again, then llab; llab2: two more rounds
#   shfl     # the reduce's checks by warp shuffles: its tests, four A/B rounds
#   recheck40 # the graph replays, NVSHMEM across nodes, chain suites after the shuffles
#   final40  # a combine entry never dispatched fails whatever became of its expert's rank
#   llab     # the facade's low-latency pairs (plain, hook), A/B against .whl/old = `git
#            # archive 64bed80 server proto client cuda` (extracted): the tree before this
#            # change (the reduce's duplicate and range checks, a done kernel per buffer)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, merge_json, layer_rows,
#  ll_rows)
case "${1:-}" in
  combine)
    STEP_TEST_SECONDS=150 step kernels 200 "tests/gpu/test_low_latency_kernels.py \
        -k 'bad or combines or decode or uneven'"
    STEP_TEST_SECONDS=150 step plain 330 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    STEP_TEST_SECONDS=120 step graph 140 "tests/gpu/test_daemon.py -k low_latency_cuda_graph"
    STEP_TEST_SECONDS=150 step across 170 "tests/gpu/test_nvshmem.py -k 'low_latency_across and 2'"
    STEP_TEST_SECONDS=120 step mps 150 "tests/gpu/test_mps_gpu.py -k private_server_and"
    ;;
  combine2)  # after the first run (the dispatch clears its buffer's combine verdict) and a
    # review (ids outside [-1, E) at combine, a second combine of one handle), and the other
    # low-latency suites not run since the thirty-eighth session
    STEP_TEST_SECONDS=150 step kernels2 200 "tests/gpu/test_low_latency_kernels.py"
    STEP_TEST_SECONDS=150 step plain2 330 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    STEP_TEST_SECONDS=150 step across2 170 "tests/gpu/test_nvshmem.py -k 'low_latency_across and 2'"
    STEP_TEST_SECONDS=150 step rest 420 "tests/gpu/test_ll_chain.py tests/gpu/test_graph_reserve.py \
        tests/gpu/test_framework_replays_gpu.py tests/gpu/test_elastic_buffer_gpu.py"
    ;;
  combine3)  # the kernel and NVSHMEM tests again (a verdict of code 0 reads as none: the
    # value word stays poisoned), then llab
    STEP_TEST_SECONDS=150 step kernels3 200 "tests/gpu/test_low_latency_kernels.py"
    STEP_TEST_SECONDS=150 step across3 170 "tests/gpu/test_nvshmem.py -k 'low_latency_across and 2'"
    ab_rounds 1 2 ll_rows
    merge_json llrows llrows_ab
    ;;
  shfl)  # the reduce's checks by warp shuffles (two parallel loads, not up to 2K dependent
    # ones): the kernel tests, the facade's calls, then four A/B rounds (two each order)
    STEP_TEST_SECONDS=150 step kernels4 200 "tests/gpu/test_low_latency_kernels.py"
    STEP_TEST_SECONDS=150 step plain4 330 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    ab_rounds 5 6 ll_rows
    ab_rounds 7 8 ll_rows new-first
    merge_json llrows llrows_ab3
    ;;
  recheck40)  # what the shuffles' run left out: the daemon's graph replays, the NVSHMEM build
    # across two logical nodes, the chain and graph-reserve suites
    STEP_TEST_SECONDS=120 step graph5 140 "tests/gpu/test_daemon.py -k low_latency_cuda_graph"
    STEP_TEST_SECONDS=150 step across5 170 "tests/gpu/test_nvshmem.py -k 'low_latency_across and 2'"
    STEP_TEST_SECONDS=120 step chain5 150 "tests/gpu/test_ll_chain.py tests/gpu/test_graph_reserve.py"
    ;;
  final40)  # an entry its dispatch did not send fails a combine whatever became of the
    # expert's rank (as the host path): the kernel tests, the facade's calls (one helper now),
    # rank masking (masked and gone ranks' dispatched experts are still skipped)
    STEP_TEST_SECONDS=100 step kernels6 120 "tests/gpu/test_low_latency_kernels.py"
    STEP_TEST_SECONDS=150 step plain6 200 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    STEP_TEST_SECONDS=100 step masking6 150 "tests/gpu/test_rank_masking_gpu.py"
    ;;
  llab2)  # two more rounds, this tree first
    ab_rounds 3 4 ll_rows new-first
    merge_json llrows llrows_ab2
    ;;
  llab)
    ab_rounds 1 2 ll_rows
    merge_json llrows llrows_ab
    ;;
  *) echo "usage: $0 combine|combine2|combine3|llab|llab2|shfl|recheck40|final40"; exit 2 ;;
esac
