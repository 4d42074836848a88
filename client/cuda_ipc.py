"""Client side of the CUDA backend: device tensors as CUDA IPC regions, stream order by an
interprocess event, and the engine's output heap mapped once.

A device tensor (torch CUDA tensor or CuPy array) is described as (region, offset) where the
region is its whole allocation (`cuMemGetAddressRange`), exported once with
`cudaIpcGetMemHandle` and cached by its handle, so torch's caching allocator reusing a segment
costs nothing. Before each call the client records one interprocess event on its current stream
and sends its handle; the engine waits for it before reading the inputs, so the client never
synchronises its stream. The engine answers once the outputs are complete.

CuPy has no bfloat16 / float8 dtypes: a CuPy uint16 array is taken as bfloat16 bits and a uint8
array as float8_e4m3 bits. Torch tensors carry their real dtype.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..proto import cuda_driver, dtypes, spin
from ..proto.errors import InvalidArgument
from ..proto.v1 import epd_pb2
from .frameworks import torch_if_loaded as _torch
from .output_desc import check_output

MAX_CACHED_VIEWS = 256  # output views kept per mapped heap (cleared when full)
# A host wait for a plain low-latency call's event (Buffer.check, evicting an op): longer than
# any call's deadline (the engine fails a late call through its done word, and a lost session
# releases its streams), so only a stream held by the caller's own work reaches it.
EVENT_WAIT_SECONDS = 900.0


def _cupy():
    import cupy
    return cupy


def is_device_array(x: Any) -> bool:
    t = _torch()
    if t is not None and isinstance(x, t.Tensor):
        return x.device.type == "cuda"
    return hasattr(x, "__cuda_array_interface__")


@dataclass
class DeviceView:
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # elements
    dtype: int  # wire enum
    itemsize: int
    device: int


_TORCH_WIRE: dict[Any, int] = {}  # torch dtype -> wire enum (filled at first use)
_TORCH_DTYPES: dict[np.dtype, Any] = {}  # logical NumPy dtype -> torch dtype
_TORCH_DEVICES: dict[int, Any] = {}  # ordinal -> torch.device


def _torch_wire(t: Any) -> dict[Any, int]:
    if not _TORCH_WIRE:
        _TORCH_WIRE.update({t.bfloat16: epd_pb2.BFLOAT16, t.float16: epd_pb2.FLOAT16,
                            t.float32: epd_pb2.FLOAT32, t.int64: epd_pb2.INT64,
                            t.int32: epd_pb2.INT32, t.bool: epd_pb2.BOOL, t.uint8: epd_pb2.UINT8})
        fp8 = getattr(t, "float8_e4m3fn", None)
        if fp8 is not None:
            _TORCH_WIRE[fp8] = epd_pb2.FLOAT8_E4M3
    return _TORCH_WIRE


def torch_wire(t: Any, dtype: Any, what: str) -> int:
    """The wire enum of a torch dtype; InvalidArgument for one EPD does not carry."""
    wire = _torch_wire(t).get(dtype)
    if wire is None:
        raise InvalidArgument(f"{what}: torch dtype {dtype} is not carried by EPD")
    return wire


def describe_device(x: Any, what: str) -> DeviceView:
    t = _torch()
    if t is not None and isinstance(x, t.Tensor):
        wire = torch_wire(t, x.dtype, what)
        return DeviceView(x.data_ptr(), tuple(x.shape), tuple(x.stride()), wire,
                          x.element_size(), x.device.index)
    cai = x.__cuda_array_interface__
    dt = np.dtype(cai["typestr"])
    if dt == np.uint16:
        wire = epd_pb2.BFLOAT16
    elif dt == np.uint8:
        wire = epd_pb2.FLOAT8_E4M3
    else:
        try:
            wire = dtypes.from_numpy(dt)
        except ValueError as e:
            raise InvalidArgument(f"{what}: {e}") from None
    strides = cai.get("strides")
    shape = tuple(cai["shape"])
    if strides is None:
        strides = dtypes.contiguous_strides(shape)
    else:
        strides = tuple(s // dt.itemsize for s in strides)
    return DeviceView(int(cai["data"][0]), shape, strides, wire, dt.itemsize,
                      int(x.device.id))


def allocation_of(ptr: int, device: int) -> tuple[int, int]:
    """(base, size) of the allocation holding `ptr`, which lives on `device` (the driver looks it
    up in the current context: a tensor on another GPU than the current one is not found)."""
    from cuda.bindings import driver

    with _cupy().cuda.Device(device):
        err, base, size = driver.cuMemGetAddressRange(driver.CUdeviceptr(ptr))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise InvalidArgument(f"the tensor at {ptr:#x} is not in a CUDA allocation "
                              f"(cuMemGetAddressRange: {err})")
    return int(base), int(size)


def ipc_handle(base: int, device: int) -> bytes:
    cp = _cupy()
    with cp.cuda.Device(device):
        try:
            return bytes(cp.cuda.runtime.ipcGetMemHandle(base))
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise InvalidArgument(
                "this allocation cannot be shared over CUDA IPC (torch expandable segments? "
                "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF): " + str(e)) from None


class ReadyEvent:
    """One interprocess event per session, recorded on the caller's stream before each call."""

    def __init__(self, device: int) -> None:
        cp = _cupy()
        self.device = device
        with cp.cuda.Device(device):
            self.event = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
            self.handle = bytes(cp.cuda.runtime.ipcGetEventHandle(self.event.ptr))

    def record(self, template: Any) -> bytes:
        cp = _cupy()
        t = _torch()
        with cp.cuda.Device(self.device):
            if t is not None and isinstance(template, t.Tensor):
                stream_ptr = t.cuda.current_stream(self.device).cuda_stream
            else:
                stream_ptr = cp.cuda.get_current_stream().ptr
            cp.cuda.runtime.eventRecord(self.event.ptr, stream_ptr)
        return self.handle


