#!/usr/bin/env bash
# One device call for the stream-ordered normal mode (issue 10): the GPU tests that exercise it
# (daemon, facade, kernels) and the demo on the CUDA engine. Logs under $OUT.
source benchmarks/device/gpu_env.sh
timeout ${TEST_TIMEOUT:-420} python3 -P -m pytest -p no:cacheprovider -q -rfEx --timeout 150 \
    --durations=8 -o addopts="" ${TESTS:-tests/gpu/test_stream_ordered.py tests/gpu/test_daemon.py tests/gpu/test_deep_ep_facade.py} \
    2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
