"""The plain low-latency dispatch's copy-out plan (client/received_rows.CopyPlan) and the scales'
allocator, on the host: what they pack for the kernel and allocate per call. The kernel itself
runs in tests/gpu/test_received_rows.py and every plain call of tests/gpu/test_ll_plain.py."""

from __future__ import annotations

import pytest

from epd.client import deep_ep_compat as C
from epd.client import received_rows as rr

torch = pytest.importorskip("torch")


@pytest.fixture
def launches(monkeypatch):
    got: list[tuple] = []
    monkeypatch.setattr(rr, "compiled_kernel", lambda source, name, device: 77)
    monkeypatch.setattr(rr, "launch_packed",
                        lambda fn, grid, block, stream, fmt, values, device: got.append(
                            (fn, grid, block, stream, fmt, values, device)))
    return got


def _sources(L: int, N: int, H: int, S: int):
    return (torch.empty((L, N, H), dtype=torch.uint8), torch.empty((L, N, S)),
            torch.zeros(L, dtype=torch.int32), torch.zeros((L, N), dtype=torch.int32),
            torch.zeros((L, N), dtype=torch.int32))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_each_call_packs_its_own_outputs_beside_the_fixed_sources(launches, ue8m0) -> None:
    x, sc, cnt, rk, ix = _sources(4, 16, 512, 4)
    plan = rr.CopyPlan(x, sc, cnt, rk, ix, ue8m0, device=0)
    alloc = C.LowLatencyScales.allocator(sc, ue8m0)
    outs = [plan(alloc(), stream=5) for _ in range(2)]
    assert len(launches) == 2
    for (fn, grid, block, stream, fmt, values, device), out in zip(launches, outs, strict=True):
        rx, rs, oc, orank, oidx = out
        assert (fn, stream, device, fmt) == (77, 5, 0, rr.COPY_ARGS)
        assert grid == (max(1, rr._TARGET_BLOCKS // 4), 4) and block == rr._THREADS
        assert len(values) == len(fmt)
        assert values == (x.data_ptr(), rx.data_ptr(), 16, 512 // 16, sc.data_ptr(),
                          rs.data_ptr(), 4, int(ue8m0), cnt.data_ptr(), rk.data_ptr(),
                          ix.data_ptr(), oc.data_ptr(), orank.data_ptr(), oidx.data_ptr())
        assert rx.shape == x.shape and rx.dtype == x.dtype
        assert oc.shape == (4,) and orank.shape == oidx.shape == (4, 16)
    # fresh outputs every call: the caller keeps each
    assert outs[0][0].data_ptr() != outs[1][0].data_ptr()
    assert outs[0][1].data_ptr() != outs[1][1].data_ptr()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_scales_allocator_makes_deep_eps_layout(ue8m0) -> None:
    sc = torch.empty((3, 32, 8))
    want = C.LowLatencyScales(sc, ue8m0).out
    got = C.LowLatencyScales.allocator(sc, ue8m0)()
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


def test_without_scales_and_empty_buffers(launches) -> None:
    x, _, cnt, rk, ix = _sources(4, 16, 512, 4)
    _, rs, *_ = rr.CopyPlan(x, None, cnt, rk, ix, False, 0)(None, 1)
    assert rs is None and launches[0][5][4:6] == (0, 0)
    x0, _, c0, r0, i0 = _sources(0, 16, 512, 4)
    out = rr.CopyPlan(x0, None, c0, r0, i0, False, 0)(None, 1)
    assert len(launches) == 1 and out[0].shape == (0, 16, 512)  # nothing to copy: no launch


def test_what_it_cannot_copy_is_refused_when_planned(launches) -> None:
    x, _, cnt, rk, ix = _sources(4, 16, 512, 4)
    with pytest.raises(ValueError, match="16-byte"):
        rr.CopyPlan(x[:, :, :4], None, cnt, rk, ix, False, 0)
    with pytest.raises(ValueError, match="contiguous"):
        rr.CopyPlan(x, None, cnt, rk.t(), ix, False, 0)
    assert not launches
