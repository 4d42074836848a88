"""DeepEP V2's expanded layout (client/elastic_buffer.py, `do_expand=True`): the received rows
spread to one row per (token, local expert) slot, and an expanded combine's rows folded back
to one row per received token.

`spread` writes each received row at its slots' expanded rows (zero rows elsewhere: padding,
which DeepEP leaves unset unless do_zero_padding, and zero is one of the values it may leave)
with the weights `[rows, K]` becoming `[expanded]`; `fold` sums a token's slot rows in top-k
order in float32 and rounds once (DeepEP's local reduction), its weights back to `[rows, K]`
(0 where the slot is not local). On CUDA tensors each is one kernel launch after the zeroed
outputs (`epd_v2_spread`, `epd_v2_fold`: a warp per received row, 16-byte vectors where the
rows allow); elsewhere, and for dtypes the kernels do not take, torch index copies (K of them
per tensor: no boolean indexing, which would ask the host for a count). `local_weights` masks
a non-expanded combine's weights the same way (one launch: torch's compare and masked_fill took
~280 µs of host time per combine on one H100, profiled in the thirty-sixth session).
"""

from __future__ import annotations

from typing import Any

from ..proto.errors import InvalidArgument
from .cuda_ipc import compiled_kernel, launch_on_current_stream

Array = Any
THREADS = 256  # 8 warps a block, a warp per received row

_SOURCE = r"""
// bf16 by its bits (no toolkit headers under NVRTC), rounded to nearest even as torch does
// (cuda/epd_common.cuh has the same two for the engine's kernels)
__device__ __forceinline__ float bf16_f32(unsigned short h) {
    return __uint_as_float(((unsigned)h) << 16);
}
__device__ __forceinline__ unsigned short f32_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// A row's bytes to another row (16-byte vectors when both rows and the length allow).
__device__ __forceinline__ void copy_row(char* __restrict__ dst, const char* __restrict__ src,
                                         long long nbytes, int lane) {
    if ((nbytes & 15) == 0 && ((reinterpret_cast<unsigned long long>(dst) |
                                reinterpret_cast<unsigned long long>(src)) & 15) == 0) {
        const int4* s = reinterpret_cast<const int4*>(src);
        int4* d = reinterpret_cast<int4*>(dst);
        for (long long i = lane; i < (nbytes >> 4); i += 32) d[i] = s[i];
    } else {
        for (long long i = lane; i < nbytes; i += 32) dst[i] = src[i];
    }
}

// slots: [rows, 2 + K] int32 recv_src_metadata; columns 2.. each slot's expanded row (-1).
// A slot at or past `n` (duplicate ids in a token's top-k overflowing the worst case) is
// dropped, as are the slots that are not local.
extern "C" __global__ void epd_v2_spread(
        const int* __restrict__ meta, int rows, int K, int n,
        const char* __restrict__ a, long long a_row, char* __restrict__ a_out,
        const char* __restrict__ b, long long b_row, char* __restrict__ b_out,
        const float* __restrict__ w, float* __restrict__ w_out) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    for (int r = warp; r < rows; r += nwarps) {
        const int* s = meta + (long long)r * (2 + K) + 2;
        for (int k = 0; k < K; ++k) {
            const int slot = s[k];
            if (slot < 0 || slot >= n) continue;
            copy_row(a_out + (long long)slot * a_row, a + (long long)r * a_row, a_row, lane);
            if (b != nullptr)
                copy_row(b_out + (long long)slot * b_row, b + (long long)r * b_row, b_row, lane);
            if (w != nullptr && lane == 0) w_out[slot] = w[(long long)r * K + k];
        }
    }
}

// out[r] = bf16(sum over local slots k, in order, of float(x[slot])); w_out[r, k] = w[slot]
// or 0 where the slot is not local.
extern "C" __global__ void epd_v2_fold(
        const int* __restrict__ meta, int rows, int K, int H, int n,
        const unsigned short* __restrict__ x, unsigned short* __restrict__ out,
        const float* __restrict__ w, float* __restrict__ w_out) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    for (int r = warp; r < rows; r += nwarps) {
        const int* s = meta + (long long)r * (2 + K) + 2;
        for (int h = lane * 2; h < H; h += 64) {
            float acc0 = 0.f, acc1 = 0.f;
            const bool pair = h + 1 < H;
            for (int k = 0; k < K; ++k) {
                const int slot = s[k];
                if (slot < 0 || slot >= n) continue;
                const unsigned short* row = x + (long long)slot * H;
                acc0 += bf16_f32(row[h]);
                if (pair) acc1 += bf16_f32(row[h + 1]);
            }
            out[(long long)r * H + h] = f32_bf16(acc0);
            if (pair) out[(long long)r * H + h + 1] = f32_bf16(acc1);
        }
        if (w != nullptr && lane < K) {
            const int slot = s[lane];
            w_out[(long long)r * K + lane] = slot >= 0 && slot < n ? w[slot] : 0.f;
        }
    }
}

// w_out[i] = ids[i] >= 0 ? w[i] : 0 (a non-expanded combine's weights: each slot's weight from
// the rank of its expert only)
extern "C" __global__ void epd_v2_local_weights(const long long* __restrict__ ids,
                                                const float* __restrict__ w,
                                                float* __restrict__ w_out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        w_out[i] = ids[i] >= 0 ? w[i] : 0.f;
}
"""
_SPREAD_ARGS = "Qiii" + "QqQ" * 2 + "QQ"
_MASK_ARGS = "QQQq"
_FOLD_ARGS = "QiiiiQQQQ"


