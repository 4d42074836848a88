#!/usr/bin/env bash
# Fiftieth session's GPU runs, from a `git archive` of HEAD carried in .whl (unpacked as
# gpu_s34_run.sh says):
#   one50 [N]  # the host wait (EPD_HOST_WAIT_US) where a GPU holds one rank's client and the
#              # engine, as on a node of one GPU per rank (host49 ran two ranks on one GPU,
#              # three contexts time-slicing): benchmarks/probe_calls.py --ranks 1 --mps off,
#              # the stream wait (0) and the host wait (auto) alternated for N rounds (default
#              # 2), the same rows under MPS after the first round (the ratio's denominator)
# EPD_HOST_WAIT_US was removed in the fiftieth session (docs/DESIGN_NOTES.md, "Off MPS the
# host waited"): these modes measured it on trees up to 66067f2 and do nothing different after.
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean, ...)
LLROWS="dispatch,combine,layout + dispatch + combine,ll plain pair,ll hook pair"
one() {  # one LABEL MPS: probe_calls.py at D, one rank, the rows above
  timeout 110 python3 -P benchmarks/probe_calls.py --tokens 128 \
      --iters "${ONE_ITERS:-100}" --ranks 1 --mps "$2" --low-latency --rows "$LLROWS" \
      --json "$OUT/one_$1.json" 2>&1 | clean | tail -8 | tee "$OUT/one_$1.txt"
}
case "${1:-}" in
  one50)
    for r in $(seq 1 "${2:-2}"); do
      EPD_HOST_WAIT_US=0 one "stream_r$r" off
      EPD_HOST_WAIT_US=auto one "host_r$r" off
      [ "$r" = 1 ] && EPD_HOST_WAIT_US=auto one mps on  # (before the call's time may end)
    done
    ;;
  *) echo "usage: $0 one50 [N]"; exit 2 ;;
esac
