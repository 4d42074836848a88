#!/usr/bin/env bash
# Short last call (the session's remaining device time): the normal-mode GPU tests after every
# kernel wait learned to skip masked ranks (tests/gpu/test_intranode.py, the stream-ordered
# normal mode, the daemon's round trips and failure paths).
source benchmarks/device/gpu_env.sh
timeout 190 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_intranode.py \
    tests/gpu/test_stream_ordered.py tests/gpu/test_daemon.py -k "not low_latency and not graph" \
    -q -rfEsx --timeout 120 -o addopts="" 2>&1 | grep -v " INFO " | tee "$OUT/gpu_tests.txt" | tail -15
