"""A registered region in host memory for engine-side unit tests: the engine resolves a
descriptor to `view(offset, shape, dtype, strides)` of it (strides in elements), as it would a
client's shared memory or a CUDA IPC mapping."""

from __future__ import annotations

import numpy as np

from epd.server.backends.base import Region


class HostRegion(Region):
    def __init__(self, region_id: str = "r", size: int = 4096) -> None:
        super().__init__(region_id, size)
        self.buf = np.zeros(size, np.uint8)

    def close(self) -> None:
        pass

    def view(self, offset, shape, dtype, strides):
        item = np.dtype(dtype).itemsize
        return np.lib.stride_tricks.as_strided(
            self.buf[offset:].view(dtype), shape, tuple(s * item for s in strides))
