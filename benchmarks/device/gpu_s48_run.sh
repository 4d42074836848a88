#!/usr/bin/env bash
# Forty-eighth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   prof48   # the poller thread under cProfile (EPD_PROFILE_THREADS=poller) through `epd bench`
#            # D with the low-latency rows: where a captured call's trigger (fire) spends the
#            # engine's host time now that it keeps its checked arguments. At most 8 files come
#            # back: the profile's text and one .prof.
#   sweep48a # the GPU suites not run since the poller's changes of the forty-sixth and
#            # forty-seventh sessions: the chain and its triggers, masking, class engines and
#            # tenant pools, the low-latency kernels
#   idle48   # the idle rings' back-off (--stream-op-idle-poll-us): the captured normal-mode and
#            # poller-path tests, then `epd bench` D with the low-latency rows alternated without
#            # the back-off (EPD_STREAM_OP_IDLE_POLL_US=0, the looks every 50 µs as before) and
#            # with it (the default, 500), two rounds: the engine's CPU while idle with the
#            # graph row's calls armed, the low-latency rows' engine CPU, every row's latency
#   kernels48 # the suites not run since the forty-second session, whose code changed since
#            # (the handle refill in cuda_runtime, the cluster's settings checks): the kernel
#            # tests, NVSHMEM normal mode across logical nodes (flat and two-stage), the
#            # 16-rank two-stage group through two daemons and the facade
#   final48  # the review's mends of the back-off (a trigger held back keeps the fast looks, an
#            # arm's wake kept until seen): the captured normal-mode and poller-path tests and
#            # `epd bench` D with the low-latency rows; then the same bench without MPS
#            # (EPD_MPS=off: issue 10 asks for every figure without MPS too)
#   sweep48b # the rest not run since the forty-fourth session: the calls' outputs, stream
#            # order, the daemon, ElasticBuffer, handle bytes, received rows, MPS, bad input
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, bench, ...)
case "${1:-}" in
  prof48)
    mkdir -p /tmp/prof && rm -f /tmp/prof/*.prof
    EPD_PROFILE_DIR=/tmp/prof EPD_PROFILE_THREADS=poller bench prof --shapes D --iters 60 \
        --low-latency --skip pipeline > /dev/null
    cp "$(ls /tmp/prof/*.prof | head -1)" "$OUT/poller.prof" 2>/dev/null
    python3 -c "
import pstats, glob
for p in sorted(glob.glob('/tmp/prof/*.prof')):
    s = pstats.Stats(p); print('==', p)
    s.sort_stats('cumulative').print_stats(80)
    s.sort_stats('tottime').print_stats(40)
    for f in ('captured_calls.py.*fire', 'captured_calls.py.*_dispatch', 'captured_calls.py.*run',
              'launch_stream_dispatch', 'launch_stream_combine', '_launch_dispatch',
              '_launch_combine', '_poll_rounds', '_run_ring'):
        s.print_callees(f)
" > "$OUT/prof_poller.txt" 2>&1
    rm -rf /tmp/prof
    ;;
  sweep48a)
    step chain 170 "tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py tests/gpu/test_ll_trigger.py tests/gpu/test_graph_reserve.py"
    step masking 90 "tests/gpu/test_rank_masking_gpu.py"
    step pools 150 "tests/gpu/test_service_classes_gpu.py tests/gpu/test_tenant_pools_gpu.py tests/gpu/test_security_cuda.py"
    step llk 100 "tests/gpu/test_low_latency_kernels.py tests/gpu/test_local_layout.py"
    ;;
  sweep48b)
    step calls 230 "tests/gpu/test_call_outputs.py tests/gpu/test_stream_ordered.py tests/gpu/test_daemon.py"
    step facade 150 "tests/gpu/test_elastic_buffer_gpu.py tests/gpu/test_handle_bytes_gpu.py tests/gpu/test_bad_input_alike.py tests/gpu/test_framework_replays_gpu.py"
    step rows 150 "tests/gpu/test_received_rows.py tests/gpu/test_mps_gpu.py"
    ;;
  idle48)
    STEP_TEST_SECONDS=100 step captured 120 "tests/gpu/test_captured_normal.py"
    STEP_TEST_SECONDS=100 step poller 130 "tests/gpu/test_ll_chain_plain.py -k poller"
    for round in 1 2; do
      for idle in 0 500; do
        EPD_STREAM_OP_IDLE_POLL_US=$idle timeout 200 python3 -P -m epd.server.cli bench --ranks 2 \
            --shapes D --iters 20 --low-latency --json "$OUT/bench_idle${idle}_r$round.json" 2>&1 \
            | clean | grep -E "^\| D|idle for|per call by thread|PASS|FAIL" | cut -c1-400
      done
    done
    ;;
  kernels48)
    STEP_TEST_SECONDS=120 step kernels 120 "tests/gpu/test_intranode.py"
    STEP_TEST_SECONDS=150 step stages 240 "tests/gpu/test_nvshmem.py -k 'normal_mode_across \
        and (1 or 2 or 8)'"
    STEP_TEST_SECONDS=200 step cluster16 220 "tests/gpu/test_cuda_cluster.py -k sixteen"
    ;;
  final48)
    STEP_TEST_SECONDS=60 step captured 70 "tests/gpu/test_captured_normal.py"
    STEP_TEST_SECONDS=60 step poller 70 "tests/gpu/test_ll_chain_plain.py -k poller"
    bench mps --shapes D --iters 30 --low-latency | grep -E "^\| D|idle for|PASS|FAIL"
    EPD_MPS=off timeout 130 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 20 \
        --low-latency --json "$OUT/bench_nomps.json" 2>&1 | clean | tail -45 \
        | tee "$OUT/bench_nomps.txt" | grep -E "^\| D|idle for|PASS|FAIL|MPS"
    ;;
  *) echo "usage: $0 prof48|sweep48a|sweep48b|idle48|kernels48|final48"; exit 2 ;;
esac
