"""The CUDA engine's memory that is not a group's buffers: regions it maps (a client's CUDA IPC
allocation, or its own heap) and the host memory its kernels write and poll — the session's
counter page, registered as mapped pinned memory so that notify writes the receive counts
where the client reads them, and the host control words (abort code, ranks gone) the kernels'
waits read without any GPU work queued behind a client's stream. No GPU is touched on import."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any

import numpy as np

from ...proto import abi, counter_page, dtypes
from ...proto.errors import ResourceExhausted, Unavailable
from . import cuda_kernels as ck
from .base import CounterPage, Region
from .cuda_quiet import QuietCloser

log = logging.getLogger("epd.cuda")
cp = ck.cp


def storage_dtype(dt: np.dtype) -> np.dtype:
    """The CuPy dtype that holds a logical dtype's bits."""
    dt = np.dtype(dt)
    if dt == dtypes.BFLOAT16:
        return np.dtype(np.uint16)
    if dt == dtypes.FLOAT8_E4M3:
        return np.dtype(np.uint8)
    return dt


class DeviceRegion(Region):
    """Device memory at `ptr` (a client's IPC allocation, or the engine's heap)."""

    def __init__(self, region_id: str, ptr: int, size: int, device: int, *,
                 closer: QuietCloser | None = None, ipc_handle: bytes = b"") -> None:
        super().__init__(region_id, size)
        self.ptr, self.device = ptr, device
        self.ipc_handle = ipc_handle
        self._closer = closer  # an IPC mapping's (None: the engine's own memory)

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype,
             strides: tuple[int, ...]) -> Any:
        sd = storage_dtype(dtype)
        extent = 1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) \
            if all(shape) else 0
        mem = cp.cuda.UnownedMemory(self.ptr + offset, max(extent * sd.itemsize, 1), self,
                                    self.device)
        return cp.ndarray(shape, sd, memptr=cp.cuda.MemoryPointer(mem, 0),
                          strides=tuple(s * sd.itemsize for s in strides))

    def typed(self, offset: int, shape: tuple[int, ...], dtype: Any) -> Any:
        dt = np.dtype(dtype)
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= max(d, 1)
        return self.view(offset, shape, dt, tuple(reversed(strides)))

    def offset_of(self, array: Any) -> int:
        return int(array.data.ptr) - self.ptr

    def close(self) -> None:
        if self._closer is not None and self.ptr:
            # when no kernel is in flight (cuda_quiet.py)
            self._closer.close_later(functools.partial(ipc_close, self.device, self.ptr))
        self.ptr = 0


def ipc_close(device: int, ptr: int) -> None:
    """Unmap a CUDA IPC mapping (QuietCloser calls it when the engine is quiet); a failure is
    logged, not raised (the closer goes on with the next)."""
    from cuda.bindings import runtime as cudart

    with cp.cuda.Device(device):
        err, = cudart.cudaIpcCloseMemHandle(ptr)
    if err != cudart.cudaError_t.cudaSuccess:
        log.warning("cudaIpcCloseMemHandle(%#x) failed: %s", ptr, err)


class CounterSlot(np.ndarray):
    """Host int64 words of a counter slot, with the device pointer the notify kernel writes."""

    device_ptr: int = 0


class DeviceWords:
    """Synchronous host reads and writes of 64-bit words in device memory (any engine's control
    block on this node: device addresses through NVSHMEM's peer mappings). CudaRankComm's
    `device_words`; tests of the host protocols over control words put memory of their own."""

    @staticmethod
    def read(addr: int) -> int:
        out = np.zeros(1, np.uint64)
        cp.cuda.runtime.memcpy(out.ctypes.data, addr, 8, cp.cuda.runtime.memcpyDeviceToHost)
        return int(out[0])

    @staticmethod
    def write(addr: int, values: list[int]) -> None:
        v = np.array(values, np.uint64)
        cp.cuda.runtime.memcpy(addr, v.ctypes.data, v.nbytes,
                               cp.cuda.runtime.memcpyHostToDevice)


