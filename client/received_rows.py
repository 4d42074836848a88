"""Copy-out of a low-latency dispatch's received rows, for plain calls on the cuda backend.

A plain `low_latency_dispatch` hands the caller its own copy of the engine's receive buffer
(DeepEP's lifetime: the outputs live as long as the caller holds them). The buffer is
`[L, R*m, H]`, but only rows `[0, recv_count[e])` of each expert hold data: at D (128 local
experts, 2 ranks, m = 128, H = 7168 FP8) the whole buffer is 235 MB and the received rows about
7 MB. DeepEP's receive kernel writes only the received rows, so the rest of its output is
whatever the allocator returned; this kernel copies the same rows, reading the counts on the
GPU (the host learns nothing and waits for nothing). FP8 scales are written straight into
DeepEP's layout (column-major, optionally UE8M0 exponents packed four to an int32), which
replaces the strided whole-tensor copy (and the four element-wise kernels of the packing).

Only the client's own stream is involved: the kernels run after the op's GPU-side wait, on the
stream the call runs on, into tensors allocated on that stream.
"""

from __future__ import annotations

import functools
from typing import Any

from . import tensors as T

_SOURCE = r"""
typedef long long i64;

// Rows [0, counts[e]) of expert e: a contiguous prefix of its [rows, row_vecs] block.
extern "C" __global__ void epd_copy_received_rows(const int4* __restrict__ src,
                                                   int4* __restrict__ dst,
                                                   const int* __restrict__ counts,
                                                   i64 rows, i64 row_vecs) {
    const int e = blockIdx.y;
    const i64 n = (i64)min(max(counts[e], 0), (int)rows) * row_vecs;
    const int4* s = src + (i64)e * rows * row_vecs;
    int4* d = dst + (i64)e * rows * row_vecs;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x)
        d[i] = s[i];
}

// FP8 scales of the received rows, from row-major float32 [L, rows, S] into DeepEP's
// column-major storage [L, C, rows]: C = S floats, or with ue8m0 C = S / 4 int32 words whose
// byte k is the exponent of scale 4j + k.
extern "C" __global__ void epd_copy_received_scales(const unsigned* __restrict__ src,
                                                     unsigned* __restrict__ dst,
                                                     const int* __restrict__ counts,
                                                     int rows, int S, int ue8m0) {
    const int e = blockIdx.y;
    const int n = min(max(counts[e], 0), rows);
    const int C = ue8m0 ? S / 4 : S;
    const unsigned* s = src + (i64)e * rows * S;
    unsigned* d = dst + (i64)e * C * rows;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)n * C;
         i += (i64)gridDim.x * blockDim.x) {
        const int c = (int)(i / n), r = (int)(i % n);  // consecutive threads: consecutive rows
        unsigned v;
        if (ue8m0) {
            const unsigned* q = s + (i64)r * S + 4 * c;
            v = ((q[0] >> 23) & 0xffu) | (((q[1] >> 23) & 0xffu) << 8) |
                (((q[2] >> 23) & 0xffu) << 16) | (((q[3] >> 23) & 0xffu) << 24);
        } else {
            v = s[(i64)r * S + c];
        }
        d[(i64)c * rows + r] = v;
    }
}
"""

_THREADS = 256
_TARGET_BLOCKS = 264  # two waves on an H100/H200 (132 SMs); the grid is (per expert, experts)


@functools.cache
def _module(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        mod = cupy.RawModule(code=_SOURCE)
        return (mod.get_function("epd_copy_received_rows"),
                mod.get_function("epd_copy_received_scales"))


def load(device: int) -> None:
    """Compile and load the kernels now (not inside a CUDA graph capture or on the hot path)."""
    _module(device)


def _ptr(x: Any) -> int:
    return int(x.data_ptr()) if T.is_torch(x) else int(x.data.ptr)


def contiguous(x: Any) -> bool:
    return bool(x.is_contiguous()) if T.is_torch(x) else bool(x.flags.c_contiguous)


def _grid(num_experts: int) -> tuple[int, int]:
    return (max(1, _TARGET_BLOCKS // max(num_experts, 1)), num_experts)


def copy_rows(src: Any, counts: Any, stream: int, device: int) -> Any:
    """A new array like `src` (`[L, N, ...]`, contiguous) holding rows [0, counts[e]) of each
    expert e; the other rows are left as allocated, as DeepEP leaves them. Enqueued on
    `stream` (the caller's current stream: the new array is allocated there too)."""
    import cupy

    L, rows = int(src.shape[0]), int(src.shape[1])
    row_bytes = (src.numel() * src.element_size() if T.is_torch(src) else src.nbytes) \
        // max(L * rows, 1)
    if not contiguous(src) or row_bytes % 16 or L == 0 or rows == 0:
        return T.clone(src)
    dst = src.new_empty(src.shape) if T.is_torch(src) else cupy.empty_like(src)
    rows_kernel, _ = _module(device)
    with cupy.cuda.Device(device):
        rows_kernel(_grid(L), (_THREADS,),
                    (cupy.uint64(_ptr(src)), cupy.uint64(_ptr(dst)), cupy.uint64(_ptr(counts)),
                     cupy.int64(rows), cupy.int64(row_bytes // 16)),
                    stream=cupy.cuda.ExternalStream(stream, device))
    return dst


def copy_scales(src: Any, out: Any, counts: Any, use_ue8m0: bool, stream: int,
                device: int) -> Any:
    """Write the received rows' scales from the engine's row-major float32 `[L, N, S]` into
    `out`, DeepEP's column-major `[L, N, C]` (storage `[L, C, N]`); returns `out`."""
    import cupy

    L, rows, S = (int(d) for d in src.shape)
    _, scales_kernel = _module(device)
    with cupy.cuda.Device(device):
        scales_kernel(_grid(L), (_THREADS,),
                      (cupy.uint64(_ptr(src)), cupy.uint64(_ptr(out)), cupy.uint64(_ptr(counts)),
                       cupy.int32(rows), cupy.int32(S), cupy.int32(1 if use_ue8m0 else 0)),
                      stream=cupy.cuda.ExternalStream(stream, device))
    return out
