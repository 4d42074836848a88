#!/usr/bin/env bash
# Twelfth session (2026-12-02, one H200). carry [".whl"] (with .whl/old: the tree of f7aecf0,
# `git archive f7aecf0 server proto client cuda | tar -x -C .whl/old`, for the A/B rows).
#   bash benchmarks/device/gpu_s12_run.sh ab    # answering before launching (issue 10): the GPU tests
#        of the stream-ordered calls and the kernels' runner, then one rank's normal-mode rows at
#        D alternately on f7aecf0 (launch, then answer) and this tree (answer, then launch),
#        then `epd bench --shapes D --low-latency`
#   bash benchmarks/device/gpu_s12_run.sh ab2   # three more alternations of those rows, then the
#        opt-in local layout's GPU test and the rows with it (probes_ab2.json: every probe)
#   bash benchmarks/device/gpu_s12_run.sh flip  # the local layout as the default: its tests, the facade,
#        the rows with and without it, the bench at D
#   bash benchmarks/device/gpu_s12_run.sh local # the local layout's GPU test alone
#   bash benchmarks/device/gpu_s12_run.sh rest  # the daemon's failure cases, the rest of the GPU suite, the cluster daemons
#        (carry the nvidia-cuda-cccl wheel in .whl: fetch-wheels.sh nvidia-cuda-cccl==13.3.5.0.6)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
rows="layout,dispatch,cached dispatch,combine,layout + dispatch + combine"
probe() {  # probe LABEL PKG: the normal-mode rows at D, one rank, MPS on, the package in PKG
  local label=$1 pkg=$2
  PYTHONPATH=$pkg:/tmp/site timeout 90 python3 -P benchmarks/probe_calls.py --tokens 128 \
      --iters 200 --mps on --ranks 1 --rows "$rows" --json "$OUT/probe_$label.json" 2>&1 \
      | clean | tail -7 > "$OUT/probe_$label.txt"
  cat "$OUT/probe_$label.txt"
}
case "${1:-}" in
  ab)
    step changed 280 "tests/gpu/test_stream_ordered.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_intranode.py tests/gpu/test_ll_plain.py tests/gpu/test_daemon.py \
        tests/gpu/test_service_classes_gpu.py"
    mkdir -p /tmp/pkg_old/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
    for round in 1 2; do
      probe "old_$round" /tmp/pkg_old
      probe "new_$round" /tmp/pkg
    done
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_ab.json" 2>&1 | clean | tail -30 > "$OUT/bench_ab.txt"
    head -12 "$OUT/bench_ab.txt"; grep -a "PASS\|FAIL" "$OUT/bench_ab.txt"
    ;;
  rest)  # (first the daemon's failure cases: a failed dispatch now waits for its last kernel
          # to name the cause; the killed-rank case failed in `ab` without that)
    step failures 100 "tests/gpu/test_daemon.py -k failure"
    step rest 260 "tests/gpu --durations=10 --ignore=tests/gpu/test_rank_masking_gpu.py \
        --ignore=tests/gpu/test_cuda_cluster.py --ignore=tests/gpu/test_nvshmem.py \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_low_latency_kernels.py \
        --ignore=tests/gpu/test_call_outputs.py --ignore=tests/gpu/test_stream_ordered.py \
        --ignore=tests/gpu/test_deep_ep_facade.py --ignore=tests/gpu/test_daemon.py \
        --ignore=tests/gpu/test_intranode.py --ignore=tests/gpu/test_ll_plain.py \
        --ignore=tests/gpu/test_service_classes_gpu.py"
    step cluster 200 "tests/gpu/test_cuda_cluster.py"
    ;;
  ab2)  # more rounds of the A/B rows (the machine's spread between probes is larger than the
         # change): three alternations; then the opt-in local layout (EPD_LOCAL_LAYOUT=1): its
         # GPU test and the same rows with it. Every probe's JSON merged into one file.
    mkdir -p /tmp/pkg_old/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
    for round in 1 2 3; do
      probe "old_$round" /tmp/pkg_old >/dev/null
      probe "new_$round" /tmp/pkg >/dev/null
    done
    step local 150 "tests/gpu/test_local_layout.py"
    EPD_LOCAL_LAYOUT=1 probe local /tmp/pkg >/dev/null
    for f in "$OUT"/probe_*.txt; do echo "== $f"; cat "$f"; done > "$OUT/probes_ab2.txt"
    python3 -c "
import json, glob, os
out = {os.path.basename(f)[6:-5]: json.load(open(f)) for f in sorted(glob.glob('$OUT/probe_*.json'))}
json.dump(out, open('$OUT/probes_ab2.json', 'w'), indent=1)"
    rm -f "$OUT"/probe_*.txt "$OUT"/probe_*.json; cat "$OUT/probes_ab2.txt"
    ;;
  flip)  # the local layout as the default: the tests of both layout paths and of the facade,
          # the rows with it and without it (EPD_LOCAL_LAYOUT=0) alternately, the bench at D
    step flip 240 "tests/gpu/test_local_layout.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_service_classes_gpu.py \
        tests/gpu/test_daemon.py -k 'not failure and not low_latency'"
    for round in 1 2; do
      probe "local_$round" /tmp/pkg >/dev/null
      EPD_LOCAL_LAYOUT=0 probe "daemon_$round" /tmp/pkg >/dev/null
    done
    for f in "$OUT"/probe_*.txt; do echo "== $f"; cat "$f"; done > "$OUT/probes_flip.txt"
    python3 -c "
import json, glob, os
out = {os.path.basename(f)[6:-5]: json.load(open(f)) for f in sorted(glob.glob('$OUT/probe_*.json'))}
json.dump(out, open('$OUT/probes_flip.json', 'w'), indent=1)"
    rm -f "$OUT"/probe_*.txt "$OUT"/probe_*.json; cat "$OUT/probes_flip.txt"
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_flip.json" 2>&1 | clean | tail -30 > "$OUT/bench_flip.txt"
    head -12 "$OUT/bench_flip.txt"; grep -a "PASS\|FAIL" "$OUT/bench_flip.txt"
    ;;
  local)  # the local layout's GPU test alone (its error words from never-reused pinned pages)
    step local 120 "tests/gpu/test_local_layout.py"
    ;;
  *) echo "usage: $0 ab|ab2|rest|flip|local" >&2; exit 2 ;;
esac
