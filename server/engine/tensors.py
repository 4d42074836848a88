"""Tensor descriptors: validated against their region before any view is made.

A descriptor names a region of the calling session, a byte offset, a shape, a dtype and strides
in elements. The check is overflow-safe by construction (Python integers) and rejects negative
strides, misaligned offsets and any element outside the region's real extent.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from google.protobuf.message import Message

from ...proto import dtypes
from ...proto.errors import InvalidArgument, NotFound
from ...proto.v1 import epd_pb2
from ..backends.base import Array, Region


def is_set(desc: epd_pb2.TensorDesc) -> bool:
    return bool(desc.region_id)


def resolve(desc: epd_pb2.TensorDesc, regions: dict[str, Region], what: str, *,
            ndim: int, dtype: int | Sequence[int] | None = None, dense: bool = False) -> Array:
    """The array a descriptor names, or InvalidArgument/NotFound saying what is wrong. Checked
    once per distinct descriptor of a region: later calls get the cached view. `dense`: it
    must be row-major without gaps or overlaps (kernels that take only its base address)."""
    region = regions.get(desc.region_id)
    if region is None:
        raise NotFound(f"{what}: region {desc.region_id!r} is not registered by this session")
    key = (desc.offset_bytes, tuple(desc.shape), tuple(desc.strides), desc.dtype, ndim,
           dtype if dtype is None or isinstance(dtype, int) else tuple(dtype), dense)
    hit = region.resolved.get(key)
    if hit is not None:
        return hit
    view = _resolve(desc, region, what, ndim, dtype)
    if dense and desc.strides and not is_dense(tuple(desc.shape), tuple(desc.strides)):
        raise InvalidArgument(f"{what}: the kernels read it as dense rows; shape "
                              f"{list(desc.shape)} with strides {list(desc.strides)} is not "
                              f"(pass a contiguous tensor)")
    if len(region.resolved) >= MAX_RESOLVED or (  # (the sum only on a miss: rare once warm)
            sum(len(r.resolved) for r in regions.values()) >= SESSION_RESOLVED):
        region.resolved.clear()
    region.resolved[key] = view
    return view


def region_ids(msg: Message) -> frozenset[str]:
    """The regions the tensor descriptors of a request name (those an armed op reads or
    writes on every trigger)."""
    return frozenset(v.region_id for _, v in msg.ListFields()
                     if isinstance(v, epd_pb2.TensorDesc) and v.region_id)


def is_dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Row-major without gaps or overlaps (element strides; a dimension of one element, or an
    empty tensor, may carry any stride)."""
    if not all(shape):
        return True
    want = 1
    for d, s in zip(reversed(shape), reversed(strides), strict=True):
        if d > 1 and s != want:
            return False
        want *= d
    return True


