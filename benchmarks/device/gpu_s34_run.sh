#!/usr/bin/env bash
# Thirty-fourth session's GPU checks, for the next session that is lent a GPU (this one was
# not). From a `git archive` of HEAD carried in .whl: mkdir /tmp/head && tar -xzf
# .whl/head.tar.gz -C /tmp/head && cp -r .whl /tmp/head && cd /tmp/head &&
# bash benchmarks/device/gpu_s34_run.sh next
#   next  # one GPU (~8 minutes): the thirty-third session's unverified client changes (its
#         # `final` step's tests), the CUDA handle bound against the device allocation, the
#         # daemon and facade tests that store handles (the handle-bytes charge on every
#         # dispatch), then the bench's rows at D once (fresh inputs)
#   x2    # two GPUs (~6 minutes): the framework replays with CUDA tensors, xtuner's autograd
#         # functions (save_for_backward(*handle), a real autograd backward) and handles
#         # passed back as tuples included
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
case "${1:-}" in
  next)
    STEP_TEST_SECONDS=120 step next 420 "tests/gpu/test_handle_bytes_gpu.py \
        tests/gpu/test_ll_plain.py \
        tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_daemon.py tests/gpu/test_stream_ordered.py"
    timeout 60 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
        --low-latency --expert-intermediate 0 --fresh-inputs --json "$OUT/next_rows.json" \
        > /tmp/b.log 2>&1
    echo "== bench --fresh-inputs rc=$?"
    clean < /tmp/b.log | grep -E "^\| D |host work|PASS|FAIL" | cut -c1-200
    ;;
  x2)
    STEP_TEST_SECONDS=200 step x2 360 "tests/gpu/test_framework_replays_gpu.py"
    ;;
  *) echo "usage: $0 next|x2" >&2; exit 2 ;;
esac
