"""The host side of the CUDA hot path that needs no GPU: where a call's outputs are placed in
their one allocation (client/call_outputs.py), and the driver binding's error where there is
no driver (proto/cuda_driver.py). tests/gpu/test_call_outputs.py runs both on a GPU."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from epd.client import call_outputs
from epd.proto import cuda_driver, dtypes


@pytest.mark.parametrize("sizes", [[14_868_992, 232_288, 66_368, 33_184, 4_148, 256],
                                   [12, 1024, 39], [0, 40_960, 1], [], [256, 0, 0, 1]])
def test_parts_are_aligned_in_order_and_disjoint(sizes: list[int]) -> None:
    offsets, total = call_outputs.placement(sizes)
    assert len(offsets) == len(sizes)
    end = 0
    for off, n in zip(offsets, sizes, strict=True):
        assert off % call_outputs.ALIGN == 0 and off >= end
        end = off + n
    assert end <= total < end + call_outputs.ALIGN * max(len(sizes), 1)
    assert total % call_outputs.ALIGN == 0


def test_part_sizes_use_the_storage_dtype() -> None:
    assert call_outputs.nbytes((1037, 7168), dtypes.BFLOAT16) == 1037 * 7168 * 2
    assert call_outputs.nbytes((5, 4096), dtypes.FLOAT8_E4M3) == 5 * 4096
    assert call_outputs.nbytes((0, 4096), np.dtype(np.float32)) == 0
    assert call_outputs.nbytes((13, 3), np.dtype(np.bool_)) == 39


PARTS = [[((1037, 7168), dtypes.BFLOAT16), ((1037, 56), np.dtype(np.float32)),
          ((1037, 8), np.dtype(np.int64)), ((1037,), np.dtype(np.int32)),
          ((8, 8), np.dtype(np.int32))],
         [((3,), np.dtype(np.int32)), ((13, 3), np.dtype(np.bool_)),
          ((0, 4096), dtypes.BFLOAT16), ((5, 4096), dtypes.FLOAT8_E4M3)]]


@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_empty_parts_are_views_at_their_places(parts: list, kind: str, monkeypatch) -> None:
    """call_outputs.empty's views of its one allocation, made from a plan cached per
    signature: each part where placement() puts it, with its shape, dtype and dense strides,
    on the first call of a signature and on the cached ones (host memory standing in for the
    device allocation; tests/gpu/test_call_outputs.py runs it on a GPU)."""
    from epd.client import cuda_ipc
    use_torch = kind == "torch"
    if use_torch:
        torch = pytest.importorskip("torch")

        def host_empty(shape, dtype, device, torch_out):
            return torch.empty(shape, dtype=cuda_ipc.torch_dtype(dtype))
    else:
        def host_empty(shape, dtype, device, torch_out):
            return np.empty(shape, cuda_ipc.storage_dtype(dtype))
    monkeypatch.setattr(cuda_ipc, "device_empty", host_empty)
    sizes = [call_outputs.nbytes(shape, dt) for shape, dt in parts]
    offsets, _ = call_outputs.placement(sizes)
    for _ in range(2):  # the second call takes the cached plan
        assert call_outputs.plan(parts).sizes == sizes
        out = call_outputs.empty(parts, 0, use_torch)
        ptr = (lambda a: a.data_ptr()) if use_torch else (lambda a: a.ctypes.data)
        base = ptr(out[0]) if sizes[0] else None
        for o, (shape, dt), off, n in zip(out, parts, offsets, sizes, strict=True):
            assert tuple(o.shape) == shape
            if use_torch:
                assert o.dtype == cuda_ipc.torch_dtype(dt) and o.is_contiguous()
            else:
                assert o.dtype == cuda_ipc.storage_dtype(dt) and o.flags.c_contiguous
            if n and base is not None:
                assert ptr(o) - base == off
        # Distinct calls get distinct allocations (a cached plan, never a cached buffer).
        again = call_outputs.empty(parts, 0, use_torch)
        if sizes[0]:
            assert ptr(again[0]) != ptr(out[0])
        # Writing one part touches no other.
        for i, o in enumerate(out):
            if sizes[i]:
                (o.view(-1) if use_torch else o.reshape(-1))[...] = 0
        first = next(i for i, n in enumerate(sizes) if n)
        flat = out[first].view(-1) if use_torch else out[first].reshape(-1)
        flat[...] = 1
        for i, o in enumerate(out):
            if sizes[i] and i != first:
                assert not (o != 0).any()


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_present(), reason="this machine has a CUDA driver")
def test_without_a_driver_the_error_says_so() -> None:
    with pytest.raises(cuda_driver.DriverError, match="CUDA driver library is not available"):
        cuda_driver.stream_write(0, 0, 1)
    with pytest.raises(cuda_driver.DriverError):  # every call, not only the first
        cuda_driver.allocation_info(0)


class _Dev:
    """A device array as the client sees one (the driver side is replaced below)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4",
                                         "data": (ptr, False), "version": 2}
        self.device = type("D", (), {"id": 0})()


