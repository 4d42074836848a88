#!/usr/bin/env bash
# Twenty-ninth session's GPU runs (one H100 or H200, whichever is lent; carry .whl). The
# twenty-eighth session's work had no device, so these are its checks, cut into calls that
# each fit one device command (at most 600 s):
#   bash benchmarks/device/gpu_s29_run.sh verify  # FP8 scales of any width (test_daemon's
#        roundtrips), the receive hook on the dispatch's stream (test_ll_plain, the facade),
#        a graph replayed after its session ended, the replacement refusal (rank masking)
# The session ran them from a `git archive` of HEAD carried in .whl (helpers' uncommitted
# edits stayed home): mkdir /tmp/head && tar -xzf .whl/head.tar.gz -C /tmp/head &&
# cp -r .whl /tmp/head && cd /tmp/head && bash benchmarks/device/gpu_s29_run.sh verify
#   bash benchmarks/device/gpu_s29_run.sh chain   # the twenty-seventh session's unverified
#        checks: plain calls on the chain and on the poller, the chain's own tests
#   bash benchmarks/device/gpu_s29_run.sh bench   # the default low-latency path's rows at D
#        (`epd bench`; its JSON's low_latency_path must say chain under MPS)
#   bash benchmarks/device/gpu_s29_run.sh cluster # the CUDA cluster tests (two logical nodes)
#   bash benchmarks/device/gpu_s29_run.sh next    # what came after the device time: DeepEP's FP8
#        cast in the low-latency kernel against the reference (the kernels in-process, the
#        daemon's low-latency cases, plain calls), and the trigger's released word again
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
case "${1:-}" in
  verify)
    STEP_TEST_SECONDS=180 step verify 330 "tests/gpu/test_ll_plain.py tests/gpu/test_daemon.py \
        tests/gpu/test_deep_ep_facade.py tests/gpu/test_rank_masking_gpu.py"
    ;;
  chain)
    STEP_TEST_SECONDS=150 step chain 300 "tests/gpu/test_ll_chain_plain.py tests/gpu/test_ll_chain.py"
    ;;
  bench)
    bash benchmarks/device/gpu_s28_run.sh bench
    ;;
  next)
    STEP_TEST_SECONDS=200 step next 560 "tests/gpu/test_low_latency_kernels.py \
        tests/gpu/test_ll_plain.py tests/gpu/test_daemon.py tests/gpu/test_intranode.py"
    ;;
  cluster)
    STEP_TEST_SECONDS=200 step cluster 560 "tests/gpu/test_cuda_cluster.py"
    ;;
  *) echo "usage: $0 verify|chain|bench|cluster|next" >&2; exit 2 ;;
esac
