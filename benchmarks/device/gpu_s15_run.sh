#!/usr/bin/env bash
# (Historical. EPD_COMBINE_NO_WAIT, set by its "nowait" steps, was removed in the twenty-sixth
# session: those steps now measure the ordinary, answered combine.)
# Fifteenth session (2026-12-03, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6). What the thirteenth and fourteenth sessions built after their
# device time, in three calls:
#   bash benchmarks/device/gpu_s15_run.sh one    # the chain's per-type reduce and literal launches (its
#        default now) with the timeline, its A/B switches (split exec, entry in device memory),
#        and the combine that returns once sent (test_stream_ordered runs answered and not)
#   bash benchmarks/device/gpu_s15_run.sh two    # the rest of the one-GPU suite on this tree (the CUDA
#        backend's memory wrappers moved to cuda_memory.py), the three files not run since the
#        tenth and eleventh sessions among them
#   bash benchmarks/device/gpu_s15_run.sh three  # issue 14's pools on one GPU with each chain variant
#        beside the poller; one rank's rows answered and without waiting for the combine
#   bash benchmarks/device/gpu_s15_run.sh ring   # armed low-latency ops triggered through a ring per
#        member, in stream order (the fix of test_two_micro_batches_in_flight on the poller):
#        every armed-op test, then the pools on the poller (RING_CHAIN=1: and the chain with its
#        entry on the device)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, pools, merge, merge_json)
case "${1:-}" in
  one)
    export EPD_CHAIN_TIMELINE=1
    step chain 130 "tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py"
    EPD_CHAIN_EXEC=split step chain_split 70 "tests/gpu/test_ll_chain.py"
    EPD_CHAIN_ENTRY=device step chain_entry 70 "tests/gpu/test_ll_chain.py"
    EPD_CHAIN_REDUCE=generic step chain_generic 70 "tests/gpu/test_ll_chain.py"
    unset EPD_CHAIN_TIMELINE
    step nowait 200 "tests/gpu/test_stream_ordered.py tests/gpu/test_deep_ep_facade.py"
    ;;
  two)
    step suite_a 270 "tests/gpu/test_intranode.py tests/gpu/test_daemon.py \
        tests/gpu/test_ll_plain.py tests/gpu/test_call_outputs.py tests/gpu/test_local_layout.py"
    step suite_b 270 "tests/gpu/test_rank_masking_gpu.py tests/gpu/test_nvshmem.py \
        tests/gpu/test_low_latency_kernels.py tests/gpu/test_received_rows.py \
        tests/gpu/test_mps_gpu.py tests/gpu/test_security_cuda.py \
        tests/gpu/test_service_classes_gpu.py tests/gpu/test_cuda_cluster.py"
    ;;
  three)
    export POOLS_SECONDS=70
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
           --daemon-env EPD_CHAIN_TIMELINE=1)
    pools chain_trait "${chain[@]}"
    pools chain_generic "${chain[@]}" --daemon-env EPD_CHAIN_REDUCE=generic
    pools chain_split "${chain[@]}" --daemon-env EPD_CHAIN_EXEC=split
    pools chain_entry "${chain[@]}" --daemon-env EPD_CHAIN_ENTRY=device
    pools poller --daemon-env EPD_CHAIN_TIMELINE=1
    merge_json pool pools_chain_variants
    for round in 1 2; do
      probe "answered_$round" /tmp/pkg
      EPD_COMBINE_NO_WAIT=1 probe "nowait_$round" /tmp/pkg
    done
    merge nowait
    ;;
  ring)
    step ring "${RING_STEP_SECONDS:-240}" "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py tests/gpu/test_ll_chain.py tests/gpu/test_daemon.py \
        tests/gpu/test_service_classes_gpu.py ${RING_MORE:-} \
        -k 'low_latency or micro or armed or graph or concurrently or plain or masked or rejoin'"
    export POOLS_SECONDS=65
    pools poller_ring
    [ "${RING_CHAIN:-0}" = 1 ] && pools chain_entry_ring --serve-arg=--ll-chain \
        --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32 --daemon-env EPD_CHAIN_ENTRY=device
    merge_json pool pools_ring
    ;;
  *) echo "usage: $0 one|two|three|ring" >&2; exit 2 ;;
esac
