"""client/received_rows.py on the GPU vs NumPy: a plain low-latency dispatch's received rows, their
FP8 scales (DeepEP's column-major layout, float or UE8M0-packed), the counts and the source
info, copied for the caller by one kernel. Fresh random inputs, outputs poisoned before the copy;
everything compared exactly, the rows and scales beyond each count left as the poison (DeepEP
leaves them unwritten)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPES = [  # (local experts, rows per expert, hidden, dtype, scales: None / "float" / "ue8m0")
    (128, 256, 7168, "float8_e4m3fn", "float"),
    (128, 256, 7168, "float8_e4m3fn", "ue8m0"),
    (8, 96, 4096, "bfloat16", None),
    (3, 40, 512, "float8_e4m3fn", "ue8m0"),
    (1, 17, 2048, "bfloat16", None),
]


def _counts(rng: np.random.Generator, L: int, rows: int) -> np.ndarray:
    c = rng.integers(0, rows + 1, size=L).astype(np.int32)
    c[0] = rows  # a full expert
    if L > 1:
        c[-1] = 0  # an empty one
    return c


@pytest.mark.parametrize("shape", SHAPES)
def test_copy_out_exact(shape: tuple) -> None:
    torch = pytest.importorskip("torch")
    from epd.client import deep_ep_compat as C
    from epd.client import received_rows

    L, rows, H, dt, scales_kind = shape
    rng = np.random.default_rng(L * 1000 + rows + H)
    dtype = getattr(torch, dt)
    counts = _counts(rng, L, rows)
    x_bits = rng.integers(0, 255, size=(L, rows, H * dtype.itemsize), dtype=np.uint8)
    src_rank = rng.integers(-1, 8, size=(L, rows)).astype(np.int32)
    src_idx = rng.integers(-1, 1000, size=(L, rows)).astype(np.int32)
    dev = torch.cuda.current_device()
    x = torch.from_numpy(x_bits).cuda().view(dtype)
    cnt, rk, ix = (torch.from_numpy(a).cuda() for a in (counts, src_rank, src_idx))
    scales = fmt = None
    if scales_kind is not None:
        S = H // 128
        exps = rng.integers(-20, 20, size=(L, rows, S))
        sc = np.ldexp(np.float32(1), exps).astype(np.float32) if scales_kind == "ue8m0" else \
            rng.uniform(1e-4, 4.0, size=(L, rows, S)).astype(np.float32)
        scales = torch.from_numpy(sc).cuda()
        fmt = C.LowLatencyScales(scales, scales_kind == "ue8m0")
        fmt.out.fill_(-7)  # poison
    # poison the new x: a block of its size filled and freed, which torch's caching allocator
    # hands to the copy (same size, same stream) when nothing else intervenes
    filler = torch.empty(x.shape, dtype=dtype, device="cuda")
    filler.view(torch.uint8).fill_(0xA5)
    poisoned = filler.data_ptr()
    del filler
    stream = torch.cuda.current_stream().cuda_stream
    out = received_rows.copy_out(x, scales, fmt.out if fmt is not None else None, cnt, rk, ix,
                                 scales_kind == "ue8m0", stream, dev)
    torch.cuda.synchronize()
    ox, osc, ocnt, ork, oix = out
    assert ox.shape == x.shape and ox.dtype == x.dtype and ox.data_ptr() != x.data_ptr()
    np.testing.assert_array_equal(ocnt.cpu().numpy(), counts)
    np.testing.assert_array_equal(ork.cpu().numpy(), src_rank)
    np.testing.assert_array_equal(oix.cpu().numpy(), src_idx)
    got = ox.view(torch.uint8).cpu().numpy().reshape(L, rows, -1)
    for e in range(L):
        n = int(counts[e])
        np.testing.assert_array_equal(got[e, :n], x_bits[e, :n], err_msg=f"expert {e}")
        if ox.data_ptr() == poisoned:  # rows beyond the count are not written
            assert (got[e, n:] == 0xA5).all(), "a row beyond the count was written"
    if fmt is None:
        assert osc is None
        return
    assert osc is fmt.out and osc.stride()[1] == 1  # column-major, as DeepEP's
    want = C.LowLatencyScales(scales, scales_kind == "ue8m0").fill().cpu().numpy()
    got_sc = osc.cpu().numpy()
    for e in range(L):
        n = int(counts[e])
        np.testing.assert_array_equal(got_sc[e, :n], want[e, :n], err_msg=f"scales {e}")
        assert (got_sc[e, n:] == -7).all(), "a scale row beyond the count was written"


def test_copy_out_refuses_what_it_cannot_copy() -> None:
    torch = pytest.importorskip("torch")
    from epd.client import received_rows

    L, rows = 2, 4
    x = torch.zeros((L, rows, 8), dtype=torch.bfloat16, device="cuda")  # 16-byte rows
    cnt = torch.zeros(L, dtype=torch.int32, device="cuda")
    info = torch.zeros((L, rows), dtype=torch.int32, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    with pytest.raises(ValueError, match="16-byte"):
        received_rows.copy_out(x[:, :, :4], None, None, cnt, info, info, False, s, 0)
    with pytest.raises(ValueError, match="contiguous"):
        received_rows.copy_out(x, None, None, cnt, info.t(), info, False, s, 0)
