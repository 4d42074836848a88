#!/usr/bin/env bash
# Forty-first session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   first41  # the fortieth session's request-path changes, never run on a GPU (a call's client
#            # deadline in the fast-path slot and the gRPC context, refused stale calls, the
#            # read-only retry over gRPC, the facade's branch keywords): the daemon, the facade,
#            # stream-ordered normal mode, bad input alike, worst-case, plain low-latency calls,
#            # security; then the elastic buffer, call outputs, the local layout
#   a41, b41 # the two above in two calls; c41: the low-latency disagreement verdict; d41:
#            # after the tenant pools' review
#   pools41  # tenant pools on the CUDA engine (a pool's engine: its own process, NVSHMEM
#            # world and heap), the class engines (the planner's worlds changed), MPS, the
#            # daemon and security suites after the reviews' mends (a session's waits on its own
#            # threads, huge-page regions refused, request size), the low-latency facade calls
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, merge_json, layer_rows,
#  ll_rows)
case "${1:-}" in
  first41)
    STEP_TEST_SECONDS=150 step suite 380 "tests/gpu/test_daemon.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_bad_input_alike.py \
        tests/gpu/test_worst_case_no_wait.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_security_cuda.py"
    STEP_TEST_SECONDS=100 step rest 170 "tests/gpu/test_elastic_buffer_gpu.py \
        tests/gpu/test_call_outputs.py tests/gpu/test_local_layout.py"
    ;;
  pools41)
    STEP_TEST_SECONDS=150 step pools 200 "tests/gpu/test_tenant_pools_gpu.py \
        tests/gpu/test_service_classes_gpu.py"
    STEP_TEST_SECONDS=150 step after 380 "tests/gpu/test_mps_gpu.py tests/gpu/test_daemon.py \
        tests/gpu/test_security_cuda.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_ll_chain_plain.py"
    ;;
  a41)  # the two above in two calls of at most 600 s: tenant pools and class engines, then
    # the daemon, the facade, stream-ordered normal mode, bad input alike, security
    STEP_TEST_SECONDS=150 step pools 200 "tests/gpu/test_tenant_pools_gpu.py \
        tests/gpu/test_service_classes_gpu.py"
    STEP_TEST_SECONDS=150 step suite 380 "tests/gpu/test_daemon.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_bad_input_alike.py \
        tests/gpu/test_security_cuda.py"
    ;;
  b41)  # worst-case, plain low-latency calls (poller and chain), MPS, the elastic buffer,
    # call outputs, the local layout
    STEP_TEST_SECONDS=150 step rest 560 "tests/gpu/test_worst_case_no_wait.py \
        tests/gpu/test_ll_plain.py tests/gpu/test_ll_chain_plain.py tests/gpu/test_mps_gpu.py \
        tests/gpu/test_elastic_buffer_gpu.py tests/gpu/test_call_outputs.py \
        tests/gpu/test_local_layout.py"
    ;;
  c41)  # ranks that disagree on a low-latency dispatch's num_max or use_fp8 fail it alike
    # (ERR_DISAGREE): the kernel tests (16 ranks with the queues they need), the facade's
    # plain and hook calls on the poller and the chain, rank masking (the verdict's set of
    # sources), the NVSHMEM build across two logical nodes
    CUDA_DEVICE_MAX_CONNECTIONS=32 STEP_TEST_SECONDS=120 step kernels 150 \
        "tests/gpu/test_low_latency_kernels.py"
    STEP_TEST_SECONDS=150 step plain 200 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    STEP_TEST_SECONDS=100 step masking 120 "tests/gpu/test_rank_masking_gpu.py"
    STEP_TEST_SECONDS=90 step across 100 "tests/gpu/test_nvshmem.py -k 'low_latency_across and 2'"
    ;;
  d41)  # after a review of tenant pools (the daemon's uid served by a pool's engines only
    # where the pool lists it; a refusal's socket followed only as an engine socket's name in
    # the client's own folder, class engines' too) and the poller's NotFilled code: the pools
    # and service classes, the facade's plain low-latency calls
    STEP_TEST_SECONDS=150 step pools2 200 "tests/gpu/test_tenant_pools_gpu.py \
        tests/gpu/test_service_classes_gpu.py"
    STEP_TEST_SECONDS=150 step plain2 200 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    ;;
  e41)  # the last read's simplifications (a stream dispatch counted as queued inside
    # dispatch_stream, a session's wait threads' flag) and the Python mends after d41: the
    # stream-ordered calls, bad input alike, the daemon's roundtrips, tenant pools
    STEP_TEST_SECONDS=120 step last 280 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_bad_input_alike.py tests/gpu/test_tenant_pools_gpu.py \
        tests/gpu/test_daemon.py -k 'roundtrip or stream or bad or pool'"
    ;;
  *) echo "usage: $0 first41|pools41|a41|b41|c41|d41|e41"; exit 2 ;;
esac
