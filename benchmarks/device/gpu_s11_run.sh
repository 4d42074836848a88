#!/usr/bin/env bash
# Eleventh session (2026-12-02, one H200). carry [".whl"].
#   bash benchmarks/device/gpu_s11_run.sh profile  # where one rank's per-call host time goes (issue 10):
#        probe_calls' normal-mode rows at D with one rank, the engine's fast-path thread and
#        rank 0's client under cProfile; then the same rows unprofiled (the baseline); then
#        tests/gpu/test_cuda_cluster.py (not run since the hierarchical kernels)
#   bash benchmarks/device/gpu_s11_run.sh after    # this session's host-path changes: their GPU tests,
#        the same rows (engine spin 50 and 500 µs), `epd bench --shapes D --low-latency`
#   bash benchmarks/device/gpu_s11_run.sh retest   # after's GPU tests alone, the stream-wait test fixed
#   bash benchmarks/device/gpu_s11_run.sh last     # the same, the wait test's kernel loaded first (lazy
#        loading), then the stream-ordered and facade tests
#   bash benchmarks/device/gpu_s11_run.sh views    # test_intranode.py and test_daemon.py (output views)
#   bash benchmarks/device/gpu_s11_run.sh next     # for the next session: the capture refusal, the
#        adaptive engine spin against the fixed one (one rank), `epd bench` D
#   bash benchmarks/device/gpu_s11_run.sh rest     # the rest of the GPU suite, the cluster daemons
#        (carry the nvidia-cuda-cccl wheel in .whl: fetch-wheels.sh nvidia-cuda-cccl==13.3.5.0.6)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
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
  after)  # the changed host path: its GPU tests, then the rows (spin 50 and 500 µs), epd bench D
    step changed 330 "tests/gpu/test_call_outputs.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_daemon.py tests/gpu/test_intranode.py \
        tests/gpu/test_ll_plain.py"
    probe after
    EPD_FAST_PATH_SPIN_US=500 probe after_spin500
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_after.json" 2>&1 | clean | tail -24 | tee "$OUT/bench_after.txt"
    ;;
  retest)  # the changed host path's GPU tests again (after's step hung in a test of its own:
            # a second stream writing the word sat behind the waiting stream's hardware queue)
    step changed 450 "tests/gpu/test_call_outputs.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_daemon.py tests/gpu/test_intranode.py \
        tests/gpu/test_ll_plain.py"
    ;;
  last)  # the driver-binding tests with the fill kernel loaded first, then the stream-ordered
          # calls through the daemon and the facade (the client's one-allocation outputs)
    step last 200 "tests/gpu/test_call_outputs.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_deep_ep_facade.py"
    ;;
  views)  # the runner's outputs without the handle's prefix in the cached views (intranode
           # kernels' checks) and the daemon's synchronous dispatch path
    step views 150 "tests/gpu/test_intranode.py tests/gpu/test_daemon.py -x"
    ;;
  next)  # the next session's first call: what this session built after its device time
          # (the capture refusal, the adaptive engine spin against the fixed one), then the
          # bench at D, whose normal rows are now checked against the reference
    step next 150 "tests/gpu/test_stream_ordered.py tests/gpu/test_call_outputs.py"
    probe adaptive
    EPD_FAST_PATH_SPIN_MAX_US=0 probe fixed50
    timeout 150 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --json "$OUT/bench_next.json" 2>&1 | clean | tail -30 | tee "$OUT/bench_next.txt"
    ;;
  rest)  # the rest of the GPU suite, and the cluster daemons with the CCCL wheel carried
    step rest 330 "tests/gpu --durations=10 --ignore=tests/gpu/test_rank_masking_gpu.py \
        --ignore=tests/gpu/test_cuda_cluster.py --ignore=tests/gpu/test_nvshmem.py \
        --ignore=tests/gpu/test_framework_replays_gpu.py --ignore=tests/gpu/test_low_latency_kernels.py \
        --ignore=tests/gpu/test_call_outputs.py --ignore=tests/gpu/test_stream_ordered.py \
        --ignore=tests/gpu/test_deep_ep_facade.py --ignore=tests/gpu/test_daemon.py \
        --ignore=tests/gpu/test_intranode.py --ignore=tests/gpu/test_ll_plain.py"
    step cluster 240 "tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 profile|after|retest|last|views|next|rest" >&2; exit 2 ;;
esac
