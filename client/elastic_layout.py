"""The layout tensors of a DeepEP V2 handle (client/elastic_buffer.py's `EPHandle`), computed on
the device from the V1 dispatch's outputs: prefix sums per source rank and per local expert,
each received row's source metadata, where each sent token lands at each destination, and in
expanded mode each received slot's expanded row.

Two paths give the same tensors. The torch path (any device; the CPU backend's) is ~67 tensor
operations (~90 with the expanded layout), each a CUDA launch and an allocation on a GPU,
several times a V1 dispatch's own host work. On CUDA tensors one single-block kernel
(`epd_v2_handle`, compiled by NVRTC at the buffer's first dispatch and launched on the current
stream) writes every tensor but the expanded slots into one int32 allocation; the expanded
slots (a stable sort by expert) stay torch operations. Neither path synchronises with the
host: every size comes from the shapes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .cuda_ipc import compiled_kernel, launch_on_current_stream

Array = Any
THREADS = 1024  # one block: phases separated by block barriers, no grid-wide sync
SHARED_LIMIT = 48 * 1024  # dynamic shared bytes a launch gets without an opt-in attribute


class HandleLayout(NamedTuple):
    psum_ranks: Array    # [R] int32: rows received from sources <= r
    psum_experts: Array  # [L] int32: aligned ends per local expert (expanded: start + count)
    unaligned: Array     # [L] int32: received (token, local expert) pairs per expert
    meta: Array          # [rows, 2 + K] int32: recv_src_metadata
    dst_slot: Array      # [T, K] int32: dst_buffer_slot_idx
    recv_idx: Array      # [rows, K] int64: the handle's own copy of the received ids
    topk_idx: Array      # [T, K] int64: the handle's copy of the sent ids (or them: no copy)


_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(1024) epd_v2_handle(
        const int* __restrict__ prefix,          // [R, R] rank_prefix_matrix
        const int* __restrict__ src_idx,         // [rows] recv_src_idx
        const long long* __restrict__ ridx,      // [rows, K] received local ids, -1 none
        const long long* __restrict__ tidx,      // [T, K] this rank's global ids, -1 none
        const bool* __restrict__ in_rank,        // [T, R]
        int R, int me, int rows, int K, int T, int L, int M, int align, int expand,
        int* __restrict__ psum_ranks, int* __restrict__ psum_experts,
        int* __restrict__ unaligned, int* __restrict__ meta, int* __restrict__ dst_slot,
        long long* __restrict__ ridx_copy, long long* __restrict__ tidx_copy) {
    extern __shared__ int sm[];
    int* s_psum = sm;                 // [R]
    int* s_cnt = s_psum + R;          // [L]
    int* s_drun = s_cnt + L;          // [R]: tokens of earlier chunks sent to each rank
    unsigned* s_ballot = reinterpret_cast<unsigned*>(s_drun + R);  // [32][R]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nthreads = blockDim.x, nwarps = nthreads >> 5;
    for (int r = tid; r < R; r += nthreads) {
        const int v = prefix[r * R + me];
        s_psum[r] = v;
        psum_ranks[r] = v;
        s_drun[r] = 0;
    }
    for (int e = tid; e < L; e += nthreads) s_cnt[e] = 0;
    __syncthreads();

    // Received (row, slot) pairs per local expert (a count: the order of the adds is free),
    // and the handle's copies of the ids.
    const long long pairs = (long long)rows * K;
    for (long long i = tid; i < pairs; i += nthreads) {
        const long long e = ridx[i];
        ridx_copy[i] = e;
        if (e >= 0 && e < L) atomicAdd(&s_cnt[e], 1);
    }
    if (tidx_copy != nullptr)
        for (long long i = tid; i < (long long)T * K; i += nthreads) tidx_copy[i] = tidx[i];
    __syncthreads();
    if (tid == 0) {
        int acc = 0;
        for (int e = 0; e < L; ++e) {
            const int c = s_cnt[e];
            const int start = acc;
            acc += (c + align - 1) / align * align;
            unaligned[e] = c;
            psum_experts[e] = expand ? start + c : acc;
        }
    }

    // recv_src_metadata: the global source index, the source's last local slot, then -1
    // (the expanded rows are written by the caller).
    const int total = s_psum[R - 1];
    for (int row = tid; row < rows; row += nthreads) {
        int* m = meta + (long long)row * (2 + K);
        const long long* ids = ridx + (long long)row * K;
        if (row < total) {
            int src = 0;
            while (src < R && s_psum[src] <= row) ++src;
            int last = K - 1;  // (torch's argmax of no True is 0: the last slot)
            for (int k = K - 1; k >= 0; --k)
                if (ids[k] >= 0) { last = k; break; }
            m[0] = src * M + src_idx[row];
            m[1] = src * K + last;
        } else {
            m[0] = -1;
            m[1] = -1;
        }
        for (int k = 0; k < K; ++k) m[2 + k] = -1;
    }

    // dst_buffer_slot_idx: on the last slot of each destination rank, me * M + the token's
    // place among this rank's tokens for that rank (cumsum(in_rank) - 1); -1 elsewhere.
    for (int base = 0; base < T; base += nthreads) {
        const int t = base + tid;
        for (int d = 0; d < R; ++d) {
            const unsigned b = __ballot_sync(0xffffffffu, t < T && in_rank[(long long)t * R + d]);
            if (lane == 0) s_ballot[warp * R + d] = b;
        }
        __syncthreads();
        if (t < T) {
            const long long* g = tidx + (long long)t * K;
            for (int k = 0; k < K; ++k) {
                int out = -1;
                const long long e = g[k];
                const int d = e >= 0 ? (int)(e / L) : -1;
                if (d >= 0 && d < R) {
                    bool later = false;
                    for (int k2 = k + 1; k2 < K && !later; ++k2)
                        later = g[k2] >= 0 && (int)(g[k2] / L) == d;
                    if (!later) {
                        int before = s_drun[d];
                        for (int w = 0; w < warp; ++w) before += __popc(s_ballot[w * R + d]);
                        const unsigned mine = s_ballot[warp * R + d];
                        before += __popc(mine & ((1u << lane) - 1u));
                        // inclusive count - 1: this token's place when it goes to d
                        out = me * M + before + (int)((mine >> lane) & 1u) - 1;
                    }
                }
                dst_slot[(long long)t * K + k] = out;
            }
        }
        __syncthreads();
        for (int d = tid; d < R; d += nthreads) {
            int c = 0;
            for (int w = 0; w < nwarps; ++w) c += __popc(s_ballot[w * R + d]);
            s_drun[d] += c;
        }
        __syncthreads();
    }
}
"""
_ARGS = "QQQQQ" + "i" * 9 + "QQQQQQQ"


