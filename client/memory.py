"""Where a session's tensors live: one memory strategy per session, chosen once at open from the
engine's backend (`SessionOpened.backend`); the rest of the client calls it and never asks which
backend it talks to.

* `ShmMemory` (cpu backend): inputs reach the engine through memfds both processes map, sealed
  against shrinking and sent once over the engine's descriptor channel (proto/fd_channel.py);
  no named file, no path. Arrays from `empty()` live in a registered region and travel without
  a copy; any other array is copied once into the session's staging region. A group's outputs
  are an engine-owned memfd the client fetches ("outputs/<group_id>") and maps at join.
* `CudaIpcMemory` (cuda backend): device tensors travel as (CUDA IPC region, offset), the region
  being the tensor's whole allocation, registered once and cached by its IPC handle; an
  interprocess event recorded on the caller's stream orders the engine after it. A group's
  outputs are views into the engine's output heap, mapped once per heap. The counter page is
  registered with CUDA for stream-ordered calls (client/stream_ops.py).
"""

from __future__ import annotations

import abc
import contextlib
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping

import grpc
import numpy as np

from ..proto import cuda_driver, dtypes
from ..proto import fd_channel as fdc
from ..proto.errors import EpdError, FailedPrecondition, InvalidArgument, ResourceExhausted
from ..proto.v1 import epd_pb2
from . import call_outputs, cuda_ipc
from . import tensors as T
from .output_desc import check_output
from .tensors import Array

MAX_DEVICE_REGIONS = 1024  # cached CUDA IPC registrations per session (oldest dropped)
MIN_STAGING_BYTES = 1 << 20  # the staging region starts at this size and doubles as needed

# A call's tensor fields: TensorDesc per tensor, plus `ready_event` (bytes) on the cuda backend.
Descs = dict[str, epd_pb2.TensorDesc | bytes]
# What a strategy needs from its session: register a region (returns its id), unregister one.
Register = Callable[[epd_pb2.RegisterRegionRequest], str]
Unregister = Callable[[str], None]
# The descriptor channel (proto/fd_channel.Channel): register a sealed memfd (fd, size) -> region
# id; fetch an engine-owned memfd by name -> (fd, size).
RegisterFd = Callable[[int, int], str]
Fetch = Callable[[str], tuple[int, int]]


def _desc(region_id: str, offset: int, shape: tuple[int, ...], dtype: int,
          strides: tuple[int, ...]) -> epd_pb2.TensorDesc:
    return epd_pb2.TensorDesc(region_id=region_id, offset_bytes=offset, shape=list(shape),
                              dtype=dtype, strides=list(strides))


class OutputRegion(abc.ABC):
    """The region the engine writes one group membership's outputs into."""

    def __init__(self, region_id: str, size: int) -> None:
        self.region_id = region_id
        self.size = size  # (bytes: check_output)

    @abc.abstractmethod
    def view(self, d: epd_pb2.TensorDesc, copy: bool, template: Array) -> Array:
        """An output as the template's array type: a copy, or a view valid until the engine
        writes the same output again."""

    def close(self) -> None:  # noqa: B027  (only file-mapped outputs hold something)
        """The membership ended."""


