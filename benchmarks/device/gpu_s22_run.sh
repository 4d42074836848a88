#!/usr/bin/env bash
# Twenty-second session (2026-12-04, one H200). carry [".whl", ".deepep"].
#   bash benchmarks/device/gpu_s22_run.sh shared  # issue 10's `epd bench` with two ranks sharing the
#        one GPU under the daemon's MPS server, and DeepEP V1's normal mode sharing it the same
#        way (--deep-ep-shared-gpu): the daemon's hop against DeepEP in-process on one GPU.
#        .deepep from ../shared/device/deepep-anchor.sh, built here (~60 s)
#        With the 'layer with expert MLPs' row (default on cuda).
#   bash benchmarks/device/gpu_s22_run.sh check   # after the cuda backend's split (cuda_rejoin.py): the
#        GPU tests that cover what moved
#   bash benchmarks/device/gpu_s22_run.sh both    # shared (one bench run), then check
#   bash benchmarks/device/gpu_s22_run.sh rest    # the GPU tests not run in the twenty-first and
#        twenty-second sessions, at this session's code (one GPU)
#   bash benchmarks/device/gpu_s22_run.sh ab      # is EPD's host work at D slower after the P rows?
#        the twenty-first session's D-only command, then P,D, then D-only again (no DeepEP)
set -u
source benchmarks/device/gpu_env.sh  # (pt, step, clean)
export EPD_GPU_LOG_DIR=$OUT
RUNS=2
[ "${1:-}" = both ] && RUNS=1
case "${1:-}" in
  shared|both)
    [ -d .deepep ] || { echo "carry .deepep (../shared/device/deepep-anchor.sh)" >&2; exit 2; }
    rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
    (cd /tmp/deepep && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 timeout 240 \
        python3 setup.py build_ext --inplace) > "$OUT/deepep_build.txt" 2>&1 \
      || { tail -20 "$OUT/deepep_build.txt"; exit 1; }
    export PYTHONPATH=$PYTHONPATH:/tmp/deepep
    for run in $(seq 1 $RUNS); do  # (the second only where the device call has time left for it)
      [ "$run" = 2 ] && [ "$SECONDS" -gt 380 ] && { echo "run 2 skipped: ${SECONDS} s used"; break; }
      timeout 200 python3 -P -m epd.server.cli bench --ranks 2 --shapes P,D --iters 60 \
          --low-latency --deep-ep-shared-gpu --json "$OUT/bench_shared_$run.json" 2>&1 \
          | clean | tail -32
    done
    ;;&
  check|both)
    STEP_TEST_SECONDS=150 step check $(( 570 - SECONDS < 400 ? 570 - SECONDS : 400 )) \
        "tests/gpu/test_rank_masking_gpu.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_stream_ordered.py"
    ;;
  shared) ;;
  rest)
    STEP_TEST_SECONDS=150 step rest 550 "tests/gpu/test_intranode.py tests/gpu/test_daemon.py \
        tests/gpu/test_local_layout.py tests/gpu/test_call_outputs.py tests/gpu/test_mps_gpu.py \
        tests/gpu/test_received_rows.py tests/gpu/test_security_cuda.py \
        tests/gpu/test_framework_replays_gpu.py tests/gpu/test_nvshmem.py \
        tests/gpu/test_cuda_cluster.py"
    if grep -q -a "FAILED\|exit status [1-9]" "$OUT"/gpu_*.txt; then
      tar -C "$OUT" -czf "$OUT/daemon_logs.tgz" $(cd "$OUT" && ls daemon-*.log 2>/dev/null)
    fi
    rm -f "$OUT"/daemon-*.log
    ;;
  ab)
    for what in D P,D D; do
      echo "== --shapes $what"
      timeout 150 python3 -P -m epd.server.cli bench --ranks 2 --shapes $what --iters 100 \
          --low-latency --expert-intermediate 0 --json "$OUT/ab_${what/,/}_$SECONDS.json" 2>&1 \
          | clean | grep -a "^| [PD] \|host work\|FAIL" | cut -c1-200
    done
    merge_json ab ab
    ;;
  *) echo "usage: $0 shared|check|both" >&2; exit 2 ;;
esac