def test_describe_finds_each_allocation_once_per_call(monkeypatch) -> None:
    """CudaIpcMemory.describe asks the driver once per allocation of a call: the tensors of
    one call inside a range already found are placed by offset (a call's outputs share one
    allocation, client/call_outputs.py); another call asks again (a freed range can be reused
    by a new allocation, which only the driver's buffer id tells)."""
    from epd.client import cuda_ipc, memory
    from epd.proto.v1 import epd_pb2

    allocations = {0x10000: (0x10000, 4096, 7), 0x40000: (0x40000, 1 << 20, 9)}
    asked: list[int] = []

    def allocation_info(ptr: int):
        asked.append(ptr)
        return next(a for a in allocations.values() if a[0] <= ptr < a[0] + a[1])

    registered: list[epd_pb2.RegisterRegionRequest] = []

    def register(req: epd_pb2.RegisterRegionRequest) -> str:
        registered.append(req)
        return f"r{len(registered)}"

    monkeypatch.setattr(cuda_driver, "allocation_info", allocation_info)
    monkeypatch.setattr(cuda_ipc, "ipc_handle", lambda base, device: base.to_bytes(8, "little"))
    mem = memory.CudaIpcMemory(register, lambda rid: None, None, 0)
    arrays = {"a": _Dev(0x10000, 4), "b": _Dev(0x10100, 8), "c": _Dev(0x40200, 2),
              "d": _Dev(0x10f00, 1), "none": None}
    d = mem.describe(arrays, event=False)
    assert asked == [0x10000, 0x40200]  # b and d: inside a's allocation, no query
    assert [(d[k].region_id, d[k].offset_bytes) for k in "abcd"] == [
        ("r1", 0), ("r1", 0x100), ("r2", 0x200), ("r1", 0xf00)]
    assert [r.size_bytes for r in registered] == [4096, 1 << 20]
    d = mem.describe({"b": arrays["b"]}, event=False)  # a new call: the driver is asked again
    assert asked[-1] == 0x10100 and d["b"].region_id == "r1" and len(registered) == 2


