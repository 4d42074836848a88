#!/usr/bin/env bash
# Eighth session of 2026-12-01 (one H200). carry [".whl"] (nvshmem4py, gRPC extras, CCCL).
#   bash benchmarks/device/gpu_s8_run.sh xnodes   # normal mode across two logical nodes: the kernels
#        (two PEs, 2/4/8 ranks) and two --cuda-cluster daemons through the DeepEP facade
#   bash benchmarks/device/gpu_s8_run.sh final    # xnodes, then the one-node kernels and the framework
#        replays (the intranode kernels changed: staging offsets, reduce by plain name)
#   bash benchmarks/device/gpu_s8_run.sh across   # both modes across two logical nodes (kernel tests)
#   bash benchmarks/device/gpu_s8_run.sh normal   # normal mode across two logical nodes (kernel test)
#   bash benchmarks/device/gpu_s8_run.sh normal2  # its 4-rank case alone, every rank's error named
#   bash benchmarks/device/gpu_s8_run.sh suite    # the GPU suite without the cluster and masking tests
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
export EPD_GPU_LOG_DIR="$OUT"  # every daemon's whole log (tests/gpu/conftest.py)
case "${1:-}" in
  xnodes)
    step normal_kernels 240 "-s tests/gpu/test_nvshmem.py -k normal_mode_across"
    step cluster 260 "-s tests/gpu/test_cuda_cluster.py"
    ;;
  final)
    step normal_kernels 190 "-s tests/gpu/test_nvshmem.py -k normal_mode_across"
    step cluster 200 "-s tests/gpu/test_cuda_cluster.py"
    step onenode 190 "tests/gpu/test_intranode.py tests/gpu/test_framework_replays_gpu.py"
    ;;
  across)
    step across 300 "-s tests/gpu/test_nvshmem.py -k across_logical_nodes"
    ;;
  normal)
    step normal_kernels 200 "-s tests/gpu/test_nvshmem.py -k normal_mode_across"
    ;;
  normal2)  # the failing 4-rank case alone, every rank's error named
    step normal2 120 "-s 'tests/gpu/test_nvshmem.py::test_normal_mode_across_logical_nodes[2]'"
    ;;
  suite)
    step suite 540 "tests/gpu --durations=10 --ignore=tests/gpu/test_rank_masking_gpu.py \
        --ignore=tests/gpu/test_cuda_cluster.py --ignore=tests/gpu/test_nvshmem.py \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_low_latency_kernels.py"
    ;;
  *) echo "usage: $0 xnodes|final|across|normal|normal2|suite" >&2; exit 2 ;;
esac
