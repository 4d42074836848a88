#!/usr/bin/env bash
# Thirty-ninth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   next     # what the thirty-eighth session left unrun: the daemon's roundtrips (the engine's
#            # synchronous dispatch after counter_page.alike_failure) and its dispatch without
#            # top-k (every rank's failure asserted), the low-latency suites and the daemon's
#            # low-latency tests as a regression baseline, then an A/B of the layer rows against
#            # .whl/old = `git archive d548938 server proto client cuda` (extracted), the tree
#            # before the thirty-eighth session (notify's payload grew by three words)
#   ll       # low-latency bad input fails the dispatch on every rank alike (each source's
#            # histogram row carries its verdict): the kernel tests, the facade's plain and
#            # hook calls on the chain, the poller and the default, the daemon's graph replay,
#            # the NVSHMEM build across two logical nodes
#   llab     # the facade's low-latency pairs (plain, hook), A/B against .whl/old = `git
#            # archive e8b3d64 server proto client cuda` (extracted): the tree before the
#            # verdict (its duplicate check, the next dispatch's settle)
#   llprof   # rank 0's client under cProfile in those pairs, this tree and .whl/old
#   llcount  # how often the next dispatch's settle waited in those pairs, and for what
#   llsplit  # those pairs with .whl/old's client over this tree's engine (no settle) beside
#            # this tree and .whl/old: the client's share of the difference and the kernels'
#   final    # the verdict raised at Buffer.check() only (the settle at the next dispatch cost
#            # the client tens of µs a call): its tests again, and the pairs' A/B once
#   recheck  # after a review's mends (every verdict taken at once; StreamOp.check()): the
#            # facade's plain and hook calls, and the native graph replay
#   next40   # for the next session: the one-GPU suite after the verdict, the 16-rank kernels
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, merge_json, layer_rows,
#  ll_rows)
case "${1:-}" in
  next)
    STEP_TEST_SECONDS=100 step daemon 200 "tests/gpu/test_daemon.py -k 'roundtrip or without_topk'"
    STEP_TEST_SECONDS=150 step ll 240 "tests/gpu/test_low_latency_kernels.py \
        tests/gpu/test_ll_plain.py tests/gpu/test_daemon.py -k 'low_latency or plain'"
    ab_rounds 1 1 layer_rows new-first
    merge_json rows rows_ab
    ;;
  ll)
    STEP_TEST_SECONDS=120 step kernels 150 "tests/gpu/test_low_latency_kernels.py -k 'bad or decode'"
    STEP_TEST_SECONDS=150 step plain 330 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    STEP_TEST_SECONDS=120 step graph 140 "tests/gpu/test_daemon.py -k low_latency_cuda_graph"
    STEP_TEST_SECONDS=150 step across 170 "tests/gpu/test_nvshmem.py -k 'low_latency_across and 2'"
    ;;
  llab)
    ab_rounds 1 2 ll_rows
    merge_json llrows llrows_ab
    ;;
  llprof)  # rank 0's client under cProfile in the facade's low-latency pairs, new and old
    for label in new old; do
      pkg=/tmp/pkg; [ $label = old ] && pkg=/tmp/pkg_old
      mkdir -p /tmp/pkg_old/epd
      for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
      EPD_PROBE_PROFILE=/tmp/ll_$label.prof ll_rows "prof_$label" $pkg
      python3 -c "
import pstats, sys
st = pstats.Stats(sys.argv[1]); st.sort_stats('tottime').print_stats(40)
st.sort_stats('cumulative').print_stats(60)" /tmp/ll_$label.prof > "$OUT/llprof_$label.txt" 2>&1
    done
    ;;
  llcount)  # how often the next dispatch's settle waited, and for what (this tree)
    ll_rows count /tmp/pkg
    python3 -c "
import json, sys
for r in json.load(open(sys.argv[1]))['ranks']:
    print(r.get('rank'), {k: v for k, v in r.items() if 'settles' in k})
" "$OUT/llrows_count.json"
    ;;
  llsplit)  # where the pairs' difference lies: this tree, .whl/old's client over this tree's
    # engine and kernels (no settle), and .whl/old, twice each
    mkdir -p /tmp/pkg_old/epd /tmp/pkg_hyb/epd
    for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
    for d in server proto cuda; do ln -sfn "$PWD/$d" /tmp/pkg_hyb/epd/$d; done
    ln -sfn "$PWD/.whl/old/client" /tmp/pkg_hyb/epd/client
    for round in ${LLSPLIT_ROUNDS:-1 2}; do
      ll_rows "new_$round" /tmp/pkg; ll_rows "oldclient_$round" /tmp/pkg_hyb
      ll_rows "old_$round" /tmp/pkg_old
    done
    merge_json llrows llrows_split
    ;;
  final)  # the verdict raised at check() only (no settle at the next dispatch): its tests,
    # then the pairs against .whl/old once
    STEP_TEST_SECONDS=60 step kernels2 80 "tests/gpu/test_low_latency_kernels.py -k bad"
    STEP_TEST_SECONDS=150 step plain2 300 "tests/gpu/test_ll_plain.py \
        tests/gpu/test_ll_chain_plain.py -k 'plain_low_latency_calls'"
    STEP_TEST_SECONDS=120 step graph2 140 "tests/gpu/test_daemon.py -k 'low_latency_cuda_graph and native'"
    ab_rounds 4 4 ll_rows new-first
    merge_json llrows llrows_final
    ;;
  recheck)  # after a review: Buffer.check() takes every verdict at once, StreamOp.check()
    STEP_TEST_SECONDS=100 step plain3 130 "tests/gpu/test_ll_plain.py -k plain_low_latency_calls"
    STEP_TEST_SECONDS=60 step graph3 80 "tests/gpu/test_daemon.py -k 'low_latency_cuda_graph and native'"
    ;;
  next40)  # for the next session (about 9 minutes): the one-GPU suite after the verdict
    # (rank masking and a dispatch's verdict share the left-out set; MPS, service classes,
    # security, the call outputs), and the 16-rank kernel test this script left skipped
    STEP_TEST_SECONDS=150 step suite 420 "tests/gpu/test_ll_chain_plain.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_received_rows.py \
        tests/gpu/test_daemon.py tests/gpu/test_call_outputs.py tests/gpu/test_mps_gpu.py \
        tests/gpu/test_security_cuda.py tests/gpu/test_service_classes_gpu.py \
        tests/gpu/test_rank_masking_gpu.py tests/gpu/test_ll_trigger.py"
    CUDA_DEVICE_MAX_CONNECTIONS=32 STEP_TEST_SECONDS=100 step ll16 120 \
        "tests/gpu/test_low_latency_kernels.py -k 16"
    ;;
  *) echo "usage: $0 next|ll|llab|llprof|llcount|llsplit|final|recheck|next40"; exit 2 ;;
esac
