#!/usr/bin/env bash
# Fifth session of 2026-12-01 (one H200: both ranks of each group on GPU 0, one engine):
#   bash benchmarks/device/gpu_s5_run.sh chain   # carry [".whl"]: the low-latency chain's GPU tests
#        (chain on, and the same armed tests with --no-ll-chain), then `epd bench` at D with
#        the low-latency rows, chain on and off, in one call
#   bash benchmarks/device/gpu_s5_run.sh suite   # carry [".whl"]: every GPU test but the replays
set -u
source benchmarks/device/gpu_env.sh
pt() { python3 -P -m pytest -p no:cacheprovider -v -rfEsx --timeout 150 -o addopts="" "$@"; }
bench() {  # $1: name, then env assignments for the daemon
  local name=$1; shift
  env "$@" timeout 170 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
      --skip deep_ep,pipeline --json "$OUT/bench_D_ll_$name.json" 2>&1 \
      | grep -v " INFO \|WARNING\|MpsWarning\|warnings.warn" | tail -14
}
case "${1:-}" in
  chain)
    timeout 330 bash -c "$(declare -f pt); pt tests/gpu/test_ll_chain.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_poller.py" 2>&1 | grep -v " INFO " > "$OUT/gpu_chain.txt"
    grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_chain.txt" | head -60
    bench chain EPD_LL_CHAIN=1
    bench poller EPD_LL_CHAIN=0
    ;;
  diag)  # carry [".whl"]: why the chain was slow under MPS (see docs/BENCHMARKS.md)
    python3 -P benchmarks/probe_stream_wait.py --iters 200 --idle-ms 1 \
        --json "$OUT/probe_stream_wait.json" 2>&1 | tail -4
    EPD_MPS=off timeout 200 bash -c "$(declare -f pt); pt tests/gpu/test_ll_chain.py" 2>&1 \
        | grep -v " INFO " > "$OUT/gpu_chain_nomps.txt"
    grep -E "PASSED|FAILED|passed|failed|^E  " "$OUT/gpu_chain_nomps.txt" | head -8
    bench chain_nomps EPD_LL_CHAIN=1 EPD_MPS=off
    bench chain_mps_conn32 EPD_LL_CHAIN=1 CUDA_DEVICE_MAX_CONNECTIONS=32
    ;;
  diag2)  # carry [".whl"]: the wake-up probe, then the chain with a gate kernel vs the poller,
          # both with 32 connections for the MPS server
    python3 -P benchmarks/probe_stream_wait.py --iters 200 --idle-ms 1 \
        --json "$OUT/probe_stream_wait.json" 2>&1 | tail -4
    bench gate_conn32 EPD_LL_CHAIN=1 EPD_LL_CHAIN_GATE=1 CUDA_DEVICE_MAX_CONNECTIONS=32
    bench poller_conn32 EPD_LL_CHAIN=0 CUDA_DEVICE_MAX_CONNECTIONS=32
    CUDA_DEVICE_MAX_CONNECTIONS=32 EPD_LL_CHAIN_GATE=1 timeout 150 bash -c "$(declare -f pt); \
        pt tests/gpu/test_ll_plain.py" 2>&1 | grep -v " INFO " > "$OUT/gpu_plain_gate.txt"
    grep -E "PASSED|FAILED|passed|failed|^E  " "$OUT/gpu_plain_gate.txt" | head -8
    ;;
  r1)  # carry [".whl"]: one-rank groups (one chain per engine: no other member's chain to
        # share a work queue with): chain vs poller per low-latency pair, default and 32
        # connections for the MPS server
    for v in poller:0 chain:1; do for c in def 32; do
      if [ "$c" = 32 ]; then export CUDA_DEVICE_MAX_CONNECTIONS=32; else unset CUDA_DEVICE_MAX_CONNECTIONS; fi
      echo "== ${v%%:*} connections $c"
      EPD_LL_CHAIN=${v#*:} timeout 100 python3 -P benchmarks/probe_calls.py --ranks 1 \
          --low-latency --rows "ll plain pair,ll hook pair" --iters 100 \
          --json "$OUT/probe_r1_${v%%:*}_conn$c.json" 2>&1 | grep "pair" | tail -2
    done; done
    ;;
  ll)  # carry [".whl"]: every low-latency GPU test (kernels, masking incl. a live rank masked
       # by a call, plain/hook/graph calls, the chain, the facade, two service classes)
    timeout 450 bash -c "$(declare -f pt); pt tests/gpu/test_rank_masking_gpu.py \
        tests/gpu/test_low_latency_kernels.py tests/gpu/test_ll_plain.py tests/gpu/test_ll_chain.py \
        tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config \
        tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_service_classes_gpu.py --durations=10" \
        2>&1 | grep -v " INFO " > "$OUT/gpu_ll.txt"
    grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_ll.txt" | head -60
    ;;
  mask)  # carry [".whl"]: the rank-masking GPU tests alone, with the daemon's log
    timeout 200 bash -c "$(declare -f pt); pt -s tests/gpu/test_rank_masking_gpu.py" \
        > "$OUT/gpu_mask.txt" 2>&1
    grep -E "PASSED|FAILED|passed|failed|^E  " "$OUT/gpu_mask.txt" | head -12
    grep -iE "mask|went away|deadline|abort|left" "$OUT/gpu_mask.txt" | grep -v "^E " | head -40
    ;;
  suite)
    timeout 560 bash -c "$(declare -f pt); pt tests/gpu --durations=20 \
        --ignore=tests/gpu/test_framework_replays_gpu.py" 2>&1 | grep -v " INFO " \
        > "$OUT/gpu_suite.txt"
    grep -E "FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_suite.txt" | tail -40
    ;;
  *) echo "usage: $0 chain|diag|diag2|r1|ll|mask|suite" >&2; exit 2 ;;
esac
