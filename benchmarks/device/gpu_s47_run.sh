#!/usr/bin/env bash
# Forty-seventh session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   poller47   # the poller no longer spinning for an idle poller ring beside busy chains:
#              # `epd bench` D with the low-latency rows (their engine CPU), then the same under
#              # py-spy (Python frames, every thread of every process: where the engine's host
#              # work per call goes, the graph replay's trigger among it), the chain tests
#   prof47     # the poller thread under cProfile (EPD_PROFILE_THREADS=poller) through `epd
#              # bench` D with the low-latency rows: where a captured call's trigger spends the
#              # engine's host time, and the poller's looks and naps between calls
#   fire47     # a captured call's trigger keeping its first run's checked arguments, building
#              # no response and refilling the previous trigger's handle arrays: the captured
#              # normal-mode tests, then `epd bench` D and the profile above
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, bench, ...)
case "${1:-}" in
  poller47)
    bench d --shapes D --iters 30 --low-latency
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/spy \
        .whl/py_spy*.whl || exit 1
    timeout 200 /tmp/spy/bin/py-spy record --subprocesses --threads --nonblocking --rate 250 \
        --format raw -o /tmp/spy.txt -- python3 -P -m epd.server.cli bench --ranks 2 --shapes D \
        --iters 60 --low-latency --skip pipeline 2>&1 | clean | tail -30 > "$OUT/bench_spy.txt"
    gzip -c /tmp/spy.txt > "$OUT/spy_raw.txt.gz"
    python3 benchmarks/spy_summary.py /tmp/spy.txt --top 40 > "$OUT/spy_summary.txt" 2>&1
    python3 benchmarks/spy_summary.py /tmp/spy.txt --top 60 --match "_fire" \
        > "$OUT/spy_fire.txt" 2>&1
    rm -f /tmp/spy.txt
    STEP_TEST_SECONDS=200 step ll 230 "tests/gpu/test_ll_plain.py"
    ;;
  fire47)
    STEP_TEST_SECONDS=120 step captured 150 "tests/gpu/test_captured_normal.py"
    STEP_TEST_SECONDS=100 step facade 130 "tests/gpu/test_worst_case_no_wait.py tests/gpu/test_deep_ep_facade.py"
    bench d --shapes D --iters 30 --low-latency
    bash "$0" prof47
    ;;
  lean47)  # (fire47 within a short device budget: the captured tests, the bench, the poller)
    STEP_TEST_SECONDS=100 step captured 120 "tests/gpu/test_captured_normal.py"
    bench d --shapes D --iters 30 --low-latency
    PROF_FAST=0 bash "$0" prof47
    ;;
  tiny47)  # (the last device seconds: the captured tests and the bench's graph row)
    STEP_TEST_SECONDS=70 step captured 80 "tests/gpu/test_captured_normal.py"
    bench d --shapes D --iters 20 --low-latency --skip pipeline,deep_ep
    ;;
  prof47)
    mkdir -p /tmp/prof && rm -f /tmp/prof/*.prof
    EPD_PROFILE_DIR=/tmp/prof EPD_PROFILE_THREADS=poller bench prof --shapes D --iters 60 \
        --low-latency --skip pipeline > /dev/null
    cp /tmp/prof/*.prof "$OUT/" 2>/dev/null
    python3 -c "
import pstats, glob
for p in sorted(glob.glob('/tmp/prof/*.prof')):
    s = pstats.Stats(p); print('==', p)
    s.sort_stats('cumulative').print_stats(70)
    s.print_callees('fire')
    s.print_callees('_poll_rounds')
" > "$OUT/prof_poller.txt" 2>&1
    rm -rf /tmp/prof; mkdir -p /tmp/prof  # (then one session's fast-path thread: eager calls)
    [ "${PROF_FAST:-1}" = 0 ] && exit 0
    EPD_PROFILE_DIR=/tmp/prof EPD_PROFILE_THREADS=fast bench proffast --shapes D --iters 100 \
        --skip pipeline > /dev/null
    cp /tmp/prof/*.prof "$OUT/" 2>/dev/null
    python3 -c "
import pstats, glob
for p in sorted(glob.glob('/tmp/prof/*.prof')):
    s = pstats.Stats(p); print('==', p)
    s.sort_stats('cumulative').print_stats(90)
    s.sort_stats('tottime').print_stats(40)
" > "$OUT/prof_fast.txt" 2>&1
    rm -rf /tmp/prof
    ;;
  *) echo "usage: $0 poller47|prof47|fire47|lean47|tiny47"; exit 2 ;;
esac
