#!/usr/bin/env bash
# One device call for issue 10 (1 or 2 H200): the whole GPU suite, the demo on the CUDA engine,
# per-call phases and host CPU (probe_calls.py) at D with and without MPS and at P, and
# `epd bench` (EPD through the DeepEP facade; DeepEP and NCCL where the GPUs allow). Logs and
# JSON under $OUT.
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
timeout 280 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEx --timeout 120 \
    --durations=10 -o addopts="" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -22
timeout 60 python3 -P -m epd.server.cli demo --backend cuda 2>&1 | tee "$OUT/demo.txt" | tail -6
timeout 45 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --mps on \
    --json "$OUT/probe_D_mps.json" 2>&1 | clean | tail -7
timeout 45 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --mps off \
    --json "$OUT/probe_D_nomps.json" 2>&1 | clean | tail -7
timeout 60 python3 -P benchmarks/probe_calls.py --tokens 4096 --iters 40 --mps on \
    --json "$OUT/probe_P_mps.json" 2>&1 | clean | tail -7
timeout 120 python3 -P -m epd.server.cli bench --shapes D,P --iters 30 --low-latency \
    --json "$OUT/bench.json" 2>&1 | clean | tail -22