class MappedHeap:
    """The engine's output heap opened in this process (once per session and handle)."""

    def __init__(self, handle: bytes, size: int, device: int) -> None:
        cp = _cupy()
        self.device, self.size = device, size
        with cp.cuda.Device(device):
            self.ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, 1)
        # Outputs come back at the same few places call after call: building a view (CuPy
        # array + DLPack to torch) costs tens of microseconds, so views are reused.
        self._views: dict[tuple, Any] = {}

    def view(self, d: epd_pb2.TensorDesc, copy: bool, template: Any) -> Any:
        t = _torch()
        key = (d.offset_bytes, tuple(d.shape), tuple(d.strides), d.dtype,
               t is not None and isinstance(template, t.Tensor))
        if not copy:
            v = self._views.get(key)
            if v is not None:
                return v
        v = self._make_view(d, copy, template)
        if not copy:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            self._views[key] = v
        return v

    def _make_view(self, d: epd_pb2.TensorDesc, copy: bool, template: Any) -> Any:
        check_output(d, self.size)  # (a view's miss only: hits were checked when made)
        logical = dtypes.to_numpy(d.dtype)
        storage = storage_dtype(logical)
        shape = tuple(d.shape)
        strides = tuple(s * storage.itemsize for s in d.strides)
        t = _torch()
        if t is not None and isinstance(template, t.Tensor):
            # Through a stream-less array interface, not DLPack: DLPack's exchange enqueues a
            # stream sync, which is illegal while the caller captures a CUDA graph.
            out = t.as_tensor(_HeapSlice(self, self.ptr + d.offset_bytes, shape, storage,
                                         strides), device=_torch_device(t, self.device))
            if logical == dtypes.BFLOAT16:
                out = out.view(t.bfloat16)
            elif logical == dtypes.FLOAT8_E4M3:
                out = out.view(t.float8_e4m3fn)
            return out.clone() if copy else out
        cp = _cupy()
        extent = (1 + sum((n - 1) * s for n, s in zip(shape, d.strides, strict=True))
                  if all(shape) else 0) * storage.itemsize
        with cp.cuda.Device(self.device):
            mem = cp.cuda.UnownedMemory(self.ptr + d.offset_bytes, max(extent, 1), self,
                                        self.device)
            arr = cp.ndarray(shape, storage, memptr=cp.cuda.MemoryPointer(mem, 0),
                             strides=strides)
            return arr.copy() if copy else arr

    def close(self) -> None:
        cp = _cupy()
        self._views.clear()
        if self.ptr:
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.ipcCloseMemHandle(self.ptr)
            self.ptr = 0


