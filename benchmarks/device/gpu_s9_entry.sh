#!/usr/bin/env bash
# Ninth session, last call: after 63554e2 (host words read by waits only after 1 ms) the
# low-latency pair is 2.9 ms, not the 0.48 ms of no host words: is it the single host reads
# at a kernel's entry (abort_code, gone_ranks)? .bisect/entry = 63554e2 without them
# (diagnostic copy made by hand, then deleted: `git archive` of the tree, abort_code and
# gone_ranks in cuda/epd_common.cuh without their host-word read). Then the masking tests of the working tree (the rejoin test's leave race fixed).
set -u
source benchmarks/device/gpu_env.sh
bash benchmarks/device/gpu_s9_bisect.sh work entry
step masking 110 "tests/gpu/test_rank_masking_gpu.py"
