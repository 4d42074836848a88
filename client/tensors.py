"""Client-side host tensors: NumPy and CPU torch arrays in and out (bf16 and fp8 included), and
the shared-memory files and staging allocator the cpu backend's memory strategy
(client/memory.py) is built from.

Errors: an array whose element type EPD does not carry, or a CUDA tensor given to a session on
the cpu backend, raises `InvalidArgument`; an object that is no array at all raises `TypeError`
(Python's convention for an argument of the wrong kind).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import operator
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..proto import dtypes
from ..proto import fd_channel as fdc
from ..proto.errors import InvalidArgument
from .frameworks import torch_if_loaded

# A caller's tensor: a NumPy array or torch tensor (CPU or CUDA) or a CuPy array. The client
# accepts all of them and returns outputs of the caller's kind, so no narrower type applies.
Array = Any

STAGING_ALIGN = 256  # bytes: each staged tensor starts on this boundary


_torch = torch_if_loaded


def is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def to_numpy(x: Array, what: str) -> np.ndarray:
    """A NumPy view of a NumPy array or CPU torch tensor (bf16 and fp8 included)."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        torch = _torch()
        if x.device.type != "cpu":
            raise InvalidArgument(f"{what}: CUDA tensors travel by CUDA IPC and need the cuda "
                                  f"backend; this session's engine runs the cpu backend")
        if x.dtype == torch.bfloat16:
            return x.detach().view(torch.int16).numpy().view(dtypes.BFLOAT16)
        if x.dtype == getattr(torch, "float8_e4m3fn", None):
            return x.detach().view(torch.uint8).numpy().view(dtypes.FLOAT8_E4M3)
        return x.detach().numpy()
    if hasattr(x, "__cuda_array_interface__"):
        raise InvalidArgument(f"{what}: CUDA arrays travel by CUDA IPC and need the cuda "
                              f"backend; this session's engine runs the cpu backend")
    raise TypeError(f"{what}: expected a NumPy array or torch tensor, got {type(x).__name__}")


def wire_dtype(dtype: np.dtype, what: str) -> int:
    """The wire enum of an element type; InvalidArgument for one EPD does not carry."""
    try:
        return dtypes.from_numpy(dtype)
    except ValueError as e:
        raise InvalidArgument(f"{what}: {e}") from None


def check_shape(shape: Any, dtype: np.dtype, what: str) -> tuple[int, ...]:
    """A shape to allocate: an int or a sequence of ints, each >= 0, whose bytes fit in an
    index (Python's arithmetic: NumPy's product wraps around silently); InvalidArgument
    naming it otherwise."""
    try:
        dims = (operator.index(shape),) if not hasattr(shape, "__iter__") else tuple(
            operator.index(d) for d in shape)
    except TypeError:
        raise InvalidArgument(f"{what}: shape must be an int or a sequence of ints, got "
                              f"{shape!r}") from None
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{what}: shape {dims} has a negative dimension")
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes > sys.maxsize:
        raise InvalidArgument(f"{what}: shape {dims} of {dtype} is {nbytes} bytes, more than "
                              f"can be addressed")
    return dims


