"""Copy-out of a low-latency dispatch's received rows, for plain calls on the cuda backend.

A plain `low_latency_dispatch` hands the caller its own copy of the engine's receive buffer
(DeepEP's lifetime: the outputs live as long as the caller holds them). The buffer is
`[L, R*m, H]`, but only rows `[0, recv_count[e])` of each expert hold data: at D (128 local
experts, 2 ranks, m = 128, H = 7168 FP8) the whole buffer is 235 MB and the received rows about
7 MB. DeepEP's receive kernel writes only the received rows, so the rest of its output is
whatever the allocator returned; one kernel here copies the same rows, reading the counts on the
GPU (the host learns nothing and waits for nothing), writes their FP8 scales straight into
DeepEP's layout (column-major, optionally UE8M0 exponents packed four to an int32), and copies
the small arrays (counts, source rank and token of every row) whole.

One launch per call, its arguments packed into one buffer (cuda_ipc.launch_packed) and handed
to the driver with the caller's raw stream handle: a CuPy kernel call per array, plus a clone
per small array, cost the host more than the copy costs the GPU. The kernel runs after the
op's GPU-side wait, on the stream the call runs on, into tensors allocated on that stream.
"""

from __future__ import annotations

from typing import Any

from . import tensors as T
from .cuda_ipc import compiled_kernel, data_ptr, launch_packed

_SOURCE = r"""
typedef long long i64;

// Block (x, e) works on expert e. Rows [0, counts[e]) of x (a contiguous prefix of the expert's
// [rows, row_vecs] block); with scales, those rows' float32 scales from row-major [L, rows, S]
// into DeepEP's column-major storage [L, C, rows] (C = S floats, or with ue8m0 S / 4 int32
// words whose byte k is the exponent of scale 4j + k); the expert's count and its whole source
// rank / token rows.
extern "C" __global__ void epd_copy_received(const int4* __restrict__ src_x,
                                             int4* __restrict__ dst_x, i64 rows, i64 row_vecs,
                                             const unsigned* __restrict__ src_sc,
                                             unsigned* __restrict__ dst_sc, int S, int ue8m0,
                                             const int* __restrict__ counts,
                                             const int* __restrict__ src_rank,
                                             const int* __restrict__ src_idx,
                                             int* __restrict__ out_counts,
                                             int* __restrict__ out_rank,
                                             int* __restrict__ out_idx) {
    const int e = blockIdx.y;
    const int n = min(max(counts[e], 0), (int)rows);
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 step = (i64)gridDim.x * blockDim.x;
    const int4* sx = src_x + (i64)e * rows * row_vecs;
    int4* dx = dst_x + (i64)e * rows * row_vecs;
    for (i64 i = tid; i < (i64)n * row_vecs; i += step) dx[i] = sx[i];
    if (src_sc != nullptr && n > 0) {
        const int C = ue8m0 ? S / 4 : S;
        const unsigned* s = src_sc + (i64)e * rows * S;
        unsigned* d = dst_sc + (i64)e * C * rows;
        for (i64 i = tid; i < (i64)n * C; i += step) {
            const int c = (int)(i / n), r = (int)(i % n);  // consecutive threads: rows
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
    for (i64 i = tid; i < rows; i += step) {
        out_rank[(i64)e * rows + i] = src_rank[(i64)e * rows + i];
        out_idx[(i64)e * rows + i] = src_idx[(i64)e * rows + i];
    }
    if (tid == 0) out_counts[e] = counts[e];
}
"""

_THREADS = 256
_TARGET_BLOCKS = 264  # two waves on an H100/H200 (132 SMs); the grid is (per expert, experts)
# The kernel's parameters (struct codes): src_x, dst_x, rows, row_vecs, src_sc, dst_sc, S,
# ue8m0, counts, src_rank, src_idx, out_counts, out_rank, out_idx.
COPY_ARGS = "QQqqQQiiQQQQQQ"


def load(device: int) -> None:
    """Compile and load the kernel now (not inside a CUDA graph capture or on the hot path)."""
    compiled_kernel(_SOURCE, "epd_copy_received", device)


