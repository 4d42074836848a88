#!/usr/bin/env bash
# Thirty-sixth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says), with .whl/old a `git archive` of server proto client cuda at ba3c521:
#   first    # the thirty-fifth session's unrun work in one call (~7 minutes): DeepEP V2's
#            # ElasticBuffer GPU test, one A/B round of the bench's rows at D (this tree, then
#            # ba3c521: gpu_s35_run.sh ab), and the V1 facade / V2 ElasticBuffer layer rows
#   elastic_rows  # the layer rows alone (probe_calls.py --elastic, one rank per process, D)
#   v2prof   # rank 0's client under cProfile: the V1 facade layer, then the V2 layer (CPU sync)
#   final    # the ElasticBuffer GPU tests, the layer rows and v2prof (~4 minutes)
#   verify   # the ElasticBuffer GPU tests and three layer rows (~2 minutes)
#   torchops # torch's compare + masked_fill alone and after a V1 dispatch (was ~280 µs in V2's
#            # combine): the client's host time per call (~1 minute)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, merge_json)
elastic_rows() {
  timeout 150 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 200 --mps on \
      --ranks 2 --elastic --rows "layout + dispatch + combine,v1 facade layer,v2 layer cpu-sync,v2 layer worst-case,v2 layer torch-handle,v2 expanded layer" \
      --json "$OUT/elastic_rows.json" 2>&1 | clean | tail -8
}
case "${1:-}" in
  first)
    bash benchmarks/device/gpu_s35_run.sh elastic
    echo "== elastic rows"; elastic_rows
    bash benchmarks/device/gpu_s35_run.sh ab 1
    ;;
  elastic_rows) elastic_rows ;;
  final)
    bash benchmarks/device/gpu_s35_run.sh elastic
    echo "== elastic rows"; elastic_rows
    bash "$0" v2prof
    ;;
  verify)
    bash benchmarks/device/gpu_s35_run.sh elastic
    timeout 100 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 200 --mps on \
        --ranks 2 --elastic --rows "v1 facade layer,v2 layer cpu-sync,v2 layer worst-case" \
        --json "$OUT/verify_rows.json" 2>&1 | clean | tail -4
    ;;
  torchops)
    timeout 100 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 200 --mps on \
        --ranks 2 --elastic --rows "torch mask ops,v1 dispatch,v1 dispatch + torch mask ops" \
        --json "$OUT/torchops_rows.json" 2>&1 | clean | tail -4
    ;;
  v2prof)
    for row in "v1 facade layer" "v2 layer cpu-sync"; do
      label=${row// /_}
      EPD_PROBE_PROFILE=/tmp/p.prof timeout 120 python3 -P benchmarks/probe_calls.py --tokens 128 \
          --iters 200 --mps on --ranks 2 --elastic --rows "$row" \
          --json "$OUT/prof_rows_$label.json" 2>&1 | clean | tail -2
      python3 -c "
import pstats
s = pstats.Stats('/tmp/p.prof')
s.sort_stats('tottime').print_stats(40)
s.sort_stats('cumulative').print_stats('epd', 70)" > "$OUT/profile_$label.txt" 2>&1
      rm -f /tmp/p.prof
    done
    merge_json prof_rows prof_rows
    ;;
  *) echo "usage: $0 first | elastic_rows | v2prof | final | verify | torchops" >&2; exit 2 ;;
esac
