#!/usr/bin/env bash
# Sixteenth session (2026-12-03, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6). Issue 13's two-stage hierarchical normal mode
# (server/backends/cuda_stages.py):
#   bash benchmarks/device/gpu_s16_run.sh stages   # the kernels' two stages over two logical nodes
#        (1, 2, 4 ranks each) exact against the hierarchical reference, with the wall clock
#        against direct puts; the daemons' cluster test (a node-major group of 1 x 2: two
#        stages through the engine and the DeepEP facade); the intranode kernels and the
#        daemon's normal mode after RankRunner.notify was split out of dispatch
#   bash benchmarks/device/gpu_s16_run.sh again    # the first two after the fix of the stages' streams
#   bash benchmarks/device/gpu_s16_run.sh more     # direct puts across logical nodes (the A/B
#        switch's other side), test_nvshmem.py as a whole
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, pools, merge, merge_json)
case "${1:-}" in
  stages)
    EPD_STAGES_TIMING=1 step stages 280 "tests/gpu/test_nvshmem.py -k two_stage"
    step cluster 170 "tests/gpu/test_cuda_cluster.py"
    step regress 130 "tests/gpu/test_intranode.py tests/gpu/test_daemon.py \
        -k 'not low_latency and not graph and not armed'"
    ;;
  again)  # after the stage runners moved onto their rank's streams
    EPD_STAGES_TIMING=1 step stages 280 "tests/gpu/test_nvshmem.py -k two_stage"
    step cluster 170 "tests/gpu/test_cuda_cluster.py"
    ;;
  more)
    step direct 250 "tests/gpu/test_nvshmem.py -k 'not two_stage'"
    EPD_CUDA_HIERARCHICAL=direct step cluster_direct 170 "tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 stages|again|more" >&2; exit 2 ;;
esac