class Memory(abc.ABC):
    """How one session's tensors reach its engine and its outputs come back."""

    backend: str  # "cpu" or "cuda": the engine backend this strategy serves
    supports_stream_ops = False  # stream-ordered calls (counter page mapped for CUDA streams)

    @abc.abstractmethod
    def describe(self, arrays: Mapping[str, Array | None], *, event: bool = True) -> Descs:
        """Descriptors of a call's input tensors (None entries are left out). `event`: order
        the engine after the caller's stream (cuda; stream-ordered calls arm without one)."""

    def write_back(self, name: str, user: Array) -> None:  # noqa: B027  (a no-op unless staged)
        """After a call that updates input `name` in place (out=, cumulative stats): make the
        caller's array see the engine's result."""

    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Array = None) -> Array:
        """An uninitialised array the engine reads without a copy (`like`: its array type)."""

    @abc.abstractmethod
    def outputs(self, resp: epd_pb2.JoinGroupResponse) -> OutputRegion:
        """Map the output region of a membership the engine just created."""

    @abc.abstractmethod
    def from_host(self, a: np.ndarray) -> Array:
        """Host data as an input this session takes (a copy on the device for cuda)."""

    @abc.abstractmethod
    def to_host(self, a: Array, dtype: np.dtype | None = None) -> np.ndarray:
        """An output as a NumPy array (`dtype`: the logical type, for bits CuPy carries)."""

    def synchronize(self, template: Array) -> None:  # noqa: B027  (host calls: done)
        """Wait until the calls made so far on the caller's stream are done (cuda: they are
        stream-ordered; a host timing them synchronises first)."""

    def hold_staging(self) -> None:  # noqa: B027  (a no-op unless inputs are staged)
        """A call whose inputs were just described is in flight past this one (an async
        dispatch): later calls must not reuse the staged copies it has not read yet."""

    def release_staging(self) -> None:  # noqa: B027
        """That call is done: staging may be reused from its start."""

    def call_scope(self) -> _CallScope:
        """`with memory.call_scope():` around a synchronous call, from the description of its
        inputs to its answer (and write_back): while any such call is inside one, no other
        thread's call reuses the staging it was given (cpu backend; a no-op elsewhere)."""
        return _NO_SCOPE

    def counter_page_device_ptr(self) -> int:
        """The counter page's address for this process's CUDA streams (stream-ordered calls)."""
        raise FailedPrecondition("stream-ordered calls need the cuda backend")

    def is_capturing(self, template: Array) -> bool:
        """Whether the caller's current stream is capturing a CUDA graph."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the session mapped or allocated (the session is ending)."""


class _CallScope:
    """The context manager of Memory.call_scope: one per call, which counts as inside the
    scope while the object lives and has not exited. So an exit that an exception cut short
    (a signal handler's KeyboardInterrupt as `__exit__` began) ends when the object is
    collected, where a count of calls inside stayed one too high for the session's life and
    every later call grew the staging instead of reusing it (a fuzzer: 256 MiB after 300
    calls)."""

    __slots__ = ("__weakref__", "_memory", "outer")

    def __init__(self, memory: ShmMemory | None) -> None:
        self._memory = memory
        self.outer: weakref.ref[_CallScope] | None = None  # the thread's scope it is inside

    def __enter__(self) -> None:
        if self._memory is not None:
            self._memory._enter_call(self)

    def __exit__(self, *exc: object) -> None:
        if self._memory is not None:
            self._memory._exit_call(self)


_NO_SCOPE = _CallScope(None)


def for_backend(backend: int, register: Register, unregister: Unregister,
                counter_file: T.ShmFile, device: int, *, register_fd: RegisterFd,
                fetch: Fetch) -> Memory:
    """The strategy for the engine's backend (an `epd_pb2.Backend` value)."""
    if backend == epd_pb2.CUDA:
        return CudaIpcMemory(register, unregister, counter_file, device)
    return ShmMemory(register_fd, unregister, fetch)


# ------------------------------------------------------------------------------------------------
# cpu backend: shared-memory files
# ------------------------------------------------------------------------------------------------

class MappedFileOutputs(OutputRegion):
    def __init__(self, resp: epd_pb2.JoinGroupResponse, fetch: Fetch) -> None:
        super().__init__(resp.output_region_id, resp.output_region_bytes)
        name = f"{fdc.OUTPUTS}{resp.group_id}"
        fd, _ = fetch(name)
        self._file = T.ShmFile.from_fd(fd, resp.output_region_bytes, name)

    def view(self, d: epd_pb2.TensorDesc, copy: bool, template: Array) -> Array:
        check_output(d, self.size)
        arr = self._file.view(d.offset_bytes, tuple(d.shape), dtypes.to_numpy(d.dtype),
                              tuple(d.strides))
        return T.like(arr.copy() if copy else arr, template)

    def close(self) -> None:
        self._file.close(unlink=False)


