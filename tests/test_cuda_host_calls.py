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
