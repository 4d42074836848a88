#!/usr/bin/env bash
# Forty-ninth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   first49  # the forty-eighth session's last tree on a GPU (its bench settle, the poller's
#            # mends after 9e6be47): gpu_s48_run.sh final48, then tests/gpu/test_ll_plain.py
#            # (not run since the forty-seventh session)
#   host49   # eager calls waiting on the host off MPS (EPD_HOST_WAIT_US, new): `epd bench` D
#            # --low-latency without MPS (EPD_MPS=off), the host waiting (EPD_HOST_WAIT_US=auto:
#            # on there; the default is off until this has run) and
#            # the stream (EPD_HOST_WAIT_US=0, as before); then test_ll_plain.py (its plain
#            # calls with the host wait auto and forced on) and test_stream_ordered.py with the
#            # host wait forced on (EPD_HOST_WAIT_US=20000)
#   quick49  # host49's two benches only, 10 iterations each
#   ab49 N   # the same two benches alternated, rounds 1..N (default 1), then one under MPS
# EPD_HOST_WAIT_US was removed in the fiftieth session (docs/DESIGN_NOTES.md, "Off MPS the
# host waited"): these modes measured it on trees up to 66067f2 and do nothing different after.
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, bench, ...)
nomps() {  # nomps LABEL: `epd bench` D --low-latency without MPS (the daemon's and clients')
  EPD_MPS=off timeout 140 python3 -P -m epd.server.cli bench --ranks 2 --shapes D \
      --iters "${NOMPS_ITERS:-20}" \
      --low-latency --json "$OUT/bench_nomps_$1.json" 2>&1 | clean | tail -45 \
      > "$OUT/bench_nomps_$1.txt"
  grep -E "^\| D|idle for|PASS|FAIL" "$OUT/bench_nomps_$1.txt"
}
case "${1:-}" in
  first49)
    bash benchmarks/device/gpu_s48_run.sh final48
    STEP_TEST_SECONDS=90 step ll_plain 110 "tests/gpu/test_ll_plain.py"
    ;;
  host49)  # (most needed first: the device time may end the call early)
    EPD_HOST_WAIT_US=auto nomps host
    EPD_HOST_WAIT_US=0 nomps stream
    STEP_TEST_SECONDS=90 step ll_plain 170 "tests/gpu/test_ll_plain.py"
    EPD_HOST_WAIT_US=20000 STEP_TEST_SECONDS=90 step ordered_host 110 \
        "tests/gpu/test_stream_ordered.py"
    ;;
  quick49)  # host49's two benches only, 10 iterations each (little device time left)
    NOMPS_ITERS=10 EPD_HOST_WAIT_US=auto nomps host
    NOMPS_ITERS=10 EPD_HOST_WAIT_US=0 nomps stream
    ;;
  ab49)
    for r in $(seq 1 "${2:-1}"); do
      EPD_HOST_WAIT_US=0 nomps "stream_r$r"
      EPD_HOST_WAIT_US=auto nomps "host_r$r"
    done
    bench mps --shapes D --iters 30 --low-latency | grep -E "^\| D|idle for|PASS|FAIL"
    ;;
  *) echo "usage: $0 first49|host49|quick49|ab49"; exit 2 ;;
esac
