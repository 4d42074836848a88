# Sourced by the gpu_*_run.sh scripts on the device machine: environment, the carried wheels,
# the package shim, versions into $OUT/env.txt.
set -o pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=/tmp/cupy_cache
# Not CUDA_DEVICE_MAX_CONNECTIONS=32 for every process (the sixth session did): under MPS three
# clients with 32 queues each and the engine leave none for the next ("CUDA-capable device(s)
# is/are busy or unavailable" at a client's first CUDA call, seventh session). The engines set
# it themselves; the in-process 16-rank kernel test gets it from its script step.
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/nvshmem4py*.whl .whl/grpcio_health_checking*.whl \
    $(ls .whl/nvidia_cuda_cccl*.whl 2>/dev/null) || exit 1  # (CCCL: cuda_remote.py's build)
mkdir -p /tmp/pkg/epd
for d in server proto cuda client; do ln -sfn "$PWD/$d" /tmp/pkg/epd/$d; done
# not $PWD: the checkout's cuda/ folder would shadow the `cuda` namespace package
export PYTHONPATH=/tmp/pkg:/tmp/site
{
  date -u; nvidia-smi; nvidia-smi topo -m
  python3 -P -c "import torch, cupy, numpy; import importlib.metadata as m; print('torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvshmem4py', m.version('nvshmem4py-cu13'), 'cuda-bindings', m.version('cuda-bindings'))"
} > "$OUT/env.txt" 2>&1

# The scripts' pytest (a per-test limit; no repository settings) and one step of it: a run on
# fresh daemons, its output in $OUT/gpu_NAME.txt, a summary (a script that wants every
# daemon's whole log exports EPD_GPU_LOG_DIR="$OUT": tests/gpu/conftest.py).
pt() { python3 -P -m pytest -p no:cacheprovider -v -rfEsx --timeout 240 -o addopts="" "$@"; }
step() {  # step NAME SECONDS PYTEST-ARGS...: one pytest run on a fresh daemon, its summary
  # Each test gets at most STEP_TEST_SECONDS (180) so that one hung test fails with its stack
  # and the others still run; the last line says how the step ended (124: its limit).
  local name=$1 secs=$2 per; shift 2
  per=$(( secs - 15 < ${STEP_TEST_SECONDS:-180} ? secs - 15 : ${STEP_TEST_SECONDS:-180} ))
  EPD_GPU_INSTAFAIL=1 timeout "$secs" bash -c "$(declare -f pt); pt --tb=short --timeout $per $*" \
      2>&1 | grep -a -v " INFO " > "$OUT/gpu_$name.txt"  # (-a: a worker's bytes)
  local rc=${PIPESTATUS[0]}
  echo "STEP $name: exit status $rc$( [ "$rc" = 124 ] && echo ' (the step limit: cut short)')" \
      >> "$OUT/gpu_$name.txt"
  grep -a -E "PASSED|FAILED|ERROR|passed|failed|^E  | ok$|timing|^STEP " "$OUT/gpu_$name.txt" \
      | cut -c1-240 | tail -60
}

