#!/usr/bin/env bash
# Thirty-ninth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   next     # what the thirty-eighth session left unrun: the daemon's roundtrips (the engine's
#            # synchronous dispatch after counter_page.alike_failure) and its dispatch without
#            # top-k (every rank's failure asserted), the low-latency suites and the daemon's
#            # low-latency tests as a regression baseline, then an A/B of the layer rows against
#            # .whl/old = `git archive d548938 server proto client cuda` (extracted), the tree
#            # before the thirty-eighth session (notify's payload grew by three words)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, merge_json, layer_rows)
case "${1:-}" in
  next)
    STEP_TEST_SECONDS=100 step daemon 200 "tests/gpu/test_daemon.py -k 'roundtrip or without_topk'"
    STEP_TEST_SECONDS=150 step ll 240 "tests/gpu/test_low_latency_kernels.py \
        tests/gpu/test_ll_plain.py tests/gpu/test_daemon.py -k 'low_latency or plain'"
    ab_rounds 1 1 layer_rows new-first
    merge_json rows rows_ab
    ;;
  *) echo "usage: $0 next"; exit 2 ;;
esac
