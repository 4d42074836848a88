"""client/received_rows.py on the GPU vs NumPy: a plain low-latency dispatch's received rows and
their FP8 scales (DeepEP's column-major layout, float or UE8M0-packed) copied for the caller.
Fresh random inputs, outputs poisoned before the copy; the received rows compared exactly, the
rows beyond each count left as the poison (DeepEP leaves them unwritten)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPES = [  # (local experts, rows per expert, hidden, dtype)
    (128, 256, 7168, "float8_e4m3fn"),
    (8, 96, 4096, "bfloat16"),
    (3, 40, 512, "float8_e4m3fn"),
    (1, 17, 2048, "bfloat16"),
]


def _counts(rng: np.random.Generator, L: int, rows: int) -> np.ndarray:
    c = rng.integers(0, rows + 1, size=L).astype(np.int32)
    c[0] = rows  # a full expert
    if L > 1:
        c[-1] = 0  # an empty one
    return c


@pytest.mark.parametrize("shape", SHAPES)
def test_received_rows_exact(shape: tuple) -> None:
    torch = pytest.importorskip("torch")
    from epd.client import received_rows

    L, rows, H, dt = shape
    rng = np.random.default_rng(L * 1000 + rows)
    dtype = getattr(torch, dt)
    counts = _counts(rng, L, rows)
    src_bits = rng.integers(0, 255, size=(L, rows, H * dtype.itemsize), dtype=np.uint8)
    src = torch.from_numpy(src_bits).cuda().view(dtype).view(L, rows, H)
    cnt = torch.from_numpy(counts).cuda()
    stream = torch.cuda.current_stream().cuda_stream
    # poison: a block of the output's size filled and freed, which torch's caching allocator
    # hands to the copy's new tensor (same size, same stream) when nothing else intervenes
    filler = torch.full(src.shape, 0, dtype=dtype, device="cuda")
    filler.view(torch.uint8).fill_(0xA5)
    poisoned = filler.data_ptr()
    del filler
    out = received_rows.copy_rows(src, cnt, stream, torch.cuda.current_device())
    torch.cuda.synchronize()
    assert out.shape == src.shape and out.dtype == src.dtype
    assert out.data_ptr() != src.data_ptr()
    got = out.view(torch.uint8).cpu().numpy().reshape(L, rows, -1)
    for e in range(L):
        n = int(counts[e])
        np.testing.assert_array_equal(got[e, :n], src_bits[e, :n])
        if out.data_ptr() == poisoned:  # rows beyond the count are not written
            assert (got[e, n:] == 0xA5).all(), "a row beyond the count was written"


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(128, 256, 7168), (5, 33, 1024), (1, 8, 512)])
def test_received_scales_layout(shape: tuple, ue8m0: bool) -> None:
    torch = pytest.importorskip("torch")
    from epd.client import deep_ep_compat as C
    from epd.client import received_rows

    L, rows, H = shape
    S = H // 128
    rng = np.random.default_rng(L + rows + ue8m0)
    counts = _counts(rng, L, rows)
    # scales as the kernels make them: positive, powers of two when UE8M0 is asked for
    exps = rng.integers(-20, 20, size=(L, rows, S))
    scales = np.ldexp(np.float32(1), exps).astype(np.float32) if ue8m0 else \
        rng.uniform(1e-4, 4.0, size=(L, rows, S)).astype(np.float32)
    src = torch.from_numpy(scales).cuda()
    cnt = torch.from_numpy(counts).cuda()
    fmt = C.LowLatencyScales(src, ue8m0)
    fmt.out.fill_(-7 if ue8m0 else -7.0)  # poison
    out = received_rows.copy_scales(src, fmt.out, cnt, ue8m0,
                                    torch.cuda.current_stream().cuda_stream,
                                    torch.cuda.current_device())
    torch.cuda.synchronize()
    assert out is fmt.out
    # the reference: the whole-tensor path of LowLatencyScales, on the valid rows
    want = C.LowLatencyScales(src, ue8m0).fill().cpu().numpy()
    got = out.cpu().numpy()
    assert out.stride()[1] == 1  # column-major in the last two dimensions, as DeepEP's
    for e in range(L):
        n = int(counts[e])
        np.testing.assert_array_equal(got[e, :n], want[e, :n])
        assert (got[e, n:] == -7).all(), "a row beyond the count was written"