def element_strides(arr: np.ndarray) -> tuple[int, ...]:
    """Strides in elements (the wire's unit), from NumPy's bytes."""
    return tuple(s // arr.dtype.itemsize for s in arr.strides)


def meta(x: Array, what: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and logical element type of a host or device array, without touching its data."""
    from . import cuda_ipc

    t = _torch()
    if t is not None and isinstance(x, t.Tensor) and x.is_cuda:  # (the calls' common case)
        return tuple(x.shape), dtypes.to_numpy(cuda_ipc.torch_wire(t, x.dtype, what))
    if cuda_ipc.is_device_array(x):
        v = cuda_ipc.describe_device(x, what)
        return v.shape, dtypes.to_numpy(v.dtype)
    arr = to_numpy(x, what)
    return arr.shape, arr.dtype


def rows_dense(x: Array) -> Array:
    """`x` with a dense last dimension: itself when it has one (or is None), else a copy
    (enqueued on the current stream for a CUDA tensor). The engine's kernels copy whole rows;
    DeepEP's kernels also read FP8 scales column-major (`scales.T.contiguous().T`), which
    its tests and callers pass."""
    if x is None:
        return x
    if is_torch(x):
        return x if x.dim() == 0 or x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()
    strides = getattr(x, "strides", None)
    if strides and getattr(x, "ndim", 0) and x.shape[-1] > 1 \
            and strides[-1] != x.dtype.itemsize:
        return x.copy(order="C")  # NumPy and CuPy
    return x


def as_fp8_bytes(x: Array) -> tuple[Array, Any]:
    """A quantised payload of another one-byte type (int8 or uint8 as int8 block
    quantisation makes, float8_e5m2) viewed as float8_e4m3, whose bytes dispatch carries bit
    for bit as DeepEP carries any one-byte payload with scales; and the type to view the
    received rows back as (None where x needs no view)."""
    if is_torch(x):
        torch = _torch()
        if x.element_size() == 1 and x.dtype not in (torch.float8_e4m3fn, torch.bool):
            return x.view(torch.float8_e4m3fn), x.dtype
        return x, None
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and dtype.itemsize == 1 and dtype != dtypes.FLOAT8_E4M3 \
            and dtype.kind != "b":
        return x.view(dtypes.FLOAT8_E4M3), dtype
    return x, None


def viewed_as(x: Array, dtype: Any) -> Array:
    """`x` viewed as `dtype` (as_fp8_bytes's second part; None: x itself)."""
    return x if dtype is None else x.view(dtype)


def clone(x: Array) -> Array:
    """A new array with x's contents, of x's kind (a torch tensor's copy is enqueued on the
    current stream)."""
    return x.clone() if is_torch(x) else x.copy()


def like(arr: np.ndarray, template: Array) -> Array:
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
    """Shared memory mapped into this process: a memfd, never a named file. `create` makes one
    sealed against shrinking (F_SEAL_SHRINK: neither side can truncate it, so no mapping of it
    can fault) and keeps its descriptor in `fd` until it has been sent to the engine
    (`release_fd`); `from_fd` maps one the engine sent (counter page, outputs) and closes the
    descriptor. `path` is only a name for messages."""

    path: str
    size: int
    mm: mmap.mmap
    region_id: str = ""
    fd: int = -1

    @classmethod
    def create(cls, size: int, prefix: str = "epd-client") -> ShmFile:
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = fdc.create_memfd(name, size, fdc.CLIENT_SEALS)
        try:
            mm = fdc.map_fd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(f"memfd:{name}", size, mm, fd=fd)

    @classmethod
    def from_fd(cls, fd: int, size: int, name: str) -> ShmFile:
        """Map an engine-owned memfd (sealed: checked) and close the descriptor."""
        try:
            fdc.check_sealed(fd, size, fdc.F_SEAL_SHRINK, name)
            mm = fdc.map_fd(fd, size)
        finally:
            os.close(fd)
        return cls(f"memfd:{name}", size, mm)

    def release_fd(self) -> None:
        """The engine has its own mapping now: this process needs no descriptor."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    @property
    def base(self) -> int:
        return np.frombuffer(self.mm, dtype=np.uint8).ctypes.data

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype,
             strides: tuple[int, ...] | None = None) -> np.ndarray:
        byte_strides = None if strides is None else tuple(s * dtype.itemsize for s in strides)
        return np.ndarray(shape, dtype=dtype, buffer=self.mm, offset=offset,
                          strides=byte_strides)

    def close(self, unlink: bool = False) -> None:
        """Unmap (`unlink` is accepted for older callers: a memfd has no name to remove)."""
        # An array may still view it: the mapping then goes with the last reference.
        fdc.close_mapping(self.mm)
        self.release_fd()


class Staging:
    """A bump allocator over one registered file, reset at the start of every call but while
    an async call's copies are held (ShmMemory.hold_staging)."""

    def __init__(self) -> None:
        self.file: ShmFile | None = None
        self.used = 0

    @property
    def region_id(self) -> str:
        return self.file.region_id if self.file is not None else ""

    @staticmethod
    def footprint(arr: np.ndarray) -> int:
        """Bytes `put(arr)` may take, alignment included."""
        return arr.nbytes + STAGING_ALIGN

    def reset(self) -> None:
        self.used = 0

    def need(self, nbytes: int) -> bool:
        """True when the current file cannot hold `nbytes` more (the caller grows it)."""
        return self.file is None or self.used + nbytes > self.file.size

    def put(self, arr: np.ndarray) -> tuple[int, np.ndarray]:
        off = self.used
        dst = self.file.view(off, arr.shape, arr.dtype)
        dst[...] = arr
        self.used = (off + arr.nbytes + STAGING_ALIGN - 1) // STAGING_ALIGN * STAGING_ALIGN
        return off, dst
