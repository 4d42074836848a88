#!/usr/bin/env bash
# Thirty-first session's GPU runs (one H100 or H200, whichever is lent; carry .whl). Run from a
# `git archive` of HEAD carried in .whl: mkdir /tmp/head && tar -xzf .whl/head.tar.gz -C
# /tmp/head && cp -r .whl /tmp/head && cd /tmp/head && bash benchmarks/device/gpu_s31_run.sh fma
#   fma  # the low-latency combine's fused multiply-add (DeepEP's rounding) against the
#        # reference bit for bit: the kernels in-process, the chain's reduce, plain and hook
#        # calls through the daemon, the daemon's low-latency cases
#   unfused  # the same kernels' test with the old separate rounding put back: must fail
#   fma2  # the daemon's graph and decode tests and the class engines' (their sums now fused),
#         # then `epd bench` at D with the low-latency rows (its check of them fused too)
#   chaingraph  # the chain's instances launched as CUDA graphs: the chain's GPU tests, then
#               # the low-latency rows A/B against the launches, two rounds (EPD_CHAIN_GRAPH
#               # was the default in that tree; now opt-in: the A/B sets it both ways)
#   graphfirst  # graph mode's first chain on a fresh engine, twice, with -v
#   chainlaunch  # the chain's tests on the default launches with the new last kernel
#   next  # the review's fixes after the device time (not yet run on a GPU), ~9 minutes,
#         # (the tests, launches then graphs)
#   nextbench  # the low-latency rows with the trigger's fence
# (EPD_CHAIN_GRAPH is gone since the thirty-second session: graphs are the default, in room
# made before serving; EPD_LL_CHAIN_GRAPHS=0 turns them off.)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
case "${1:-}" in
  fma)
    STEP_TEST_SECONDS=150 step fma 330 "tests/gpu/test_low_latency_kernels.py \
        tests/gpu/test_ll_chain.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config \
        tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph"
    ;;
  unfused)  # the check can fail: the kernel's old separate rounding against the new reference
    # (expected: the exactness tests fail)
    sed -i 's|acc\[j\] = __fmaf_rn(ww, Tr::to_f32(vw\[j\]), acc\[j\]);|acc[j] = __fadd_rn(acc[j], __fmul_rn(ww, Tr::to_f32(vw[j])));|' \
        cuda/epd_low_latency.cu && grep -c "__fadd_rn(acc\[j\]" cuda/epd_low_latency.cu \
        && rm -rf /tmp/cupy_cache && STEP_TEST_SECONDS=100 step unfused 120 \
        "tests/gpu/test_low_latency_kernels.py::test_decode_config"
    git checkout -q -- cuda/epd_low_latency.cu 2>/dev/null || sed -i 's|acc\[j\] = __fadd_rn(acc\[j\], __fmul_rn(ww, Tr::to_f32(vw\[j\])));|acc[j] = __fmaf_rn(ww, Tr::to_f32(vw[j]), acc[j]);|' cuda/epd_low_latency.cu
    rm -rf /tmp/cupy_cache
    ;;
  fma2)  # the GPU tests' own fused sums (they summed apart), and the bench's check of the rows
    STEP_TEST_SECONDS=150 step fma2 240 "tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph \
        tests/gpu/test_daemon.py::test_daemon_low_latency_decode_config \
        tests/gpu/test_service_classes_gpu.py::test_latency_and_throughput_groups_concurrently"
    timeout 300 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
        --low-latency --expert-intermediate 0 --json "$OUT/llbench.json" 2>&1 \
        | clean | tail -40 > "$OUT/llbench.txt"
    cat "$OUT/llbench.txt"
    ;;
  chaingraph)  # the chain's instances as CUDA graph launches (the default now): its tests,
    # then the low-latency rows at D alternated with the launches (EPD_CHAIN_GRAPH=0)
    STEP_TEST_SECONDS=150 step chaingraph 260 "tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py tests/gpu/test_ll_plain.py"
    for round in 1 2; do
      for g in 0 1; do
        EPD_CHAIN_GRAPH=$g timeout 150 python3 -P -m epd.server.cli bench --ranks 2 \
            --shapes D --iters 100 --low-latency --expert-intermediate 0 \
            --json "$OUT/chaingraph_${g}_${round}.json" 2>&1 | clean \
            | grep -E "low latency|PASS|FAIL|host work" > "$OUT/chaingraph_${g}_${round}.txt"
        echo "== EPD_CHAIN_GRAPH=$g round $round"; cat "$OUT/chaingraph_${g}_${round}.txt"
      done
    done
    ;;
  graphfirst)  # the first chain of a fresh engine in graph mode: two benches, -v, short
    # deadlines (the first stalled its ArmStreamOp past the deadline in each device call)
    for r in 1 2; do
      EPD_CHAIN_GRAPH=1 timeout 100 python3 -P -m epd.server.cli bench --ranks 2 --shapes D \
          --iters 30 --warmup 5 --low-latency --expert-intermediate 0 -v --call-timeout 20 \
          --collective-timeout 20 --json "$OUT/w_$r.json" > "$OUT/w_$r.log" 2>&1
      echo "rc=$?"; grep -E "Traceback|Error|low latency|host work|PASS|FAIL" "$OUT/w_$r.log" \
          | grep -v " INFO " | head -14
    done
    ;;
  chainlaunch)  # the chain's tests on the default (launches) with the new last kernel
    STEP_TEST_SECONDS=100 step chainlaunch 125 "tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py::test_plain_low_latency_calls_through_armed_ops"
    ;;
  next)  # (then nextbench) what changed after this session's device time: the chain's slot kept until its
    # stream is done, engine-wide generations, the trigger's fence after its head read, the
    # graph-mode drain; the trigger's and the chain's tests, launches then graphs
    STEP_TEST_SECONDS=150 step next 300 "tests/gpu/test_ll_trigger.py tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_daemon.py::test_daemon_low_latency_cuda_graph"
    EPD_CHAIN_GRAPH=1 STEP_TEST_SECONDS=120 step next_graphs 200 "tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py"
    ;;
  nextbench)  # the low-latency rows with the trigger's new fence (the default launches)
    timeout 150 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 100 \
        --low-latency --expert-intermediate 0 --json "$OUT/next_bench.json" 2>&1 | clean \
        | grep -E "low latency|PASS|FAIL|host work" > "$OUT/next_bench.txt"
    cat "$OUT/next_bench.txt"
    ;;
  *) echo "usage: $0 fma|unfused|fma2|chaingraph|graphfirst|chainlaunch|next|nextbench" >&2; exit 2 ;;
esac