def shared_bytes(ranks: int, local: int) -> int:
    return 4 * (ranks + local + ranks + 32 * ranks)


def load(device: int) -> None:
    """Compile and load the kernel now (at an ElasticBuffer's making: never on a call)."""
    compiled_kernel(_SOURCE, "epd_v2_handle", device)


def compute(t: Any, rank_prefix: Array, recv_src_idx: Array, recv_idx: Array, topk_idx: Array,
            in_rank: Array, me: int, ranks: int, num_experts: int, alignment: int,
            max_tokens: int, do_expand: bool, copy_topk: bool = True) -> HandleLayout:
    """The handle's layout tensors (see HandleLayout) by the kernel where it applies (CUDA
    tensors of the dtypes V1 returns, its shared memory within the default limit), else by
    torch operations. `copy_topk`: the handle gets a copy of topk_idx (V2's
    do_handle_copy), else topk_idx itself."""
    local = num_experts // ranks
    if (recv_idx.is_cuda and recv_idx.dtype == t.int64 and topk_idx.dtype == t.int64
            and rank_prefix.dtype == t.int32 and recv_src_idx.dtype == t.int32
            and in_rank.dtype == t.bool and shared_bytes(ranks, local) <= SHARED_LIMIT):
        out = _by_kernel(t, rank_prefix, recv_src_idx, recv_idx, topk_idx, in_rank, me, ranks,
                         local, alignment, max_tokens, do_expand, copy_topk)
    else:
        out = by_torch(t, rank_prefix, recv_src_idx, recv_idx, topk_idx, in_rank, me, ranks,
                       local, alignment, max_tokens, do_expand, copy_topk)
    if do_expand:
        unaligned = out.unaligned.to(t.int64)
        starts = out.psum_experts.to(t.int64) - unaligned
        out.meta[:, 2:] = _expanded_slots(t, recv_idx, unaligned, starts, local).to(t.int32)
    return out


def _by_kernel(t: Any, rank_prefix: Array, recv_src_idx: Array, recv_idx: Array,
               topk_idx: Array, in_rank: Array, me: int, ranks: int, local: int,
               alignment: int, max_tokens: int, do_expand: bool,
               copy_topk: bool) -> HandleLayout:
    dev = recv_idx.device
    rows, topk = int(recv_idx.shape[0]), int(recv_idx.shape[1])
    tokens = int(topk_idx.shape[0])
    # One allocation: the int64 copies first (8-byte aligned), then the int32 tensors.
    wide = rows * topk + (tokens * topk if copy_topk else 0)
    sizes = [2 * wide, ranks, local, local, rows * (2 + topk), tokens * topk]
    copies, psum_ranks, psum_experts, unaligned, meta, dst_slot = t.empty(
        sum(sizes), dtype=t.int32, device=dev).split(sizes)
    copies = copies.view(t.int64)
    ridx_copy = copies[:rows * topk].view(rows, topk)
    tidx_copy = copies[rows * topk:].view(tokens, topk) if copy_topk else topk_idx
    inputs = [a.contiguous() for a in (rank_prefix, recv_src_idx, recv_idx, topk_idx, in_rank)]
    launch_on_current_stream(
        _SOURCE, "epd_v2_handle", recv_idx, (1, 1), THREADS, _ARGS,
        (*(a.data_ptr() for a in inputs), ranks, me, rows, topk, tokens, local, max_tokens,
         alignment, int(do_expand),
         *(p.data_ptr() for p in (psum_ranks, psum_experts, unaligned, meta, dst_slot,
                                  ridx_copy)),
         tidx_copy.data_ptr() if copy_topk else 0), shared_bytes(ranks, local))
    return HandleLayout(psum_ranks, psum_experts, unaligned, meta.view(rows, 2 + topk),
                        dst_slot.view(tokens, topk), ridx_copy, tidx_copy)


