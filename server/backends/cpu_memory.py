"""What the cpu backend maps: a client's sealed memfd region, the engine-owned output region of
a membership, the session's counter page, and the fixed places of a membership's outputs in
its region (the cuda backend's counterpart is cuda_memory.py)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from ...proto import counter_page, dtypes
from ...proto import fd_channel as fdc
from .base import CounterPage, GroupSpec, Region
from .cpu_comm_file import align


class ShmRegion(Region):
    """A sealed memfd mapped into this process: a client's region (`fd` given: its seals and
    size checked, mapped; the caller closes the descriptor), or an engine-owned output region
    (`create`: a new memfd sealed against shrinking and growing, whose descriptor `fd` is kept
    for the client to fetch as "outputs/<group_id>")."""

    def __init__(self, region_id: str, size: int, *, fd: int = -1,
                 create: bool = False) -> None:
        super().__init__(region_id, size)
        self.fd = -1
        if create:
            fd = self.fd = fdc.create_memfd("epd-out", size, fdc.ENGINE_SEALS)
        else:
            fdc.check_sealed(fd, size, fdc.CLIENT_SEALS, "region")
        try:
            self._mm = fdc.map_fd(fd, size)
        except BaseException:
            self._release_fd()
            raise
        self._base = np.frombuffer(self._mm, dtype=np.uint8)
        self._base_address = self._base.ctypes.data  # (`.ctypes` builds an object per use)

    def _release_fd(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype,
             strides: tuple[int, ...]) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self._mm, offset=offset,
                          strides=tuple(s * dtype.itemsize for s in strides))

    def offset_of(self, array: np.ndarray) -> int:
        return array.__array_interface__["data"][0] - self._base_address

    def close(self) -> None:
        self._base = None  # type: ignore[assignment]
        # A view may still be alive (a response being serialised): the mapping then goes with
        # the last reference instead.
        fdc.close_mapping(self._mm)
        self._release_fd()


class ShmCounterPage(CounterPage):
    def slot(self, index: int) -> np.ndarray:
        return counter_page.slot_words(self._mm, index)

    def close(self) -> None:
        self._unmap()


class OutputArena:
    """Fixed sub-buffers of the membership's output region (valid until the next call of the
    same kind on this membership). Each is sized for its widest dtype and viewed per call, so
    an FP8 dispatch and a bf16 dispatch share recv_x."""

    def __init__(self, region: ShmRegion, spec: GroupSpec) -> None:
        self._mm = region._mm
        self.offsets: dict[str, int] = {}
        off = 0
        for name, nbytes in self.sizes(spec):
            self.offsets[name] = off
            off = align(off + nbytes)
        self.size = off

    @staticmethod
    def sizes(spec: GroupSpec) -> list[tuple[str, int]]:
        r, t, h, k, e = (spec.num_ranks, spec.max_tokens_per_rank, spec.hidden, spec.num_topk,
                         spec.num_experts)
        lx = spec.num_local_experts
        n = spec.max_recv_tokens
        item = spec.x_numpy_dtype.itemsize
        return [("recv_x", n * h * item), ("recv_x_scales", n * max(h // dtypes.FP8_BLOCK, 1) * 4),
                ("recv_topk_idx", n * k * 8), ("recv_topk_weights", n * k * 4),
                ("recv_src_idx", n * 4), ("rank_prefix_matrix", r * r * 4),
                ("num_tokens_per_rank", r * 4), ("num_tokens_per_expert", e * 4),
                ("is_token_in_rank", t * r), ("combined_x", t * h * item),
                ("combined_topk_weights", t * k * 4),
                # low-latency mode: [L, R * max_tokens_per_rank] rows per buffer
                ("ll_recv_x", lx * n * h * item),
                ("ll_recv_x_scales", lx * n * max(h // dtypes.FP8_BLOCK, 1) * 4),
                ("ll_recv_count", lx * 4), ("ll_recv_src_rank", lx * n * 4),
                ("ll_recv_src_idx", lx * n * 4), ("ll_combined_x", t * h * item)]

    @classmethod
    def bytes_for(cls, spec: GroupSpec) -> int:
        return sum(align(n) for _, n in cls.sizes(spec))

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.ndarray(shape, dtype=np.dtype(dtype), buffer=self._mm,
                          offset=self.offsets[name])