def _launch(name: str, like: Array, fmt: str, values: tuple, warps: int) -> None:
    """Kernel `name` on the caller's current stream with about `warps` warps (at most 1024
    blocks: the kernels loop)."""
    blocks = max(1, min(-(-warps // (THREADS // 32)), 1024))
    launch_on_current_stream(_SOURCE, name, like, (blocks, 1), THREADS, fmt, values)


def _dense(*arrays: Array) -> bool:
    return all(a is None or a.is_contiguous() for a in arrays)


def _on(device: Any, *arrays: Array) -> bool:
    """Every array given is on `device` (the kernels take their addresses as that device's)."""
    return all(a is None or a.device == device for a in arrays)


def load(device: int) -> None:
    """Compile and load the kernels now (at an ElasticBuffer's making: never on a call)."""
    for name in ("epd_v2_spread", "epd_v2_fold", "epd_v2_local_weights"):
        compiled_kernel(_SOURCE, name, device)


def spread(t: Any, meta: Array, n: int, recv_x: Any, recv_w: Array) -> tuple[Any, Array]:
    """(recv_x as `n` expanded rows, recv_w as `[n]`): each received row at its slots' rows
    (`meta[:, 2:]`), zero rows elsewhere. recv_x is a tensor or an (FP8 data, scales) pair."""
    parts = list(recv_x) if isinstance(recv_x, tuple) else [recv_x]
    rows, topk = int(meta.shape[0]), int(meta.shape[1]) - 2
    kernel = (meta.is_cuda and len(parts) <= 2 and _dense(meta, *parts, recv_w)
              and _on(meta.device, *parts, recv_w)
              and (recv_w is None or recv_w.dtype == t.float32))
    spare = 0 if kernel else 1  # (the torch path's row n: where dropped slots are written)
    outs = [t.zeros((n + spare, *a.shape[1:]), dtype=a.dtype, device=a.device) for a in parts]
    w_out = t.zeros(n + spare, dtype=recv_w.dtype, device=recv_w.device) \
        if recv_w is not None else None
    if kernel:
        if rows and n:
            a, a_out = parts[0], outs[0]
            b, b_out = (parts[1], outs[1]) if len(parts) == 2 else (None, None)

            def ptr(x: Array | None) -> int:
                return x.data_ptr() if x is not None else 0

            def row_bytes(x: Array | None) -> int:
                return x[0].numel() * x.element_size() if x is not None else 0
            _launch("epd_v2_spread", meta, _SPREAD_ARGS,
                    (meta.data_ptr(), rows, topk, n, ptr(a), row_bytes(a), ptr(a_out), ptr(b),
                     row_bytes(b), ptr(b_out), ptr(recv_w), ptr(w_out)), rows)
    else:
        slots = meta[:, 2:].long()
        dst = t.where((slots >= 0) & (slots < n), slots, t.full_like(slots, n))
        for a, o in zip(parts, outs, strict=True):
            for k in range(topk):
                o[dst[:, k]] = a
        outs = [o[:n] for o in outs]
        if w_out is not None:
            for k in range(topk):
                w_out[dst[:, k]] = recv_w[:, k]
            w_out = w_out[:n]
    return (tuple(outs) if isinstance(recv_x, tuple) else outs[0]), w_out


def fold(t: Any, meta: Array, expanded: int, x: Array, w: Array) -> tuple[Array, Array]:
    """(y [rows, hidden], w [rows, K]) of an expanded combine's `x [>= expanded, hidden]` and
    `w [>= expanded]`: each received row's slot rows summed in top-k order in float32, rounded
    once to x's dtype; each slot's weight (0 where the slot is not local)."""
    rows, topk = int(meta.shape[0]), int(meta.shape[1]) - 2
    if x.dim() != 2 or int(x.shape[0]) < expanded:
        raise InvalidArgument(f"expanded combine takes x [>= {expanded}, hidden] (the "
                              f"expanded dispatch's rows), got shape {list(x.shape)}")
    if w is not None and (w.dim() != 1 or int(w.shape[0]) < expanded):
        raise InvalidArgument(f"expanded combine takes topk_weights [>= {expanded}] (one per "
                              f"expanded row), got shape {list(w.shape)}")
    hidden = int(x.shape[1])
    if (meta.is_cuda and x.dtype == t.bfloat16 and _dense(meta, x, w) and topk <= 32
            and _on(meta.device, x, w) and (w is None or w.dtype == t.float32)):
        y = t.empty((rows, hidden), dtype=x.dtype, device=x.device)
        w_out = t.empty((rows, topk), dtype=t.float32, device=x.device) \
            if w is not None else None
        if rows:
            _launch("epd_v2_fold", meta, _FOLD_ARGS,
                    (meta.data_ptr(), rows, topk, hidden, expanded, x.data_ptr(), y.data_ptr(),
                     w.data_ptr() if w is not None else 0,
                     w_out.data_ptr() if w_out is not None else 0), rows)
        return y, w_out
    slots = meta[:, 2:].long()
    n = int(x.shape[0])
    ok = (slots >= 0) & (slots < expanded)
    src = t.where(ok, slots, t.full_like(slots, n))  # (row n: a zero row appended)
    xz = t.cat([x, t.zeros((1, hidden), dtype=x.dtype, device=x.device)])
    acc = t.zeros((rows, hidden), dtype=t.float32, device=x.device)
    for k in range(topk):
        acc += xz[src[:, k]].float()
    y = acc.to(x.dtype)
    if w is None:
        return y, None
    wz = t.cat([w[:expanded], t.zeros(1, dtype=w.dtype, device=w.device)])
    return y, wz[t.where(ok, slots, t.full_like(slots, expanded))]


def local_weights(t: Any, ids: Array, w: Array) -> Array:
    """`w` where `ids >= 0`, else 0 (both `[rows, K]`): a combine's weights, each slot's from
    the rank that holds its expert only."""
    if (w.is_cuda and _on(w.device, ids) and w.dtype == t.float32 and ids.dtype == t.int64
            and w.shape == ids.shape and _dense(w, ids)):
        out = t.empty_like(w)
        n = w.numel()
        if n:
            _launch("epd_v2_local_weights", w, _MASK_ARGS,
                    (ids.data_ptr(), w.data_ptr(), out.data_ptr(), n), -(-n // 32))
        return out
    return w.masked_fill(ids < 0, 0.0)
