#!/usr/bin/env bash
# Final device call of the third 2026-12-01 session: rank masking on the CUDA engine (a mask
# word in every rank's control block that the kernels' waits skip, the low-latency kernels
# dropping entries for masked ranks) and every low-latency GPU test the kernel change touches.
source benchmarks/device/gpu_env.sh
timeout 280 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_rank_masking_gpu.py \
    tests/gpu/test_low_latency_kernels.py tests/gpu/test_ll_plain.py \
    tests/gpu/test_deep_ep_facade.py tests/gpu/test_daemon.py -k "not roundtrip and not failure" \
    -q -rfEsx --timeout 150 -o addopts="" 2>&1 | grep -v " INFO " > "$OUT/gpu_tests.txt"
tail -40 "$OUT/gpu_tests.txt"
