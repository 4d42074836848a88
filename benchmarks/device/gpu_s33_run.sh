#!/usr/bin/env bash
# Thirty-third session's GPU runs (one H100 or H200; carry .whl), from a `git archive` of HEAD
# carried in .whl: mkdir /tmp/head && tar -xzf .whl/head.tar.gz -C /tmp/head && cp -r .whl
# /tmp/head && cd /tmp/head && bash benchmarks/device/gpu_s33_run.sh prof
#   prof  # where the host time goes with NVSHMEM's proxy off (the one-node default now):
#         # one rank's normal-mode rows at D with the engine's fast-path thread and the client
#         # under cProfile, then the facade's low-latency pairs with rank 0's client profiled
#         # (~3 minutes)
#   suite  # the one-GPU test files that start daemons, on the new default (~9 minutes)
#   rows  # the daemon's rows at D (normal and low latency), 2 ranks, twice (~4 minutes)
#   final  # the client's last changes (the hook's scales allocator, the null relaxed_capture):
#          # the plain/hook/graph tests, then the bench with --fresh-inputs and without (~3 min)
#   llab [ROUNDS]  # the facade's low-latency pairs (2 ranks) on this tree, on it with
#        # NVSHMEM's proxy thread on, and on .whl/old (a `git archive` of server proto client
#        # cuda at the commit before the copy-out plan), alternated (2 rounds, ~4 minutes)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, profile_rows)
llrows() {  # llrows LABEL [PROFILE] [PKG]: the facade's low-latency pairs at D (probe_calls.py)
  EPD_PROBE_PROFILE=${2:-} PYTHONPATH=${3:-/tmp/pkg}:/tmp/site timeout 150 python3 -P benchmarks/probe_calls.py --low-latency \
      --tokens 128 --iters 300 --mps on --ranks 2 --rows "ll plain pair,ll hook pair" \
      --json "$OUT/ll_$1.json" 2>&1 | clean | tail -6
}
case "${1:-}" in
  prof)
    profile_rows normal /tmp/pkg
    cat "$OUT/probe_profiled_normal.txt"
    head -70 "$OUT/profile_top_normal.txt" | cut -c1-200
    llrows profiled /tmp/ll.prof
    python3 -c "
import pstats
s = pstats.Stats('/tmp/ll.prof')
s.sort_stats('tottime').print_stats(45)
s.sort_stats('cumulative').print_stats('epd', 80)" > "$OUT/ll_profile.txt" 2>&1
    rm -f /tmp/ll.prof
    head -70 "$OUT/ll_profile.txt" | cut -c1-200
    ;;
  suite)
    # (the first ones first: a step cut short by its limit still says what passed)
    STEP_TEST_SECONDS=150 step suite 560 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_received_rows.py \
        tests/gpu/test_daemon.py tests/gpu/test_framework_replays_gpu.py \
        tests/gpu/test_ll_chain_plain.py tests/gpu/test_call_outputs.py \
        tests/gpu/test_mps_gpu.py tests/gpu/test_security_cuda.py \
        tests/gpu/test_service_classes_gpu.py tests/gpu/test_rank_masking_gpu.py \
        tests/gpu/test_ll_trigger.py"
    ;;
  llab)
    mkdir -p /tmp/pkg_old/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
    for round in $(seq 1 "${2:-2}"); do
      echo "== new $round (proxy off, the default)"; llrows "new_$round" "" /tmp/pkg
      echo "== proxy $round (NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=0)"
      NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=0 llrows "proxy_$round" "" /tmp/pkg
      echo "== old $round (before the copy-out plan)"; llrows "old_$round" "" /tmp/pkg_old
    done
    merge_json ll ll_ab
    ;;
  final)
    STEP_TEST_SECONDS=100 step final 150 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_deep_ep_facade.py::test_facade_v1_pattern_with_events \
        tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph \
        tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config"
    for fresh in --fresh-inputs ""; do
      timeout 60 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
          --low-latency --expert-intermediate 0 $fresh --json "$OUT/final${fresh:+_fresh}.json" \
          > /tmp/b.log 2>&1
      echo "== bench ${fresh:-(same objects)} rc=$?"
      clean < /tmp/b.log | grep -E "^\| D |host work|FAIL" | cut -c1-200
    done
    ;;
  rows)
    for round in $(seq 1 "${ROUNDS:-2}"); do
      timeout 110 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 80 \
          --low-latency --expert-intermediate 0 --json "$OUT/rows_$round.json" \
          > "$OUT/rows_$round.log" 2>&1
      echo "== rows_$round rc=$?"
      clean < "$OUT/rows_$round.log" | grep -E "^\| D |PASS|FAIL|host work|by thread|Error"
    done
    ;;
  *) echo "usage: $0 prof|suite|rows|llab|final" >&2; exit 2 ;;
esac
