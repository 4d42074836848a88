#!/usr/bin/env bash
# Twenty-fourth session's GPU runs (one H200; carry .whl, with .whl/old for `ab`):
#   bash benchmarks/device/gpu_s24_run.sh first   # the review commit's GPU tests, a profile of one
#        rank's normal-mode calls at D on this tree, its rows once unprofiled
#   bash benchmarks/device/gpu_s24_run.sh ab      # one rank's rows on .whl/old and this tree,
#        alternated (three rounds, the baseline first, then two this tree first)
#   bash benchmarks/device/gpu_s24_run.sh spin    # the two pools on one engine, the poller's spin
#        5000 us (default) against 200 us, alternated twice
#   bash benchmarks/device/gpu_s24_run.sh adaptive  # the poller's spin shortened while the engine
#        serves calls, against the long and the short spin always; the low-latency rows
#   bash benchmarks/device/gpu_s24_run.sh final   # the GPU tests of the session's last code
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, probe_ab, profile_rows, merge, merge_json)
tests() {  # tests NAME: the GPU tests of the client's outputs, stream-ordered calls, plain
  # low-latency calls, rank masking and the daemon's roundtrips
  STEP_TEST_SECONDS=120 step "$1" 330 "tests/gpu/test_call_outputs.py \
      tests/gpu/test_stream_ordered.py tests/gpu/test_ll_plain.py \
      tests/gpu/test_rank_masking_gpu.py tests/gpu/test_deep_ep_facade.py \
      tests/gpu/test_daemon.py -k \
      'parts or stream or plain or micro or masked or rejoin or low_latency or roundtrip or facade or capacity'"
}
case "${1:-}" in
  first)
    tests check
    profile_rows base /tmp/pkg
    probe plain_1 /tmp/pkg
    merge base
    ;;
  ab)
    probe_ab 1 3
    probe_ab 4 5 new-first
    merge ab
    ;;
  spin)  # the poller's spin (5 ms after a trigger, the default since the twenty-third
    # session, against 200 us) in one engine serving both pools: does the spinning poller
    # slow the prefill pool's normal-mode calls, or decode?
    for r in 1 2; do
      pools "spin5000_$r"
      pools "spin200_$r" --serve-arg=--stream-op-spin-us=200
    done
    merge_json pool pools_spin
    ;;
  adaptive)  # the poller's spin shortened while the engine serves calls too (this tree's
    # default) against the long spin always (--stream-op-busy-spin-us=5000, the twenty-third
    # session's default) and the short spin always (--stream-op-spin-us=200): the two pools on
    # one engine, alternated twice; then the low-latency rows at D (decode alone) twice
    for r in 1 2; do
      pools "adaptive_$r"
      pools "long_$r" --serve-arg=--stream-op-busy-spin-us=5000
      pools "short_$r" --serve-arg=--stream-op-spin-us=200
    done
    merge_json pool pools_adaptive
    for r in 1 2; do
      echo "== low-latency rows ($r)"
      timeout 120 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
          --low-latency --expert-intermediate 0 --skip pipeline \
          --json "$OUT/ll_adaptive_$r.json" 2>&1 | clean | grep -a "^| D \|FAIL" | cut -c1-160
    done
    merge_json ll ll_adaptive
    # rank 0's client in the low-latency pairs, plain and with hooks, under cProfile
    EPD_PROBE_PROFILE=/tmp/ll.prof timeout 120 python3 -P benchmarks/probe_calls.py \
        --low-latency --tokens 128 --iters 200 --mps on --ranks 2 \
        --rows "ll plain pair,ll hook pair" 2>&1 | clean | tail -4 > "$OUT/ll_profile.txt"
    python3 -c "
import pstats
s = pstats.Stats('/tmp/ll.prof')
s.sort_stats('tottime').print_stats(30)
s.sort_stats('cumulative').print_stats('epd', 60)" >> "$OUT/ll_profile.txt" 2>&1
    rm -f /tmp/ll.prof
    head -4 "$OUT/ll_profile.txt"
    ;;
  final) tests final ;;
  *) echo "usage: $0 first|ab|spin|adaptive|final" >&2; exit 2 ;;
esac
