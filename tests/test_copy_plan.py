"""The plain low-latency dispatch's copy-out plan (client/received_rows.CopyPlan) and the scales'
allocator, on the host: what they pack for the kernel and allocate per call. The kernel itself
runs in tests/gpu/test_received_rows.py and every plain call of tests/gpu/test_ll_plain.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from epd.client import deep_ep_compat as C
from epd.client import received_rows as rr
from epd.client.buffer_low_latency import LowLatencyMixin
from epd.proto import cuda_driver

torch = pytest.importorskip("torch")


@pytest.fixture
def launches(monkeypatch):
    got: list[tuple] = []

    def launch(fn, grid, block, stream, fmt, values, device):
        cuda_driver.PackedArguments(fmt).pack(*values)  # (each value fits its struct code)
        got.append((fn, grid, block, stream, fmt, values, device))

    monkeypatch.setattr(rr, "compiled_kernel", lambda source, name, device: 77)
    monkeypatch.setattr(rr, "launch_packed", launch)
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
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_scales_allocator_makes_deep_eps_layout(ue8m0) -> None:
    """[L, N, C] column-major in its last two dimensions (storage [L, C, N]): C = S float32
    scales, or S / 4 int32 words of packed UE8M0 exponents; a new array every call."""
    sc = torch.empty((3, 32, 8))
    alloc = C.LowLatencyScales.allocator(sc, ue8m0)
    got, again = alloc(), alloc()
    cols = 2 if ue8m0 else 8
    assert got.shape == (3, 32, cols) and got.stride() == (cols * 32, 1, 32)
    assert got.dtype == (torch.int32 if ue8m0 else torch.float32)
    assert got.data_ptr() != again.data_ptr()
    host = C.LowLatencyScales.allocator(sc.numpy(), ue8m0)()  # (host arrays: the same)
    assert host.shape == (3, 32, cols) and host.strides == (cols * 32 * 4, 4, 32 * 4)


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


def _results(L: int = 4, N: int = 16, H: int = 512, S: int = 4) -> SimpleNamespace:
    x, sc, cnt, rk, ix = _sources(L, N, H, S)
    return SimpleNamespace(recv_x=x, recv_x_scales=sc, recv_count=cnt, recv_src_rank=rk,
                           recv_src_idx=ix)


def test_the_facades_plans_follow_the_receive_buffer_and_format(launches) -> None:
    """Buffer's plain copy-out (`_copy_received`) and its scales (`_scales_out`) keep one plan
    per receive buffer and format of the op: a call of buffer b copies b's rows, a ue8m0 call
    gets int32 scales, and the hook path's scales (`out=`) fill as a fresh layout does."""
    op = SimpleNamespace(results=[_results(), _results()], plans={})
    me = SimpleNamespace(session=SimpleNamespace(device_ordinal=0),
                         _scales_out=LowLatencyMixin._scales_out)
    outs = [LowLatencyMixin._copy_received(me, op, b, True, False, 5) for b in (0, 1, 0, 1)]
    for (*_, values, _), b in zip(launches, (0, 1, 0, 1), strict=True):
        assert values[0] == op.results[b].recv_x.data_ptr()
        assert values[4] == op.results[b].recv_x_scales.data_ptr() and values[7] == 0
    assert len({o[1].data_ptr() for o in outs}) == 4  # (a new scales array every call)
    ue = LowLatencyMixin._copy_received(me, op, 0, True, True, 5)
    assert ue[1].dtype == torch.int32 and launches[-1][5][7] == 1
    bf16 = LowLatencyMixin._copy_received(me, op, 1, False, False, 5)
    assert bf16[1] is None and launches[-1][5][4:6] == (0, 0)
    src = op.results[1].recv_x_scales
    src.copy_(2.0 ** torch.randint(-3, 3, tuple(src.shape)).float())
    for ue8m0 in (False, True):
        hook = C.LowLatencyScales(src, ue8m0, out=LowLatencyMixin._scales_out(op, 1, ue8m0))
        want = C.LowLatencyScales(src, ue8m0).fill()
        assert torch.equal(hook.fill(), want) and hook.out.stride() == want.stride()