class ShmMemory(Memory):
    backend = "cpu"

    def __init__(self, register_fd: RegisterFd, unregister: Unregister, fetch: Fetch) -> None:
        self._register_fd, self._unregister, self._fetch = register_fd, unregister, fetch
        self.staging = T.Staging()
        # Staging is shared by the session's threads: its allocation and bookkeeping run under
        # this lock, and it is reset (or a file it outgrew unregistered) only while no other
        # call's staged copies may still be read: none held by an async dispatch, none of a
        # synchronous call between its describe and its answer (`call_scope`).
        self._lock = threading.Lock()
        self._local = threading.local()  # .staged: this thread's last call's copies, by name;
        # .scope: its innermost call scope (a weak reference)
        self._held = 0  # calls in flight whose staged inputs the engine may not have read
        # synchronous calls inside call_scope (their answer not come yet)
        self._scopes: weakref.WeakSet[_CallScope] = weakref.WeakSet()
        self._retired: list[T.ShmFile] = []  # staging files replaced while in use
        self.user_regions: list[T.ShmFile] = []  # from empty()

    @property
    def staged(self) -> dict[str, np.ndarray]:
        """The staged copies of this thread's last described call, by name."""
        return getattr(self._local, "staged", {})

    def _register_file(self, f: T.ShmFile) -> None:
        try:
            f.region_id = self._register_fd(f.fd, f.size)
        except BaseException:
            f.close()
            raise
        # Both sides have it mapped now: no descriptor is needed any more, and nothing has a
        # name, so nothing outlives the two processes however they end.
        f.release_fd()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Array = None) -> Array:
        shape = T.check_shape(shape, dtype, "empty()")  # (before anything is registered)
        nbytes = max(math.prod(shape) * dtype.itemsize, 1)
        try:
            f = T.ShmFile.create(nbytes)
        except OSError as e:
            raise ResourceExhausted(f"empty(): no shared memory of {nbytes} bytes for shape "
                                    f"{shape}: {e}") from None
        self._register_file(f)
        self.user_regions.append(f)
        return T.like(f.view(0, shape, dtype), like)

    def _region_of(self, arr: np.ndarray) -> T.ShmFile | None:
        if arr.size == 0:
            return None
        lo = arr.ctypes.data
        return next((f for f in self.user_regions if f.base <= lo < f.base + f.size), None)

    def _others(self) -> int:
        """(Under the lock.) Calls other than this thread's own that may still read staging."""
        # every call inside a scope but the one this thread describes for now (its innermost:
        # a call made inside another, from a signal handler, must leave the outer's inputs)
        current = getattr(self._local, "scope", None)
        mine = current() if current is not None else None
        return self._held + len(self._scopes) - int(mine is not None and mine in self._scopes)

    def _grow_staging(self, nbytes: int) -> None:
        old = self.staging.file
        size = max(MIN_STAGING_BYTES, 1 << (2 * nbytes - 1).bit_length())
        in_use = old is not None and self._others()
        if in_use:  # (at least double: calls made while others run replace few files)
            size = max(size, 2 * old.size)
        f = T.ShmFile.create(size)
        self._register_file(f)
        self.staging.file = f
        self.staging.reset()
        if old is not None:
            if in_use:  # (a call in flight still names it: unregistered once done)
                self._retired.append(old)
            else:
                self._drop_staging(old)

    def _drop_staging(self, f: T.ShmFile) -> None:
        try:
            self._unregister(f.region_id)
        finally:
            f.close(unlink=True)

    def describe(self, arrays: Mapping[str, Array | None], *, event: bool = True) -> Descs:
        self._local.staged = {}
        out: Descs = {}
        staged: dict[str, np.ndarray] = {}
        for name, a in arrays.items():
            if a is None:
                continue
            arr = T.to_numpy(a, name)
            wire = T.wire_dtype(arr.dtype, name)
            region = self._region_of(arr)
            if region is not None:
                out[name] = _desc(region.region_id, arr.ctypes.data - region.base, arr.shape,
                                  wire, T.element_strides(arr))
            else:
                staged[name] = np.ascontiguousarray(arr)
        if not staged:
            return out
        mine = self._local.staged
        with self._lock:
            if not self._others():  # (else after the copies of the calls in flight: a bump,
                self.staging.reset()  # or a new file, the old one unregistered after them)
            total = sum(T.Staging.footprint(a) for a in staged.values())
            if self.staging.need(total):
                self._grow_staging(total)
            for name, arr in staged.items():
                off, dst = self.staging.put(arr)
                out[name] = _desc(self.staging.region_id, off, dst.shape,
                                  dtypes.from_numpy(dst.dtype), T.element_strides(dst))
                mine[name] = dst
        return out

    def call_scope(self) -> _CallScope:
        return _CallScope(self)

    def _enter_call(self, scope: _CallScope) -> None:
        with self._lock:
            self._scopes.add(scope)
        scope.outer = getattr(self._local, "scope", None)
        self._local.scope = weakref.ref(scope)

    def _exit_call(self, scope: _CallScope) -> None:
        self._local.scope = scope.outer
        with self._lock:
            self._scopes.discard(scope)
        self._drop_retired()

    def hold_staging(self) -> None:
        with self._lock:
            self._held += 1

    def release_staging(self) -> None:
        with self._lock:
            self._held = max(self._held - 1, 0)
        self._drop_retired()

    def _drop_retired(self) -> None:
        """Unregister the staging files outgrown while in use, once nothing may read them."""
        with self._lock:
            if self._held or self._scopes or not self._retired:
                return
            retired, self._retired = self._retired, []
        for f in retired:
            with contextlib.suppress(EpdError):  # (the session is gone: so is the region)
                self._drop_staging(f)

    def write_back(self, name: str, user: Array) -> None:
        dst = self.staged.get(name)
        if dst is not None:
            T.to_numpy(user, name)[...] = dst

    def outputs(self, resp: epd_pb2.JoinGroupResponse) -> OutputRegion:
        return MappedFileOutputs(resp, self._fetch)

    def from_host(self, a: np.ndarray) -> Array:
        return a

    def to_host(self, a: Array, dtype: np.dtype | None = None) -> np.ndarray:
        return T.to_numpy(a, "output")

    def close(self) -> None:
        for f in [*self.user_regions, *self._retired, self.staging.file]:
            if f is not None:
                f.close(unlink=True)
        self.user_regions.clear()
        self._retired.clear()
        self.staging.file = None


