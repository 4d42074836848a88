#!/usr/bin/env bash
# Twenty-seventh session's GPU runs (one H200; carry .whl):
#   bash benchmarks/device/gpu_s27_run.sh suite_a  # the one-GPU suite's files the last sessions did not
#        run: the kernels in-process (test_intranode), the daemon's roundtrips, the call
#        outputs, the low-latency chain (plain and graph)
#   bash benchmarks/device/gpu_s27_run.sh suite_b  # the rest: masking and rejoin, NVSHMEM worlds,
#        the low-latency kernels, MPS, security, service classes, the CUDA cluster
#   bash benchmarks/device/gpu_s27_run.sh chainab [ROUNDS]  # the low-latency rows of `epd bench` at D
#        (plain, hooks, graph; two ranks on the GPU) on the poller and on the chain
#        (--ll-chain), alternated; then the two pools on class engines, poller and chain
#   bash benchmarks/device/gpu_s27_run.sh autocheck  # the GPU tests of low-latency paths with
#        EPD_LL_CHAIN=auto on the daemons (members on the daemon's MPS server chained, shrink
#        groups on the poller): plain calls, graphs, the facade, masking, service classes
#   bash benchmarks/device/gpu_s27_run.sh next  # the GPU tests of what came after the device time
# (test_ll_plain, test_received_rows, test_local_layout, test_stream_ordered and the facade are
# gpu_s26_run.sh check; test_framework_replays_gpu needs two GPUs.)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, merge_json)
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
  chainab)
    llbench() {  # llbench LABEL [SERVE-ARGS...]: the D rows with the low-latency pair
      local label=$1; shift
      echo "== $label"
      timeout 150 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
          --low-latency --expert-intermediate 0 --json "$OUT/llbench_$label.json" "$@" 2>&1 \
          | clean | grep -a -E "low latency|hooks|graph|host work|PASS|FAIL|check" | cut -c1-200
    }
    for round in $(seq 1 "${2:-2}"); do
      llbench "poller_$round" --serve-arg=--ll-chain=off  # (auto since this session)
      llbench "chain_$round" --serve-arg=--ll-chain
    done
    merge_json llbench ll_chain_ab
    export POOLS_SECONDS=${POOLS_SECONDS:-80}
    pools class_engines --class-engines --serve-arg=--ll-chain=off
    pools class_engines_chain --class-engines --serve-arg=--ll-chain
    merge_json pool pools_chain
    ;;
  autocheck)
    EPD_LL_CHAIN=auto STEP_TEST_SECONDS=150 step autocheck 570 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_rank_masking_gpu.py \
        tests/gpu/test_service_classes_gpu.py \
        tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config \
        tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph"
    ;;
  next)  # what came after the device time: the default auto's stricter plain-call check, the
         # poller's plain calls (--ll-chain off), the chain forced on, the cluster tests
         # (groups over nodes stay on the poller under auto)
    STEP_TEST_SECONDS=200 step next 560 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py tests/gpu/test_ll_chain.py tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 suite_a|suite_b|chainab|autocheck|next" >&2; exit 2 ;;
esac
