#!/usr/bin/env bash
# Eighteenth session (2026-12-03, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6). Normal mode beyond MAX_RANKS = 8 ranks across nodes: a
# two-stage group of up to 8 nodes x 8 ranks, its whole-group notify in epd_wide_notify, and
# the layout kernel for up to 64 ranks.
#   bash benchmarks/device/gpu_s18_run.sh wide    # the layout kernel at 2..64 ranks against the
#        reference; two stages exact over two logical nodes at 1, 2, 4 and 8 ranks each (16
#        ranks: the wide notify); the daemons' cluster test with two stages; the client's
#        own layout through the daemon
#   bash benchmarks/device/gpu_s18_run.sh daemon16   # 16 ranks through two logical-node daemons and
#        the DeepEP facade (test_cuda_cluster.py's sixteen-rank test), and the cluster test
#   bash benchmarks/device/gpu_s18_run.sh ordered   # two-stage calls stream-ordered: the fold of a
#        stage's failure (epd_stage_errors), the stages' kernel test after the handles are
#        made first, the daemons' cluster tests (2 and 16 ranks) with stages
#   bash benchmarks/device/gpu_s18_run.sh shared    # after epd_notify and epd_wide_notify share their
#        end (notify_publish): the intranode notify cases (counts, capacity, deadline,
#        cached, small), the stages at 2 and 16 ranks, the daemon's flat stream-ordered path
#   bash benchmarks/device/gpu_s18_run.sh stagefail # (not run yet) what came after the last device
#        call: the fold launched packed (epd_stage_errors), the cluster tests after their
#        helper refactor, and a stage's deadline through the done word of a stream-ordered
#        two-stage combine, naming the group rank (about 5 minutes)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, pools, merge, merge_json)
case "${1:-}" in
  wide)
    step layout 60 "tests/gpu/test_intranode.py -k 'layout_kernel or every_kernel'"
    STEP_TEST_SECONDS=260 step stages 420 "tests/gpu/test_nvshmem.py -k two_stage"
    EPD_CUDA_HIERARCHICAL=stages step cluster 100 "tests/gpu/test_cuda_cluster.py"
    step local_layout 90 "tests/gpu/test_local_layout.py"
    ;;
  daemon16)
    STEP_TEST_SECONDS=280 step daemon16 560 "tests/gpu/test_cuda_cluster.py"
    ;;
  ordered)
    step fold 60 "tests/gpu/test_intranode.py -k 'stage_failure or every_kernel'"
    STEP_TEST_SECONDS=200 step stages 260 "tests/gpu/test_nvshmem.py -k two_stage"
    EPD_CUDA_HIERARCHICAL=stages STEP_TEST_SECONDS=240 step cluster 300 \
        "tests/gpu/test_cuda_cluster.py"
    ;;
  shared)
    step intranode 90 "tests/gpu/test_intranode.py -k 'small or counter_slot or missing_rank \
        or cached or uneven or every_kernel'"
    t=tests/gpu/test_nvshmem.py::test_two_stage_normal_mode_across_logical_nodes
    STEP_TEST_SECONDS=150 step stages 120 "'$t[2]' '$t[8]'"
    step daemon 170 "tests/gpu/test_daemon.py::test_daemon_roundtrip \
        tests/gpu/test_stream_ordered.py"
    ;;
  stagefail)
    step fold 60 "tests/gpu/test_intranode.py -k 'stage_failure or every_kernel'"
    EPD_CUDA_HIERARCHICAL=stages STEP_TEST_SECONDS=240 step cluster 420 \
        "tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 wide|daemon16|ordered|shared|stagefail" >&2; exit 2 ;;
esac
