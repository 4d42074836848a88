#!/usr/bin/env bash
# Prepared in the twelfth session for the next one (one H200; carry [".whl"] with the wheels of
# ../shared/device/fetch-wheels.sh nvidia-cuda-cccl==13.3.5.0.6):
#   bash benchmarks/device/gpu_s13_run.sh verify  # what the twelfth session changed after its device
#        time: the facade's growth path through the local layout kernel, the fallback path,
#        then the facade and stream-ordered tests again
#   bash benchmarks/device/gpu_s13_run.sh pools   # issue 14's two pools on one GPU with this code
#        (the local layout takes the prefill pool's layouts off the engine; answers come before
#        launches): classes on, then off, beside the tenth session's figures
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
case "${1:-}" in
  verify)
    step verify 300 "tests/gpu/test_deep_ep_facade.py tests/gpu/test_local_layout.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_daemon.py -k 'not low_latency'"
    ;;
  pools)
    for classes in "" "--no-classes"; do
      timeout 150 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
          --prefill-iters 150 $classes --json "$OUT/two_pools${classes:+_noclasses}.json" 2>&1 \
          | clean | tail -8
    done
    ;;
  *) echo "usage: $0 verify|pools" >&2; exit 2 ;;
esac