# ------------------------------------------------------------------------------------------------
# cuda backend: CUDA IPC
# ------------------------------------------------------------------------------------------------

class HeapOutputs(OutputRegion):
    def __init__(self, region_id: str, heap: cuda_ipc.MappedHeap) -> None:
        super().__init__(region_id, heap.size)
        self._heap = heap  # shared by the session's memberships; the strategy closes it

    def view(self, d: epd_pb2.TensorDesc, copy: bool, template: Array) -> Array:
        return self._heap.view(d, copy, template)

    def rows(self, parts: list[tuple[epd_pb2.TensorDesc, int | None]], copy: bool,
             template: Array, stream: int) -> list[Array]:
        """Stream-ordered outputs (client/stream_calls.py): the first `nrows` rows of each
        output (all when None) as new tensors, views of one allocation filled by one copy
        launch on `stream` (after the call's DONE wait there; client/call_outputs.py), or with
        copy=False views of the heap."""

        for d, n in parts:  # (the full check where a view is made: MappedHeap._make_view)
            if n is not None and not 0 <= n <= (d.shape[0] if d.shape else 0):
                raise EpdError(grpc.StatusCode.INTERNAL, f"the engine counted {n} rows of an "
                                                         f"output of shape {list(d.shape)}")
        shapes = [tuple(d.shape) if n is None else (n, *d.shape[1:]) for d, n in parts]
        if not copy:
            out = []
            for (d, _), shape in zip(parts, shapes, strict=True):
                part = epd_pb2.TensorDesc()
                part.CopyFrom(d)
                part.shape[:] = shape
                out.append(self._heap.view(part, False, template))
            return out
        heap = self._heap
        plan = call_outputs.plan([(shape, dtypes.to_numpy(d.dtype))
                                  for (d, _), shape in zip(parts, shapes, strict=True)])
        for (d, _), nbytes in zip(parts, plan.sizes, strict=True):  # (what the copy reads)
            if not 0 <= d.offset_bytes <= heap.size - nbytes:
                raise EpdError(grpc.StatusCode.INTERNAL,
                               f"the engine answered an output of {nbytes} bytes at offset "
                               f"{d.offset_bytes}, past its heap ({heap.size} bytes)")
        out = call_outputs.allocate(plan, heap.device, call_outputs.uses_torch(template))
        # The engine's buffers are row-major and dense: each part is one run of bytes.
        call_outputs.copy([(heap.ptr + d.offset_bytes, o, n) for (d, _), o, n in
                           zip(parts, out, plan.sizes, strict=True)], stream, heap.device)
        return out