class _HeapSlice:
    """Part of a mapped heap as a CUDA array interface (version 2: no stream to sync with);
    the tensor made of it keeps this object, and so the heap mapping, alive."""

    def __init__(self, heap: MappedHeap, ptr: int, shape: tuple[int, ...], dtype: np.dtype,
                 strides: tuple[int, ...]) -> None:
        self.heap = heap
        self.__cuda_array_interface__ = {"shape": shape, "typestr": dtype.str,
                                         "data": (ptr, False), "strides": strides,
                                         "version": 2}


def _torch_device(t: Any, ordinal: int) -> Any:
    dev = _TORCH_DEVICES.get(ordinal)
    if dev is None:
        dev = _TORCH_DEVICES[ordinal] = t.device("cuda", ordinal)
    return dev


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a logical NumPy dtype (bfloat16 and float8 included)."""
    logical = _TORCH_DTYPES.get(dtype)
    if logical is None:
        t = _torch()
        logical = {dtypes.BFLOAT16: t.bfloat16, dtypes.FLOAT8_E4M3: t.float8_e4m3fn}.get(dtype)
        if logical is None:
            logical = t.from_numpy(np.empty(0, storage_dtype(dtype))).dtype
        _TORCH_DTYPES[dtype] = logical
    return logical


def device_empty(shape: tuple[int, ...], dtype: np.dtype, device: int, torch: bool) -> Any:
    """An uninitialised device array: a torch CUDA tensor, or a CuPy array (bfloat16 / float8
    as their uint16 / uint8 bits, as everywhere in this module)."""
    if torch:
        t = _torch()
        return t.empty(shape, dtype=torch_dtype(dtype), device=_torch_device(t, device))
    cp = _cupy()
    with cp.cuda.Device(device):
        return cp.empty(shape, storage_dtype(dtype))


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype CuPy holds a logical dtype in (it has no bfloat16 / float8)."""
    return (np.dtype(np.uint16) if dtype == dtypes.BFLOAT16 else
            np.dtype(np.uint8) if dtype == dtypes.FLOAT8_E4M3 else np.dtype(dtype))


def device_copy(a: np.ndarray, device: int) -> Any:
    """A CuPy copy of a host array on `device` (bfloat16 / float8 as their bits)."""
    cp = _cupy()
    with cp.cuda.Device(device):
        return cp.asarray(a.view(storage_dtype(a.dtype)))


def host_copy(a: Any, dtype: np.dtype | None = None) -> np.ndarray:
    """A NumPy copy of a device array (torch or CuPy); `dtype` reinterprets CuPy's bits."""
    t = _torch()
    if t is not None and isinstance(a, t.Tensor):
        logical = {t.bfloat16: dtypes.BFLOAT16, getattr(t, "float8_e4m3fn", None):
                   dtypes.FLOAT8_E4M3}.get(a.dtype)
        if logical is not None:
            return a.view(t.int16 if logical == dtypes.BFLOAT16 else t.uint8).cpu().numpy().view(
                logical)
        return a.cpu().numpy()
    h = _cupy().asnumpy(a)
    return h.view(dtype) if dtype is not None and h.dtype != dtype else h


def is_capturing(template: Any) -> bool:
    """Whether the caller's current stream (for the template's array type) is capturing a
    CUDA graph: host-side waits are impossible then."""
    t = _torch()
    if t is not None and isinstance(template, t.Tensor):
        return bool(t.cuda.is_current_stream_capturing())
    cp = _cupy()
    return bool(cp.cuda.get_current_stream().is_capturing())


