#!/usr/bin/env bash
# The 2-GPU runs the targets of issues 10, 11 and 14 need (nvidia-h200-x2; first run 2026-12-01
# 09:24-09:35 UTC, docs/BENCHMARKS.md "Fourth session"). Device calls, each under 10 minutes:
#   bash benchmarks/device/gpu_x2_targets_run.sh bench   # carry [".whl", ".deepep"]: DeepEP V1 built
#        intranode-only (prepare .deepep here with ../shared/device/deepep-anchor.sh), then
#        `epd bench` at P and D with the low-latency rows, with and without MPS, beside DeepEP
#        in-process and the NCCL pipeline (JSON + plot under $OUT)
#   bash benchmarks/device/gpu_x2_targets_run.sh bench_fresh   # carry [".whl", ".deepep"]: the
#        same bench with MPS, each call given new tensor objects (--fresh-inputs: what an
#        eager model hands the facade; thirty-third session)
#   bash benchmarks/device/gpu_x2_targets_run.sh pools   # carry [".whl"]: the two-pool benchmark
#        (issue 14's targets) with classes, without, on class engines (--class-engines: an
#        engine process per GPU and class), and the chain on class engines (each with the
#        engine host's figures, the chain's dry count and the poller's slow rounds)
#   bash benchmarks/device/gpu_x2_targets_run.sh pools2  # the chain on one engine, class engines
#        without MPS, class engines with prefill's engines at 75% of the SMs under MPS, and
#        one engine without MPS
#   bash benchmarks/device/gpu_x2_targets_run.sh cluster # carry [".whl"]: the cluster tests with one
#        logical node per GPU (auto and two stages), test_nvshmem.py whole (issue 13)
#   bash benchmarks/device/gpu_x2_targets_run.sh suite   # the GPU test suite (a part of it fits one
#        call on x2; gpu_x2_s4_run.sh suite splits it)
#   bash benchmarks/device/gpu_x2_targets_run.sh deepep_tests   # carry [".whl", ".deepep"]: DeepEP V1's
#        own tests/test_intranode.py and tests/test_low_latency.py, unchanged but for
#        --num-processes 2, with `import deep_ep` resolving to EPD (client/deep_ep_shim) and a
#        CUDA daemon serving them (issue 11), after the low-latency GPU tests.
set -u
source benchmarks/device/gpu_env.sh
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
case "${1:-}" in
  bench|bench_fresh)
    if [ -d .deepep ]; then
      rm -rf /tmp/deepep && cp -r .deepep /tmp/deepep
      (cd /tmp/deepep && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 timeout 240 \
          python3 setup.py build_ext --inplace) > "$OUT/deepep_build.txt" 2>&1 \
        && export PYTHONPATH=$PYTHONPATH:/tmp/deepep || tail -5 "$OUT/deepep_build.txt"
    fi
    # DeepEP's intranode-only build has no low-latency mode: its LL rows are skipped.
    if [ "$1" = bench_fresh ]; then
      timeout 300 python3 -P -m epd.server.cli bench --shapes P,D --iters 40 --low-latency \
          --skip deep_ep_ll --fresh-inputs --json "$OUT/bench_fresh_mps.json" 2>&1 \
          | clean | tail -30
      exit
    fi
    timeout 200 python3 -P -m epd.server.cli bench --shapes P,D --iters 40 --low-latency \
        --skip deep_ep_ll --json "$OUT/bench_mps.json" --plot "$OUT/bench_mps.png" 2>&1 \
        | clean | tail -30
    EPD_MPS=off timeout 200 python3 -P -m epd.server.cli bench --shapes P,D --iters 40 \
        --low-latency --skip deep_ep_ll --json "$OUT/bench_nomps.json" 2>&1 | clean | tail -30
    ;;
  pools|pools2)
    # pools: the poller with and without classes, on class engines (the two-daemon split that
    # met the three targets on one GPU, twentieth session, built into one daemon), and the
    # chain on them; pools2: the chain on one engine, class engines without MPS, class
    # engines with prefill's engines at 75% of the SMs, one engine without MPS (the chain's
    # runs give the daemon and its private MPS server 32 connections)
    # (--ll-chain is auto by default since the twenty-seventh session: the poller's runs say
    # off, the chain's on)
    chain="--serve-arg=--ll-chain=on --daemon-env CUDA_DEVICE_MAX_CONNECTIONS=32"
    poller="--serve-arg=--ll-chain=off"
    if [ "$1" = pools ]; then
      variants=("classes:$poller" "noclasses:--no-classes $poller"
                "class_engines:--class-engines $poller"
                "chain_class_engines:$chain --class-engines")
    else
      variants=("chain:$chain" "class_engines_nomps:--class-engines --mps=off"
                "class_engines_tp75:--class-engines --serve-arg=--throughput-mps-percentage=75 $poller"
                "nomps:--mps=off")
    fi
    for v in "${variants[@]}"; do
      # shellcheck disable=SC2086  # (the variant's flags, split on purpose)
      timeout 130 python3 -P benchmarks/bench_two_pools.py --backend cuda --decode-iters 1000 \
          --prefill-iters 150 ${v#*:} --json "$OUT/two_pools_${v%%:*}.json" 2>&1 | clean \
          | tail -9
    done
    ;;
  cluster)  # issue 13 with a GPU per logical node: the daemons' cluster tests (2 and 16
            # ranks, a stage's deadline, both modes; the harness puts one node on each GPU)
            # with the default `auto` and with two stages forced, then test_nvshmem.py whole
    STEP_TEST_SECONDS=200 step cluster 230 "tests/gpu/test_cuda_cluster.py"
    EPD_CUDA_HIERARCHICAL=stages STEP_TEST_SECONDS=200 step cluster_stages 200 \
        "tests/gpu/test_cuda_cluster.py -k 'sixteen or deadline'"
    STEP_TEST_SECONDS=150 step nvshmem 150 "tests/gpu/test_nvshmem.py"
    ;;
  suite)
    timeout 560 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfEsx --timeout 150 \
        -o addopts="" 2>&1 | grep -v " INFO " | tee "$OUT/gpu_tests.txt" | tail -20
    ;;
  deepep_tests)
    [ -d .deepep ] || { echo "carry .deepep (../shared/device/deepep-anchor.sh)" >&2; exit 2; }
    # the low-latency kernels' own GPU tests first (rows placed per source: handle[1])
    timeout 200 python3 -P -m pytest -p no:cacheprovider -q -rfEsx --timeout 120 -o addopts="" \
        tests/gpu/test_low_latency_kernels.py tests/gpu/test_ll_plain.py \
        tests/gpu/test_rank_masking_gpu.py 2>&1 | grep -v " INFO " | tee "$OUT/ll_gpu_tests.txt" \
        | tail -8
    ln -sfn "$PWD/client/deep_ep_shim/deep_ep" /tmp/pkg/deep_ep  # `import deep_ep` -> EPD
    sock=/tmp/epd-sock && mkdir -p "$sock"
    python3 -P -m epd.server.cli serve --backend cuda --socket-dir "$sock" \
        > "$OUT/daemon.txt" 2>&1 &
    daemon=$!
    for _ in $(seq 120); do
      python3 -P -m epd.server.cli topology --socket-dir "$sock" > /dev/null 2>&1 && break
      sleep 1
    done
    export EPD_SOCKET_DIR="$sock"
    eval "$(python3 -P -m epd.server.cli env --socket-dir "$sock")"  # the daemon's MPS server
    for t in test_intranode test_low_latency; do  # (not -P: the tests import their utils.py)
      (cd .deepep/tests && timeout 240 python3 "$t.py" --num-processes 2) \
          > "$OUT/deepep_$t.txt" 2>&1
      echo "$t: rc=$?"; tail -15 "$OUT/deepep_$t.txt"
    done
    kill "$daemon"; wait "$daemon"
    ;;
  *) echo "usage: $0 bench|pools|pools2|cluster|suite|deepep_tests" >&2; exit 2 ;;
esac