def test_registrations_are_dropped_least_recently_used_and_never_in_use(monkeypatch) -> None:
    """Past MAX_DEVICE_REGIONS registrations the client unregisters one: the least recently
    used (a hot allocation is reused, not registered again and again), and never one the call
    being described names already (it would go out naming an unregistered region)."""
    from epd.client import cuda_ipc, memory

    monkeypatch.setattr(memory, "MAX_DEVICE_REGIONS", 2)
    allocations = {p << 16: (p << 16, 4096, p) for p in range(1, 8)}
    monkeypatch.setattr(cuda_driver, "allocation_info", lambda ptr: allocations[ptr & ~0xfff])
    monkeypatch.setattr(cuda_ipc, "ipc_handle", lambda base, device: base.to_bytes(8, "little"))
    registered: list[int] = []
    dropped: list[str] = []

    def register(req) -> str:
        registered.append(int.from_bytes(req.cuda_ipc_handle, "little"))
        return f"r{registered[-1] >> 16}"
    mem = memory.CudaIpcMemory(register, dropped.append, None, 0)

    def describe(*ptrs: int) -> list[str]:
        d = mem.describe({f"t{i}": _Dev(p, 4) for i, p in enumerate(ptrs)}, event=False)
        return [d[f"t{i}"].region_id for i in range(len(ptrs))]
    assert describe(0x10000) == ["r1"] and describe(0x20000) == ["r2"]
    assert describe(0x10000) == ["r1"]  # r1 used again: r2 is the least recently used now
    assert describe(0x30000) == ["r3"] and dropped == ["r2"]
    # a call whose first tensor is in the oldest registration (r1) and whose second is new:
    # r1 stays (the call names it), r3 goes
    assert describe(0x10000 + 0x100, 0x40000) == ["r1", "r4"] and dropped == ["r2", "r3"]
    assert describe(0x10000) == ["r1"] and registered == [0x10000, 0x20000, 0x30000, 0x40000]
    # a call naming more new allocations than the limit keeps every one of them
    assert describe(0x50000, 0x60000, 0x70000) == ["r5", "r6", "r7"]
    assert dropped == ["r2", "r3", "r4", "r1"]


def test_normal_mode_refuses_what_a_graph_cannot_replay() -> None:
    """Under CUDA-graph capture a normal-mode call the engine would run once (a daemon layout,
    a dispatch without num_worst_tokens, a cached dispatch, the combine of an eager
    dispatch's handle) fails with FAILED_PRECONDITION before it reaches the engine or the
    counter slot; a worst-case dispatch and its combine are armed instead
    (client/captured_calls.py). tests/gpu/test_captured_normal.py does the same inside
    torch.cuda.graph."""
    from types import SimpleNamespace

    from epd.client import stream_calls
    from epd.proto.errors import FailedPrecondition
    from epd.proto.v1 import epd_pb2

    sent: list[str] = []
    memory = SimpleNamespace(is_capturing=lambda template: True)
    session = SimpleNamespace(memory=memory, device_ordinal=0,
                              _call=lambda method, *a, **k: sent.append(method))
    group = SimpleNamespace(_session=session, name="g", spec=None, _stream_slot=None,
                            _local_layout=None, _captured=[])
    with pytest.raises(FailedPrecondition, match="get_dispatch_layout cannot be captured"):
        stream_calls.layout(group, object())
    with pytest.raises(FailedPrecondition, match="needs num_worst_tokens"):
        stream_calls.dispatch(group, epd_pb2.DispatchRequest(), 1.0, object(), True, 0)
    with pytest.raises(FailedPrecondition, match="cached dispatch cannot be captured"):
        stream_calls.dispatch(group, epd_pb2.DispatchRequest(cached_handle=3,
                                                             num_worst_tokens=8),
                              1.0, object(), True, 0)
    eager = SimpleNamespace(op=None, num_tokens=4)
    with pytest.raises(FailedPrecondition, match="ran outside the graph"):
        stream_calls.combine(group, object(), eager, None, None, None, 1.0, 1.0, 0)
    assert sent == [] and group._stream_slot is None  # nothing sent, no slot touched


