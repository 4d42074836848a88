#!/usr/bin/env bash
# Twenty-third session (2026-12-04, one H200). carry [".whl"] (fetch-wheels.sh
# nvidia-cuda-cccl==13.3.5.0.6; for `ab`, .whl/old: `git archive REV server proto client cuda`).
#   bash benchmarks/device/gpu_s23_run.sh profile  # one rank's normal-mode rows at D under cProfile
#        (the engine's fast-path thread and the client), then twice without: where a call's
#        host work goes on the code of the twenty-second session
#   bash benchmarks/device/gpu_s23_run.sh first    # the review commit 4a03249 on a GPU (rank masking
#        and rejoin, the facade, stream-ordered layers), then the engine threads' GIL hand-off
#        (benchmarks/probe_gil_handoff.py, no GPU needed, on the device's 16 cores)
#   bash benchmarks/device/gpu_s23_run.sh ab       # this session's host-path cuts: their GPU tests,
#        the GIL probe's futex rows, then one rank's rows alternately on .whl/old (4a03249)
#        and this tree, then a profile of this tree's rows
#   bash benchmarks/device/gpu_s23_run.sh poller   # the low-latency rows with the poller's idle
#        policy as it is, spinning longer, or looking more often once idle
#   bash benchmarks/device/gpu_s23_run.sh final    # the GPU tests of the session's last code
#   bash benchmarks/device/gpu_s23_run.sh ab2      # the rows again, this tree first; two ranks at D
#        through epd bench on each tree
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, probe, probe_ab, profile_rows, merge, merge_json)
case "${1:-}" in
  profile)
    profile_rows base /tmp/pkg
    probe plain_1 /tmp/pkg
    probe plain_2 /tmp/pkg
    merge base
    ;;
  first)
    STEP_TEST_SECONDS=150 step check 330 "tests/gpu/test_rank_masking_gpu.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_stream_ordered.py"
    timeout 120 python3 -P benchmarks/probe_gil_handoff.py --seconds 2 \
        --json "$OUT/gil_handoff.json" 2>&1 | tee "$OUT/gil_handoff.txt"
    ;;
  ab)
    step changed 260 "tests/gpu/test_call_outputs.py tests/gpu/test_stream_ordered.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_daemon.py"
    timeout 90 python3 -P benchmarks/probe_gil_handoff.py --seconds 2 \
        --json "$OUT/gil_handoff.json" 2>&1 | tee "$OUT/gil_handoff.txt"
    probe_ab 1 3
    merge ab
    profile_rows new /tmp/pkg
    ;;
  ab2)  # the same rows in the other order (this tree first), then two ranks at D through
         # `epd bench` (no DeepEP, no pipeline) on each tree
    probe_ab 4 5 new-first
    merge ab2
    for tree in new old; do
      pkg=/tmp/pkg; [ $tree = old ] && pkg=/tmp/pkg_old
      echo "== bench, two ranks, D, $tree"
      PYTHONPATH=$pkg:/tmp/site timeout 150 python3 -P -m epd.server.cli bench --ranks 2 \
          --shapes D --iters 100 --expert-intermediate 0 --skip pipeline \
          --json "$OUT/bench2_$tree.json" 2>&1 | clean | grep -a "^| D \|host work\|FAIL" \
          | cut -c1-200
    done
    merge_json bench2 bench2_D
    ;;
  poller)  # the low-latency rows at D (two ranks) with the stream-op poller's idle policy
            # as it is (spin 200 µs after a trigger, then a look every 50 µs), spinning 5 ms,
            # and looking every 5 µs once idle; each twice, alternated
    for round in 1 2; do
      for v in default spin5000 poll5; do
        args=()
        [ $v = spin5000 ] && args=(--serve-arg=--stream-op-spin-us=5000)
        [ $v = poll5 ] && args=(--serve-arg=--stream-op-poll-us=5)
        echo "== $v ($round)"
        timeout 120 python3 -P -m epd.server.cli bench --ranks 2 --shapes D --iters 60 \
            --low-latency --expert-intermediate 0 --skip pipeline "${args[@]}" \
            --json "$OUT/ll_${v}_$round.json" 2>&1 | clean | grep -a "^| D \|FAIL" | cut -c1-160
      done
    done
    merge_json ll ll_poller
    ;;
  final)  # the last code: the output cuts' and the poller default's GPU tests
    STEP_TEST_SECONDS=120 step final 330 "tests/gpu/test_call_outputs.py \
        tests/gpu/test_stream_ordered.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_rank_masking_gpu.py tests/gpu/test_daemon.py -k \
        'parts or stream or plain or micro or masked or rejoin or low_latency or roundtrip'"
    ;;
  *) echo "usage: $0 profile|first|ab|ab2|poller|final" >&2; exit 2 ;;
esac