def by_torch(t: Any, rank_prefix: Array, recv_src_idx: Array, recv_idx: Array, topk_idx: Array,
             in_rank: Array, me: int, ranks: int, local: int, alignment: int, max_tokens: int,
             do_expand: bool, copy_topk: bool = True) -> HandleLayout:
    """The same tensors by torch operations (the expanded slots are left -1: `compute` writes
    them). No boolean indexing: it asks the host for a count, a synchronisation."""
    dev = recv_idx.device
    rows, topk = int(recv_idx.shape[0]), int(recv_idx.shape[1])
    mine = rank_prefix.to(t.int64)[:, me].contiguous()  # [R]: rows at me from sources <= s
    # Each row's source rank: rows come grouped by source, ascending.
    row_ids = t.arange(rows, device=dev, dtype=t.int64)
    src_rank = t.searchsorted(mine, row_ids, right=True)
    valid = recv_idx >= 0
    # DeepEP's master lane: the last local slot of the row
    last_local = (topk - 1 - valid.flip(1).to(t.int32).argmax(dim=1)).to(t.int64)
    meta = t.full((rows, 2 + topk), -1, dtype=t.int32, device=dev)
    received = row_ids < mine[-1]  # (the worst case's padding rows stay -1)
    none = t.full_like(row_ids, -1)
    meta[:, 0] = t.where(received, src_rank * max_tokens + recv_src_idx.to(t.int64),
                         none).to(t.int32)
    meta[:, 1] = t.where(received, src_rank * topk + last_local, none).to(t.int32)
    unaligned = t.zeros(local, dtype=t.int64, device=dev)
    unaligned.scatter_add_(0, recv_idx.clamp(min=0).reshape(-1).to(t.int64),
                           valid.reshape(-1).to(t.int64))
    aligned = (unaligned + alignment - 1) // alignment * alignment
    ends = t.cumsum(aligned, 0)
    psum_experts = ends - aligned + unaligned if do_expand else ends
    # Where each token goes at each destination (DeepEP's encoding: this rank's slot range,
    # the token's place among those this rank sends there), on the last slot of each
    # destination rank only.
    dest = t.where(topk_idx >= 0, topk_idx // local, t.full_like(topk_idx, -1)).to(t.int64)
    order_at = t.cumsum(in_rank.to(t.int64), 0) - 1  # [T, R]: this token's place among ours
    dst_slot = me * max_tokens + t.gather(order_at, 1, dest.clamp(min=0))
    later = t.triu(t.ones((topk, topk), dtype=t.bool, device=dev), diagonal=1)  # [k, k']
    same_later = ((dest.unsqueeze(2) == dest.unsqueeze(1)) & later).any(dim=2)
    keep = (dest >= 0) & ~same_later
    dst_slot = t.where(keep, dst_slot, t.full_like(dst_slot, -1)).to(t.int32)
    return HandleLayout(mine.to(t.int32), psum_experts.to(t.int32), unaligned.to(t.int32), meta,
                        dst_slot, recv_idx.clone(), topk_idx.clone() if copy_topk else topk_idx)


def _expanded_slots(t: Any, recv_idx: Array, unaligned: Array, starts: Array,
                    local: int) -> Array:
    """[rows, K] int64: each received slot's row in the expanded layout, experts in order and
    each expert's slots in received order (row, then slot), from the expert's aligned start;
    -1 for a slot that is not local."""
    rows, topk = int(recv_idx.shape[0]), int(recv_idx.shape[1])
    flat = recv_idx.reshape(-1).to(t.int64)
    keys = t.where(flat >= 0, flat, t.full_like(flat, local))
    order = t.sort(keys, stable=True).indices
    sorted_e = keys[order]
    ok = sorted_e < local
    pos = t.arange(flat.numel(), device=flat.device, dtype=t.int64)
    before = t.cumsum(unaligned, 0) - unaligned  # pairs of earlier experts
    e = sorted_e.clamp(max=local - 1)
    placed = t.where(ok, starts[e] + pos - before[e], t.full_like(pos, -1))
    return t.empty_like(flat).scatter_(0, order, placed).view(rows, topk)
