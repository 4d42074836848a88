#!/usr/bin/env bash
# Sixth session of 2026-12-01 (one H200). The NVSHMEM build needs the CCCL headers: first
#   bash ../shared/device/fetch-wheels.sh nvidia-cuda-cccl==13.3.5.0.6   (into .whl/)
#   bash benchmarks/device/gpu_s6_run.sh remote   # carry [".whl"] (with the nvidia-cuda-cccl wheel):
#        low-latency mode across two logical nodes (two PEs on GPU 0 under MPS, the kernels'
#        NVSHMEM build), then every low-latency GPU test of the one-node build
#   bash benchmarks/device/gpu_s6_run.sh final    # carry [".whl"]: the test across logical nodes (with
#        its timing lines), then every daemon-level GPU test (the engine's host control words)
#   bash benchmarks/device/gpu_s6_run.sh mask     # carry [".whl"]: the MPS tests, then rank masking
#   bash benchmarks/device/gpu_s6_run.sh ipcprobe # benchmarks/probe_ipc_close.py without and with MPS
#   bash benchmarks/device/gpu_s6_run.sh cluster  # carry [".whl"]: tests/gpu/test_cuda_cluster.py
#   bash benchmarks/device/gpu_s6_run.sh next     # carry [".whl"]: what landed unrun, in priority order
#        (then `cluster` and `gpu_s5_run.sh suite`, one call each: each alone nears 600 s)
set -u
source benchmarks/device/gpu_env.sh
pt() { python3 -P -m pytest -p no:cacheprovider -v -rfEsx --timeout 300 -o addopts="" "$@"; }
case "${1:-}" in
  remote)
    timeout 250 bash -c "$(declare -f pt); pt -s tests/gpu/test_nvshmem.py -k across_logical_nodes" \
        > "$OUT/gpu_remote.txt" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed|ok$|^E  |error|rror:" "$OUT/gpu_remote.txt" | head -60
    timeout 170 bash -c "$(declare -f pt); pt tests/gpu/test_low_latency_kernels.py \
        tests/gpu/test_ll_plain.py" 2>&1 | grep -v " INFO " \
        > "$OUT/gpu_ll_one_node.txt"
    grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_ll_one_node.txt" | head -40
    python3 -P -c "
from epd.server.backends import cuda_kernels as ck
k = ck.kernels_for_device(0)
for n in ('epd_ll_dispatch', 'epd_ll_combine_push', 'epd_ll_combine_reduce<Bf16>', 'epd_mask_rank'):
    a = k.fn(n).attributes
    print(n, 'regs', a['num_regs'], 'smem', a['shared_size_bytes'], 'max threads', a['max_threads_per_block'])
" 2>&1 | tail -5
    timeout 110 bash -c "$(declare -f pt); pt -s tests/gpu/test_rank_masking_gpu.py" \
        > "$OUT/gpu_mask.txt" 2>&1
    grep -E "PASSED|FAILED|passed|failed|took|MPS|mps" "$OUT/gpu_mask.txt" | head -20
    ;;
  final)
    timeout 200 bash -c "$(declare -f pt); pt -s tests/gpu/test_nvshmem.py -k across_logical_nodes" \
        > "$OUT/gpu_remote.txt" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed|ok$|timing|^E  " "$OUT/gpu_remote.txt" | head -40
    timeout 370 bash -c "$(declare -f pt); pt tests/gpu --durations=10 \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_intranode.py \
        --ignore=tests/gpu/test_nvshmem.py --ignore=tests/gpu/test_low_latency_kernels.py" 2>&1 \
        | grep -v " INFO " > "$OUT/gpu_suite.txt"
    grep -E "FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_suite.txt" | tail -30
    ;;
  mask)  # the MPS tests then rank masking, as in the suite's order, with the daemon's log
    timeout 220 bash -c "$(declare -f pt); pt -s tests/gpu/test_mps_gpu.py \
        tests/gpu/test_rank_masking_gpu.py" > "$OUT/gpu_mask.txt" 2>&1
    grep -E "PASSED|FAILED|passed|failed|^E  |masked|went away|deadline|WARNING" \
        "$OUT/gpu_mask.txt" | cut -c1-300 | head -60
    ;;
  ipcprobe)  # does closing an IPC mapping hold back other threads' launches? (no MPS, MPS)
    for b in cupy bindings; do
      timeout 60 python3 -P benchmarks/probe_ipc_close.py --binding $b \
          --json "$OUT/probe_ipc_close_nomps_$b.json"
    done
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/epd-probe-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/epd-probe-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && sleep 1
    for b in cupy bindings; do
      timeout 60 python3 -P benchmarks/probe_ipc_close.py --binding $b \
          --json "$OUT/probe_ipc_close_mps_$b.json"
    done
    echo quit | nvidia-cuda-mps-control
    ;;
  cluster)  # carry [".whl"]: two logical-node daemons (--cuda-cluster) forming one world
    timeout 400 bash -c "$(declare -f pt); pt -s tests/gpu/test_cuda_cluster.py" \
        > "$OUT/gpu_cuda_cluster.txt" 2>&1
    grep -E "PASSED|FAILED|passed|failed|^E  |world|lost" "$OUT/gpu_cuda_cluster.txt" \
        | cut -c1-300 | head -60
    ;;
  next)  # carry [".whl"]: the next session's first call, what landed unrun, in priority order
    bash "$0" ipcprobe 2>&1 | grep -E '"spin_outcome"|"launch_s"|"close_s"|reading' | head -16
    timeout 120 bash -c "$(declare -f pt); pt -s tests/gpu/test_rank_masking_gpu.py" \
        > "$OUT/gpu_mask.txt" 2>&1
    grep -E "PASSED|FAILED|passed|failed|^E  " "$OUT/gpu_mask.txt" | head -12
    timeout 120 bash -c "$(declare -f pt); pt tests/gpu/test_low_latency_kernels.py" 2>&1 \
        | grep -v " INFO " > "$OUT/gpu_ll_kernels.txt"
    grep -E "PASSED|FAILED|passed|failed|^E  " "$OUT/gpu_ll_kernels.txt" | head -12
    timeout 200 bash -c "$(declare -f pt); pt -s tests/gpu/test_nvshmem.py -k across_logical_nodes" \
        > "$OUT/gpu_remote.txt" 2>&1
    grep -E "PASSED|FAILED|passed|failed|timing|^E  " "$OUT/gpu_remote.txt" | head -20
    ;;
  *) echo "usage: $0 remote|final|mask|ipcprobe|cluster|next" >&2; exit 2 ;;
esac
