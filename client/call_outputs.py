"""A stream-ordered normal-mode call's new output tensors: one allocation per call, filled by
one copy launch (cuda backend).

Layout returns three tensors, combine one or two, and a dispatch copies up to six out of the
engine's receive buffers. One `torch.empty` / `cupy.empty` and one `cudaMemcpyAsync` per tensor
cost the caller's host about 10 µs each on the H200 under MPS, which was a fifth of a call's
client time; here the parts of a call are views of one byte allocation (each part 256-byte
aligned), and a dispatch's copies are one launch of a kernel that copies every part. The
caller's tensors share that allocation's lifetime: it is freed (by the caller's allocator, in
its stream order) when the last of them goes, as DeepEP's separately allocated outputs are one
by one. The sizes are small next to recv_x, which dominates.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..proto import dtypes
from ..proto.v1 import epd_pb2
from . import cuda_ipc
from .frameworks import torch_if_loaded as _torch
from .tensors import Array

if TYPE_CHECKING:
    from .group import Group, Handle

ALIGN = 256  # bytes between parts (and the allocation's own alignment): a kernel's vectors
MAX_PARTS = 8  # a dispatch copies at most six: recv_x, scales, topk idx / weights, src, prefix

_SOURCE = r"""
typedef unsigned long long u64;
struct Parts { u64 src[8]; u64 dst[8]; u64 nbytes[8]; };

// Block (b, p) copies part p: 16-byte vectors where both ends are 16-byte aligned, then the
// tail (or everything, where they are not) byte by byte.
extern "C" __global__ void epd_copy_parts(Parts parts) {
    const int p = blockIdx.y;
    const unsigned char* src = (const unsigned char*)parts.src[p];
    unsigned char* dst = (unsigned char*)parts.dst[p];
    const u64 n = parts.nbytes[p];
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 step = (u64)gridDim.x * blockDim.x;
    const bool aligned = (((u64)src | (u64)dst) & 15) == 0;
    const u64 vecs = aligned ? n / 16 : 0;
    const int4* s4 = (const int4*)src;
    int4* d4 = (int4*)dst;
    for (u64 i = tid; i < vecs; i += step) d4[i] = s4[i];
    for (u64 i = vecs * 16 + tid; i < n; i += step) dst[i] = src[i];
}
"""

_THREADS = 512
_BLOCKS = 132  # one wave on an H100/H200 per part; the copies are a few MB at most


class _Parts(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint64 * MAX_PARTS), ("dst", ctypes.c_uint64 * MAX_PARTS),
                ("nbytes", ctypes.c_uint64 * MAX_PARTS)]


def load(device: int) -> None:
    """Compile and load the copy kernel now (at set-up, not on a call's hot path)."""
    cuda_ipc.compiled_kernel(_SOURCE, "epd_copy_parts", device)


def nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return math.prod(shape) * cuda_ipc.storage_dtype(dtype).itemsize


def placement(sizes: Sequence[int]) -> tuple[list[int], int]:
    """(offset of each part, total bytes): parts in order, each starting ALIGN-aligned."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


@dataclass(frozen=True)
class Plan:
    """Where a call signature's parts lie in their one allocation (computed once per
    signature: a serving loop repeats a handful of them)."""
    total: int
    parts: tuple[tuple[tuple[int, ...], tuple[int, ...], int, np.dtype, int], ...]
    # (shape, contiguous strides in elements, offset in elements, logical dtype, bytes)

    @property
    def sizes(self) -> list[int]:
        """Each part's bytes."""
        return [p[4] for p in self.parts]


_PLANS: dict[tuple, Plan] = {}
MAX_PLANS = 256  # distinct signatures remembered (cleared when full)


