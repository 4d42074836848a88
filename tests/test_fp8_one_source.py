"""FP8 quantisation has one implementation (reference.quantize_fp8), used by the CPU backend too.
A copy in cpu.py once computed round_scale with float32 log2, which rounds down just above a
power of two and gave half the scale (values then clip at 448)."""

from __future__ import annotations

import numpy as np
import pytest

from epd.server import reference
from epd.server.backends import cpu


def _rows_near_powers_of_two() -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = []
    for k in range(-12, 12):
        for amax in (np.nextafter(np.float32(448.0 * 2.0 ** k), np.float32(np.inf)),
                     np.float32(448.0 * 2.0 ** k)):
            row = rng.uniform(-1, 1, 128).astype(np.float32) * amax * np.float32(0.5)
            row[int(rng.integers(128))] = amax
            rows.append(row)
    return np.stack(rows)  # 48 rows, one FP8 block each


@pytest.mark.parametrize("round_scale", [False, True])
def test_cpu_backend_quantizes_with_the_reference(round_scale: bool) -> None:
    """One implementation (the cpu backend's is the reference's, not a copy), and its scales
    checked against float64 arithmetic done here: amax / 448, or with round_scale the next
    power of two at or above it; nothing clips at the e4m3 maximum."""
    assert cpu.quantize_fp8 is reference.quantize_fp8
    x = _rows_near_powers_of_two()
    _, s = reference.quantize_fp8(x, round_scale)
    amax = np.abs(x.astype(np.float64)).max(axis=1)
    want = amax / 448.0
    if round_scale:
        want = 2.0 ** np.ceil(np.log2(want))
    np.testing.assert_allclose(s[:, 0].astype(np.float64), want, rtol=1e-6)
    assert (s[:, 0] * np.float32(448.0) >= amax).all()
