#!/usr/bin/env bash
# Seventeenth session (2026-12-03, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6). The sixteenth session's open failure (two stages with more
# than one rank per logical node, and the older two-ranks-per-PE xfail) traced to CUDA's lazy
# kernel loading: the process-wide module now loads every kernel up front
# (cuda_kernels.load_function).
#   bash benchmarks/device/gpu_s17_run.sh load     # every kernel loaded; two stages over two logical
#        nodes at 1, 2, 4 ranks each (exact, with the timing beside direct puts); two PEs on
#        one GPU with 1 and 2 ranks each; the daemons' cluster test with two stages
#   bash benchmarks/device/gpu_s17_run.sh more     # two PEs on one GPU again (after the worker's
#        barrier), the two stages' timing at 2 x 2 ranks, the rest of test_nvshmem.py (direct
#        puts across logical nodes, low latency) and the cluster test with direct puts
#   bash benchmarks/device/gpu_s17_run.sh next     # what was committed after the last device call
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, pools, merge, merge_json)
case "${1:-}" in
  load)
    step loaded 60 "tests/gpu/test_intranode.py -k every_kernel_loaded"
    EPD_STAGES_TIMING=1 step stages 300 "tests/gpu/test_nvshmem.py -k 'two_stage or two_pes'"
    EPD_CUDA_HIERARCHICAL=stages step cluster 170 "tests/gpu/test_cuda_cluster.py"
    ;;
  more)
    step twopes 120 "tests/gpu/test_nvshmem.py -k two_pes"
    EPD_STAGES_TIMING=1 step timing 90 \
        "-rP 'tests/gpu/test_nvshmem.py::test_two_stage_normal_mode_across_logical_nodes[2]'"
    step direct 220 "tests/gpu/test_nvshmem.py -k 'not two_stage and not two_pes'"
    EPD_CUDA_HIERARCHICAL=direct step cluster_direct 170 "tests/gpu/test_cuda_cluster.py"
    ;;
  regress)  # the intranode kernels and the daemon after the kernel-loading change
    step regress 420 "tests/gpu/test_intranode.py tests/gpu/test_daemon.py"
    ;;
  client)  # the client's kernels loaded up front too (cuda_ipc.compiled_kernel)
    step loaded 60 "tests/gpu/test_intranode.py -k every_kernel_loaded"
    step client 170 "tests/gpu/test_ll_plain.py tests/gpu/test_call_outputs.py"
    ;;
  nowait)  # the stages without the host wait between them (the rail outputs padded)
    EPD_STAGES_TIMING=1 step nowait 110 "-rP tests/gpu/test_nvshmem.py -k two_stage"
    EPD_CUDA_HIERARCHICAL=stages step cluster 90 "tests/gpu/test_cuda_cluster.py"
    ;;
  next)  # what was committed after the last device call (one H200, about 420 s): the engine's
         # prefix copy (daemon tests), dense_rows, the stages' capacity case, the cluster
    step intranode 120 "tests/gpu/test_intranode.py -k 'dense_rows or every_kernel or cached'"
    step daemon 200 "tests/gpu/test_daemon.py tests/gpu/test_stream_ordered.py"
    step stages 120 "tests/gpu/test_nvshmem.py -k two_stage"
    EPD_CUDA_HIERARCHICAL=stages step cluster 100 "tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 load|more|regress|client|nowait|next" >&2; exit 2 ;;
esac