class CudaIpcMemory(Memory):
    backend = "cuda"
    supports_stream_ops = True

    def __init__(self, register: Register, unregister: Unregister, counter_file: T.ShmFile,
                 device: int) -> None:
        self._register, self._unregister = register, unregister
        self._counter_file, self.device = counter_file, device
        self._regions: OrderedDict[bytes, str] = OrderedDict()  # IPC handle -> region id
        # The registrations are the session's, used by every thread that calls (vLLM's
        # dual-batch overlap runs micro-batches on two): their bookkeeping under one lock.
        self._lock = threading.Lock()
        # Allocation buffer id -> (base, region id, IPC handle): a registered allocation is
        # found with one driver query per tensor (cuda_driver.allocation_info), not an IPC
        # handle export.
        self._by_buffer: dict[int, tuple[int, str, bytes]] = {}
        self._heaps: dict[bytes, cuda_ipc.MappedHeap] = {}  # engine output heaps, by handle
        self._heap_region: dict[bytes, str] = {}  # heap handle -> its latest region id
        self._ready_event: cuda_ipc.ReadyEvent | None = None
        self._page: cuda_ipc.MappedPage | None = None

    def _any_region(self, name: str) -> str:
        rid = next(iter(self._regions.values()), None) or next(
            iter(self._heap_region.values()), None)
        if rid is None:
            raise FailedPrecondition(f"{name}: an empty tensor before any group was joined")
        return rid

    def _region_of(self, v: cuda_ipc.DeviceView, in_use: Collection[str] = ()
                   ) -> tuple[str, int, int]:
        """(region id, base, size) of the allocation (or engine heap) holding the tensor.
        Registrations are kept least recently used first; `in_use`: regions the call being
        described names already, never the one dropped for a new registration."""

        for handle, heap in list(self._heaps.items()):  # an output of ours passed back in
            if heap.ptr <= v.ptr < heap.ptr + heap.size:
                return self._heap_region[handle], heap.ptr, heap.size
        with self._lock:
            return self._registered(v, in_use)

    def _registered(self, v: cuda_ipc.DeviceView, in_use: Collection[str]
                    ) -> tuple[str, int, int]:
        """(Under self._lock.) `_region_of` for a tensor in one of the caller's allocations."""
        info = cuda_driver.allocation_info(v.ptr)
        if info is not None:
            known = self._by_buffer.get(info[2])
            if known is not None:
                self._regions.move_to_end(known[2])
                return known[1], known[0], info[1]
            base, size = info[0], info[1]
        else:
            base, size = cuda_ipc.allocation_of(v.ptr, v.device)
        handle = cuda_ipc.ipc_handle(base, v.device)
        rid = self._regions.get(handle)
        if rid is None:
            rid = self._regions[handle] = self._register(epd_pb2.RegisterRegionRequest(
                cuda_ipc_handle=handle, size_bytes=size, device_ordinal=v.device))
            if len(self._regions) > MAX_DEVICE_REGIONS:
                self._drop_oldest({*in_use, rid})
        else:
            self._regions.move_to_end(handle)
        if info is not None:
            self._by_buffer[info[2]] = (base, rid, handle)
        return rid, base, size

    def _drop_oldest(self, keep: Collection[str]) -> None:
        """Unregister the least recently used registration that is not in `keep`, nor read by
        an armed op (the engine refuses those: FAILED_PRECONDITION; they stay, as recent)."""
        for old in [h for h, r in self._regions.items() if r not in keep]:
            rid = self._regions[old]
            try:
                self._unregister(rid)
            except FailedPrecondition:
                self._regions.move_to_end(old)
                continue
            del self._regions[old]
            self._by_buffer = {b: e for b, e in self._by_buffer.items() if e[1] != rid}
            return

    def describe(self, arrays: Mapping[str, Array | None], *, event: bool = True) -> Descs:

        out: Descs = {}
        template: Array = None
        # Allocations already found in this call: the call's tensors are all alive, so a
        # pointer inside one of these ranges is in that allocation (a call's outputs share one,
        # client/call_outputs.py, and small inputs often share a segment of the allocator).
        seen: list[tuple[int, int, str]] = []
        for name, a in arrays.items():
            if a is None:
                continue
            if not cuda_ipc.is_device_array(a):
                raise InvalidArgument(f"{name}: the engine runs the cuda backend and takes CUDA "
                                      f"tensors (torch on 'cuda' or CuPy); got "
                                      f"{type(a).__name__}")
            v = cuda_ipc.describe_device(a, name)
            template = template if template is not None else a
            if v.ptr and all(v.shape):
                hit = next(((b, r) for b, e, r in seen if b <= v.ptr < e), None)
                if hit is None:
                    rid, base, size = self._region_of(v, [r for _, _, r in seen])
                    seen.append((base, base + size, rid))
                else:
                    base, rid = hit
                offset = v.ptr - base
            else:  # empty: no allocation; any region, offset 0
                rid, offset = self._any_region(name), 0
            out[name] = _desc(rid, offset, v.shape, v.dtype, v.strides)
        if template is not None and event:
            if self._ready_event is None:
                self._ready_event = cuda_ipc.ReadyEvent(self.device)
            out["ready_event"] = self._ready_event.record(template)
        return out

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, like: Array = None) -> Array:
        """A device array on the engine's GPU (torch when `like` is torch, else CuPy with
        bfloat16/float8 as their uint16/uint8 bits); registered at its first use."""
        return cuda_ipc.device_empty(shape, dtype, self.device, torch=T.is_torch(like))

    def from_host(self, a: np.ndarray) -> Array:
        """A CuPy copy on the engine's GPU (bfloat16 / float8 as their uint16 / uint8 bits)."""
        return cuda_ipc.device_copy(a, self.device)

    def to_host(self, a: Array, dtype: np.dtype | None = None) -> np.ndarray:
        return cuda_ipc.host_copy(a, dtype)

    def synchronize(self, template: Array) -> None:
        cuda_ipc.synchronize(template, self.device)

    def outputs(self, resp: epd_pb2.JoinGroupResponse) -> OutputRegion:

        handle = resp.output_region_ipc
        heap = self._heaps.get(handle)
        if heap is None:
            heap = self._heaps[handle] = cuda_ipc.MappedHeap(handle, resp.output_region_bytes,
                                                             self.device)
        self._heap_region[handle] = resp.output_region_id
        return HeapOutputs(resp.output_region_id, heap)

    def counter_page_device_ptr(self) -> int:

        if self._page is None:
            self._page = cuda_ipc.MappedPage(self._counter_file.base, self._counter_file.size,
                                             self.device)
        return self._page.device_ptr

    def is_capturing(self, template: Array) -> bool:
        return cuda_ipc.is_capturing(template)

    def close(self) -> None:
        for heap in self._heaps.values():
            heap.close()
        self._heaps.clear()
        if self._page is not None:
            self._page.close()  # before the session unmaps the counter page, never after
            self._page = None
