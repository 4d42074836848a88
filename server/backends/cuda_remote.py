"""EPD's kernels built for ranks on other nodes (issue 13): the same sources as
`cuda_kernels.Kernels`, compiled with `EPD_NVSHMEM` so that every write to a rank whose peer
table entry is 0 goes through NVSHMEM's device API (put, put-with-signal, signal), which NVSHMEM
carries over its network transports on a cluster and over NVLink between logical nodes of one
host. Peer pointers stay for the ranks of this node.

Why a second build and not one module: the NVSHMEM device library must be linked in and
registered with the PE's NVSHMEM state (`library_init`, after `nvshmem.core.init`), which CuPy's
`RawModule` cannot do, and the one-node engine should not pay for it. The recipe (NVRTC with
relocatable code through cuda.core, link against `libnvshmem_device.a`, the `uint64_t`
spelling of the library) is in docs/GPU_NOTES.md; it needs the CCCL headers (the
`nvidia-cuda-cccl` wheel) beside NVSHMEM's.

Launches keep the driver's path of `cuda_kernels.Launch`: a linked kernel is a `CUkernel`,
which `cuLaunchKernel` takes in place of a `CUfunction`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from . import cuda_kernels as ck

cp = ck.cp

PRELUDE = """
#include <cuda/std/type_traits>
#include <cuda/std/cstdint>
#include <cuda/std/cstddef>
#include <cuda/std/limits>
namespace std { using namespace cuda::std; }
// libnvshmem_device.a was built where uint64_t is unsigned long (NVRTC: unsigned long long);
// the names must mangle alike.
#define uint64_t unsigned long
#define int64_t long
#include <nvshmem.h>
#include <nvshmemx.h>
#undef uint64_t
#undef int64_t
#define EPD_NVSHMEM 1
"""


def find_installed(rel: str) -> Path | None:
    """`rel` under a site directory (the wheels put NVIDIA's files in nvidia/...)."""
    for entry in sys.path:
        p = Path(entry or ".") / rel
        if p.exists():
            return p
    return None


def toolchain_paths() -> tuple[list[str], Path]:
    """(include directories, libnvshmem_device.a); RuntimeError naming what is missing."""
    nvshmem_inc = find_installed("nvidia/nvshmem/include/nvshmem.h")
    device_lib = find_installed("nvidia/nvshmem/lib/libnvshmem_device.a")
    cccl = find_installed("nvidia/cu13/include/cccl/cuda/std/cstdint")
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    missing = [name for name, p in (("nvidia-nvshmem-cu13 (nvshmem.h)", nvshmem_inc),
                                    ("nvidia-nvshmem-cu13 (libnvshmem_device.a)", device_lib),
                                    ("nvidia-cuda-cccl (cuda/std headers)", cccl)) if p is None]
    if missing:
        raise RuntimeError("the kernels for ranks on other nodes need " + ", ".join(missing))
    incs = [str(nvshmem_inc.parent), str(cccl.parents[2]), str(cccl.parents[3])]  # (nv/target)
    if cuda_home.exists():
        incs.append(str(cuda_home))
    return incs, device_lib


def _core():
    try:
        import cuda.core as core
        core.Program  # noqa: B018 (older releases keep it under experimental)
    except (ImportError, AttributeError):
        import cuda.core.experimental as core
    return core


def link_relocatable(text: str, arch: str, library: Path, **options: Any) -> Any:
    """`text` compiled as relocatable device code and linked against a static device library
    into a cubin (cuda.core's linked module): the kernels calling NVSHMEM's device library."""
    core = _core()
    opts = core.ProgramOptions(arch=arch, std="c++17", relocatable_device_code=True, **options)
    obj = core.Program(text, "c++", opts).compile("cubin")
    lib = core.ObjectCode.from_library(library.read_bytes())
    return core.Linker(obj, lib, options=core.LinkerOptions(arch=arch)).link("cubin")


def loaded_kernel(linked: Any, name: str) -> int:
    """The handle of kernel `name` of a linked module, loaded into the current context."""
    k = linked.get_kernel(name)
    handle = int(getattr(k, "handle", None) or k._handle)
    load_into_context(handle)
    return handle


def _c_arg(a: Any) -> Any:
    """A kernel argument as the ctypes value `cuLaunchKernel` reads (as CuPy would pass it)."""
    if a is None:
        return ctypes.c_uint64(0)
    if cp is not None and isinstance(a, cp.ndarray):
        return ctypes.c_uint64(a.data.ptr)
    if isinstance(a, np.generic):
        return np.ctypeslib.as_ctypes_type(a.dtype)(a.item())
    raise TypeError(f"kernel argument of type {type(a).__name__}: pass NumPy scalars or arrays")


class LinkedKernel:
    """A kernel of the linked module, called like a CuPy RawKernel."""

    def __init__(self, name: str, handle: int, max_dynamic_shared: int = 48 << 10) -> None:
        self.name, self.ptr, self.max_dynamic_shared = name, handle, max_dynamic_shared

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 shared_mem: int = 0, stream: Any = None) -> None:
        vals = [_c_arg(a) for a in args]
        argv = (ctypes.c_void_p * len(vals))(*(ctypes.addressof(v) for v in vals))
        g = (*grid, 1, 1)[:3]
        b = (*block, 1, 1)[:3]
        s = stream.ptr if stream is not None else cp.cuda.get_current_stream().ptr
        if shared_mem > self.max_dynamic_shared:  # (the driver would only say INVALID_VALUE)
            raise RuntimeError(f"{self.name}: {shared_mem} bytes of dynamic shared memory, "
                               f"more than the {self.max_dynamic_shared} it can have")
        cp.cuda.driver.launchKernel(self.ptr, *g, *b, shared_mem, s, ctypes.addressof(argv), 0)


