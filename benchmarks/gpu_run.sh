#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests and the benchmark, logs under $OUT.
set -o pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=/tmp/cupy_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/nvshmem4py*.whl || exit 1
mkdir -p /tmp/pkg/epd
for d in server proto cuda client; do ln -sfn "$PWD/$d" /tmp/pkg/epd/$d; done
# not $PWD: the checkout's cuda/ folder would shadow the `cuda` namespace package
export PYTHONPATH=/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # no empty entry (= cwd)
{
  date -u; nvidia-smi; nvidia-smi topo -m
  python3 -P -c "import torch, cupy, numpy; import importlib.metadata as m; print('torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvshmem4py', m.version('nvshmem4py-cu13'), 'cuda-bindings', m.version('cuda-bindings'))"
} > "$OUT/env.txt" 2>&1
MODE=${1:-all}
if [ "$MODE" != bench ]; then
  timeout 330 python3 -P -m pytest -p no:cacheprovider tests/gpu -q -rfE --timeout 120 --durations=15 \
      -o addopts="" 2>&1 | tee "$OUT/tests.txt" | tail -40
fi
if [ "$MODE" != tests ]; then
  timeout 150 python3 -P benchmarks/bench_kernels.py --iters 20 --json "$OUT/bench.json" 2>&1 \
      | tee "$OUT/bench.txt" | tail -30
fi
