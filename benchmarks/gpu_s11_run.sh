#!/usr/bin/env bash
# Eleventh session (2026-12-02, one H200). carry [".whl"].
#   bash benchmarks/gpu_s11_run.sh profile  # where one rank's per-call host time goes (issue 10):
#        probe_calls' normal-mode rows at D with one rank, the engine's fast-path thread and
#        rank 0's client under cProfile; then the same rows unprofiled (the baseline); then
#        tests/gpu/test_cuda_cluster.py (not run since the hierarchical kernels)
#   bash benchmarks/gpu_s11_run.sh after    # the same rows after this session's host-path
#        changes, then the GPU suite
set -u
source benchmarks/gpu_env.sh  # (pt, step)
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
rows="layout,dispatch,cached dispatch,combine,layout + dispatch + combine"
probe() {  # probe LABEL [extra args]: the normal-mode rows at D, one rank, MPS on
  local label=$1; shift
  timeout 90 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 200 --mps on \
      --ranks 1 --rows "$rows" --json "$OUT/probe_$label.json" "$@" 2>&1 | clean | tail -7 \
      | tee "$OUT/probe_$label.txt"
}
case "${1:-}" in
  profile)
    mkdir -p /tmp/prof
    EPD_PROFILE_DIR=/tmp/prof EPD_PROBE_PROFILE=/tmp/prof/client.prof probe profiled
    python3 benchmarks/pstats_top.py /tmp/prof/*.prof > "$OUT/profile.txt" 2>&1
    python3 -c "
import pstats, glob
for p in sorted(glob.glob('/tmp/prof/*.prof')):
    print('==', p); pstats.Stats(p).sort_stats('cumulative').print_stats(45)
" > "$OUT/profile_cum.txt" 2>&1
    probe baseline
    step cluster 200 "tests/gpu/test_cuda_cluster.py"
    ;;
  after)
    probe after
    step suite 420 "tests/gpu --durations=10 --ignore=tests/gpu/test_rank_masking_gpu.py \
        --ignore=tests/gpu/test_cuda_cluster.py --ignore=tests/gpu/test_nvshmem.py \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_low_latency_kernels.py"
    ;;
  *) echo "usage: $0 profile|after" >&2; exit 2 ;;
esac
