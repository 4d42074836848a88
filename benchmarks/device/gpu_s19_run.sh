#!/usr/bin/env bash
# Nineteenth session (2026-12-03, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6).
#   bash benchmarks/device/gpu_s19_run.sh tail   # issue 14: where the device-entry chain's p99 under
#        prefill goes. The two pools with the chain's GPU timeline, its segments' p50/p99 and
#        counts above 1 ms per phase (bench_two_pools.py's decode_chain_tails) and every call's
#        start and duration (its samples); then the same with fewer low-latency blocks
#        (--ll-num-sms 32: two decode ranks' blocks fit beside prefill's on 132 SMs) and with
#        prefill's blocks capped (--throughput-num-sms 12), and the poller with 32
#   bash benchmarks/device/gpu_s19_run.sh depth  # the chain's instances enqueued ahead (DEPTH 8, 32,
#        64: EPD_CHAIN_DEPTH) in the pools, with the times it ran dry; the chain's GPU tests
#        with the timeline and at depth 64
#   bash benchmarks/device/gpu_s19_run.sh residual  # the tail left at depth 64: the gate kernel
#        instead of the stream wait, prefill's SMs capped, classes off, the poller beside; the
#        chain's GPU tests at the new default depth
#   bash benchmarks/device/gpu_s19_run.sh final  # the chain's GPU tests at its new defaults (entry
#        on the device, depth 64); the pools with the poller's slow rounds by part, with 32
#        low-latency blocks, without MPS, and the poller with prefill capped at 12 blocks
#   bash benchmarks/device/gpu_s19_run.sh probe  # one pools run on the chain with EPD_STALL_PROBE:
#        the engine's other threads' stacks while the poller is stuck (about 40 s)
#   bash benchmarks/device/gpu_s19_run.sh split  # the pools on two daemons (chain, poller): the
#        prefill pool's launches out of the decode engine's process (about 100 s)
#   bash benchmarks/device/gpu_s19_run.sh mends  # the review's mends: layout/notify kernels (one
#        routing loop), the NVSHMEM kernels' link, at 2 and 16 ranks (about 4 minutes)
#   bash benchmarks/device/gpu_s19_run.sh next   # the chain's GPU tests, with the host top-up and as
#        a CUDA graph loop (EPD_CHAIN_LOOP=require), then probe, split and the pools on the
#        loop (about 6 minutes)
# (EPD_CHAIN_LOOP was removed in the twenty-first session: its steps now run the host top-up.)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, pools, merge, merge_json)
case "${1:-}" in
  tail)
    export POOLS_SECONDS=${POOLS_SECONDS:-68}
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
           --daemon-env EPD_CHAIN_ENTRY=device --daemon-env EPD_CHAIN_TIMELINE=1)
    pools chain_entry "${chain[@]}"
    pools chain_entry_ll32 "${chain[@]}" --serve-arg=--ll-num-sms=32
    pools chain_entry_tp12 "${chain[@]}" --serve-arg=--throughput-num-sms=12
    pools chain_entry_ll32_tp12 "${chain[@]}" --serve-arg=--ll-num-sms=32 \
        --serve-arg=--throughput-num-sms=12
    pools poller_ll32 --serve-arg=--ll-num-sms=32
    merge_json pool pools_tail
    ;;
  depth)  # the tail is one stalled pair per prefill layer (`tail`): the chain running dry
           # while the engine host's top-up is late? Its count (epd_ll_chain_starved_total),
           # the host's gaps between top-ups, and the chain 4x and 8x deeper
    EPD_CHAIN_TIMELINE=1 step chain 100 "tests/gpu/test_ll_chain.py"
    EPD_CHAIN_DEPTH=64 step chain_deep 80 "tests/gpu/test_ll_chain.py"
    export POOLS_SECONDS=${POOLS_SECONDS:-68}
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
           --daemon-env EPD_CHAIN_ENTRY=device --daemon-env EPD_CHAIN_TIMELINE=1)
    pools depth8 "${chain[@]}"
    pools depth32 "${chain[@]}" --daemon-env EPD_CHAIN_DEPTH=32
    pools depth64 "${chain[@]}" --daemon-env EPD_CHAIN_DEPTH=64
    pools depth64_untimed --serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32 \
        --daemon-env EPD_CHAIN_ENTRY=device --daemon-env EPD_CHAIN_DEPTH=64
    merge_json pool pools_depth
    ;;
  residual)  # depth 64 (now the default) never ran dry, yet about one prefill layer in four
              # still stalls a decode pair 3-5 ms: the chain's stream wait parked in a hardware
              # queue another stream shares (the gate kernel does not park), SMs (prefill
              # capped), stream priorities (classes off); the poller beside it
    export POOLS_SECONDS=${POOLS_SECONDS:-68}
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32
           --daemon-env EPD_CHAIN_ENTRY=device)
    pools chain64 "${chain[@]}"
    pools chain64_gate "${chain[@]}" --serve-arg=--ll-chain-gate
    pools chain64_tp12 "${chain[@]}" --serve-arg=--throughput-num-sms=12
    pools chain64_noclasses "${chain[@]}" --no-classes
    pools poller
    merge_json pool pools_residual
    EPD_CHAIN_ENTRY=device step chain 100 "tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py"
    ;;
  final)  # the chain's defaults now (entry on the device, depth 64): its GPU tests; in the
           # pools, with the poller's slow rounds by part (epd_stream_poller_slow_seconds: at
           # depth 64 the chain still ran dry ~40 times a run), with fewer low-latency blocks,
           # without MPS, and the poller with prefill's blocks capped
    step chain 100 "tests/gpu/test_ll_chain.py tests/gpu/test_ll_chain_plain.py"
    export POOLS_SECONDS=${POOLS_SECONDS:-68}
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32)
    pools chain "${chain[@]}"
    pools chain_ll32 "${chain[@]}" --serve-arg=--ll-num-sms=32
    pools chain_nomps "${chain[@]}" --mps off
    pools poller_tp12 --serve-arg=--throughput-num-sms=12
    merge_json pool pools_final
    ;;
  probe)  # what holds the poller's top-up 10 ms (`final`): the engine's other threads' stacks
           # while it is stuck (EPD_STALL_PROBE), one pools run on the chain
    POOLS_SECONDS=${POOLS_SECONDS:-60} pools chain_probe --serve-arg=--ll-chain \
        --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32 --daemon-env "EPD_STALL_PROBE=$OUT/stalls.json"
    python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('stalls', d['stalls'], 'looks', d['looks'])