class MappedCounterPage(CounterPage):
    def __init__(self, device: int, closer: QuietCloser) -> None:
        from cuda.bindings import runtime as cudart

        super().__init__()
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        with cp.cuda.Device(device):
            flags = cudart.cudaHostRegisterPortable | cudart.cudaHostRegisterMapped
            err, = cudart.cudaHostRegister(self._addr, counter_page.PAGE_BYTES, flags)
            if err != cudart.cudaError_t.cudaSuccess:
                raise Unavailable(f"cudaHostRegister of the counter page failed: {err}")
            err, dptr = cudart.cudaHostGetDevicePointer(self._addr, 0)
            if err != cudart.cudaError_t.cudaSuccess:
                raise Unavailable(f"cudaHostGetDevicePointer failed: {err}")
        self.device_ptr = int(dptr)
        self._cudart = cudart
        self._closer = closer

    def slot(self, index: int) -> CounterSlot:
        words = counter_page.slot_words(self._mm, index).view(CounterSlot)
        words.device_ptr = self.device_ptr + index * counter_page.SLOT_BYTES
        return words

    def close(self) -> None:
        # Unregistering pinned memory waits for the device like an IPC close: when quiet.
        self._closer.close_later(self._close_now)

    def _close_now(self) -> None:
        if self._addr:
            self._cudart.cudaHostUnregister(self._addr)  # before the unmap, never after
            self._addr = 0
        self._unmap()


class HostControlWords:
    """The engine's host words (cuda/epd_common.cuh, CTRL_HOST_WORDS): per group-rank, an abort
    code and the ranks that went away, in mapped pinned host memory that the kernels' waits
    poll. The host writes them directly, with no GPU work: a kernel or copy the engine queued
    to write the control block can wait behind a parked client stream that shares its hardware
    queue (MPS), while the kernels it should release keep that client waiting: a deadlock
    until a deadline. The control block's words are still written (by kernels, not awaited)
    for the ranks on other engines, which poll their own engine's words."""

    SLOTS = 4096  # group-ranks of one engine at once
    WORDS = 2

    def __init__(self, device: int) -> None:
        from cuda.bindings import runtime as cudart

        n = self.SLOTS * self.WORDS * 8
        with cp.cuda.Device(device):
            flags = cudart.cudaHostAllocMapped | cudart.cudaHostAllocPortable
            err, ptr = cudart.cudaHostAlloc(n, flags)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaHostAlloc of the host control words failed: {err}")
            err, dptr = cudart.cudaHostGetDevicePointer(ptr, 0)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        self._ptr, self._dptr, self._cudart = int(ptr), int(dptr), cudart
        buf = (ctypes.c_uint64 * (self.SLOTS * self.WORDS)).from_address(self._ptr)
        self.words = np.frombuffer(buf, np.uint64).reshape(self.SLOTS, self.WORDS)
        self.words[:] = 0
        self._free = list(range(self.SLOTS - 1, -1, -1))
        self._groups: dict[int, set[int]] = {}  # group key (heap offset) -> its slots here
        self._lock = threading.Lock()

    def acquire(self, group: int) -> int:
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"more than {self.SLOTS} group-ranks on one engine")
            slot = self._free.pop()
            self.words[slot] = 0
            self._groups.setdefault(group, set()).add(slot)
            return slot

    def release(self, group: int, slot: int) -> None:
        with self._lock:
            self.words[slot] = 0
            self._groups.get(group, set()).discard(slot)
            if not self._groups.get(group, True):
                del self._groups[group]
            self._free.append(slot)

    def device_ptr(self, slot: int) -> int:
        return self._dptr + slot * self.WORDS * 8

    def abort(self, group: int, code: int) -> None:
        """Every rank of the group on this engine sees the abort (the first code stays)."""
        with self._lock:
            for slot in self._groups.get(group, ()):
                if self.words[slot, abi.HOST_WORD_ABORT] == 0:
                    self.words[slot, abi.HOST_WORD_ABORT] = code

    def mark_gone(self, group: int, rank: int) -> None:
        with self._lock:
            for slot in self._groups.get(group, ()):
                self.words[slot, abi.HOST_WORD_GONE] |= np.uint64(1 << rank)

    def unmark_gone(self, group: int, rank: int) -> None:
        """A replacement rejoined in `rank`'s place."""
        with self._lock:
            for slot in self._groups.get(group, ()):
                self.words[slot, abi.HOST_WORD_GONE] &= ~np.uint64(1 << rank)

    def read(self, slot: int) -> tuple[int, int]:
        """(abort code, gone ranks) of one slot."""
        return (int(self.words[slot, abi.HOST_WORD_ABORT]),
                int(self.words[slot, abi.HOST_WORD_GONE]))

    def close(self) -> None:
        if self._ptr:
            self.words = None
            self._cudart.cudaFreeHost(self._ptr)
            self._ptr = 0
