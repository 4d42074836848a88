#!/usr/bin/env bash
# One device call for the daemon on GPUs: daemon GPU tests, `epd demo` on the CUDA engine, and
# the end-to-end benchmark through gRPC. Logs under $OUT.
set -o pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=/tmp/cupy_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/nvshmem4py*.whl .whl/grpcio_health_checking*.whl || exit 1
mkdir -p /tmp/pkg/epd
for d in server proto cuda client; do ln -sfn "$PWD/$d" /tmp/pkg/epd/$d; done
export PYTHONPATH=/tmp/pkg:/tmp/site
MODE=${1:-all}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$OUT/env.txt"
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  timeout 420 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_daemon.py -q -rfE -x \
      --timeout 300 -o addopts="" -s 2>&1 | tee "$OUT/daemon_tests.txt" | tail -60
fi
if [ "$MODE" = all ] || [ "$MODE" = demo ]; then
  timeout 180 python3 -P -m epd.server.cli demo --backend cuda --ranks 2 --tokens 512 \
      --hidden 2048 --experts 32 --topk 4 2>&1 | tee "$OUT/demo.txt" | tail -15
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  timeout 300 python3 -P benchmarks/bench_daemon.py --iters 30 --json "$OUT/bench_daemon.json" \
      2>&1 | tee "$OUT/bench_daemon.txt" | tail -20
fi
