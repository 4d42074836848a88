#!/usr/bin/env bash
# Ninth session of 2026-12-01 (one H200). carry [".whl", ".old"] for `hop`.
#   bash benchmarks/device/gpu_s9_run.sh hop     # the host hop before and after the spin/timer-slack
#        change, same machine, same call: .old holds the tree before it (`git archive dc63b83`);
#        per tree: the empty round trip (bench_transport.py), the per-call phases at D
#        (probe_calls.py, MPS on) and `epd bench --shapes D --low-latency` (MPS on)
#   bash benchmarks/device/gpu_s9_run.sh verify  # after the host-words fix: the low-latency pair
#        (probe_calls), `epd bench --shapes D --low-latency`, the masking, low-latency and
#        intranode GPU tests (the kernels' waits changed)
#   bash benchmarks/device/gpu_s9_run.sh next    # the next session's first call: ade4cab's kernels
#        (host words off the fast path) on the GPU tests they touch, then the issue-10 rows
#        (probe_calls D normal + low latency, `epd bench` D) on the committed code
#   bash benchmarks/device/gpu_s9_run.sh suite   # the GPU suite without the cluster/masking files
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
hop() {  # hop LABEL: the three measurements of the tree in the current folder, package at $1
  local label=$1
  {
    echo "== $label: bench_transport (cpu engine: the hop alone)"
    timeout 60 python3 -P benchmarks/bench_transport.py --iters 10000 2>&1 | clean | tail -4
    echo "== $label: probe_calls D, MPS on"
    timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --mps on \
        --json "$OUT/probe_$label.json" 2>&1 | clean | tail -12
    echo "== $label: epd bench D --low-latency"
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_$label.json" 2>&1 | clean | tail -24
  } > "$OUT/hop_$label.txt" 2>&1
  cat "$OUT/hop_$label.txt"
}
case "${1:-}" in
  hop)
    mkdir -p /tmp/pkg_old/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.old/$d" /tmp/pkg_old/epd/$d; done
    (cd .old && PYTHONPATH=/tmp/pkg_old:/tmp/site hop before)
    hop after
    # Where the engine's host time goes now: its ring threads under cProfile, D, MPS on.
    mkdir -p /tmp/prof
    EPD_PROFILE_DIR=/tmp/prof timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 \
        --iters 60 --mps on 2>&1 | clean | tail -8 > "$OUT/engine_profile.txt"
    python3 benchmarks/pstats_top.py /tmp/prof/*.prof >> "$OUT/engine_profile.txt" 2>&1
    ;;
  verify)
    timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 60 --mps on \
        --low-latency --rows "ll plain pair,ll hook pair" 2>&1 | clean | tail -4 \
        | tee "$OUT/verify_probe.txt"
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_verify.json" 2>&1 | clean | tail -24 | tee "$OUT/bench_verify.txt"
    step masking 130 "tests/gpu/test_rank_masking_gpu.py"
    step ll 110 "tests/gpu/test_low_latency_kernels.py tests/gpu/test_ll_plain.py"
    step intranode 100 "tests/gpu/test_intranode.py"
    ;;
  next)
    step masking 130 "tests/gpu/test_rank_masking_gpu.py"
    step ll 110 "tests/gpu/test_low_latency_kernels.py tests/gpu/test_ll_plain.py"
    step intranode 100 "tests/gpu/test_intranode.py"
    timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 60 --mps on \
        --low-latency 2>&1 | clean | tail -10 | tee "$OUT/next_probe.txt"
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_next.json" 2>&1 | clean | tail -24 | tee "$OUT/bench_next.txt"
    ;;
  suite)
    step suite 540 "tests/gpu --durations=10 --ignore=tests/gpu/test_rank_masking_gpu.py \
        --ignore=tests/gpu/test_cuda_cluster.py --ignore=tests/gpu/test_nvshmem.py \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_low_latency_kernels.py"
    ;;
  *) echo "usage: $0 hop|verify|next|suite" >&2; exit 2 ;;
esac
