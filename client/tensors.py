"""Client-side tensors: NumPy and torch (CPU) arrays in and out, and shared-memory regions.

On the CPU backend a tensor reaches the engine through a file in /dev/shm that both processes
map. Arrays allocated with `Session.empty()` already live in a registered region and travel
without a copy; any other array is copied once into the session's staging region.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..proto import dtypes
from ..proto.v1 import epd_pb2

_ALIGN = 256


def _torch():
    """torch if this process has imported it, else None. An object can only be a torch tensor
    once torch is imported, so this never pays for the import (seconds) on behalf of a caller
    that uses NumPy or CuPy only."""
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def to_numpy(x: Any, what: str) -> np.ndarray:
    """A NumPy view of a NumPy array or CPU torch tensor (bf16 and fp8 included)."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        torch = _torch()
        if x.device.type != "cpu":
            raise TypeError(f"{what}: CUDA tensors travel by CUDA IPC and need the cuda "
                            f"backend; this session's engine runs the cpu backend")
        if x.dtype == torch.bfloat16:
            return x.detach().view(torch.int16).numpy().view(dtypes.BFLOAT16)
        if x.dtype == getattr(torch, "float8_e4m3fn", None):
            return x.detach().view(torch.uint8).numpy().view(dtypes.FLOAT8_E4M3)
        return x.detach().numpy()
    raise TypeError(f"{what}: expected a NumPy array or torch tensor, got {type(x).__name__}")


def meta(x: Any, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and logical element type of a host or device array, without touching its data."""
    from . import cuda_ipc

    if cuda_ipc.is_device_array(x):
        v = cuda_ipc.describe_device(x, what)
        return v.shape, dtypes.to_numpy(v.dtype)
    arr = to_numpy(x, what)
    return arr.shape, arr.dtype


def like(arr: np.ndarray, template: Any) -> Any:
    """Return `arr` as the caller's array type (torch when the template was torch)."""
    if not is_torch(template):
        return arr
    torch = _torch()
    if arr.dtype == dtypes.BFLOAT16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if arr.dtype == dtypes.FLOAT8_E4M3:
        return torch.from_numpy(arr.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(arr)


@dataclass
class ShmFile:
    """A file under /dev/shm mapped into this process, registered with the engine once."""

    path: str
    size: int
    mm: mmap.mmap
    region_id: str = ""

    @classmethod
    def create(cls, size: int, folder: str = "/dev/shm", prefix: str = "epd-client") -> ShmFile:
        path = os.path.join(folder, f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, mm)

    @classmethod
    def open(cls, path: str, size: int) -> ShmFile:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, mm)

    @property
    def base(self) -> int:
        return np.frombuffer(self.mm, dtype=np.uint8).ctypes.data

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype,
             strides: tuple[int, ...] | None = None) -> np.ndarray:
        byte_strides = None if strides is None else tuple(s * dtype.itemsize for s in strides)
        return np.ndarray(shape, dtype=dtype, buffer=self.mm, offset=offset,
                          strides=byte_strides)

    def close(self, unlink: bool) -> None:
        # An array may still view it: the mapping then goes with the last reference.
        with contextlib.suppress(BufferError):
            self.mm.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class Staging:
    """A bump allocator over one registered file, reset at the start of every call."""

    def __init__(self) -> None:
        self.file: ShmFile | None = None
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def need(self, nbytes: int) -> bool:
        """True when the current file cannot hold `nbytes` more (the caller grows it)."""
        return self.file is None or self.used + nbytes > self.file.size

    def put(self, arr: np.ndarray) -> tuple[int, np.ndarray]:
        off = self.used
        dst = self.file.view(off, arr.shape, arr.dtype)
        dst[...] = arr
        self.used = (off + arr.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return off, dst


def desc(region_id: str, offset: int, arr: np.ndarray) -> epd_pb2.TensorDesc:
    item = arr.dtype.itemsize
    return epd_pb2.TensorDesc(region_id=region_id, offset_bytes=offset, shape=list(arr.shape),
                              dtype=dtypes.from_numpy(arr.dtype),
                              strides=[s // item for s in arr.strides])
