#!/usr/bin/env bash
# Thirty-second session's GPU runs (one H100 or H200; carry .whl), from a `git archive` of HEAD
# carried in .whl: mkdir /tmp/head && tar -xzf .whl/head.tar.gz -C /tmp/head && cp -r .whl
# /tmp/head && cd /tmp/head && bash benchmarks/device/gpu_s32_run.sh graphstall
#   graphstall  # graph mode's first arm (it stalls for good): the chain's first test with the
#               # daemon's whole log, every engine thread's stack (SIGUSR1) 50 s in, then the
#               # same test with CUDA_MODULE_LOADING=EAGER (ran on tree cfe6900,
#               # before GraphReserve; EPD_CHAIN_GRAPH has no effect since)
#   probe  # benchmarks/graph_instantiate_probe.py: which driver calls wait for a running
#          # kernel (idle, then while one spins), without MPS and under MPS
#   reserve  # the chain's graphs (now the default) in room made before serving: the chain's
#            # tests, then the low-latency rows with graphs and with launches (~6 minutes)
#   nap  # the poller's nap while every ring is chained: the chain's tests, the low-latency
#        # rows with the nap and with the spin (~3 minutes)
#   next  # after the device time: the graph reserve's test, the bad-input claim, the chain's
#         # tests (~6 minutes)
#   napab  # the nap against the spin, alternated twice, and without NVSHMEM's proxy thread;
#          # the engine's CPU by thread
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
stacks() {  # stacks AFTER: every engine's threads into its log after AFTER seconds
  ( sleep "$1"; pkill -USR1 -f "epd.server.engine.app"; nvidia-smi > "$OUT/smi_$2.txt" 2>&1 ) &
}
ll_rows() {  # ll_rows LABEL [VAR=VALUE...]: the low-latency rows at D (2 ranks, 80 iterations)
  # with those variables set for the daemon, its log and JSON as $OUT/LABEL.*, a summary
  local label=$1; shift
  env "$@" timeout 100 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 80 \
      --low-latency --expert-intermediate 0 --json "$OUT/$label.json" > "$OUT/$label.log" 2>&1
  echo "== $label ($*) rc=$?"
  clean < "$OUT/$label.log" | grep -E "^\| D low|PASS|FAIL|host work|by thread|Error" | head -12
  grep -E "room for|graphs built" "$OUT/$label.log" | head -3
}
case "${1:-}" in
  graphstall)
    for mode in lazy eager; do
      mkdir -p "$OUT/logs_$mode"
      stacks 50 "$mode"
      [ $mode = eager ] && export CUDA_MODULE_LOADING=EAGER
      EPD_GPU_LOG_DIR="$OUT/logs_$mode" EPD_CHAIN_GRAPH=1 STEP_TEST_SECONDS=70 \
          step "graphstall_$mode" 95 tests/gpu/test_ll_chain.py::test_armed_ops_on_the_chain
      sleep 2; pkill -9 -f "epd.server" ; sleep 3; wait
      grep -h -E "graphs built|enqueue|Thread|File|WARN|ERROR" "$OUT"/logs_$mode/*.log | head -80
    done
    ;;
  probe)  # which driver calls wait for a running kernel, without MPS and under a private one
    timeout 60 python3 -P benchmarks/graph_instantiate_probe.py --json "$OUT/probe_nomps.json"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mpsp CUDA_MPS_LOG_DIRECTORY=/tmp/mpsl
    mkdir -p /tmp/mpsp /tmp/mpsl && nvidia-cuda-mps-control -d && sleep 1
    timeout 60 python3 -P benchmarks/graph_instantiate_probe.py --json "$OUT/probe_mps.json"
    echo quit | nvidia-cuda-mps-control; sleep 1
    ;;
  reserve)  # graphs by default, in room made before serving: the chain's tests (daemon logs
    # kept), then the low-latency rows at D with graphs (a fresh device call's first bench,
    # where the first arm stalled) and with launches (EPD_LL_CHAIN_GRAPHS=0)
    mkdir -p "$OUT/logs_reserve"
    EPD_GPU_LOG_DIR="$OUT/logs_reserve" STEP_TEST_SECONDS=90 step reserve 200 \
        "tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py"
    grep -h -E "room for|graphs built|by launches|enqueue" "$OUT"/logs_reserve/*.log | head
    for g in 1 0; do ll_rows "reserve_bench_$g" "EPD_LL_CHAIN_GRAPHS=$g"; done
    ;;
  nap)  # the poller naps between top-ups while every ring is chained: the chain's tests,
    # then the low-latency rows with the nap (the default) and with the spin (POLL_US=0)
    STEP_TEST_SECONDS=90 step nap 200 "tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py"
    for us in 500 0; do ll_rows "nap_bench_$us" "EPD_LL_CHAIN_POLL_US=$us"; done
    ;;
  next)  # what changed after the device time (not yet run on a GPU), ~6 minutes: the graph
    # reserve's own test, the bad-input word's claim (the layout's and the stream-ordered
    # calls' bad-id cases), the chain's and the plain calls' tests (then napab)
    STEP_TEST_SECONDS=120 step next 330 "tests/gpu/test_graph_reserve.py \
        tests/gpu/test_local_layout.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_ll_chain.py tests/gpu/test_ll_plain.py"
    ;;
  napab)  # the nap against the spin, alternated twice, and the nap with NVSHMEM's host proxy
    # thread off (NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=1: the engines inherit it; on one node EPD
    # uses neither of what it serves, device-side global exit and wait timeouts) (~7 minutes)
    for round in 1 2; do
      ll_rows "napab_500_$round" EPD_LL_CHAIN_POLL_US=500
      ll_rows "napab_0_$round" EPD_LL_CHAIN_POLL_US=0
      ll_rows "napab_noproxy_$round" EPD_LL_CHAIN_POLL_US=500 NVSHMEM_DISABLE_LOCAL_ONLY_PROXY=1
    done
    ;;
  *) echo "usage: $0 graphstall|probe|reserve|nap|next|napab" >&2; exit 2 ;;
esac
