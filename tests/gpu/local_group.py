"""All R ranks of one group driven from one process (ranks spread over the visible GPUs with
peer access enabled, several ranks per GPU allowed), with the daemon's buffer layout
(`cuda_plan.membership_layout`): the GPU tests use it, and the benchmarks import it from here
(`sys.path` + `import local_group`). Importable without CuPy (collection on CPU machines)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

from epd.proto import dtypes
from epd.server.backends import cuda_kernels as ck
from epd.server.backends import cuda_runtime as rt
from epd.server.backends.base import GroupSpec
from epd.server.backends.cuda_plan import membership_layout

cp = ck.cp
RankRunner, DispatchResult = rt.RankRunner, rt.DispatchResult
DEFAULT_TIMEOUT_NS = rt.DEFAULT_TIMEOUT_NS


class BenchKernels(ck.Kernels):
    """The engine's kernels plus the benchmark-only ones of cuda/epd_bench.cu (an NVLink copy
    probe and a start gate), compiled into one module so a runner's launches and the gate share
    it. The engine never compiles epd_bench.cu."""

    FILES = (*ck.KERNEL_FILES, "epd_bench.cu")
    NAMES = (*ck.Kernels.NAMES, "epd_copy16", "epd_gate")

    def copy16(self, src: Any, dst_ptr: int, nbytes: int, *, num_sms: int = 132,
               stream: Any = None) -> None:
        with ck._stream_ptr(stream):
            self.fn("epd_copy16")((num_sms,), (1024,),
                                  (src, np.uint64(dst_ptr), np.int64(nbytes // 16)))

    def gate(self, flag_ptr: int, *, timeout_ns: int = 10_000_000_000, stream: Any = None
             ) -> None:
        """Hold `stream` until the host raises the mapped word at `flag_ptr` (bounded)."""
        with ck._stream_ptr(stream):
            self.fn("epd_gate")((1,), (1,), (np.uint64(flag_ptr), np.int64(timeout_ns)))


@functools.cache
def bench_kernels_for_device(device_id: int) -> BenchKernels:
    os.environ.setdefault("CUPY_CACHE_DIR", str(Path.home() / ".cache" / "epd" / "cupy"))
    with cp.cuda.Device(device_id):
        k = BenchKernels()
        # Load every function now: under CUDA's lazy loading, the first launch of a kernel
        # (epd_abort) waits for the kernels running on the device, which may be spinning on it.
        k.compile_all()
        return k


class MappedSlot:
    """A mapped pinned host page (counter slots); with UVA its host pointer is device-usable."""

    def __init__(self, nbytes: int = 4096) -> None:
        flags = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped
        self.ptr = cp.cuda.runtime.hostAlloc(nbytes, flags)
        self.nbytes = nbytes
        buf = (ctypes.c_char * nbytes).from_address(self.ptr)
        self.words = np.frombuffer(buf, dtype=np.int64)
        self.words[:] = 0

    def close(self) -> None:
        if self.ptr:
            cp.cuda.runtime.freeHost(self.ptr)
            self.ptr = 0


def enable_peer_access(num_devices: int) -> None:
    for a in range(num_devices):
        with cp.cuda.Device(a):
            for b in range(num_devices):
                if a != b and cp.cuda.runtime.deviceCanAccessPeer(a, b):
                    with contextlib.suppress(cp.cuda.runtime.CUDARuntimeError):
                        cp.cuda.runtime.deviceEnablePeerAccess(b)  # may be enabled already


class LocalGroup:
    """All R ranks of one group in this process; rank r lives on GPU r * ndev // R."""

    def __init__(self, num_ranks: int, num_experts: int, hidden: int, num_topk: int,
                 max_tokens_per_rank: int, x_dtype: Any, *, num_devices: int | None = None,
                 y_dtype: Any = None, low_latency: bool = False) -> None:
        ndev = num_devices or cp.cuda.runtime.getDeviceCount()
        enable_peer_access(ndev)
        x_dtype = np.dtype(x_dtype)
        fp8 = x_dtype.itemsize == 1
        y_dtype = np.dtype(y_dtype) if y_dtype is not None else (
            np.dtype("uint16") if fp8 else x_dtype)
        # The daemon's layout, exactly: an FP8 run is a bf16 group dispatching FP8 payloads.
        group_dtype = dtypes.BFLOAT16 if fp8 else x_dtype
        self.spec = GroupSpec("local", num_ranks, num_experts, hidden, max_tokens_per_rank,
                              num_topk, dtypes.from_numpy(group_dtype), low_latency)
        self.mlayout = membership_layout(self.spec)
        self.layout = self.mlayout.kernel
        self.ll_layout = self.mlayout.low_latency
        total = self.mlayout.slot_bytes
        self.devices = [r * ndev // num_ranks for r in range(num_ranks)]
        self.buffers = []
        for r in range(num_ranks):
            with cp.cuda.Device(self.devices[r]):
                self.buffers.append(cp.zeros(total, cp.uint8))
                cp.cuda.Device(self.devices[r]).synchronize()
        bases = [int(b.data.ptr) for b in self.buffers]
        self.runners = []
        for r in range(num_ranks):
            kern = bench_kernels_for_device(self.devices[r])
            self.runners.append(rt.RankRunner(kern, self.layout, r, bases, self.devices[r],
                                           x_dtype, y_dtype, owner=self.buffers[r],
                                           ll_layout=self.ll_layout))

    @property
    def num_ranks(self) -> int:
        return len(self.runners)

    def poison(self, byte: int = 0xAB) -> None:
        ctrl_end = self.layout.offsets["recv_x"]
        for r, buf in enumerate(self.buffers):
            with cp.cuda.Device(self.devices[r]), self.runners[r].stream:
                buf[ctrl_end:].fill(byte)  # (the low-latency histograms too: read under flags)

    def synchronize(self) -> None:
        for r in self.runners:
            r.stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        self.runners.clear()
        self.buffers.clear()
