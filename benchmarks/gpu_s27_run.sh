#!/usr/bin/env bash
# Twenty-seventh session's GPU runs (one H200; carry .whl):
#   bash benchmarks/gpu_s27_run.sh suite_a  # the one-GPU suite's files the last sessions did not
#        run: the kernels in-process (test_intranode), the daemon's roundtrips, the call
#        outputs, the low-latency chain (plain and graph)
#   bash benchmarks/gpu_s27_run.sh suite_b  # the rest: masking and rejoin, NVSHMEM worlds,
#        the low-latency kernels, MPS, security, service classes, the CUDA cluster
# (test_ll_plain, test_received_rows, test_local_layout, test_stream_ordered and the facade are
# gpu_s26_run.sh check; test_framework_replays_gpu needs two GPUs.)
set -u
source benchmarks/gpu_env.sh  # (pt, step, clean, probe, merge_json)
case "${1:-}" in
  suite_a)
    step suite_a 560 "tests/gpu/test_intranode.py tests/gpu/test_daemon.py \
        tests/gpu/test_call_outputs.py tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py"
    ;;
  suite_b)
    step suite_b 570 "tests/gpu/test_rank_masking_gpu.py tests/gpu/test_nvshmem.py \
        tests/gpu/test_low_latency_kernels.py tests/gpu/test_mps_gpu.py \
        tests/gpu/test_security_cuda.py tests/gpu/test_service_classes_gpu.py \
        tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 suite_a|suite_b" >&2; exit 2 ;;
esac
