"""client/call_outputs.py and proto/cuda_driver.py on the GPU: a call's outputs as views of one
allocation filled by one copy launch (fresh random bytes, destinations poisoned, compared
exactly, torch and CuPy), and the ctypes driver calls against cuda-python's answers and the
stream-order semantics the calls rely on."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# (shape, dtype name) per part: odd byte counts, a 0-row part, 16-byte-aligned and not.
PARTS = [
    [((1037, 7168), "bfloat16"), ((1037, 56), "float32"), ((1037, 8), "int64"),
     ((1037, 8), "float32"), ((1037,), "int32"), ((8, 8), "int32")],
    [((3,), "int32"), ((256,), "int32"), ((13, 3), "bool")],
    [((0, 4096), "bfloat16"), ((5, 4096), "float8_e4m3fn"), ((1,), "uint8")],
]


def _np_dtype(name: str) -> np.dtype:
    from epd.proto import dtypes
    return {"bfloat16": dtypes.BFLOAT16, "float8_e4m3fn": dtypes.FLOAT8_E4M3}.get(
        name, np.dtype(name))


@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_parts_copied_exactly(parts: list, kind: str) -> None:
    import cupy as cp

    from epd.client import call_outputs, cuda_ipc

    use_torch = kind == "torch"
    if use_torch:
        torch = pytest.importorskip("torch")
    rng = np.random.default_rng(len(parts) * 7 + use_torch)
    dev = 0
    spec = [(shape, _np_dtype(name)) for shape, name in parts]
    sizes = [call_outputs.nbytes(shape, dt) for shape, dt in spec]
    srcs = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
    # Sources at offsets 16-byte aligned and not (the kernel's two copy loops).
    pool = cp.zeros(sum(sizes) + 64 * len(sizes) + 64, cp.uint8)
    src_addrs, off = [], 3
    for i, data in enumerate(srcs):
        pool[off:off + data.size] = cp.asarray(data)
        src_addrs.append(int(pool.data.ptr) + off)
        off += data.size + (48 if i % 2 else 61)
    out = call_outputs.empty(spec, dev, use_torch)
    base = cuda_ipc.data_ptr(out[0]) if sizes[0] else None
    for o, (shape, dt), n in zip(out, spec, sizes, strict=True):
        assert tuple(o.shape) == shape
        if use_torch:
            assert o.dtype == cuda_ipc.torch_dtype(dt) and o.is_contiguous()
        else:
            assert o.dtype == cuda_ipc.storage_dtype(dt)
        if not n:
            continue
        assert cuda_ipc.data_ptr(o) % call_outputs.ALIGN == 0
        if use_torch:  # poison
            o.view(-1).view(torch.uint8).fill_(0xA5)
        else:
            o.reshape(-1).view(cp.uint8).fill(0xA5)
    if base is not None:  # one allocation: the parts lie in order inside it
        ptrs = [cuda_ipc.data_ptr(o) for o, n in zip(out, sizes, strict=True) if n]
        assert ptrs == sorted(ptrs) and ptrs[0] == base
    stream = (torch.cuda.current_stream().cuda_stream if use_torch
              else cp.cuda.get_current_stream().ptr)
    call_outputs.copy([(a, o, n) for a, o, n in zip(src_addrs, out, sizes, strict=True)],
                      stream, dev)
    cp.cuda.runtime.deviceSynchronize()
    for o, data, n in zip(out, srcs, sizes, strict=True):
        if not n:
            continue
        got = (o.contiguous().view(-1).view(torch.uint8).cpu().numpy() if use_torch
               else cp.asnumpy(o.reshape(-1).view(cp.uint8)))
        np.testing.assert_array_equal(got, data)


def test_copy_refuses_too_many_parts() -> None:
    from epd.client import call_outputs

    out = call_outputs.empty([((4,), np.dtype(np.int32))] * 9, 0, False)
    with pytest.raises(ValueError, match="at most"):
        call_outputs.copy([(int(o.data.ptr), o, 16) for o in out], 0, 0)


def test_driver_enums_match_cuda_python() -> None:
    from cuda.bindings import driver

    from epd.proto import cuda_driver as D

    a = driver.CUpointer_attribute
    ours = (D.POINTER_ATTRIBUTE_BUFFER_ID, D.POINTER_ATTRIBUTE_RANGE_START_ADDR,
            D.POINTER_ATTRIBUTE_RANGE_SIZE, D.STREAM_WAIT_VALUE_GEQ,
            D.STREAM_WRITE_VALUE_DEFAULT)
    theirs = (a.CU_POINTER_ATTRIBUTE_BUFFER_ID, a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
              a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
              driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
              driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    assert ours == tuple(int(v) for v in theirs)


def test_allocation_info_matches_cuda_python() -> None:
    import cupy as cp
    from cuda.bindings import driver

    from epd.proto import cuda_driver as D

    # Two allocations of the driver's own (CuPy's pool could carve both from one).
    ptrs = [cp.cuda.runtime.malloc(3 << 20), cp.cuda.runtime.malloc(1 << 20)]
    try:
        a = driver.CUpointer_attribute
        kinds = [a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                 a.CU_POINTER_ATTRIBUTE_BUFFER_ID]
        for off in (0, 4097, (1 << 20) - 1):
            ptr = ptrs[0] + off
            err, vals = driver.cuPointerGetAttributes(3, kinds, driver.CUdeviceptr(ptr))
            assert err == driver.CUresult.CUDA_SUCCESS
            assert D.allocation_info(ptr) == tuple(int(v) for v in vals)
            assert D.allocation_info(ptr)[0] == ptrs[0]
        assert D.allocation_info(ptrs[1])[2] != D.allocation_info(ptrs[0])[2]
    finally:
        for p in ptrs:
            cp.cuda.runtime.free(p)
    host = np.zeros(16, np.uint8)
    assert D.allocation_info(host.ctypes.data) is None  # not device memory the driver knows


def test_stream_write_then_wait() -> None:
    """A stream's write lands in order; a stream waiting for word >= 5 runs its later work
    only once the word (mapped host memory, as the counter page) reaches 5, and a 4 does not
    release it. The word is written from the host: a second stream could share the waiting
    stream's hardware queue and sit behind its wait (docs/DESIGN_NOTES.md)."""
    import ctypes
    import time

    import cupy as cp

    from epd.proto import cuda_driver as D

    dev_word = cp.zeros(1, cp.int32)
    s = cp.cuda.Stream(non_blocking=True)
    D.stream_write(s.ptr, int(dev_word.data.ptr), 0xFFFFFFFE)  # (a 32-bit word, cyclic)
    s.synchronize()
    assert int(dev_word.get()[0]) == -2

    host = cp.cuda.runtime.hostAlloc(4, cp.cuda.runtime.hostAllocMapped)
    word = ctypes.c_int32.from_address(host)
    word.value = 0
    marker = cp.zeros(1, cp.int32)
    # Load the fill kernel now: with CUDA's lazy loading, a kernel's first launch loads its
    # module and can wait for the context's queued work, here the parked stream below (the
    # engine loads every kernel at set-up for the same reason).
    cp.zeros(1, cp.int32).fill(7)
    cp.cuda.runtime.deviceSynchronize()
    waiter = cp.cuda.Stream(non_blocking=True)
    try:
        D.stream_wait_geq(waiter.ptr, host, 5)
        with waiter:
            marker.fill(7)
        word.value = 4
        time.sleep(0.05)
        assert not waiter.done
        word.value = 5
        deadline = time.monotonic() + 10
        while not waiter.done and time.monotonic() < deadline:
            time.sleep(0.001)
        assert waiter.done, "the wait did not end when the word reached 5"
        assert int(marker.get()[0]) == 7
    finally:
        word.value = 1 << 30  # whatever happened, no stream stays parked on it
        waiter.synchronize()
        cp.cuda.runtime.freeHost(host)
