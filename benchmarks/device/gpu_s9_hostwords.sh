#!/usr/bin/env bash
# Ninth session: the low-latency pair went from ~500 us to ~3.5-5.5 ms at 9147f4b (host control
# words polled by the kernels). One GPU read of mapped host memory vs a device word, without and
# under MPS; then probe_calls' low-latency rows with the host words (work) and without
# (.bisect/nohost: the engine never gives the kernels their address; made by hand, then deleted:
# `git archive 308d1a2 server proto cuda client benchmarks tests/daemon_harness.py` into it and
# CudaRankComm's memcpy of the host words' address into CTRL_HOST_WORDS removed).
set -u
source benchmarks/device/gpu_env.sh
{
  echo "== host read, no MPS"; python3 -P benchmarks/probe_host_words.py
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mpsp CUDA_MPS_LOG_DIRECTORY=/tmp/mpsl
  mkdir -p /tmp/mpsp /tmp/mpsl; nvidia-cuda-mps-control -d && sleep 1
  echo "== host read, MPS"; python3 -P benchmarks/probe_host_words.py
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
} 2>&1 | tee "$OUT/host_read.txt"
bash benchmarks/device/gpu_s9_bisect.sh work nohost
