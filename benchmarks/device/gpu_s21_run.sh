#!/usr/bin/env bash
# Twenty-first session (2026-12-03, one H200). carry [".whl"].
#   bash benchmarks/device/gpu_s21_run.sh retire  # after the chain graph loop's removal (its kernel
#        arguments and state words changed): the low-latency kernels, plain calls, the chain
#        and its plain calls, stream-ordered calls (about 5 minutes)
#   bash benchmarks/device/gpu_s21_run.sh bench   # issue 10's `epd bench` at D with two ranks on the
#        one GPU, MPS on (the ratio rows need two GPUs: DeepEP and NCCL take one GPU per rank)
#   bash benchmarks/device/gpu_s21_run.sh profile  # where one rank's cached dispatch and combine
#        spend host time, client and engine (cProfile)
#   bash benchmarks/device/gpu_s21_run.sh auto     # class engines by default under a latency policy
#   bash benchmarks/device/gpu_s21_run.sh final    # the facade, the chain and stream-ordered layers
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
export EPD_GPU_LOG_DIR=$OUT
case "${1:-}" in
  retire)
    step ll 200 "tests/gpu/test_low_latency_kernels.py tests/gpu/test_ll_plain.py"
    STEP_TEST_SECONDS=100 step chain 200 "tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py"
    # the chain with the engines' own top-up on the pools' path too (--ll-chain)
    STEP_TEST_SECONDS=100 step ordered 160 "tests/gpu/test_stream_ordered.py"
    # every daemon's whole log, in one file where a step failed (the device returns 8 files)
    if grep -q -a "FAILED\|exit status [1-9]" "$OUT"/gpu_*.txt; then
      tar -C "$OUT" -czf "$OUT/daemon_logs.tgz" $(cd "$OUT" && ls daemon-*.log)
    fi
    rm -f "$OUT"/daemon-*.log
    ;;
  bench)
    timeout 240 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 100 --low-latency \
        --json "$OUT/bench_d.json" 2>&1 | clean | tail -30
    ;;
  profile)  # one rank at D: the client's cached dispatch and combine, and the engine's fast
             # path thread, under cProfile (their top functions by own time)
    mkdir -p /tmp/prof
    EPD_PROFILE_DIR=/tmp/prof EPD_PROBE_PROFILE=/tmp/prof/client.prof timeout 120 python3 -P \
        benchmarks/probe_calls.py --tokens 128 --iters 300 --ranks 1 --mps on \
        --rows "cached dispatch,combine" --json "$OUT/probe_profile.json" 2>&1 | clean | tail -8
    python3 benchmarks/pstats_top.py /tmp/prof/*.prof > "$OUT/profile_top.txt" 2>&1
    head -c 3000 "$OUT/profile_top.txt"
    ;;
  auto)  # --class-engines auto (the default): the service classes' GPU test, whose second
          # daemon passes no --class-engines and must come up with class engines
    STEP_TEST_SECONDS=150 step classes 230 "tests/gpu/test_service_classes_gpu.py"
    ;;
  final)  # the last check: the client's Group moved to client/group.py (the facade, the chain's
           # armed ops and stream-ordered layers import it)
    STEP_TEST_SECONDS=200 step final 380 "tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_ll_chain.py tests/gpu/test_stream_ordered.py"
    ;;
  *) echo "usage: $0 retire|bench|profile|auto|final" >&2; exit 2 ;;
esac
