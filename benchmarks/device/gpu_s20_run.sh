#!/usr/bin/env bash
# Twentieth session (2026-12-03, one H200). carry [".whl"].
#   bash benchmarks/device/gpu_s20_run.sh classes  # class engines (--class-engines, issue 14): the
#        service classes' GPU test on one engine and on class engines (decode on the GPU's
#        latency engine, exact), then the two pools on class engines (the poller, and the
#        chain) beside one engine's poller, in the same run (about 8 minutes)
#   bash benchmarks/device/gpu_s20_run.sh classes2  # what came after: the facade's test, the
#        throughput engines' MPS share (--throughput-mps-percentage 75) and the latency
#        engines' own heap size (--latency-heap-bytes 2 GiB) in the pools
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, pools, merge_json)
case "${1:-}" in
  classes)
    STEP_TEST_SECONDS=150 step classes 230 "tests/gpu/test_service_classes_gpu.py"
    export POOLS_SECONDS=${POOLS_SECONDS:-95}
    pools class_engines --class-engines
    pools one_engine
    if [ "$SECONDS" -lt "${CHAIN_BEFORE:-330}" ]; then  # (the chain only where time is left)
      pools class_engines_chain --class-engines --serve-arg=--ll-chain \
          --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
    fi
    merge_json pool pools_classes
    ;;
  classes2)  # after the device time of the twentieth session (not run yet): the DeepEP Buffer
             # landing on its class engine (the GPU test file again), class engines with the
             # throughput engines at 75% of the SMs under MPS, with a 2 GiB latency heap
    STEP_TEST_SECONDS=150 step classes 230 "tests/gpu/test_service_classes_gpu.py"
    export POOLS_SECONDS=${POOLS_SECONDS:-95}
    pools class_engines --class-engines
    pools class_engines_tp75 --class-engines --serve-arg=--throughput-mps-percentage=75
    pools class_engines_heap2g --class-engines --serve-arg=--latency-heap-bytes=2147483648
    merge_json pool pools_classes2
    ;;
  *) echo "usage: $0 classes|classes2" >&2; exit 2 ;;
esac
