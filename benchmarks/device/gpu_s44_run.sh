#!/usr/bin/env bash
# Forty-fourth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   verify44  # what the forty-third session changed unrun on the GPU path: the client's
#             # output-descriptor checks (client/output_desc.py) and the engine's per-session
#             # call queue: the stream-ordered suite, the call outputs, the daemon's tests, the
#             # facade, bad input alike, the worst-case dispatch
#   ab44      # host CPU per call, this tree against .whl/old = `git archive ce04310 server
#             # proto client cuda` (extracted), the tree before the forty-third session: one
#             # rank's normal-mode rows at D and the facade's low-latency pairs (2 ranks),
#             # two rounds each, then one rank's rows and rank 0's low-latency pairs under
#             # cProfile
#   final44   # after the session's client mends (the doorbell's fence, dropped and interrupted
#             # dispatches, gRPC waits with a deadline, a dispatch's count wait counted as
#             # waiting): the stream-ordered suite, the daemon's roundtrips, the facade's V1
#             # pattern and low-latency calls; one rank's rows once
#   mini44    # final44's stream-ordered and roundtrip tests alone
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ab_rounds, probe_ab, ll_rows, merge)
case "${1:-}" in
  verify44)
    STEP_TEST_SECONDS=150 step stream 260 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_call_outputs.py tests/gpu/test_daemon.py"
    STEP_TEST_SECONDS=120 step facade 200 "tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_bad_input_alike.py tests/gpu/test_worst_case_no_wait.py"
    ;;
  ab44)
    probe_ab 1 2
    profile_rows new /tmp/pkg
    merge ab44
    ab_rounds 1 2 ll_rows new-first
    EPD_PROBE_PROFILE=/tmp/ll.prof ll_rows prof /tmp/pkg
    merge_json llrows llrows_ab44
    python3 benchmarks/pstats_top.py /tmp/ll.prof > "$OUT/profile_ll.txt" 2>&1
    ;;
  final44)
    STEP_TEST_SECONDS=120 step final 200 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_daemon.py tests/gpu/test_deep_ep_facade.py tests/gpu/test_ll_plain.py \
        -k 'stream or roundtrip or v1_pattern or plain'"
    probe final /tmp/pkg
    merge final44
    ;;
  mini44)  # final44's tests alone (the device time left)
    STEP_TEST_SECONDS=100 step mini 140 "tests/gpu/test_stream_ordered.py \
        tests/gpu/test_daemon.py -k 'stream or roundtrip'"
    ;;
  *) echo "usage: $0 verify44|ab44|final44|mini44"; exit 2 ;;
esac
