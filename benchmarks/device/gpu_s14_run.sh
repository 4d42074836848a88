#!/usr/bin/env bash
# (Historical. EPD_COMBINE_NO_WAIT, set by its "nowait" steps, was removed in the twenty-sixth
# session: those steps now measure the ordinary, answered combine.)
# Thirteenth session (2026-12-02, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6; for `ab`, .whl/old: `git archive REV server proto client cuda`).
#   bash benchmarks/device/gpu_s14_run.sh first  # what the twelfth session built after its device time
#        (gpu_s13_run.sh verify), then issue 14's two pools on one GPU, classes on and off
#   bash benchmarks/device/gpu_s14_run.sh ab     # this session's host-path cuts and the engine's gc
#        freeze: their GPU tests, the one-rank rows alternately on .whl/old (6d546c5) and this
#        tree, then the pools with the collectors frozen or not
#   bash benchmarks/device/gpu_s14_run.sh pools2 # issue 14's pools: the GIL switch interval, the GPU
#        chain; then a cProfile of one rank's normal-mode rows (issue 10)
#   bash benchmarks/device/gpu_s14_run.sh final  # the rest of the one-GPU suite on the last code, the
#        rows and the pools once more
#   bash benchmarks/device/gpu_s14_run.sh chain  # the chain's GPU timeline (EPD_CHAIN_TIMELINE=1) in
#        the pools: where a chained decode call's 600 µs go
#   bash benchmarks/device/gpu_s14_run.sh chain2 # the same by kind, the poller's launches beside it
#   bash benchmarks/device/gpu_s14_run.sh next   # for the next session: the chain's per-type reduce
#        and its A/B switches; `next_nowait`: the combine that returns once sent
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, pools, merge, merge_json)
case "${1:-}" in
  first)
    step verify 230 "tests/gpu/test_deep_ep_facade.py tests/gpu/test_local_layout.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_daemon.py -k 'not low_latency'"
    for classes in "" "--no-classes"; do
      timeout 140 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 800 \
          --prefill-iters 120 $classes --json "$OUT/two_pools${classes:+_noclasses}.json" 2>&1 \
          | clean | tail -8
    done
    ;;
  ab)  # the session's host-path cuts (issue 10) and the engine's gc freeze (issue 14): their
        # GPU tests; one rank's rows alternately on .whl/old (6d546c5) and this tree; the pools
        # with the engine's collector frozen or not, and with the ranks' frozen too
    step changed 220 "tests/gpu/test_stream_ordered.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_daemon.py tests/gpu/test_local_layout.py tests/gpu/test_call_outputs.py"
    mkdir -p /tmp/pkg_old/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
    for round in 1 2 3; do
      probe "old_$round" /tmp/pkg_old
      probe "new_$round" /tmp/pkg
    done
    merge ab
    pools freeze_1
    pools nofreeze --serve-arg=--no-gc-freeze
    pools freeze_ranks --ranks-gc-freeze
    pools freeze_2
    merge_json pool pools_gc
    ;;
  pools2)  # issue 14 on one GPU, classes on: is the decode's loss under prefill the engine's
            # interpreter? the GIL switch interval lowered, and the GPU chain (no engine host on
            # a decode op's path; its stream waits need the MPS server's 32 work queues); the
            # default twice (the machine's spread). Then one rank's normal-mode rows under
            # cProfile (engine fast-path thread and client) for issue 10.
    export POOLS_SECONDS=140
    pools default_1
    pools gil50 --serve-arg=--gil-switch-us=50
    pools gil20 --serve-arg=--gil-switch-us=20
    pools chain --serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
    pools default_2
    merge_json pool pools2
    mkdir -p /tmp/prof
    EPD_PROFILE_DIR=/tmp/prof EPD_PROBE_PROFILE=/tmp/prof/client.prof probe profiled /tmp/pkg
    probe plain /tmp/pkg
    merge profile
    python3 benchmarks/pstats_top.py /tmp/prof/*.prof > "$OUT/profile_top.txt" 2>&1
    python3 -c "
import pstats, glob
for p in sorted(glob.glob('/tmp/prof/*.prof')):
    print('==', p); pstats.Stats(p).sort_stats('cumulative').print_stats(60)
" > "$OUT/profile_cum.txt" 2>&1
    ;;
  final)  # the session's last code: the rest of the one-GPU suite (the engine's gc callback
           # mended after `ab`), the cluster daemons, one rank's rows twice, the pools once
    step suite 330 "tests/gpu/test_intranode.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_service_classes_gpu.py tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py tests/gpu/test_mps_gpu.py tests/gpu/test_received_rows.py \
        tests/gpu/test_security_cuda.py tests/gpu/test_cuda_cluster.py"
    probe final_1 /tmp/pkg
    probe final_2 /tmp/pkg
    merge final
    timeout 100 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 800 \
        --prefill-iters 120 --json "$OUT/pools_final.json" 2>&1 | clean | tail -8
    ;;
  chain)  # where a chained decode call's time goes (issue 14): the chain test with the
           # timeline on, then the pools with --ll-chain and EPD_CHAIN_TIMELINE=1 (the chain's
           # GPU segments per phase) twice, and once with the poller beside them
    export EPD_CHAIN_TIMELINE=1
    step chain 120 "tests/gpu/test_ll_chain.py"
    unset EPD_CHAIN_TIMELINE
    timeline=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
              --daemon-env EPD_CHAIN_TIMELINE=1)
    pools chain_1 "${timeline[@]}"
    pools poller
    pools chain_2 "${timeline[@]}"
    merge_json pool pools_chain
    ;;
  chain2)  # the same by the call's kind, and the poller's launches timed the same way
    export EPD_CHAIN_TIMELINE=1
    step chain 90 "tests/gpu/test_ll_chain.py"
    unset EPD_CHAIN_TIMELINE
    export POOLS_SECONDS=80
    pools chain --serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32 \
        --daemon-env EPD_CHAIN_TIMELINE=1
    pools poller --daemon-env EPD_CHAIN_TIMELINE=1
    merge_json pool pools_chain2
    ;;
  next)  # prepared for the next session (built after this one's device time, not yet run):
          # the chain's reduce for the group's type only (64 registers, 4 KB shared, against
          # 104 and 12 KB), and its exec split per kind (EPD_CHAIN_EXEC=split): the chain's GPU
          # tests with the timeline on (and split), then the pools with the chain (its new
          # reduce, the generic one: EPD_CHAIN_REDUCE=generic, the split exec, the entry read
          # from a device copy: EPD_CHAIN_ENTRY=device) and the poller
    export EPD_CHAIN_TIMELINE=1
    step chain 150 "tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py"
    EPD_CHAIN_EXEC=split step chain_split 90 "tests/gpu/test_ll_chain.py"
    EPD_CHAIN_ENTRY=device step chain_entry 90 "tests/gpu/test_ll_chain.py"
    unset EPD_CHAIN_TIMELINE
    export POOLS_SECONDS=80
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
           --daemon-env EPD_CHAIN_TIMELINE=1)
    pools chain_trait "${chain[@]}"
    pools chain_generic "${chain[@]}" --daemon-env EPD_CHAIN_REDUCE=generic
    pools chain_split "${chain[@]}" --daemon-env EPD_CHAIN_EXEC=split
    pools chain_entry "${chain[@]}" --daemon-env EPD_CHAIN_ENTRY=device
    pools poller --daemon-env EPD_CHAIN_TIMELINE=1
    pools chain_trait_2 "${chain[@]}"
    merge_json pool pools_chain_variants
    ;;
  next_nowait)  # prepared too: the combine that returns once sent (EPD_COMBINE_NO_WAIT=1, not
                # yet run): the stream-ordered tests (answered and without waiting), the
                # facade's, then one rank's rows alternately without and with it
    step nowait 300 "tests/gpu/test_stream_ordered.py tests/gpu/test_deep_ep_facade.py"
    for round in 1 2 3; do
      probe "answered_$round" /tmp/pkg
      EPD_COMBINE_NO_WAIT=1 probe "nowait_$round" /tmp/pkg
    done
    merge nowait
    ;;
  *) echo "usage: $0 first|ab|pools2|final|chain|chain2|next|next_nowait" >&2; exit 2 ;;
esac
