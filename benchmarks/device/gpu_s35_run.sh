#!/usr/bin/env bash
# Thirty-fifth session's GPU runs. From a `git archive` of HEAD carried in .whl (see
# gpu_s34_run.sh for the unpacking), with .whl/old a `git archive` of server proto client cuda
# at ba3c521 (the thirty-third session's last GPU-run tree):
#   ab [ROUNDS]  # the bench's rows at D (2 ranks, fresh inputs) on this tree and on .whl/old,
#                # alternated (2 rounds, ~3 minutes): did the thirty-fourth session's client
#                # changes cost host time, or was its run's host slower?
#   llprof       # rank 0's client under cProfile for the facade's low-latency pairs
#   elastic      # DeepEP V2's ElasticBuffer on the CUDA engine (tests/gpu/test_elastic_buffer_gpu.py,
#                # ~2 minutes)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, merge_json)
rows() {  # rows LABEL PKG: the bench's rows at D once, its summary lines
  PYTHONPATH=$2:/tmp/site timeout 90 python3 -P -m epd.server.cli bench --ranks 2 --shapes D \
      --iters 60 --low-latency --expert-intermediate 0 --fresh-inputs \
      --json "$OUT/ab_$1.json" > /tmp/b.log 2>&1
  echo "== $1 rc=$?"
  clean < /tmp/b.log | grep -E "^\| D .*(MISS|pass)|FAIL" | cut -c1-120
}
case "${1:-}" in
  ab)
    ab_rounds 1 "${2:-2}" rows new-first
    merge_json ab rows_ab
    ;;
  llprof)
    EPD_PROBE_PROFILE=/tmp/ll.prof timeout 150 python3 -P benchmarks/probe_calls.py \
        --low-latency --tokens 128 --iters 300 --mps on --ranks 2 \
        --rows "ll plain pair,ll hook pair" --json "$OUT/ll_prof_rows.json" 2>&1 | clean | tail -6
    python3 -c "
import pstats
s = pstats.Stats('/tmp/ll.prof')
s.sort_stats('tottime').print_stats(45)
s.sort_stats('cumulative').print_stats('epd', 80)" > "$OUT/ll_profile.txt" 2>&1
    rm -f /tmp/ll.prof
    head -60 "$OUT/ll_profile.txt" | cut -c1-200
    ;;
  elastic)
    STEP_TEST_SECONDS=150 step elastic 170 "tests/gpu/test_elastic_buffer_gpu.py"
    ;;
  *) echo "usage: $0 ab [ROUNDS] | llprof | elastic" >&2; exit 2 ;;
esac
