"""`get_dispatch_layout` in the caller's own process (cuda backend; EPD_LOCAL_LAYOUT=0 turns it
off, sending layouts through the daemon as before).

The layout is a function of the caller's `topk_idx` alone: no peer, no buffer of the engine's,
no NVSHMEM state takes part (the engine recomputes it inside every dispatch anyway, from the
same `topk_idx`). Through the daemon it costs a ring round trip, the engine's validation and
launch (200-480 µs of host time per call on the H200, one rank at D) for a kernel of a few
microseconds; here it is one allocation, one memset and one launch of the same kernel
(cuda/epd_layout.cu) on the caller's current stream, as DeepEP's layout is. It stays
capturable in a CUDA graph (nothing waits on the host).

Bad expert ids are handled as the engine's layout does: the entry is skipped, the kernel records
the first one in this group's error words (pinned host memory the kernel writes through its
unified address), and `Group.check()` raises INVALID_ARGUMENT naming the rank and the id
(asynchronously; not at the group's next collective, which would leave this rank one call behind
its peers: client/stream_calls.py). A dispatch of the same ids fails on every rank alike.

`tests/gpu/test_local_layout.py` checks it against server/reference.py on the GPU (exact over
many shapes with poisoned outputs, in a CUDA graph, a bad id); `test_stream_ordered.py` keeps
the daemon's path covered with EPD_LOCAL_LAYOUT=0.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ..proto import abi, host_order, kernel_sources
from ..proto.errors import InvalidArgument
from ..proto.v1 import epd_pb2
from . import call_outputs, cuda_ipc

if TYPE_CHECKING:
    from .group import Group
    from .tensors import Array

ENV = "EPD_LOCAL_LAYOUT"
THREADS = 256  # the kernel's __launch_bounds__
_I32, _BOOL = np.dtype(np.int32), np.dtype(np.bool_)
_ERR_WORDS = abi.CTRL_CALL_ERR_VALUE + 1  # the kernel writes words CTRL_CALL_ERR and _VALUE


def enabled() -> bool:
    """Whether layouts run here: yes unless EPD_LOCAL_LAYOUT says 0/false/off/no."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("", "1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise InvalidArgument(f"{ENV}={v!r}: 1 (the layout on the caller's stream, the default) or "
                          f"0 (through the daemon)")


_PAGE_BYTES = 4096
_pages: list[Any] = []  # pinned host pages holding every group's error words, never freed
_free: list[tuple[np.ndarray, int]] = []  # words not handed out yet
_lock = threading.Lock()