for s in d['stacks'][:40]:
    print(s['n'], s['stack'][:300])" "$OUT/stalls.json"
    ;;
  split)  # the pools' launches in separate engine processes (--split-daemons: the prefill
           # pool on a second daemon under the first one's MPS server): does the decode tail go
           # when prefill's host work is not in the decode engine's process?
    export POOLS_SECONDS=${POOLS_SECONDS:-80}
    pools chain_split --serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32 \
        --split-daemons
    pools poller_split --split-daemons
    merge_json pool pools_split
    ;;
  next)  # what came after the last device call: the poller's and the chain's GPU tests (the
          # poller's rounds gained their parts, the chain's drain moves the tail only
          # forward), then `probe` and `split` and the loop
    step chain 160 "tests/gpu/test_ll_plain.py tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py"
    # the chain as one CUDA graph loop, no host top-up (require: no silent fallback)
    EPD_CHAIN_LOOP=require step chain_loop 100 "tests/gpu/test_ll_chain.py \
        tests/gpu/test_ll_chain_plain.py"
    bash "$0" probe
    bash "$0" split
    chain=(--serve-arg=--ll-chain --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32)
    POOLS_SECONDS=80 pools chain_loop "${chain[@]}" --daemon-env EPD_CHAIN_LOOP=require
    # Does the depth itself cause the stalls (hundreds of commands pending on the chains'
    # streams; a stream's launches block once its queue is full)? Untimed, with the
    # poller's `enqueue` part:
    for depth in 16 32; do
      POOLS_SECONDS=80 pools "depth$depth" "${chain[@]}" --daemon-env "EPD_CHAIN_DEPTH=$depth"
    done
    merge_json pool pools_next
    # facts for a chain with no host (docs/DESIGN_NOTES.md, "The engine host's stalls"): the
    # device runtime library to link cudaGraphSetConditional, the conditional-node API
    { find / -name 'libcudadevrt*' 2>/dev/null | head -3
      python3 -P -c "from cuda.bindings import driver as d; print('cuGraphConditionalHandleCreate', hasattr(d, 'cuGraphConditionalHandleCreate'), 'CU_GRAPH_COND_TYPE_WHILE', hasattr(d.CUgraphConditionalNodeType, 'CU_GRAPH_COND_TYPE_WHILE'))"
    } 2>&1 | tee "$OUT/devrt.txt"
    ;;
  mends)  # the review's mends after the device time (about 4 minutes): token_ranks, the one
           # routing loop of the layout, notify and wide-notify kernels; the NVSHMEM kernels
           # linked through cuda_remote.link_relocatable; the chain's drains through one wait
    step intranode 120 "tests/gpu/test_intranode.py -k 'layout_kernel or every_kernel or \
        small or uneven or missing_rank or cached or counter_slot'"
    step local_layout 60 "tests/gpu/test_local_layout.py"
    t=tests/gpu/test_nvshmem.py::test_two_stage_normal_mode_across_logical_nodes
    STEP_TEST_SECONDS=150 step stages16 160 "'$t[8]'"
    EPD_CUDA_HIERARCHICAL=stages STEP_TEST_SECONDS=150 step cluster 170 \
        "tests/gpu/test_cuda_cluster.py -k 'low_latency'"
    ;;
  *) echo "usage: $0 tail|depth|residual|final|probe|split|next|mends" >&2; exit 2 ;;
esac
