#!/usr/bin/env bash
# Twenty-fifth session's GPU runs (no device was lent that session: written for the next one;
# one H200 is enough; carry .whl):
#   bash benchmarks/device/gpu_s25_run.sh final   # the GPU tests of the twenty-fourth and
#        twenty-fifth sessions' code: the client's outputs, stream-ordered calls (a synchronous
#        call behind unstarted ones), plain and hook low-latency calls (new batch sizes every
#        step), graphs, micro-batches, rank masking, the facade, the daemon's roundtrips
#   bash benchmarks/device/gpu_s25_run.sh adaptive  # = gpu_s24_run.sh adaptive (the poller policy)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, probe_ab, profile_rows, merge, merge_json)
case "${1:-}" in
  final)
    STEP_TEST_SECONDS=150 step final 420 "tests/gpu/test_call_outputs.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_rank_masking_gpu.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_daemon.py -k \
        'parts or stream or plain or hook or micro or masked or rejoin or low_latency or roundtrip or facade or capacity or synchronous'"
    ;;
  adaptive) bash benchmarks/device/gpu_s24_run.sh adaptive ;;
  *) echo "usage: $0 final|adaptive" >&2; exit 2 ;;
esac
