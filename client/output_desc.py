"""Checks of what the engine answers about its outputs, before the client views them."""

from __future__ import annotations

import grpc

from ..proto import dtypes
from ..proto.errors import EpdError
from ..proto.v1 import epd_pb2


def check_output(d: epd_pb2.TensorDesc, size: int) -> None:
    """An output descriptor the engine answered names a known dtype and lies inside its
    region of `size` bytes: else INTERNAL naming it, not a NumPy or torch error (or, on the
    GPU, a view past the mapping). (An adversarial round's man in the middle.) Per output
    of every call: kept to plain loops (~1 µs)."""
    itemsize = dtypes.ITEMSIZE.get(d.dtype)
    if itemsize is None:
        raise EpdError(grpc.StatusCode.INTERNAL,
                       f"the engine answered an output of unsupported dtype enum {d.dtype}")
    shape, strides, offset = d.shape, d.strides, d.offset_bytes
    bad = ""
    if len(shape) != len(strides) or offset < 0:
        bad = "a shape and strides that do not match, or a negative offset"
    else:
        last, empty = 0, False
        for n, st in zip(shape, strides, strict=True):
            if n < 0 or st < 0:
                bad = "a negative size or stride"
                break
            empty |= n == 0
            last += (n - 1) * st
        if not bad and offset + (0 if empty else (last + 1) * itemsize) <= size:
            return
        bad = bad or f"bytes past the end of its region ({size} bytes)"
    raise EpdError(grpc.StatusCode.INTERNAL,
                   f"the engine answered a malformed output (offset {offset}, shape "
                   f"{list(shape)}, strides {list(strides)}): {bad}")