def stream_handle(stream: Any, template: Any, device: int) -> int:
    """The CUDA stream a call is ordered on: `stream` (torch/CuPy stream or raw handle), else
    the caller's current stream for the template's array type."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)
    t = _torch()
    return _current_stream(t if t is not None and isinstance(template, t.Tensor) else None,
                           device)


def current_stream(device: int) -> int:
    """The current stream of the loaded array library (torch's where torch is loaded, the
    frameworks' case; else CuPy's), for a call that has no array to tell."""
    return _current_stream(_torch(), device)


def _current_stream(torch: Any, device: int) -> int:
    """torch's current stream (`torch` the module), or CuPy's (`torch` None)."""
    if torch is not None:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (no Stream object made)
        if raw is not None:
            return int(raw(device))
        return int(torch.cuda.current_stream(device).cuda_stream)
    return int(_cupy().cuda.get_current_stream().ptr)


def synchronize(template: Any, device: int) -> None:
    """Wait for the caller's current stream (the template's array type's), where stream-ordered
    calls run: what a caller timing them does before reading the clock."""
    t = _torch()
    if t is not None and isinstance(template, t.Tensor):
        t.cuda.current_stream(device).synchronize()
        return
    _cupy().cuda.get_current_stream().synchronize()


class MappedPage:
    """The session's counter page registered in this process's CUDA context, so this
    process's streams can write and wait on its words (stream memory operations)."""

    def __init__(self, addr: int, size: int, device: int) -> None:
        from cuda.bindings import runtime as cudart

        self._cudart, self.addr, self.device = cudart, addr, device
        with _cupy().cuda.Device(device):
            flags = cudart.cudaHostRegisterPortable | cudart.cudaHostRegisterMapped
            err, = cudart.cudaHostRegister(addr, size, flags)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaHostRegister of the counter page failed: {err}")
            err, dptr = cudart.cudaHostGetDevicePointer(addr, 0)
            if err != cudart.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        self.device_ptr = int(dptr)

    def close(self) -> None:
        if self.addr:
            self._cudart.cudaHostUnregister(self.addr)
            self.addr = 0


@functools.cache
def compiled_kernel(source: str, name: str, device: int) -> int:
    """The CUfunction of kernel `name` in `source` on `device`, compiled once per process by
    CuPy's NVRTC and loaded now (call it at set-up: never inside a CUDA graph capture or on a
    call's hot path; loaded explicitly: cuda_driver.load_function)."""
    import cupy

    with cupy.cuda.Device(device):
        fn = int(cupy.RawModule(code=source).get_function(name).kernel.ptr)
        cuda_driver.load_function(fn, name)
        return fn


def launch_kernel(fn: int, grid: tuple[int, int], block: int, stream: int,
                  args: tuple[ctypes._SimpleCData, ...], device: int, shared: int = 0) -> None:
    """Launch `fn` on the raw `stream` with ctypes-packed arguments (and `shared` bytes of
    dynamic shared memory): one driver call, where a CuPy kernel call converts every argument
    (µs each). For arguments that are plain numbers, `launch_packed` costs less."""
    argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(v) for v in args))
    _launch(fn, grid, block, stream, ctypes.addressof(argv), device, shared)


class _PackedPerThread(threading.local):
    def __init__(self) -> None:
        self.by_fmt: dict[str, cuda_driver.PackedArguments] = {}


_packed = _PackedPerThread()


def launch_packed(fn: int, grid: tuple[int, int], block: int, stream: int, fmt: str,
                  values: tuple[int, ...], device: int, shared: int = 0) -> None:
    """`launch_kernel` with the arguments given as plain ints and their struct codes (`fmt`,
    cuda_driver.PackedArguments): one `pack_into` into this thread's buffer for `fmt`
    instead of a ctypes object per argument."""
    args = _packed.by_fmt.get(fmt)
    if args is None:
        args = _packed.by_fmt[fmt] = cuda_driver.PackedArguments(fmt)
    _launch(fn, grid, block, stream, args.pack(*values), device, shared)


def launch_on_current_stream(source: str, name: str, template: Any, grid: tuple[int, int],
                             block: int, fmt: str, values: tuple[int, ...],
                             shared: int = 0) -> None:
    """`launch_packed` of kernel `name` of `source` on the caller's current stream of the torch
    CUDA tensor `template`'s device (the client's kernels that work on a caller's tensors)."""
    device = template.device.index
    launch_packed(compiled_kernel(source, name, device), grid, block,
                  stream_handle(None, template, device), fmt, values, device, shared)


