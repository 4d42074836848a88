#!/usr/bin/env bash
# The 2-GPU runs the targets of issues 10 and 14 need (nvidia-h200-x2; not yet lent as of
# 2026-12-01). Two device calls, each under the 10-minute limit:
#   bash benchmarks/gpu_x2_targets_run.sh bench   # carry [".whl", ".deepep"]: DeepEP V1 built
#        intranode-only (prepare .deepep here with ../shared/device/deepep-anchor.sh), then
#        `epd bench` at P and D with the low-latency rows, with and without MPS, beside DeepEP
#        in-process and the NCCL pipeline (JSON + plot under $OUT)
#   bash benchmarks/gpu_x2_targets_run.sh pools   # carry [".whl"]: the two-pool benchmark with
#        classes, without classes, with pacing, and without MPS; then the GPU test suite
set -u
source benchmarks/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
case "${1:-}" in
  bench)
    if [ -d .deepep ]; then
      rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
      (cd /tmp/deepep && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 timeout 240 \
          python3 setup.py build_ext --inplace) > "$OUT/deepep_build.txt" 2>&1 \
        && export PYTHONPATH=$PYTHONPATH:/tmp/deepep || tail -5 "$OUT/deepep_build.txt"
    fi
    # DeepEP's intranode-only build has no low-latency mode: its LL rows are skipped.
    timeout 200 python3 -P -m epd.server.cli bench --shapes P,D --iters 40 --low-latency \
        --skip deep_ep_ll --json "$OUT/bench_mps.json" --plot "$OUT/bench_mps.png" 2>&1 \
        | clean | tail -30
    EPD_MPS=off timeout 200 python3 -P -m epd.server.cli bench --shapes P,D --iters 40 \
        --low-latency --skip deep_ep_ll --json "$OUT/bench_nomps.json" 2>&1 | clean | tail -30
    ;;
  pools)
    for v in "classes:" "noclasses:--no-classes" "pacing:--serve-arg=--throughput-pause-us=1000" \
             "nomps:--mps=off"; do
      timeout 100 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
          --prefill-iters 150 ${v#*:} --json "$OUT/two_pools_${v%%:*}.json" 2>&1 | clean | tail -6
    done
    timeout 300 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEsx --timeout 150 \
        -o addopts="" 2>&1 | grep -v " INFO " | tee "$OUT/gpu_tests.txt" | tail -20
    ;;
  *) echo "usage: $0 bench|pools" >&2; exit 2 ;;
esac
