source benchmarks/device/gpu_env.sh
timeout 240 python3 -P -m pytest -p no:cacheprovider tests/gpu/test_security_cuda.py tests/gpu/test_daemon.py -q -rfEx --timeout 120 -o addopts="" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
timeout 90 python3 -P -m epd.server.cli demo --backend cuda 2>&1 | tee "$OUT/demo.txt" | tail -9
timeout 120 python3 -P benchmarks/bench_low_latency.py --iters 50 --mps --skip kernels,nccl --json "$OUT/ll_bench_mps.json" 2>&1 | grep -v " INFO " | tail -7