def plan(parts: Sequence[tuple[tuple[int, ...], np.dtype]]) -> Plan:
    """The placement of parts (shape, logical dtype), cached per signature."""
    key = tuple(parts)
    found = _PLANS.get(key)
    if found is None:
        sizes = [nbytes(shape, dt) for shape, dt in parts]
        offsets, total = placement(sizes)
        found = Plan(total, tuple(
            (tuple(shape), dtypes.contiguous_strides(tuple(shape)),
             off // cuda_ipc.storage_dtype(dt).itemsize, dt, n)
            for (shape, dt), off, n in zip(parts, offsets, sizes, strict=True)))
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = found
    return found


def empty(parts: Sequence[tuple[tuple[int, ...], np.dtype]], device: int,
          torch: bool) -> list[Any]:
    """Uninitialised arrays of the given (shape, logical dtype), views of one allocation on
    `device` (torch tensors when `torch`, else CuPy arrays holding bfloat16 / float8 as their
    bits, as cuda_ipc.device_empty)."""
    return allocate(plan(parts), device, torch)


def allocate(p: Plan, device: int, torch: bool) -> list[Any]:
    """`empty` of a plan already looked up. Each part starts ALIGN-aligned, so the whole
    allocation viewed as any part's dtype holds it at a whole element: one strided view per
    part."""
    buf = cuda_ipc.device_empty((max(p.total, 1),), np.dtype(np.uint8), device, torch)
    out = []
    typed: dict[np.dtype, Any] = {}  # the allocation as each dtype that has a part
    for shape, strides, offset, dt, n in p.parts:
        if not n:  # an empty part needs no storage (and a zero-byte dtype view may not exist)
            out.append(cuda_ipc.device_empty(shape, dt, device, torch))
            continue
        whole = typed.get(dt)
        if whole is None:
            whole = typed[dt] = buf.view(cuda_ipc.torch_dtype(dt) if torch
                                         else cuda_ipc.storage_dtype(dt))
        if torch:
            out.append(whole.as_strided(shape, strides, offset))
        else:
            out.append(whole[offset:offset + n // whole.itemsize].reshape(shape))
    return out


def copy(pairs: Sequence[tuple[int, Any, int]], stream: int, device: int) -> None:
    """Enqueue on `stream` the copies (source address, destination array, bytes): one launch
    for up to MAX_PARTS of them."""
    pairs = [p for p in pairs if p[2]]
    if not pairs:
        return
    if len(pairs) > MAX_PARTS:
        raise ValueError(f"at most {MAX_PARTS} parts per copy launch, got {len(pairs)}")
    arg = _Parts()
    for i, (src, dst, n) in enumerate(pairs):
        arg.src[i], arg.dst[i], arg.nbytes[i] = src, cuda_ipc.data_ptr(dst), n
    cuda_ipc.launch_kernel(cuda_ipc.compiled_kernel(_SOURCE, "epd_copy_parts", device),
                           (_BLOCKS, len(pairs)), _THREADS, stream, (arg,), device)


def uses_torch(template: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(template, t.Tensor)


def combine_request(group: Group, x: Array, handle: Handle, topk_weights: Array,
                    bias_0: Array, bias_1: Array, timeout: float,
                    num_sms: int) -> tuple[epd_pb2.CombineRequest, Array, Array | None]:
    """A stream-ordered combine's request, naming its new outputs (out, out_topk_weights)."""
    s, spec = group._session, group.spec
    t = handle.num_tokens
    parts = [((t, spec.hidden), dtypes.to_numpy(spec.x_dtype))]
    if topk_weights is not None:
        parts.append(((t, spec.num_topk), np.dtype(np.float32)))
    out, *rest = empty(parts, s.device_ordinal, uses_torch(x))
    out_w = rest[0] if rest else None
    d = s._descs({"x": x, "topk_weights": topk_weights, "bias_0": bias_0, "bias_1": bias_1,
                  "out": out, "out_topk_weights": out_w}, event=False)
    req = epd_pb2.CombineRequest(
        session_id=s.session_id, group_id=group.group_id, handle=handle.handle_id,
        timeout_seconds=timeout, stream_ordered=True, num_sms=num_sms, **d)
    return req, out, out_w