def _error_words() -> tuple[np.ndarray, int]:
    """Zeroed int64 words [_ERR_WORDS] of pinned host memory, and the address the kernel
    writes them at (the same under unified addressing). Never reused: a layout still in flight
    when its group goes may write them late (a bad id), which must not land in memory another
    use holds; 64 bytes per group for the process's life."""
    import cupy

    with _lock:
        if not _free:
            mem = cupy.cuda.alloc_pinned_memory(_PAGE_BYTES)
            _pages.append(mem)
            page = np.frombuffer(mem, np.int64, _PAGE_BYTES // 8)
            page[:] = 0
            step = 8 * _ERR_WORDS
            _free.extend((page[i // 8:i // 8 + _ERR_WORDS], mem.ptr + i)
                         for i in range(_PAGE_BYTES - step, -1, -step))
        return _free.pop()


def build(group: Group) -> LocalLayout | None:
    """The group's local layout, or None (with a warning: its layouts then go through the
    daemon, as with EPD_LOCAL_LAYOUT=0) where the kernel cannot be built in this process."""
    try:
        return LocalLayout(group)
    except Exception as e:  # (NVRTC or the driver refused it: the daemon's path still works)
        warnings.warn(f"EPD: the layout kernel could not be built in this process ({e}); "
                      f"group {group.name!r} sends its layouts through the daemon",
                      RuntimeWarning, stacklevel=3)
        return None


def source() -> str:
    """The layout kernel with its header inlined, as the engine compiles it (a file apart from
    the other kernels so that a client compiles only this)."""
    return kernel_sources.source(("epd_layout.cu",))


class LocalLayout:
    """One group's layout on its caller's stream (see the module docstring)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.device = group._session.device_ordinal
        self._fn = cuda_ipc.compiled_kernel(source(), "epd_layout", self.device)
        self.words, ptr = _error_words()
        self._err_ptr = ptr

    def check(self) -> None:
        """Raise (once) a bad expert id an earlier layout of this rank skipped."""
        code = int(self.words[abi.CTRL_CALL_ERR])
        if not code or code == abi.CALL_ERR_CLAIMED:  # (claimed: the kernel is writing it)
            return
        host_order.consume()  # (the code seen before the value is read)
        value = int(self.words[abi.CTRL_CALL_ERR_VALUE])
        self.words[abi.CTRL_CALL_ERR_VALUE] = 0
        host_order.publish()  # (cleared before the word a later report claims)
        self.words[abi.CTRL_CALL_ERR] = 0
        spec = self.group.spec
        raise InvalidArgument(
            f"group {spec.name!r}: rank {self.group.rank} passed expert id {value} in the "
            f"topk_idx of an earlier get_dispatch_layout; valid ids are -1 (none) and "
            f"[0, {spec.num_experts}); the entry was skipped")

    def drop(self) -> None:
        """Forget a bad id an earlier layout skipped (stream_calls._drop_layout_failures)."""
        if int(self.words[abi.CTRL_CALL_ERR]) not in (0, abi.CALL_ERR_CLAIMED):
            self.words[abi.CTRL_CALL_ERR_VALUE] = 0
            host_order.publish()
            self.words[abi.CTRL_CALL_ERR] = 0

    def __call__(self, topk_idx: Array, *,
                 beyond_capacity: bool = False) -> tuple[Array, Array, Array]:
        """`beyond_capacity`: more tokens than the group's max_tokens_per_rank are fine (the
        DeepEP facade's layout before the dispatch that grows the group; the kernel has no
        capacity)."""
        spec = self.group.spec
        t, k = self._check_input(topk_idx, beyond_capacity)
        r, e = spec.num_ranks, spec.num_experts
        parts = (((r,), _I32), ((e,), _I32), ((t, r), _BOOL))
        torch = call_outputs.uses_torch(topk_idx)
        outs = call_outputs.empty(parts, self.device, torch)
        stream = cuda_ipc.stream_handle(None, topk_idx, self.device)
        # The two counts are accumulated atomically: zero them (one memset over both parts,
        # which are adjacent in the call's allocation) on the stream the kernel runs on.
        counts, per_expert = cuda_ipc.data_ptr(outs[0]), cuda_ipc.data_ptr(outs[1])
        cuda_ipc.memset_async(counts, per_expert - counts + 4 * e, stream, self.device)
        if t:
            args = (cuda_ipc.data_ptr(topk_idx), t, k, e, r, counts, per_expert,
                    cuda_ipc.data_ptr(outs[2]), self._err_ptr)
            cuda_ipc.launch_packed(self._fn, ((t + THREADS - 1) // THREADS, 1), THREADS,
                                   stream, kernel_sources.LAYOUT_ARGS, args, self.device,
                                   shared=4 * e)
        return outs

    def _check_input(self, topk_idx: Any, beyond_capacity: bool) -> tuple[int, int]:
        """What the engine checks of topk_idx for a layout: a contiguous int64 [T, K] CUDA
        tensor on this session's GPU, K the group's top-k, T within its capacity."""
        spec = self.group.spec
        if not cuda_ipc.is_device_array(topk_idx):
            raise InvalidArgument(f"topk_idx: the engine runs the cuda backend and takes CUDA "
                                  f"tensors (torch on 'cuda' or CuPy); got "
                                  f"{type(topk_idx).__name__}")
        v = cuda_ipc.describe_device(topk_idx, "topk_idx")
        if v.dtype != epd_pb2.INT64:
            raise InvalidArgument("topk_idx must be int64")
        if len(v.shape) != 2:
            raise InvalidArgument(f"topk_idx has {len(v.shape)} dimensions, expected 2")
        t, k = v.shape
        if k != spec.num_topk:
            raise InvalidArgument(f"topk_idx has shape {list(v.shape)}, expected "
                                  f"[{t}, {spec.num_topk}]")
        if t > spec.max_tokens_per_rank and not beyond_capacity:
            raise InvalidArgument(f"{t} tokens exceed the group's "
                                  f"max_tokens_per_rank={spec.max_tokens_per_rank}")
        if t and (v.strides != (k, 1) if k > 1 else v.strides[0] != 1):
            raise InvalidArgument("topk_idx must be contiguous")
        if v.device != self.device:
            raise InvalidArgument(f"topk_idx is on GPU {v.device}; this session's engine "
                                  f"serves GPU {self.device}")
        return t, k