def _resolve(desc: epd_pb2.TensorDesc, region: Region, what: str, ndim: int,
             dtype: int | Sequence[int] | None) -> Array:
    shape = tuple(int(s) for s in desc.shape)
    if len(shape) != ndim:
        raise InvalidArgument(f"{what}: expected {ndim} dimensions, got shape {list(shape)}")
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{what}: negative dimension in shape {list(shape)}")
    try:
        np_dtype = dtypes.to_numpy(desc.dtype)
    except ValueError:
        raise InvalidArgument(f"{what}: unknown dtype enum {desc.dtype}") from None
    allowed = (dtype,) if isinstance(dtype, int) else dtype
    if allowed is not None and desc.dtype not in allowed:
        names = [dtypes.name(d) for d in allowed]
        raise InvalidArgument(f"{what}: dtype {dtypes.name(desc.dtype)} is not one of {names}")
    if desc.strides and all(shape):  # an empty tensor's strides carry no meaning
        strides = tuple(int(s) for s in desc.strides)
        if len(strides) != ndim:
            raise InvalidArgument(f"{what}: {len(strides)} strides for {ndim} dimensions")
        if any(s < 0 for s in strides):
            raise InvalidArgument(f"{what}: negative strides {list(strides)} are not supported")
        if any(s == 0 and d > 1 for s, d in zip(strides, shape, strict=True)):
            # (a broadcast view: a few bytes of a region standing for any number of rows,
            # which the checks that read values would then walk)
            raise InvalidArgument(f"{what}: zero strides {list(strides)} (a broadcast view) "
                                  f"are not supported; pass a dense tensor")
    else:
        strides = dtypes.contiguous_strides(shape)
    # The innermost dimension must be dense: kernels copy whole rows.
    if ndim and shape[-1] > 1 and strides[-1] != 1:
        raise InvalidArgument(f"{what}: the last dimension must be contiguous "
                              f"(stride 1), got strides {list(strides)}")
    item = np_dtype.itemsize
    offset = int(desc.offset_bytes)
    if offset % item:
        raise InvalidArgument(f"{what}: offset {offset} is not a multiple of the element size "
                              f"{item}")
    if all(s > 0 for s in shape):
        last = sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
        end = offset + (last + 1) * item
        if _overlaps(shape, strides):
            # Elements that may share a position. Never a real tensor (a permuted, sliced or
            # strided view of dense memory never does), and a copy of it (the host checks read
            # topk_idx) would be larger than its region; an output so would be written twice.
            raise InvalidArgument(f"{what}: shape {list(shape)} with strides {list(strides)} "
                                  f"is not a layout of dense memory (its elements may "
                                  f"overlap); pass a dense tensor or a view of one")
    else:
        end = offset
    if end > region.size:
        raise InvalidArgument(f"{what}: bytes [{offset}, {end}) fall outside region "
                              f"{desc.region_id!r} of {region.size} bytes")
    try:
        return region.view(offset, shape, np_dtype, strides)
    except (ValueError, OverflowError) as e:  # (sizes NumPy cannot index, though in bounds:
        # an empty tensor of 2**63 rows, a stride past the dimension limit)
        raise InvalidArgument(f"{what}: shape {list(shape)} with strides {list(strides)} "
                              f"cannot be viewed ({e})") from None


def _overlaps(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether the layout is not one of dense memory's views, which covers every layout whose
    elements share a position: taken by increasing stride, each dimension's stride must step
    past every position the smaller ones reach (true of any permuted, sliced or strided view
    of dense memory). Conservative: a few layouts only `as_strided` makes, whose elements do
    not meet, are refused too (shape [2, 3, 2], strides [6, 4, 1]); exact overlap is a
    costlier question. Counting elements against the span missed interleaved aliasing (a
    review: shape [2, 2, 2], strides [3, 4, 1])."""
    reach = 1  # positions the dimensions taken so far cover, from the first
    for s, d in sorted((s, d) for s, d in zip(strides, shape, strict=True) if d > 1):
        if s < reach:
            return True
        reach += (d - 1) * s
    return False


# Cached views of descriptors (a region's cache is cleared when full): at most MAX_RESOLVED a
# region and SESSION_RESOLVED over a session's regions (~350 bytes each). Before, 512 a region
# for any number of regions let a session's refused calls (a descriptor is cached before the
# request's later checks) hold ~45 MB of views at the region budget (a fuzzer: 131k refused
# calls, 43 MiB), while a model of many layers in one allocation outgrew 512 a forward pass.
MAX_RESOLVED = 4096
SESSION_RESOLVED = 16384


def describe(array: Array, region: Region, dtype: int | None = None) -> epd_pb2.TensorDesc:
    """Descriptor of an engine-owned output array that lives in `region`. `dtype` overrides the
    array's own when it only holds the bits (bf16 / fp8 as uint16 / uint8 on the GPU)."""
    dt = np.dtype(array.dtype)
    return epd_pb2.TensorDesc(
        region_id=region.region_id, offset_bytes=region.offset_of(array),
        shape=list(array.shape), dtype=dtype if dtype is not None else dtypes.from_numpy(dt),
        strides=[s // dt.itemsize for s in array.strides])
