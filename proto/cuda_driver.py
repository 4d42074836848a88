"""The CUDA driver calls both sides make on every call's hot path, bound once through ctypes.

A call through cuda-python's bindings builds a Python object per handle argument
(`CUstream(...)`, `CUdeviceptr(...)`) and a result tuple, and converts the arguments again
inside: several microseconds per call where the driver itself needs about one, and a
stream-ordered call makes 3-8 of them per side (the READY wait and DONE write, the client's
allocation queries, its output copies). Here each entry point is looked up once with
`cuGetProcAddress` (the version-correct function for the CUDA version named below, as the
bindings and the runtime do) and called with fixed ctypes signatures; ctypes releases the GIL
for the call, as the bindings do.

Only what the hot paths need is here; everything else keeps using cuda-python or CuPy. The
driver library is opened at the first call, so importing this module needs no GPU. The one
exception, `load_function`, is a set-up call that both sides make on their kernels, through
cuda-python.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from typing import Any

CUDA_VERSION = 12000  # the API version whose semantics these calls expect (the _v2 memops)

# Values of the driver's enums (cuda.h; checked against cuda-python by the GPU tests).
POINTER_ATTRIBUTE_BUFFER_ID = 7
POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
POINTER_ATTRIBUTE_RANGE_SIZE = 12
STREAM_WAIT_VALUE_GEQ = 0
STREAM_WAIT_VALUE_AND = 2
STREAM_WRITE_VALUE_DEFAULT = 0
STREAM_CAPTURE_MODE_RELAXED = 2  # (other threads' CUDA calls during a capture stay legal)

_u32, _u64, _ptr = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
# name -> (argument types): every function returns a CUresult (int).
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuStreamWaitValue32": (_ptr, _u64, _u32, ctypes.c_uint),
    "cuStreamWriteValue32": (_ptr, _u64, _u32, ctypes.c_uint),
    "cuPointerGetAttributes": (ctypes.c_uint, _ptr, _ptr, _u64),
    "cuMemcpyDtoDAsync": (_u64, _u64, ctypes.c_size_t, _ptr),
    "cuStreamBeginCapture": (_ptr, ctypes.c_uint),
    "cuStreamEndCapture": (_ptr, ctypes.POINTER(ctypes.c_void_p)),
    "cuGraphInstantiateWithFlags": (ctypes.POINTER(ctypes.c_void_p), _ptr, ctypes.c_ulonglong),
    "cuGraphLaunch": (_ptr, _ptr),
    "cuGraphExecDestroy": (_ptr,),
    "cuGraphDestroy": (_ptr,),
    "cuStreamQuery": (_ptr,),
}
CUDA_ERROR_NOT_READY = 600


class DriverError(RuntimeError):
    """A driver call returned an error (the message names the call and the CUresult)."""


class _Driver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DriverError(f"the CUDA driver library is not available ({e}): stream-ordered "
                              f"calls need an NVIDIA driver") from None
        self._lib = lib
        get = lib.cuGetProcAddress_v2
        get.restype = ctypes.c_int
        get.argtypes = (ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        _u64, ctypes.c_void_p)
        self.fns: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            pfn = ctypes.c_void_p()
            rc = get(name.encode(), ctypes.byref(pfn), CUDA_VERSION, 0, None)
            if rc or not pfn.value:
                raise DriverError(f"cuGetProcAddress({name}) failed: CUresult {rc}")
            self.fns[name] = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(pfn.value)

    def error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        fn = self._lib.cuGetErrorName
        fn.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        if fn(rc, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {rc}"


_lock = threading.Lock()
_driver: list[_Driver] = []


def _fns() -> dict[str, Any]:
    if not _driver:
        with _lock:
            if not _driver:
                _driver.append(_Driver())
    return _driver[0].fns


def _check(rc: int, what: str) -> None:
    if rc:
        raise DriverError(f"{what} failed: {_driver[0].error_name(rc)}")


def stream_wait_geq(stream: int, addr: int, value: int) -> None:
    """`stream` waits, on the GPU, until the 32-bit word at device address `addr` is >= value
    (the driver's cyclic comparison)."""
    _check(_fns()["cuStreamWaitValue32"](stream, addr, value & 0xFFFFFFFF,
                                         STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


def stream_wait_nonzero(stream: int, addr: int) -> None:
    """`stream` waits, on the GPU, until the 32-bit word at `addr` is not 0."""
    _check(_fns()["cuStreamWaitValue32"](stream, addr, 0xFFFFFFFF, STREAM_WAIT_VALUE_AND),
           "cuStreamWaitValue32")


def stream_idle(stream: int) -> bool:
    """Whether `stream` has run everything enqueued on it (no wait: the caller polls, with
    its deadline)."""
    rc = _fns()["cuStreamQuery"](stream)
    if rc == CUDA_ERROR_NOT_READY:
        return False
    _check(rc, "cuStreamQuery")
    return True


def stream_write(stream: int, addr: int, value: int) -> None:
    """`stream` writes the 32-bit word at `addr`, ordered after its earlier work."""
    _check(_fns()["cuStreamWriteValue32"](stream, addr, value & 0xFFFFFFFF,
                                          STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


class Graph:
    """The work `enqueue(stream)` puts on a stream, captured once as a CUDA graph and then
    launched with one driver call (`launch`), where enqueueing it anew costs a call per
    kernel or stream operation. `capture` must be a stream with no other work being added
    (relaxed mode: other threads may go on calling CUDA meanwhile). Not thread-safe."""

    def __init__(self, capture: int, enqueue: Any) -> None:
        fns = _fns()
        self.graph = self.exec = None
        t0 = time.perf_counter()
        _check(fns["cuStreamBeginCapture"](capture, STREAM_CAPTURE_MODE_RELAXED),
               "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            enqueue(capture)
        except BaseException:  # (ended: a stream left capturing refuses all later work)
            fns["cuStreamEndCapture"](capture, ctypes.byref(graph))
            self.graph = graph.value
            self.close()
            raise
        rc = fns["cuStreamEndCapture"](capture, ctypes.byref(graph))
        self.graph = graph.value
        t1 = time.perf_counter()
        try:
            _check(rc, "cuStreamEndCapture")
            exe = ctypes.c_void_p()
            _check(fns["cuGraphInstantiateWithFlags"](ctypes.byref(exe), self.graph, 0),
                   "cuGraphInstantiateWithFlags")
            self.exec = exe.value
            # (how long each step took: the chain logs its slowest; an instantiation that
            # waits for running kernels shows there, docs/DESIGN_NOTES.md "Chain instances
            # as CUDA graphs")
            self.capture_seconds, self.instantiate_seconds = t1 - t0, time.perf_counter() - t1
        except BaseException:
            self.close()
            raise

    def launch(self, stream: int) -> None:
        _check(_fns()["cuGraphLaunch"](self.exec, stream), "cuGraphLaunch")

    def close(self) -> None:
        """Free the graph (its launches already enqueued still run)."""
        fns = _fns()
        if self.exec:
            fns["cuGraphExecDestroy"](self.exec)
        if self.graph:
            fns["cuGraphDestroy"](self.graph)
        self.exec = self.graph = None


class PackedArguments:
    """A kernel's arguments, the struct codes `fmt` in parameter order (Q a pointer or u64, q
    i64, i i32, I u32), written by one `struct.pack_into` into a fixed 8-byte aligned buffer
    that the driver reads through a fixed `void*` array (`pack` returns its address). The
    driver copies the values at the launch, so the buffer is reused at once; not thread-safe:
    one per thread. (A ctypes object per argument, or CuPy's conversion, costs about a
    microsecond per argument.)"""

    def __init__(self, fmt: str) -> None:
        self._st = struct.Struct("@" + fmt)
        self._buf = (ctypes.c_uint64 * max(1, -(-self._st.size // 8)))()
        base = ctypes.addressof(self._buf)
        offsets = [struct.calcsize("@" + fmt[:i + 1]) - struct.calcsize("@" + c)
                   for i, c in enumerate(fmt)]
        self._argv = (ctypes.c_void_p * len(fmt))(*(base + o for o in offsets))
        self.argv = ctypes.addressof(self._argv)

    def pack(self, *values: int) -> int:
        self._st.pack_into(self._buf, 0, *values)
        return self.argv


def load_function(function: int, name: str = "") -> None:
    """Load a kernel (a CUfunction) into its context now, not at its first launch. Under
    CUDA's lazy loading (the default) a first launch loads the kernel, and loading may wait for
    the context's running work. One host thread that drives several ranks (the lock-step GPU
    tests) or one rank through several launches in a row then deadlocks: rank 0's notify spins
    waiting for rank 1, the first launch of rank 0's dispatch waits for that notify, and rank 1
    is never launched (seen on the H200: a timeout in notify, or at combine's entry, only on a
    kernel's first use)."""
    from cuda.bindings import driver as drv

    (err,) = drv.cuFuncLoad(drv.CUfunction(function))
    if err != drv.CUresult.CUDA_SUCCESS:
        raise DriverError(f"loading kernel {name or hex(function)}: {err}")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(_fns()["cuMemcpyDtoDAsync"](dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


class _Attrs(threading.local):
    """Per-thread argument buffers of cuPointerGetAttributes (filled by the driver)."""

    def __init__(self) -> None:
        self.base, self.size, self.buffer_id = _u64(), _u64(), _u64()
        self.kinds = (ctypes.c_int * 3)(POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                        POINTER_ATTRIBUTE_RANGE_SIZE,
                                        POINTER_ATTRIBUTE_BUFFER_ID)
        self.data = (ctypes.c_void_p * 3)(ctypes.addressof(self.base),
                                          ctypes.addressof(self.size),
                                          ctypes.addressof(self.buffer_id))


_attrs = _Attrs()


def allocation_info(ptr: int) -> tuple[int, int, int] | None:
    """(base, size, buffer id) of the device allocation holding `ptr`, or None where the driver
    does not know the address. The buffer id names the allocation for the process's life: an
    address can be reused by a later allocation, an id cannot."""
    a = _attrs
    a.base.value = a.size.value = a.buffer_id.value = 0
    if _fns()["cuPointerGetAttributes"](3, a.kinds, a.data, ptr):
        return None
    base, size, buffer_id = a.base.value, a.size.value, a.buffer_id.value
    return (base, size, buffer_id) if base and size and buffer_id else None