def contiguous(x: Any) -> bool:
    return bool(x.is_contiguous()) if T.is_torch(x) else bool(x.flags.c_contiguous)


def _empty(like: Any, shape: tuple[int, ...], dtype: Any = None) -> Any:
    if T.is_torch(like):
        return like.new_empty(shape, dtype=dtype if dtype is not None else like.dtype)
    import cupy
    return cupy.empty(shape, dtype if dtype is not None else like.dtype)


class CopyPlan:
    """`copy_out` for one set of source arrays (an armed op's receive buffer: the same views
    for every call), with what repeats done once: the checks, the source addresses, the grid,
    the kernel and the layout of the scales' output. A call allocates the outputs on the
    stream and launches (a plain dispatch's client work, docs/BENCHMARKS.md thirty-third
    session). The plan holds the sources: their addresses are in it."""

    def __init__(self, recv_x: Any, scales: Any, counts: Any, src_rank: Any, src_idx: Any,
                 use_ue8m0: bool, device: int) -> None:
        L, rows = int(recv_x.shape[0]), int(recv_x.shape[1])
        nbytes = recv_x.numel() * recv_x.element_size() if T.is_torch(recv_x) else recv_x.nbytes
        row_bytes = nbytes // max(L * rows, 1)
        if row_bytes % 16 or not all(contiguous(a) for a in (recv_x, counts, src_rank, src_idx)) \
                or (scales is not None and not contiguous(scales)):
            raise ValueError("copy_out needs contiguous arrays and rows of 16-byte multiples")
        self.sources = (recv_x, scales, counts, src_rank, src_idx)
        self.L, self.rows, self.device = L, rows, device
        self.x_shape = tuple(recv_x.shape)
        self.small = L + 2 * L * rows  # one allocation for the three int32 arrays
        self.fn = compiled_kernel(_SOURCE, "epd_copy_received", device) if L and rows else 0
        self.grid = (max(1, _TARGET_BLOCKS // max(L, 1)), L)
        S = int(scales.shape[2]) if scales is not None else 0
        self.head = (data_ptr(recv_x), rows, row_bytes // 16,
                     data_ptr(scales) if scales is not None else 0)
        self.tail = (S, 1 if use_ue8m0 else 0, data_ptr(counts), data_ptr(src_rank),
                     data_ptr(src_idx))
        self.has_scales = scales is not None

    def __call__(self, scales_out: Any, stream: int) -> tuple:
        """(recv_x, scales_out, counts, source rank, source token), as `copy_out`."""
        recv_x, _, counts, _, _ = self.sources
        L, rows = self.L, self.rows
        x = _empty(recv_x, self.x_shape)
        small = _empty(counts, (self.small,))
        out_counts, out_rank, out_idx = (small[:L], small[L:L + L * rows].reshape(L, rows),
                                         small[L + L * rows:].reshape(L, rows))
        if self.fn:
            sc = data_ptr(scales_out) if self.has_scales else 0
            launch_packed(self.fn, self.grid, _THREADS, stream, COPY_ARGS,
                          (self.head[0], data_ptr(x), *self.head[1:], sc, *self.tail,
                           data_ptr(out_counts), data_ptr(out_rank), data_ptr(out_idx)),
                          self.device)
        return x, scales_out, out_counts, out_rank, out_idx


def copy_out(recv_x: Any, scales: Any, scales_out: Any, counts: Any, src_rank: Any,
             src_idx: Any, use_ue8m0: bool, stream: int, device: int) -> tuple:
    """The caller's own copies of a plain low-latency dispatch's outputs, enqueued on `stream`
    (the call's raw stream handle; the new arrays are allocated there too):
    (recv_x `[L, N, H]` with rows [0, counts[e]) of each expert, the rest as allocated;
    `scales_out` (DeepEP's layout, see deep_ep_compat.LowLatencyScales) filled for those rows,
    or None when `scales` is None; counts `[L]`; source rank and token `[L, N]`, whole).
    Every source array must be contiguous (the engine's views are). A caller that copies out
    of the same arrays again keeps the `CopyPlan`."""
    return CopyPlan(recv_x, scales, counts, src_rank, src_idx, use_ue8m0, device)(
        scales_out if scales is not None else None, stream)
