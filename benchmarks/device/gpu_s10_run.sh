#!/usr/bin/env bash
# Tenth session of 2026-12-01 (one H200). carry [".whl"].
#   bash benchmarks/device/gpu_s10_run.sh spy     # where the per-call host time goes (issue 10):
#        py-spy (native frames, every process of the run: daemon, engine, both clients) over
#        probe_calls' normal-mode rows at D, MPS on; the collapsed stacks come back gzipped
#        (benchmarks/spy_summary.py reads them); then the 8-ranks-per-PE low-latency case
#        across logical nodes with the harness fix (6afe291)
#   bash benchmarks/device/gpu_s10_run.sh spy2    # the same profile without native frames
#   bash benchmarks/device/gpu_s10_run.sh launch  # probe_launch_cost.py: the engine's driver calls alone
#   bash benchmarks/device/gpu_s10_run.sh final   # the packed launches and hierarchical kernels, then D
#   bash benchmarks/device/gpu_s10_run.sh final2  # serial enqueue off, one rank, the launch probe
#   bash benchmarks/device/gpu_s10_run.sh pools   # issue 14's two pools, serial enqueue on and off
#   bash benchmarks/device/gpu_s10_run.sh last    # the hierarchical kernels again, pools with the poller unlocked
#   bash benchmarks/device/gpu_s10_run.sh across2 # the hierarchical kernels after the shared-memory fix
set -u
source benchmarks/device/gpu_env.sh  # (pt, step)
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
rows="layout,dispatch,cached dispatch,combine,layout + dispatch + combine"
case "${1:-}" in
  spy)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/spy \
        .whl/py_spy*.whl || exit 1
    timeout 200 /tmp/spy/bin/py-spy record --subprocesses --native --threads --rate 400 \
        --format raw -o /tmp/spy.txt -- python3 -P benchmarks/probe_calls.py --tokens 128 \
        --iters 300 --mps on --rows "layout,dispatch,combine" 2>&1 | clean | tail -12 \
        | tee "$OUT/spy_probe.txt"
    gzip -c /tmp/spy.txt > "$OUT/spy_raw.txt.gz"; ls -la /tmp/spy.txt "$OUT"
    step across8 200 "-s 'tests/gpu/test_nvshmem.py::test_low_latency_across_logical_nodes[8]'"
    ;;
  spy2)  # (spy's native sampling fell 77 s behind and py-spy crashed: Python frames only)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/spy \
        .whl/py_spy*.whl || exit 1
    timeout 240 /tmp/spy/bin/py-spy record --subprocesses --threads --nonblocking --rate 200 \
        --format raw -o /tmp/spy.txt -- python3 -P benchmarks/probe_calls.py --tokens 128 \
        --iters 300 --mps on --rows "layout,dispatch,combine" 2>&1 | clean | tail -12 \
        | tee "$OUT/spy_probe.txt"
    gzip -c /tmp/spy.txt > "$OUT/spy_raw.txt.gz"; ls -la /tmp/spy.txt "$OUT"
    ;;
  launch)  # the driver calls alone: their host time without/with MPS, 1 or 32 connections
    for conn in default 32; do
      c=(); [ "$conn" = 32 ] && c=(CUDA_DEVICE_MAX_CONNECTIONS=32)
      env "${c[@]}" timeout 90 python3 -P benchmarks/probe_launch_cost.py --iters 300 \
          --label "no-mps conn=$conn" --json "$OUT/launch_nomps_$conn.json" 2>&1 | clean
    done
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p /tmp/mps_pipe /tmp/mps_log && nvidia-cuda-mps-control -d
    for conn in default 32; do
      c=(); [ "$conn" = 32 ] && c=(CUDA_DEVICE_MAX_CONNECTIONS=32)
      env "${c[@]}" timeout 90 python3 -P benchmarks/probe_launch_cost.py --iters 300 \
          --label "mps conn=$conn" --json "$OUT/launch_mps_$conn.json" 2>&1 | clean
    done
    echo quit | nvidia-cuda-mps-control
    ;;
  final)  # packed normal-mode launches, the serial enqueue and the CUDA hierarchical
           # semantics on the GPU, then the normal-mode rows at D (serial enqueue on)
    step intranode 100 "tests/gpu/test_intranode.py"
    step daemon 150 "tests/gpu/test_stream_ordered.py tests/gpu/test_deep_ep_facade.py \
        tests/gpu/test_daemon.py -k 'roundtrip or stream or facade'"
    step across 220 "-s 'tests/gpu/test_nvshmem.py::test_normal_mode_across_logical_nodes[1]' \
        'tests/gpu/test_nvshmem.py::test_normal_mode_across_logical_nodes[2]'"
    timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --mps on \
        --rows "$rows" 2>&1 | clean | tail -7 | tee "$OUT/final_probe_serial1.txt"
    ;;
  final2)  # the same rows with the serial enqueue off, with one rank, and the launch probe
    EPD_SERIAL_ENQUEUE=0 timeout 80 python3 -P benchmarks/probe_calls.py --tokens 128 \
        --iters 100 --mps on --rows "$rows" 2>&1 | clean | tail -7 \
        | tee "$OUT/final_probe_serial0.txt"
    timeout 70 python3 -P benchmarks/probe_calls.py --tokens 128 --iters 100 --mps on \
        --ranks 1 --rows "$rows" 2>&1 | clean | tail -7 | tee "$OUT/final_probe_1rank.txt"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p /tmp/mps_pipe /tmp/mps_log && nvidia-cuda-mps-control -d
    timeout 60 python3 -P benchmarks/probe_launch_cost.py --iters 300 --label mps \
        2>&1 | clean | tee "$OUT/final_launch.txt"
    echo quit | nvidia-cuda-mps-control
    ;;
  pools)  # issue 14's two pools on one GPU (classes on, MPS), the serial enqueue on and off
    for v in 1 0; do
      EPD_SERIAL_ENQUEUE=$v timeout 150 python3 -P benchmarks/bench_two_pools.py --backend cuda \
          --decode-iters 1000 --prefill-iters 150 --json "$OUT/two_pools_serial$v.json" 2>&1 \
          | clean | tail -6
    done
    ;;
  last)  # the hierarchical kernels across two logical nodes (final's step lost its output to
          # grep's binary-file rule), then the two pools with the poller outside the lock
    step across 200 "-s 'tests/gpu/test_nvshmem.py::test_normal_mode_across_logical_nodes[1]' \
        'tests/gpu/test_nvshmem.py::test_normal_mode_across_logical_nodes[2]'"
    timeout 90 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
        --prefill-iters 150 --json "$OUT/two_pools_serial1_poller_out.json" 2>&1 | clean | tail -6
    ;;
  across2)  # the hierarchical kernels after the shared-memory fix (the NVSHMEM build had
             # failed to link: notify used 0xc290 bytes of static shared memory, 0xc000 max)
    step across 175 "-s 'tests/gpu/test_nvshmem.py::test_normal_mode_across_logical_nodes[2]'"
    ;;
  *) echo "usage: $0 spy|spy2|launch|final|final2|pools|last|across2" >&2; exit 2 ;;
esac
