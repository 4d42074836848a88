#!/usr/bin/env bash
# Ninth session: where did the low-latency pair's time go? probe_calls' low-latency rows (D,
# two ranks on one GPU, MPS on) at several commits, each tree in .bisect/<commit> (carried):
#   bash benchmarks/device/gpu_s9_bisect.sh f01e1a1 9147f4b ...
set -u
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
for c in "$@"; do  # "work": the working tree itself
  if [ "$c" = work ]; then dir=$PWD; pkg=/tmp/pkg; else dir=$PWD/.bisect/$c; pkg=/tmp/pkg_$c
    mkdir -p $pkg/epd
    for d in server proto cuda client; do ln -sfn "$dir/$d" $pkg/epd/$d; done
  fi
  echo "== $c"
  (cd "$dir" && PYTHONPATH=$pkg:/tmp/site timeout 100 python3 -P \
      benchmarks/probe_calls.py --tokens 128 --iters 60 --mps on --low-latency \
      --rows "ll plain pair,ll hook pair" 2>&1 | clean | tail -4)
done 2>&1 | tee "$OUT/bisect.txt"
