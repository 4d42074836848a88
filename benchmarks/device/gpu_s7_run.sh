#!/usr/bin/env bash
# Seventh session of 2026-12-01 (one H200). carry [".whl"] (nvshmem4py, gRPC extras, CCCL).
#   bash benchmarks/device/gpu_s7_run.sh verify   # rank masking (IPC closes deferred to a quiet
#        engine), token growth through the facade, then the GPU suite without what call 1 ran
#        (low-latency kernels, across logical nodes) and without the cluster and replays
#   bash benchmarks/device/gpu_s7_run.sh final    # one fresh daemon per test: token growth, a rank
#        going away, a replacement rejoining, the --cuda-cluster daemons, a live rank masked
#   bash benchmarks/device/gpu_s7_run.sh masking  # the two masking tests that need three clients, with
#        CUDA_DEVICE_MAX_CONNECTIONS no longer exported to clients (gpu_env.sh)
#   bash benchmarks/device/gpu_s7_run.sh cluster  # tests/gpu/test_cuda_cluster.py (--cuda-cluster)
#   bash benchmarks/device/gpu_s7_run.sh next     # the next session's first call: the fixed rejoin,
#        a live rank masked, the service classes (four clients), the --cuda-cluster daemons
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
export EPD_GPU_LOG_DIR="$OUT"  # every daemon's whole log (tests/gpu/conftest.py)
case "${1:-}" in
  verify)
    timeout 150 bash -c "$(declare -f pt); pt -s tests/gpu/test_rank_masking_gpu.py \
        tests/gpu/test_deep_ep_facade.py -k 'masked or capacity'" 2>&1 | grep -v " INFO " \
        > "$OUT/gpu_mask_capacity.txt"
    grep -E "PASSED|FAILED|passed|failed|^E  " "$OUT/gpu_mask_capacity.txt" | head -30
    timeout 400 bash -c "$(declare -f pt); pt tests/gpu --durations=15 \
        --deselect tests/gpu/test_deep_ep_facade.py::test_token_capacity_grows_on_the_cuda_engine \
        --ignore=tests/gpu/test_rank_masking_gpu.py --ignore=tests/gpu/test_cuda_cluster.py \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_nvshmem.py \
        --ignore=tests/gpu/test_low_latency_kernels.py" 2>&1 | grep -v " INFO " \
        > "$OUT/gpu_suite.txt"
    grep -E "FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_suite.txt" | tail -30
    ;;
  final)  # one fresh daemon per step: capacity, a rank going away, rejoin, the cluster, live mask
    step capacity 100 "tests/gpu/test_deep_ep_facade.py -k capacity"
    step gone 110 "-s tests/gpu/test_rank_masking_gpu.py -k goes_away"
    step rejoin 125 "-s tests/gpu/test_rank_masking_gpu.py -k rejoins"
    step cluster 150 "-s tests/gpu/test_cuda_cluster.py"
    step live 95 "-s tests/gpu/test_rank_masking_gpu.py -k live_rank"
    ;;
  masking)  # a rank going away, then a replacement rejoining: one fresh daemon each
    step gone 100 "-s tests/gpu/test_rank_masking_gpu.py -k goes_away"
    step rejoin 120 "-s tests/gpu/test_rank_masking_gpu.py -k rejoins"
    ;;
  next)  # the next session's first call: what this one could not (re-)run
    step rejoin 130 "-s tests/gpu/test_rank_masking_gpu.py -k rejoins"
    step live 100 "-s tests/gpu/test_rank_masking_gpu.py -k live_rank"
    step classes 120 "tests/gpu/test_service_classes_gpu.py"
    step cluster 220 "-s tests/gpu/test_cuda_cluster.py"
    ;;
  cluster)
    timeout 400 bash -c "$(declare -f pt); pt -s tests/gpu/test_cuda_cluster.py" 2>&1 \
        | grep -v " INFO " > "$OUT/gpu_cuda_cluster.txt"
    grep -E "PASSED|FAILED|passed|failed|^E  |world|lost" "$OUT/gpu_cuda_cluster.txt" \
        | cut -c1-300 | head -60
    ;;
  *) echo "usage: $0 verify|final|masking|next|cluster" >&2; exit 2 ;;
esac
