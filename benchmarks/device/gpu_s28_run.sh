#!/usr/bin/env bash
# Twenty-eighth session's GPU checks (no device was lent that session; one H200; carry .whl):
#   bash benchmarks/device/gpu_s28_run.sh next  # what the session changed on the GPU path:
#        FP8 scales of any width (test_daemon's roundtrips: [T, 1] float32 and [T, H/512] int32,
#        fresh and cached), the receive hook on the dispatch's stream (test_ll_plain's hooks,
#        the facade), and the twenty-seventh session's unverified items (gpu_s27_run.sh next)
#   bash benchmarks/device/gpu_s28_run.sh bench  # the default low-latency path's rows at D
#        (`epd bench`; its JSON's low_latency_path must say chain under MPS)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, merge_json)
case "${1:-}" in
  next)
    STEP_TEST_SECONDS=200 step s28 560 "tests/gpu/test_daemon.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_deep_ep_facade.py"
    bash benchmarks/device/gpu_s27_run.sh next
    ;;
  bench)
    timeout 300 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
        --low-latency --expert-intermediate 0 --json "$OUT/llbench_default.json" 2>&1 \
        | clean | tail -40 > "$OUT/llbench_default.txt"
    cat "$OUT/llbench_default.txt"
    ;;
  *) echo "usage: $0 next|bench" >&2; exit 2 ;;
esac
