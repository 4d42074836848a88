#!/usr/bin/env bash
# Twenty-sixth session's GPU runs (one H200; carry .whl, and .deepep for `shared`):
#   bash benchmarks/device/gpu_s26_run.sh llprof  # where a plain / hooked low-latency pair's client
#        host time goes: the facade's FP8 dispatch + bf16 combine at D, two ranks, rank 0's
#        client under cProfile (top by own time, and the epd functions by cumulative time),
#        then the same rows unprofiled
#   bash benchmarks/device/gpu_s26_run.sh llab [ROUNDS]  # the low-latency pairs on .whl/old (a
#        `git archive` of the baseline's server proto client cuda) and on this tree, alternated
#   bash benchmarks/device/gpu_s26_run.sh shared  # = gpu_s22_run.sh shared (EPD beside DeepEP)
#   bash benchmarks/device/gpu_s26_run.sh check   # the GPU tests of what this session changed: the
#        client's packed launches (trigger, copy-out, local layout), the raw stream handle,
#        the scales' allocation, the engine's packed arguments, the refused combine
#   bash benchmarks/device/gpu_s26_run.sh abcheck # llab (3 rounds), then check
#   bash benchmarks/device/gpu_s26_run.sh normalab  # one rank's normal-mode rows at D on .whl/old and
#        this tree, two alternated rounds (the raw stream handle is on that path too)
#   bash benchmarks/device/gpu_s26_run.sh adaptive  # a third round of gpu_s24_run.sh adaptive's
#        poller policies beside a prefill pool (one round each, ~5 minutes)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, merge_json)
llrows() {  # llrows LABEL [PROFILE] [PKG]: the facade's low-latency pairs at D (probe_calls.py)
  EPD_PROBE_PROFILE=${2:-} PYTHONPATH=${3:-/tmp/pkg}:/tmp/site timeout 150 python3 -P benchmarks/probe_calls.py --low-latency \
      --tokens 128 --iters 300 --mps on --ranks 2 --rows "ll plain pair,ll hook pair" \
      --json "$OUT/ll_$1.json" 2>&1 | clean | tail -6
}
case "${1:-}" in
  llprof)
    llrows base
    llrows profiled /tmp/ll.prof > "$OUT/ll_profile.txt"
    python3 -c "
import pstats
s = pstats.Stats('/tmp/ll.prof')
s.sort_stats('tottime').print_stats(45)
s.sort_stats('cumulative').print_stats('epd', 80)" >> "$OUT/ll_profile.txt" 2>&1
    rm -f /tmp/ll.prof
    llrows base2
    merge_json ll ll_rows
    head -60 "$OUT/ll_profile.txt" | cut -c1-200
    ;;
  llab)
    mkdir -p /tmp/pkg_old/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
    for round in $(seq 1 "${2:-3}"); do
      echo "== round $round"
      llrows "old_$round" "" /tmp/pkg_old
      llrows "new_$round" "" /tmp/pkg
    done
    merge_json ll ll_ab
    ;;
  check|abcheck)
    [ "$1" = abcheck ] && bash "$0" llab 3
    STEP_TEST_SECONDS=150 step check $(( 580 - SECONDS < 420 ? 580 - SECONDS : 420 )) \
        "tests/gpu/test_ll_plain.py tests/gpu/test_received_rows.py \
        tests/gpu/test_local_layout.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_deep_ep_facade.py"
    ;;
  normalab)
    probe_ab 1 2
    merge normal_ab > /dev/null
    grep -a -h "dispatch\|combine\|layout" "$OUT/probes_normal_ab.txt" | cut -c1-200
    ;;
  adaptive)
    off=--serve-arg=--ll-chain=off  # (the poller's policies: auto chains decode since s27)
    pools adaptive_3 $off
    pools long_3 --serve-arg=--stream-op-busy-spin-us=5000 $off
    pools short_3 --serve-arg=--stream-op-spin-us=200 $off
    merge_json pool pools_adaptive_3
    ;;
  shared) bash benchmarks/device/gpu_s22_run.sh shared ;;
  *) echo "usage: $0 llprof|llab|shared|check|abcheck|normalab|adaptive" >&2; exit 2 ;;
esac
