#!/usr/bin/env bash
# Last device call of the third 2026-12-01 session: the one-launch copy-out of plain low-latency
# dispatches (client/received_rows.py): its GPU test and every test of the low-latency facade and
# daemon paths, then the per-call probe (client CPU per plain pair) and a cProfile of rank 0's
# client over the plain pair.
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 230 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_received_rows.py \
    tests/gpu/test_ll_plain.py tests/gpu/test_deep_ep_facade.py tests/gpu/test_daemon.py \
    -k "received or plain or micro or graph or facade or low_latency or without_topk" \
    -q -rfEsx --timeout 150 -o addopts="" 2>&1 | grep -v " INFO " > "$OUT/gpu_tests.txt"
tail -15 "$OUT/gpu_tests.txt"
timeout 70 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --low-latency \
    --json "$OUT/probe_D.json" 2>&1 | clean | tail -3
EPD_PROBE_PROFILE=/tmp/rank0.prof timeout 60 python3 -P benchmarks/probe_calls.py --tokens 128 \
    --iters 100 --low-latency --rows "ll plain pair" 2>&1 | clean | tail -2
python3 benchmarks/pstats_top.py /tmp/rank0.prof > "$OUT/client_profile.txt" 2>&1
head -45 "$OUT/client_profile.txt" | cut -c1-150