class RemoteKernels(ck.Kernels):
    """The kernels with the NVSHMEM device path, for the current device of an initialised PE."""

    def __init__(self, device_id: int) -> None:  # (no RawModule: see the module docstring)
        import nvshmem.core as nc

        incs, device_lib = toolchain_paths()
        arch = "sm_" + cp.cuda.Device(device_id).compute_capability
        self.linked = link_relocatable(PRELUDE + ck._source(self.FILES), arch, device_lib,
                                       device_as_default_execution_space=True,
                                       include_path=incs)
        nc.library_init(nc.NvshmemKernelObject.from_obj(self.linked))
        self.device_id = device_id
        self._fn: dict[str, Any] = {}
        self._tls = threading.local()  # (as Kernels: this thread's packed launches)

    def fn(self, name: str) -> Any:
        f = self._fn.get(name)
        if f is None:
            plain = name.replace("<", "_").replace(">", "")  # epd_combine_reduce_Bf16
            handle = loaded_kernel(self.linked, plain)
            f = self._fn[name] = LinkedKernel(plain, handle,
                                              opt_in_shared_memory(handle, self.device_id))
        return f


def load_into_context(kernel: int) -> None:
    """Load a linked kernel into the current context now. Under CUDA's lazy loading (the
    default) a kernel is loaded at its first launch, and loading may wait for the context's
    other work: an engine whose rank stream is parked in a GPU-side wait for its client would
    wait for a client that waits for the engine (a normal-mode dispatch on a spanning group ran
    into the client's deadline on the H200). So every kernel is loaded before serving."""
    from cuda.bindings import driver as drv

    err, _ = drv.cuKernelGetFunction(drv.CUkernel(kernel))
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"loading a linked kernel: {err}")


def opt_in_shared_memory(kernel: int, device_id: int) -> int:
    """Let a linked kernel take all the dynamic shared memory the device allows beside its
    static use, and return that many bytes. NVSHMEM's device library gives every kernel linked
    with it ~48 KiB of static shared memory (seen in the cubin's .nv.shared sections), so
    without the opt-in a launch asking for even 1 KiB more (notify: 4 bytes per expert) fails
    with CUDA_ERROR_INVALID_VALUE (seen on the H200)."""
    from cuda.bindings import driver as drv

    attr, dev, k = drv.CUfunction_attribute, drv.CUdevice(device_id), drv.CUkernel(kernel)

    def check(res: tuple) -> Any:
        if res[0] != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"shared memory attribute of a linked kernel: {res[0]}")
        return res[1] if len(res) > 1 else None

    static = check(drv.cuKernelGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, k, dev))
    optin = check(drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
    room = int(optin) - int(static)
    check(drv.cuKernelSetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, room,
                                   k, dev))
    return room


@functools.cache
def remote_kernels_for_device(device_id: int) -> RemoteKernels:
    """Process-wide, after `nvshmem.core.init` on that device; every kernel loaded (see
    `load_into_context`)."""
    with cp.cuda.Device(device_id):
        kernels = RemoteKernels(device_id)
        kernels.compile_all()
        return kernels
