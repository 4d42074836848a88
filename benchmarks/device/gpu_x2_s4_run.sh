#!/usr/bin/env bash
# Fourth session of 2026-12-01 on nvidia-h200-x2, two device calls (each under 10 minutes):
#   bash benchmarks/device/gpu_x2_s4_run.sh suite     # carry [".whl"]: every GPU test but the framework
#        replays, verbose (a test's name and outcome as it ends, kept if the call runs out)
#   bash benchmarks/device/gpu_x2_s4_run.sh replays   # carry [".whl"]: the vLLM/SGLang/Megatron
#        replays on the CUDA engine, then `epd bench` at D with the low-latency rows (MPS)
#   bash benchmarks/device/gpu_x2_s4_run.sh final     # carry [".whl"]: see the case below
set -u
source benchmarks/device/gpu_env.sh
pt() { python3 -P -m pytest -p no:cacheprovider -v -rfEsx --timeout 150 -o addopts="" "$@"; }
case "${1:-}" in
  suite)
    timeout 540 bash -c "$(declare -f pt); pt tests/gpu --durations=30 \
        --ignore=tests/gpu/test_framework_replays_gpu.py" 2>&1 | grep -v " INFO " \
        > "$OUT/gpu_suite.txt"
    grep -c PASSED "$OUT/gpu_suite.txt"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_suite.txt" | tail -25
    ;;
  replays)
    timeout 300 bash -c "$(declare -f pt); pt tests/gpu/test_framework_replays_gpu.py" 2>&1 \
        | grep -v " INFO " > "$OUT/gpu_replays.txt"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_replays.txt" | tail -25
    timeout 200 python3 -P -m epd.server.cli bench --shapes D --iters 40 --low-latency \
        --skip deep_ep,pipeline --json "$OUT/bench_D_ll.json" 2>&1 \
        | grep -v " INFO \|WARNING\|MpsWarning\|warnings.warn" | tail -25
    ;;
  final)  # carry [".whl"]: replays (every rank's error reported), the MPS module (sockets
           # removed after an engine's unclean stop), the two pools on the final kernels, demo
    timeout 150 bash -c "$(declare -f pt); pt tests/gpu/test_framework_replays_gpu.py \
        tests/gpu/test_mps_gpu.py" 2>&1 | grep -v " INFO " > "$OUT/gpu_final.txt"
    grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " "$OUT/gpu_final.txt" | tail -40
    for v in "classes:" "noclasses:--no-classes"; do
      timeout 100 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
          --prefill-iters 150 ${v#*:} --json "$OUT/two_pools_${v%%:*}.json" 2>&1 \
          | grep -v " INFO \|WARNING\|MpsWarning\|warnings.warn" | tail -6
    done
    timeout 120 python3 -P -m epd.server.cli demo 2>&1 | tail -4
    ;;
  *) echo "usage: $0 suite|replays|final" >&2; exit 2 ;;
esac
