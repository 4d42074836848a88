#!/usr/bin/env bash
# Twenty-sixth session's GPU runs (one H200; carry .whl, and .deepep for `shared`):
#   bash benchmarks/gpu_s26_run.sh llprof  # where a plain / hooked low-latency pair's client
#        host time goes: the facade's FP8 dispatch + bf16 combine at D, two ranks, rank 0's
#        client under cProfile (top by own time, and the epd functions by cumulative time),
#        then the same rows unprofiled
#   bash benchmarks/gpu_s26_run.sh shared  # = gpu_s22_run.sh shared (EPD beside DeepEP)
set -u
source benchmarks/gpu_env.sh  # (pt, step, clean, probe, merge_json)
llrows() {  # llrows LABEL [PROFILE]: the facade's low-latency pairs at D (probe_calls.py)
  EPD_PROBE_PROFILE=${2:-} timeout 150 python3 -P benchmarks/probe_calls.py --low-latency \
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
  shared) bash benchmarks/gpu_s22_run.sh shared ;;
  *) echo "usage: $0 llprof|shared" >&2; exit 2 ;;
esac