def test_a_failed_dispatch_waits_for_its_last_kernel_to_name_the_cause() -> None:
    """A dispatch whose count came back failed waits (bounded) for the call's DONE, after
    which the failure words name the rank that left, not before."""
    import threading
    import time

    from epd.client.stream_calls import StreamSlot
    from epd.proto import abi, counter_page

    slot = StreamSlot.__new__(StreamSlot)
    slot.words = np.zeros(abi.SLOT_BYTES // 8, dtype=np.int64)

    def last_kernel() -> None:
        time.sleep(0.05)
        counter_page.fail_stream(slot.words, 7, abi.ERR_ABORTED, 1)

    t = threading.Thread(target=last_kernel)
    t0 = time.monotonic()
    t.start()
    slot.settle(7, 5.0)
    assert 0.04 < time.monotonic() - t0 < 2.0
    t.join()
    f = counter_page.stream_failure(slot.words)
    assert f is not None and f.rank == 1 and "rank 1" in f.error("g").message
    t0 = time.monotonic()
    slot.settle(8, 0.05)  # never comes: bounded
    assert time.monotonic() - t0 < 1.0


def test_local_layout_is_the_default_and_its_setting_is_checked(monkeypatch) -> None:
    from epd.client import local_layout
    from epd.proto.errors import InvalidArgument

    monkeypatch.delenv(local_layout.ENV, raising=False)
    assert local_layout.enabled()
    for v, want in (("1", True), ("on", True), ("0", False), ("off", False), ("", True)):
        monkeypatch.setenv(local_layout.ENV, v)
        assert local_layout.enabled() is want
    monkeypatch.setenv(local_layout.ENV, "sometimes")
    with pytest.raises(InvalidArgument, match="EPD_LOCAL_LAYOUT"):
        local_layout.enabled()


def test_local_layout_compiles_the_engines_kernel_from_its_own_file() -> None:
    """The client compiles the very kernel the engine runs for a layout (one source file, with
    the common header inlined), not a copy of it."""
    from epd.client import local_layout
    from epd.proto import kernel_sources
    from epd.server.backends import cuda_kernels

    src = local_layout.source()
    assert "epd_layout(" in src and "#include" not in src
    assert "epd_notify" not in src  # only the layout: a client compiles little
    kernel = (kernel_sources.CUDA_DIR / "epd_layout.cu").read_text().split("#include")[1]
    body = kernel.split("\n", 1)[1]  # the file after its #include line
    assert body in cuda_kernels._source() and body in src  # (both: no stale copy anywhere)


def test_local_layout_error_words_are_zeroed_distinct_and_never_reused(monkeypatch) -> None:
    """Each group gets its own zeroed words in pinned host memory, at the address the kernel
    writes (a late write of a dropped group's layout must not land in another's words)."""
    import sys
    from types import SimpleNamespace

    from epd.client import local_layout

    pages: list[bytearray] = []

    class Pinned(bytearray):
        @property
        def ptr(self) -> int:
            return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def alloc(n: int) -> Pinned:
        pages.append(Pinned(b"\x07" * n))  # (not zeroed by the allocator)
        return pages[-1]

    fake = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=alloc))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(local_layout, "_free", [])
    monkeypatch.setattr(local_layout, "_pages", [])
    got = [local_layout._error_words() for _ in range(70)]  # more than one page holds
    assert len(pages) == 2
    ptrs = [p for _, p in got]
    assert len(set(ptrs)) == 70
    for words, ptr in got:
        assert words.shape == (local_layout._ERR_WORDS,) and not words.any()
        assert words.ctypes.data == ptr  # the kernel's address is the host view's
    got[0][0][3] = 5
    assert not any(w.any() for w, _ in got[1:])  # disjoint


def test_a_local_layout_that_cannot_be_built_falls_back_to_the_daemon(monkeypatch) -> None:
    """Where the kernel cannot be compiled or loaded here, the group warns and sends its
    layouts through the daemon instead of failing to join."""
    from types import SimpleNamespace

    from epd.client import local_layout

    def refuse(*args, **kwargs):
        raise RuntimeError("NVRTC_ERROR_COMPILATION")
    monkeypatch.setattr(local_layout.cuda_ipc, "compiled_kernel", refuse)
    group = SimpleNamespace(name="g", _session=SimpleNamespace(device_ordinal=0))
    with pytest.warns(RuntimeWarning, match="through the daemon"):
        assert local_layout.build(group) is None


def test_relaxed_capture_off_touches_no_driver(monkeypatch) -> None:
    """Every low-latency call enters relaxed_capture(False): one shared null context, no
    driver call (the relaxed mode is set only around set-up inside a capture)."""
    from epd.client import cuda_ipc

    calls: list[str] = []
    monkeypatch.setattr(cuda_ipc, "_relaxed", lambda: calls.append("relaxed"))
    ctx = cuda_ipc.relaxed_capture(False)
    assert ctx is cuda_ipc.relaxed_capture(False)
    for _ in range(2):
        with ctx:
            pass
    assert not calls
    cuda_ipc.relaxed_capture(True)
    assert calls == ["relaxed"]
