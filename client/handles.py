"""The handles the DeepEP facade returns (client/buffer.py), indexable as DeepEP V1's tuples.

`dispatch` returns a `BufferHandle`, `low_latency_dispatch` a `LowLatencyBufferHandle`; each
wraps EPD's own handle (what `combine` needs) plus what DeepEP's tuple positions expose, and
raises `Unsupported` naming a position EPD does not produce.

DeepEP's handle is plain tensors, usable with any Buffer of the group: Megatron-LM's fused_a2a
replaces its global Buffer when the hidden size grows, and backward combines a handle of the
old Buffer on the new one. EPD's handle names a daemon group of the Buffer that made it, so it
holds that Buffer (`owner`): a Buffer that is dropped is not collected, and does not leave its
groups and close its session, while one of its handles lives; the calls of another Buffer of
the same group run a handle on its own group (client/buffer.py). `owner.destroy()` still ends
them: a handle used after it fails with FAILED_PRECONDITION.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from . import deep_ep_compat as C
from .group import Handle, LowLatencyHandle
from .stream_ops import StreamOp
from .tensors import Array

_NORMAL_HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix",
                         "recv_channel_prefix_matrix", "recv_src_idx", "is_token_in_rank",
                         "send_head")
_LOW_LATENCY_HANDLE_FIELDS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank",
                              "hidden", "num_experts")


class _TupleLike:
    """Indexable like the tuple DeepEP returns as a handle: `handle[i]`, slices, `len()`,
    iteration. A position EPD does not produce raises `Unsupported` naming it when indexed;
    unpacked (`tuple(handle)`, `*handle`) it is None, so that a caller can keep the parts and
    pass them back as the handle, as DeepEP's tuple allows: xtuner's autograd functions
    `ctx.save_for_backward(*handle)` and give `ctx.saved_tensors` to combine and cached
    dispatch. Unpacking marks the first part (a tensor) with the handle it came from
    (`_epd_handle`), which `repacked` finds again; the mark keeps the handle, and so its
    daemon state, alive as long as that tensor lives."""

    _FIELDS: tuple[str, ...] = ()
    _UNPRODUCED: frozenset[str] = frozenset()
    _KEPT: tuple[int, ...] = (0,)  # positions whose objects the handle keeps (not computed)

    def _field(self, name: str) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._FIELDS)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self._FIELDS)
        if not -n <= i < n:
            raise IndexError(f"handle index {i} out of range ({n} positions)")
        return self._field(self._FIELDS[i % n])

    def __iter__(self):
        parts = tuple(None if name in self._UNPRODUCED else self._field(name)
                      for name in self._FIELDS)
        # (only here, not at creation: the mark is a reference cycle, which only the cyclic
        # collector frees, and a handle's daemon state is released when it is freed)
        with contextlib.suppress(AttributeError, TypeError):  # (a NumPy array takes no mark)
            parts[0]._epd_handle = self
        return iter(parts)


def repacked(handle: Any, cls: type) -> Any:
    """The `cls` handle whose unpacked parts `handle` is (a tuple or list, as
    `ctx.saved_tensors` gives them back), else `handle` itself."""
    if isinstance(handle, (tuple, list)) and len(handle) == len(cls._FIELDS):
        h = getattr(handle[0], "_epd_handle", None)
        if isinstance(h, cls) and all(h._field(cls._FIELDS[i]) is handle[i] for i in cls._KEPT):
            return h
    return handle


@dataclass(eq=False)
class BufferHandle(_TupleLike):
    """The handle `dispatch` returns; pass it to `combine` or to a cached `dispatch`. Indexable
    as DeepEP's intranode tuple `(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`: positions 0
    (`[R, R]` int32, rows from sources <= s received by this rank... DeepEP's), 3 (`[N]` int32
    source token of each received row) and 4 (`[T, R]` bool, the call's routing) are exact;
    1, 2 and 5 are DeepEP kernel-channel bookkeeping EPD does not have (Unsupported)."""

    _FIELDS = _NORMAL_HANDLE_FIELDS
    _UNPRODUCED = frozenset(("channel_prefix_matrix", "recv_channel_prefix_matrix", "send_head"))
    _KEPT = (0, 3)
    handle: Handle
    num_experts: int
    rank_prefix_matrix: Array = None
    recv_src_idx: Array = None
    is_token_in_rank: Array = None
    topk_idx: Array = None  # to derive is_token_in_rank when the caller did not pass it
    owner: Any = field(default=None, repr=False)  # the Buffer that made it, kept alive

    def _field(self, name: str) -> Any:
        if name == "is_token_in_rank" and self.is_token_in_rank is None:
            self.is_token_in_rank = C.is_token_in_rank_of(
                self.topk_idx, self.num_experts, self.handle.group.spec.num_ranks)
        if name in ("rank_prefix_matrix", "recv_src_idx", "is_token_in_rank"):
            return getattr(self, name)
        raise C.Unsupported(f"handle position {name}: DeepEP's per-channel kernel bookkeeping; "
                            "EPD's daemon keeps the routing itself and produces only "
                            "rank_prefix_matrix [0], recv_src_idx [3] and is_token_in_rank [4]")


@dataclass(eq=False)
class LowLatencyBufferHandle(_TupleLike):
    """The handle `low_latency_dispatch` returns; pass it to `low_latency_combine`. Indexable as
    DeepEP's `(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)`:
    `handle[0][i]` is the source token of each row of local expert i (int32, -1 beyond the
    count), `handle[1][i]` the `(begin << 32) | count` int64 row range of each source rank
    (computed on access from the rows' source ranks: each source's rows are contiguous)."""

    _FIELDS = _LOW_LATENCY_HANDLE_FIELDS
    handle: LowLatencyHandle | StreamOp
    template: Array = None  # the dispatch's x: combine buffers come back as its array type
    src_rank: Array = None  # [L, R*num_max] int32 source rank of each row (-1 beyond count)
    src_idx: Array = None   # [L, R*num_max] int32 source token of each row (-1 beyond count)
    num_max_dispatch_tokens_per_rank: int = 0
    hidden: int = 0
    num_experts: int = 0
    buffer: int = 0  # the receive buffer the dispatch filled (its combine brings it back)
    owner: Any = field(default=None, repr=False)  # the Buffer that made it, kept alive

    def _field(self, name: str) -> Any:
        if name == "src_info":
            return self.src_idx
        if name == "layout_range":
            return C.layout_range_of(self.src_rank, self.handle.group.spec.num_ranks)
        return getattr(self, name)