def _launch(fn: int, grid: tuple[int, int], block: int, stream: int, argv: int, device: int,
            shared: int) -> None:
    import cupy

    with cupy.cuda.Device(device):  # the function belongs to the device's primary context
        cupy.cuda.driver.launchKernel(fn, grid[0], grid[1], 1, block, 1, 1, shared,
                                      int(stream), argv, 0)


def memset_async(ptr: int, nbytes: int, stream: int, device: int) -> None:
    """Zero `nbytes` at device address `ptr`, enqueued on the raw `stream`."""
    import cupy

    with cupy.cuda.Device(device):
        cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, int(stream))


class StreamEvent:
    """A CUDA event of this process (no timing) recorded behind work on a stream: the host
    learns that the work has passed without synchronising the stream."""

    def __init__(self, device: int) -> None:
        cp = _cupy()
        with cp.cuda.Device(device):
            self._event = cp.cuda.Event(block=False, disable_timing=True)

    def record(self, stream: int) -> None:
        _cupy().cuda.runtime.eventRecord(self._event.ptr, stream)

    def done(self) -> bool:
        return bool(self._event.done)

    def wait(self, timeout: float = EVENT_WAIT_SECONDS) -> bool:
        """Whether the work before the event passed within `timeout` seconds (polled, not a
        blocking synchronize: a stream held by the caller's own work must not hang us)."""
        return spin.wait_until(self.done, timeout, nap=1e-4)


class BufferKeys:
    """`buffer_key` with a cache by array object: while an array lives, its allocation cannot
    go away, so its key is computed once (checked against its address and shape, in case it
    was re-pointed with `set_`)."""

    MAX = 512  # cached arrays (cleared when full)

    def __init__(self, device: int) -> None:
        self.device = device
        self._by_id: dict[int, tuple[Any, int, tuple, tuple]] = {}

    def __call__(self, x: Any) -> tuple:
        if x is None:
            return ()
        hit = self._by_id.get(id(x))
        if hit is not None and hit[0]() is x and hit[1] == data_ptr(x) \
                and hit[2] == tuple(x.shape):
            return hit[3]
        key = buffer_key(x, self.device)
        try:
            ref = weakref.ref(x)
        except TypeError:
            return key
        if len(self._by_id) >= self.MAX:
            self._by_id.clear()
        self._by_id[id(x)] = (ref, key[0], key[2], key)
        return key


def data_ptr(x: Any) -> int:
    """The device address of a torch tensor or CuPy array."""
    ptr = getattr(x, "data_ptr", None)
    return int(ptr()) if ptr is not None else int(x.data.ptr)


def buffer_key(x: Any, device: int) -> tuple:
    """What names a device tensor for an armed op: address, CUDA buffer id (an address reused
    by a new allocation gets a new id), shape and strides. () for None."""
    if x is None:
        return ()
    v = describe_device(x, "tensor")
    info = cuda_driver.allocation_info(v.ptr)
    return (v.ptr, info[2] if info is not None else -1, v.shape, v.strides, v.dtype)


_NOT_RELAXED = contextlib.nullcontext()  # (reusable: a low-latency call enters it every time)


def relaxed_capture(active: bool = True) -> contextlib.AbstractContextManager:
    """While a stream captures a CUDA graph (torch's default, global mode), set-up calls such
    as cudaHostRegister or cudaIpcOpenMemHandle are refused and invalidate the capture. Set-up
    that enqueues nothing (forming a group, arming an op, mapping the counter page) runs with
    this thread in relaxed mode, so a call can be captured on its first appearance. Inactive,
    a shared null context (a generator-based one cost every call a few µs)."""
    return _relaxed() if active else _NOT_RELAXED


@contextlib.contextmanager
def _relaxed() -> Iterator[None]:
    from cuda.bindings import driver

    err, old = driver.cuThreadExchangeStreamCaptureMode(
        driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed: {err}")
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(old)
