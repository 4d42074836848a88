"""The element types EPD carries, mapped between the wire enum, NumPy and torch names.

bfloat16 and float8_e4m3 have no NumPy builtin; ml_dtypes provides them as real NumPy dtypes, so
the CPU backend and the reference compute on them exactly as the GPU does (fp32 accumulation,
round-to-nearest-even on the cast back).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .abi import FP8_BLOCK  # noqa: F401  (channels per FP8 scale, as DeepEP)
from .v1 import epd_pb2

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

_TO_NUMPY: dict[int, np.dtype] = {
    epd_pb2.BFLOAT16: BFLOAT16,
    epd_pb2.FLOAT16: np.dtype(np.float16),
    epd_pb2.FLOAT32: np.dtype(np.float32),
    epd_pb2.FLOAT8_E4M3: FLOAT8_E4M3,
    epd_pb2.INT64: np.dtype(np.int64),
    epd_pb2.INT32: np.dtype(np.int32),
    epd_pb2.BOOL: np.dtype(np.bool_),
    epd_pb2.UINT8: np.dtype(np.uint8),
}
_FROM_NUMPY: dict[np.dtype, int] = {v: k for k, v in _TO_NUMPY.items()}
ITEMSIZE: dict[int, int] = {k: v.itemsize for k, v in _TO_NUMPY.items()}  # bytes, by enum

# dtypes a dispatched payload (x) may have: DeepEP carries bf16, or fp8 with float32 scales.
PAYLOAD_DTYPES = frozenset({epd_pb2.BFLOAT16, epd_pb2.FLOAT16, epd_pb2.FLOAT32,
                            epd_pb2.FLOAT8_E4M3})


def to_numpy(dtype: int) -> np.dtype:
    try:
        return _TO_NUMPY[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype enum {dtype}") from None


def from_numpy(dtype: np.dtype | type) -> int:
    dt = np.dtype(dtype)
    try:
        return _FROM_NUMPY[dt]
    except KeyError:
        raise ValueError(f"unsupported element type {dt}") from None


def name(dtype: int) -> str:
    return epd_pb2.DType.Name(dtype).lower()


def from_name(text: str) -> int:
    try:
        return epd_pb2.DType.Value(text.upper())
    except ValueError:
        raise ValueError(f"unknown dtype {text!r}; one of "
                         f"{[n.lower() for n in epd_pb2.DType.keys()[1:]]}") from None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a dense row-major array of `shape` (a TensorDesc's strides when
    it has none; a zero-size dimension counts as one, as NumPy's and torch's do)."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))