# Helpers of the later scripts (gpu_s14_run.sh on): the log filter, one rank's normal-mode rows
# (probe_calls.py) and its profile, the issue 14 pools (bench_two_pools.py), and merging each kind's files into
# one (the device returns at most 8 files).
clean() { grep -v " INFO \|WARNING\|MpsWarning\|with Session\|warnings.warn\|resource_tracker"; }
ROWS="layout,dispatch,cached dispatch,combine,layout + dispatch + combine"
probe() {  # probe LABEL PKG: the normal-mode rows at D, one rank, MPS on, the package in PKG
  local label=$1 pkg=$2
  PYTHONPATH=$pkg:/tmp/site timeout 90 python3 -P benchmarks/probe_calls.py --tokens 128 \
      --iters 200 --mps on --ranks 1 --rows "$ROWS" --json "$OUT/probe_$label.json" 2>&1 \
      | clean | tail -7 > "$OUT/probe_$label.txt"
}
profile_rows() {  # profile_rows LABEL PKG: one rank's rows with the engine's fast-path thread
  # and the client under cProfile (profile_{top,cum}_LABEL.txt)
  mkdir -p /tmp/prof && rm -f /tmp/prof/*.prof
  EPD_PROFILE_DIR=/tmp/prof EPD_PROBE_PROFILE=/tmp/prof/client.prof probe "profiled_$1" "$2"
  python3 benchmarks/pstats_top.py /tmp/prof/*.prof > "$OUT/profile_top_$1.txt" 2>&1
  python3 -c "
import pstats, glob
for p in sorted(glob.glob('/tmp/prof/*.prof')):
    print('==', p); pstats.Stats(p).sort_stats('cumulative').print_stats(90)
" > "$OUT/profile_cum_$1.txt" 2>&1
  rm -rf /tmp/prof
}
pools() {  # pools LABEL ARGS...: the two pools (POOLS_SECONDS at most), their summary lines
  local label=$1; shift
  echo "== $label"
  timeout "${POOLS_SECONDS:-100}" python3 -P benchmarks/bench_two_pools.py --backend cuda \
      --decode-iters 800 --prefill-iters 120 "$@" --json "$OUT/pool_$label.json" 2>&1 \
      | clean | tail -9
}
merge_json() {  # merge_json PREFIX NAME: $OUT/PREFIX_*.json into $OUT/NAME.json, by label
  # (the parts are removed by name: NAME may itself start with PREFIX_)
  python3 -c "
import json, glob, os, sys
prefix, name, out = sys.argv[1], sys.argv[2], os.environ['OUT']
parts = [f for f in sorted(glob.glob(f'{out}/{prefix}_*.json')) if f != f'{out}/{name}.json']
got = {os.path.basename(f)[len(prefix) + 1:-5]: json.load(open(f)) for f in parts}
json.dump(got, open(f'{out}/{name}.json', 'w'), indent=1)
for f in parts:
    os.remove(f)" "$1" "$2"
}
ab_rounds() {  # ab_rounds FIRST LAST FN [new-first]: `FN LABEL PKG` for rounds FIRST..LAST, each
  # on .whl/old (a `git archive` of the baseline's server proto client cuda) and on this tree,
  # the baseline first unless told otherwise
  mkdir -p /tmp/pkg_old/epd
  for d in server proto cuda client; do ln -sfn "$PWD/.whl/old/$d" /tmp/pkg_old/epd/$d; done
  local round
  for round in $(seq "$1" "$2"); do
    if [ "${4:-}" = new-first ]; then
      "$3" "new_$round" /tmp/pkg; "$3" "old_$round" /tmp/pkg_old
    else
      "$3" "old_$round" /tmp/pkg_old; "$3" "new_$round" /tmp/pkg
    fi
  done
}
probe_ab() { ab_rounds "$1" "$2" probe "${3:-}"; }  # one rank's rows (probe), A/B
# The facade's low-latency pairs, plain and hook (2 ranks on the GPU, D; the thirty-ninth
# session on): ll_rows LABEL PKG, for ab_rounds.
ll_rows() {
  PYTHONPATH=$2:/tmp/site timeout 120 python3 -P benchmarks/probe_calls.py --tokens 128 \
      --iters 300 --mps on --ranks 2 --low-latency --rows "ll plain pair,ll hook pair" \
      --json "$OUT/llrows_$1.json" > /tmp/r.log 2>&1
  echo "== $1 rc=$?"
  clean < /tmp/r.log | grep -E "p50|settles|Error|error" | cut -c1-200
}
# The facade's layers, exact and worst-case rows, V1 and V2 (2 ranks on the GPU, D; the
# thirty-seventh session on): layer_rows LABEL PKG, for ab_rounds.
ROWS_AB="v1 facade layer,v1 facade layer worst-case,v2 layer cpu-sync,v2 layer worst-case"
layer_rows() {
  PYTHONPATH=$2:/tmp/site timeout 150 python3 -P benchmarks/probe_calls.py --tokens 128 \
      --iters 200 --mps on --ranks 2 --elastic --rows "$ROWS_AB" \
      --json "$OUT/rows_$1.json" > /tmp/r.log 2>&1
  echo "== $1 rc=$?"
  clean < /tmp/r.log | grep -E "p50" | cut -c1-200
}
merge() {  # merge NAME: every probe's text and JSON into probes_NAME.{txt,json}
  for f in "$OUT"/probe_*.txt; do echo "== $f"; cat "$f"; done > "$OUT/probes_$1.txt"
  rm -f "$OUT"/probe_*.txt
  merge_json probe "probes_$1"
  cat "$OUT/probes_$1.txt"
}
# One `epd bench` run of two ranks (the forty-seventh session on): its table into
# $OUT/bench_LABEL.txt, its JSON beside it.
bench() {  # bench LABEL ARGS...: one `epd bench` run, its table
  local label=$1; shift
  timeout 200 python3 -P -m epd.server.cli bench --ranks 2 --json "$OUT/bench_$label.json" "$@" \
      2>&1 | clean | tail -45 | tee "$OUT/bench_$label.txt"
}
