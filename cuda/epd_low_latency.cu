// EPD low-latency (decode) kernels: DeepEP's low_latency_dispatch / low_latency_combine
// semantics (the semantics of server/reference.py) over NVLink peer pointers, and with
// EPD_NVSHMEM to ranks on other nodes through NVSHMEM's device API (see "Other nodes" below).
//
// Buffers (per rank, same offsets on every rank, sized for the group's max_tokens_per_rank M;
// a call uses m <= M rows per source block):
//   recv_x   [L][R*m][H]  payload rows, packed per local expert, in (source rank, token) order
//   scales   [L][R*m][H/128] float32 (FP8 calls)
//   src_rank, src_idx, src_k [L][R*m] int32: who sent each row and which of its top-k it was
//   hist     [R][E + 4] int32: every source's rows per global expert for this call (E = L*R),
//            then its verdict on its own ids (LL_HIST_VERDICT)
//   recv_count [L] int32
//   comb     [M][K][H]  combine rows coming back to this rank as a source, by (token, k)
//   topk     [M][K] int64  this rank's dispatch topk_idx (combine finds k of each expert)
//
// Dispatch: block 0 counts this rank's rows per expert and posts the histogram to every peer;
// every block counts the rows of the tokens before its own (a contiguous token range) and
// waits for every source's histogram. A row's place is then fixed without any remote atomic:
// expert e's rows from the sources before this one, plus this rank's earlier rows for e. So
// each source's rows are contiguous (DeepEP's handle[1] `layout_range` exists) and the order is
// the reference's, (source, token), on every run. The row (quantised to e4m3 on the way when
// FP8), its scales and (rank, token, k) are written to the destination; the last block raises
// this rank's flag in every peer, waits for every source's flag, then publishes recv_count and
// marks the rows beyond it with -1.
// Combine: the expert side pushes each valid row back to (src_rank, token, k) of the source;
// the source waits for every peer, then sums w[t,k] * y in fp32 in k order, one FMA a term.
//
// Why one histogram area is safe: a source posts call n+1's histogram only after every
// destination published call n (the entry wait), and a destination publishes after all its
// blocks placed their rows, i.e. after their last read of the histograms.
// A source counts where its histogram arrived; one that went away (shrink) before posting
// sends nothing and counts 0. (A rank that leaves in the middle of a call is undefined for
// that one call: blocks may disagree on whether its histogram arrived.)
//
// Other nodes (EPD_NVSHMEM; peer table in epd_common.cuh): nothing is stored through a pointer
// to them. The histogram goes with its flag in one put-with-signal; a row is written once to
// this rank's send_x / send_scales slot of its token and put from there to every destination
// on another node (its source info as three int puts); a combine row is staged in send_y and
// put. Every block quiets its puts before its ticket, so the flags the last block signals
// arrive after the data (signal_done). Symmetric staging, not the caller's tensors, is the
// source of every put: network transports can only send registered memory.
#include "epd_common.cuh"

#define LL_THREADS 512
#define FULL_MASK 0xffffffffu
#define LL_MAX_LOCAL_EXPERTS 1024  // (proto/abi.py)
#define LL_ROW_OVERFLOW -4611686018427387904LL  // -(1 << 62) (proto/abi.py)
// Bytes before a buffer's topk copy (proto/abi.py): u64 words of the dispatch's left-out set,
// its verdict (0, or code | source << 8 | token << 32), the verdict's value and the dispatch's
// sequence; then from word LL_COMBINE_VERDICT the same three words of the last combine of the
// buffer's dispatch that found a bad entry in its own top-k (written by its reduce, read and
// cleared by the kernel that writes that combine's done word; cleared by the dispatch's last
// block too, so a fresh or poisoned buffer, or a combine no done kernel followed, leaves none).
#define LL_TOPK_HEADER 64
#define LL_COMBINE_VERDICT 4
// A source's histogram row is its E counts, then its verdict on its own ids: code (0,
// ERR_BAD_INPUT, ERR_BAD_DUPLICATE), the token, the expert id's low and high 32 bits; with code
// 0, its num_max (m) and fp8 in the token and low words instead (every rank compares them:
// ERR_DISAGREE, call_verdict).
#define LL_HIST_VERDICT 4

// Bad input no verdict covers (a row past the m rows a source may send, which the dispatch
// verdict's duplicate check rules out; kept as a guard): record it here, with the offending
// value (LL_ROW_OVERFLOW - row), and abort the group in every peer at once (abort word =
// (rank + 1) << 8 | ERR_ABORTED, as the host writes it), since the peers have already
// exchanged data with this rank.
__device__ __forceinline__ void fail_bad_input(const u64* peers, int R, int rank, int phase,
                                               u64 seq, i64 value) {
    record_error(ctrl_of(peers, rank), ERR_BAD_INPUT, -1, phase, seq, true, value);
    const u64 code = ((u64)(rank + 1) << ABORT_RANK_SHIFT) | ERR_ABORTED;
    for (int r = 0; r < R; ++r) peer_signal(peers, R, r, CTRL_ABORT, code);
}

// Bit s: source s posted its histogram of dispatch `seq` (a source that went away before
// posting counts 0 everywhere).
__device__ __forceinline__ u64 hist_posted(const u64* ctrl, int R, u64 seq) {
    u64 posted = 0;
    for (int s = 0; s < R; ++s)
        if (ld_acquire_sys(ctrl + CTRL_LL_HIST_FLAG + s) >= seq) posted |= 1ull << s;
    return posted;
}

// The ranks dispatch `seq` leaves out, the same on every rank: those whose histogram never
// came (gone before posting) and every rank some source saw masked (by a call) or gone when it
// posted. A live masked rank still posts (its peers wait for it), so all ranks read the same
// words and a mask changed during the call takes effect for every rank at once.
__device__ __forceinline__ u64 left_out(const u64* ctrl, int R, u64 posted) {
    u64 left = 0;
    for (int s = 0; s < R; ++s)
        left |= ((posted >> s) & 1ull) ? ld_acquire_sys(ctrl + CTRL_LL_SEEN + s) : (1ull << s);
    return left;
}

// The source whose row fails the dispatch, or -1: the lowest among `among` whose histogram
// row carries a verdict (bad ids); else the lowest whose m or fp8 differs from the lowest
// source's (the ranks disagree on the call's arguments: each would lay its rows out by its
// own m and format). Every rank reads the same rows, so every rank fails the dispatch alike.
__device__ __forceinline__ int call_verdict(const int* hist, int HS, int E, int R, u64 among) {
    for (int s = 0; s < R; ++s)
        if (((among >> s) & 1ull) && hist[(i64)s * HS + E] != 0) return s;
    if (!among) return -1;
    const int first = __ffsll((long long)among) - 1;
    const int* f = hist + (i64)first * HS + E;
    for (int s = first + 1; s < R; ++s) {
        const int* v = hist + (i64)s * HS + E;
        if (((among >> s) & 1ull) && (v[1] != f[1] || v[2] != f[2])) return s;
    }
    return -1;
}

// Block-uniform "go on?": the entry wait passed and the group has not failed. Thread 0 decides
// (the error words may change under the block's feet; warps must not diverge on them).
__device__ __forceinline__ bool block_go(const u64* ctrl, int wait_code) {
    __shared__ int s_go;
    if (threadIdx.x == 0) s_go = wait_code == 0 && !group_failed(ctrl);
    __syncthreads();
    return s_go != 0;
}

__device__ __forceinline__ float pow2_ceil(float s) {
    // 2^ceil(log2(s)) for a positive normal float, exactly (bits, not log2f).
    unsigned u = __float_as_uint(s);
    unsigned e = (u >> 23) & 0xffu;
    if (u & 0x7fffffu) e += 1u;
    return __uint_as_float(e << 23);
}

__device__ __forceinline__ unsigned short f32x2_to_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// Quantise one bf16 row (H elements, H % 128 == 0) once and store it into every destination
// row of the token: e4m3 + one float scale per 128 channels, DeepEP's arithmetic (utils.cuh
// calculate_fp8_scales; server/reference.py quantize_fp8): amax clamped to 1e-4, scale =
// amax * fl(1/448), q = clip(x * fl(448 / amax), +-448); with round_scale scale rounded up to
// a power of two and q = x * (1 / scale), exact; round to nearest even. 16 threads per
// 128-channel block, 8 channels per thread; all threads of the block call it (the shuffles
// need whole warps).
__device__ __forceinline__ void block_quantize_scatter(const unsigned short* __restrict__ src,
                                                       const u64* dst, const u64* dst_scales,
                                                       int K, int H, int round_scale) {
    const int nblocks = H / FP8_BLOCK;
    const int groups = blockDim.x >> 4;
    const int sub = threadIdx.x & 15;
    for (int b0 = 0; b0 < nblocks; b0 += groups) {
        const int b = b0 + (threadIdx.x >> 4);
        const bool active = b < nblocks;
        float f[8];
        float amax = 0.f;
        if (active) {
            int4 v = __ldg(reinterpret_cast<const int4*>(src + (i64)b * FP8_BLOCK) + sub);
            const unsigned short* w = reinterpret_cast<const unsigned short*>(&v);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                f[j] = bf16_to_f32(w[j]);
                amax = fmaxf(amax, fabsf(f[j]));
            }
        }
#pragma unroll
        for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
        if (!active) continue;
        amax = fmaxf(amax, FP8_AMAX_MIN);
        float scale = __fmul_rn(amax, __frcp_rn(FP8_MAX));  // DeepEP: amax * (1 / 448.0f)
        float mul = __fdiv_rn(FP8_MAX, amax);                // DeepEP: 448.0f / amax
        if (round_scale) {
            scale = pow2_ceil(scale);
            mul = __frcp_rn(scale);  // a power of two: exact
        }
        unsigned short q[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float lo = fminf(fmaxf(__fmul_rn(f[2 * j], mul), -FP8_MAX), FP8_MAX);
            float hi = fminf(fmaxf(__fmul_rn(f[2 * j + 1], mul), -FP8_MAX), FP8_MAX);
            q[j] = f32x2_to_e4m3x2(lo, hi);
        }
        uint2 out;
        out.x = (unsigned)q[0] | ((unsigned)q[1] << 16);
        out.y = (unsigned)q[2] | ((unsigned)q[3] << 16);
        for (int k = 0; k < K; ++k) {
            if (dst[k] == 0) continue;
            reinterpret_cast<uint2*>(dst[k] + (i64)b * FP8_BLOCK)[sub] = out;
            if (sub == 0) reinterpret_cast<float*>(dst_scales[k])[b] = scale;
        }
    }
}

// ------------------------------------------------------------------------------------------
// low-latency dispatch. x: [T, H] rows of `row_bytes` (16-byte multiple) at `x_stride` bytes.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ void
ll_dispatch_body(const char* __restrict__ x, i64 x_stride, i64 row_bytes,
                 const i64* __restrict__ topk_idx, int T, int K, int L, int R, int rank, int H,
                 int m, int fp8, int round_scale, const u64* __restrict__ peers,
                 i64 o_recv_x, i64 o_scales, i64 o_src_rank, i64 o_src_idx, i64 o_src_k,
                 i64 o_hist, i64 o_recv_count, i64 o_topk, u64 seq, i64 timeout_ns,
                 i64 o_send_x, i64 o_send_scales) {
    const int rows = R * m;  // rows per local expert in the output
    const int E = L * R;
    const int HS = E + LL_HIST_VERDICT;  // a source's histogram row: counts, then its verdict
    const i64 out_row_bytes = fp8 ? (i64)H : row_bytes;
    u64* my_ctrl = ctrl_of(peers, rank);
    char* my_base = reinterpret_cast<char*>(peers[rank]);
    // (the topk copy follows the LL_TOPK_HEADER bytes that hold the set this call left out)
    i64* my_topk = reinterpret_cast<i64*>(my_base + o_topk + LL_TOPK_HEADER);
    const int* hist = reinterpret_cast<const int*>(my_base + o_hist);  // [R][HS], posted here
    __shared__ int s_run[LL_MAX_LOCAL_EXPERTS * EPD_MAX_RANKS];  // this rank's rows so far, by e
    __shared__ u64 s_dst[33];     // destination row of each k (0: not sent), [K]: staging
    __shared__ u64 s_scales[33];  // its scales row (FP8)
    __shared__ int s_expert[32];  // expert of each k whose row is sent (-1: none)
#ifdef EPD_NVSHMEM
    __shared__ u64 s_rdst[32];    // a destination on another node: its symmetric row address
    __shared__ u64 s_rsc[32];     // ... and scales row
    __shared__ int s_rpe[32];     // ... and PE (-1: none)
#endif
    __shared__ u64 s_present;  // bit s: source s's histogram arrived
    __shared__ u64 s_left;  // the ranks this call leaves out (left_out)
    __shared__ int s_fail;  // the lowest source with bad ids (every block skips the call), or -1
    __shared__ int s_bad;   // block 0: this rank's first bad id's index t * K + k, or T * K
    __shared__ int s_verdict[LL_HIST_VERDICT];  // block 0: what it posts after its counts
    // This block's tokens: a contiguous range, so that "rows before" is a prefix count.
    const int per = (T + (int)gridDim.x - 1) / (int)gridDim.x;
    const int t0 = min(T, (int)blockIdx.x * per), t1 = min(T, t0 + per);

    // Every destination has published the previous dispatch (its -1 fill must not land on
    // this call's rows, and it no longer reads the histograms); normally one poll per peer.
    if (block_go(my_ctrl, block_wait_all(my_ctrl, CTRL_LL_READY_FLAG, R, seq - 1, timeout_ns,
                                         PHASE_LL_DISPATCH))) {
        const bool mine = t0 < t1;  // (block-uniform) blocks past the last token only signal
        for (int e = threadIdx.x; e < E; e += blockDim.x) s_run[e] = 0;
        __syncthreads();
        if (blockIdx.x == 0) {
            // The whole call's histogram, without the ranks this rank sees gone or masked
            // now (they are in every rank's left-out set: it posts what it saw), posted to
            // every peer with what it saw and its verdict on its ids: the first id outside
            // [-1, E) or named twice in a token (DeepEP's low-latency mode takes distinct
            // experts per token; the reference refuses a repeat). Every rank reads every
            // source's verdict after the histogram wait and skips a call with one, alike.
            if (threadIdx.x == 0) {
                s_left = gone_ranks(my_ctrl) | ld_acquire_sys(my_ctrl + CTRL_LIVE_MASK);
                s_bad = T * K;
            }
            __syncthreads();
            const u64 seen = s_left;
            for (int i = threadIdx.x; i < T * K; i += blockDim.x) {
                const i64 e = topk_idx[i];
                if (e >= 0 && e < (i64)E) {
                    if (!((seen >> (int)(e / L)) & 1ull)) atomicAdd(&s_run[(int)e], 1);
                    const int k = i % K;
                    for (int j = i - k; j < i; ++j)
                        if (topk_idx[j] == e) { atomicMin(&s_bad, i); break; }
                } else if (e != -1) {
                    atomicMin(&s_bad, i);
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                const int i = s_bad;
                const i64 e = i < T * K ? topk_idx[i] : 0;
                const bool ok = i == T * K;  // (then its arguments, for call_verdict)
                s_verdict[0] = ok ? 0 : (e < -1 || e >= (i64)E) ? ERR_BAD_INPUT
                                                                 : ERR_BAD_DUPLICATE;
                s_verdict[1] = ok ? m : i / K;
                s_verdict[2] = ok ? fp8 : (int)(unsigned)((u64)e & 0xffffffffull);
                s_verdict[3] = ok ? 0 : (int)(unsigned)((u64)e >> 32);
            }
            __syncthreads();
            for (int r = 0; r < R; ++r) {  // (this rank's own row first: it is the put source)
                if (peer_remote(peers, r)) continue;
                int* dst = reinterpret_cast<int*>(reinterpret_cast<char*>(peers[r]) + o_hist) +
                           (i64)rank * HS;
                for (int e = threadIdx.x; e < HS; e += blockDim.x)
                    dst[e] = e < E ? s_run[e] : s_verdict[e - E];
            }
            if ((int)threadIdx.x < R) {  // what it saw, before its histogram's flag
                peer_signal(peers, R, threadIdx.x, CTRL_LL_SEEN + rank, seen);
#ifdef EPD_NVSHMEM
                nvshmem_quiet();  // (to another node: delivered before the put-with-signal)
#endif
            }
            __threadfence_system();
            __syncthreads();
#ifdef EPD_NVSHMEM
            for (int r = 0; r < R; ++r) {
                if (!peer_remote(peers, r)) continue;
                const i64 off = o_hist + (i64)rank * HS * 4;
                nvshmemx_putmem_signal_nbi_block(
                    reinterpret_cast<void*>(peer_sym(peers, R, r) + off), my_base + off,
                    (size_t)HS * 4,
                    reinterpret_cast<unsigned long*>(peer_sym(peers, R, r)) + CTRL_LL_HIST_FLAG +
                        rank,
                    (unsigned long)seq, NVSHMEM_SIGNAL_SET, peer_pe(peers, R, r));
            }
#endif
            if ((int)threadIdx.x < R && !peer_remote(peers, threadIdx.x))
                st_release_sys(ctrl_of(peers, threadIdx.x) + CTRL_LL_HIST_FLAG + rank, seq);
            for (int e = threadIdx.x; e < E; e += blockDim.x) s_run[e] = 0;  // (t0 == 0)
        }
        const int hist_wait = !mine ? 1 : block_wait_all(my_ctrl, CTRL_LL_HIST_FLAG, R, seq,
                                                         timeout_ns, PHASE_LL_DISPATCH);
        if (mine && threadIdx.x == 0) {
            s_present = hist_posted(my_ctrl, R, seq);
            s_left = left_out(my_ctrl, R, s_present);
            s_fail = hist_wait == 0 ? call_verdict(hist, HS, E, R, s_present & ~s_left) : -1;
        }
        __syncthreads();
        const u64 gone = s_left;  // nothing goes to or comes from these ranks
        const bool failed = mine && s_fail >= 0;  // (block-uniform) a source's bad ids
        // The other blocks: this rank's rows of the tokens before t0, for the ranks not left
        // out (block 0's histogram counted all of those: what it left out is in `gone`).
        if (mine && blockIdx.x != 0 && hist_wait == 0 && !failed) {
            for (int i = threadIdx.x; i < t0 * K; i += blockDim.x) {
                const i64 e = topk_idx[i];
                if (e >= 0 && e < (i64)E && !((gone >> (int)(e / L)) & 1ull))
                    atomicAdd(&s_run[(int)e], 1);
            }
            __syncthreads();
        }
        // A rank left out sends nothing; nor does any rank in a call some source's ids fail.
        const bool sends = !((gone >> rank) & 1ull) && !failed;
        for (int t = t0; t < t1 && hist_wait == 0 && sends; ++t) {
            if ((int)threadIdx.x < K) {
                const int k = threadIdx.x;
                const i64 e = topk_idx[(i64)t * K + k];
                my_topk[(i64)t * K + k] = e;
                u64 dst = 0, dsc = 0;
                int sent = -1;
#ifdef EPD_NVSHMEM
                s_rpe[k] = -1;
#endif
                if (e >= 0 && e < (i64)E && !((gone >> (int)(e / L)) & 1ull)) {
                    const int d = (int)(e / L), le = (int)(e - (i64)d * L);
                    // Place: rows of the sources before this one, this rank's earlier rows,
                    // and an earlier k of this token with the same expert (a duplicate id).
                    int p = s_run[(int)e];
                    for (int s = 0; s < rank; ++s)
                        if (!((gone >> s) & 1ull)) p += hist[(i64)s * HS + e];
                    for (int j = 0; j < k; ++j) p += topk_idx[(i64)t * K + j] == e;
                    if (p >= rows) {  // only duplicate ids overflow (the verdict's check)
                        fail_bad_input(peers, R, rank, PHASE_LL_DISPATCH, seq,
                                       LL_ROW_OVERFLOW - (i64)p);
                    } else if (!peer_remote(peers, d)) {
                        char* base = reinterpret_cast<char*>(peers[d]);
                        const i64 row = (i64)le * rows + p;
                        dst = reinterpret_cast<u64>(base + o_recv_x + row * out_row_bytes);
                        dsc = reinterpret_cast<u64>(base + o_scales + row * (H / FP8_BLOCK) * 4);
                        reinterpret_cast<int*>(base + o_src_rank)[row] = rank;
                        reinterpret_cast<int*>(base + o_src_idx)[row] = t;
                        reinterpret_cast<int*>(base + o_src_k)[row] = k;
                        sent = (int)e;
                    } else {
#ifdef EPD_NVSHMEM
                        const u64 base = peer_sym(peers, R, d);
                        const int pe = peer_pe(peers, R, d);
                        const i64 row = (i64)le * rows + p;
                        s_rdst[k] = base + o_recv_x + row * out_row_bytes;
                        s_rsc[k] = base + o_scales + row * (H / FP8_BLOCK) * 4;
                        s_rpe[k] = pe;
                        nvshmem_int_p(reinterpret_cast<int*>(base + o_src_rank) + row, rank, pe);
                        nvshmem_int_p(reinterpret_cast<int*>(base + o_src_idx) + row, t, pe);
                        nvshmem_int_p(reinterpret_cast<int*>(base + o_src_k) + row, k, pe);
                        sent = (int)e;
#endif
                    }
                }
                s_dst[k] = dst;
                s_scales[k] = dsc;
                s_expert[k] = sent;
            }
            __syncthreads();  // every k read s_run before it moves on
            if ((int)threadIdx.x < K && s_expert[threadIdx.x] >= 0)
                atomicAdd(&s_run[s_expert[threadIdx.x]], 1);
#ifdef EPD_NVSHMEM
            // Destinations on other nodes: the row is written once more, to the token's
            // staging slot (destination K), and put from there below.
            const int KD = K + 1;
            if (threadIdx.x == 0) {
                bool remote = false;
                for (int k = 0; k < K; ++k) remote |= s_rpe[k] >= 0;
                s_dst[K] = remote ? reinterpret_cast<u64>(my_base + o_send_x + t * out_row_bytes)
                                  : 0;
                s_scales[K] = remote ? reinterpret_cast<u64>(my_base + o_send_scales +
                                                             (i64)t * (H / FP8_BLOCK) * 4)
                                     : 0;
            }
            __syncthreads();
#else
            const int KD = K;
#endif
            const char* src = x + (i64)t * x_stride;
            if (fp8) {
                block_quantize_scatter(reinterpret_cast<const unsigned short*>(src), s_dst,
                                       s_scales, KD, H, round_scale);
            } else {
                const int4* s4 = reinterpret_cast<const int4*>(src);
                const int nvec = (int)(row_bytes >> 4);
                for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
                    const int4 v = __ldg(s4 + i);
                    for (int k = 0; k < KD; ++k)
                        if (s_dst[k]) reinterpret_cast<int4*>(s_dst[k])[i] = v;
                }
            }
#ifdef EPD_NVSHMEM
            if (s_dst[K]) {
                __syncthreads();  // the staged row is whole
                for (int k = 0; k < K; ++k) {
                    if (s_rpe[k] < 0) continue;
                    nvshmemx_putmem_nbi_block(reinterpret_cast<void*>(s_rdst[k]),
                                              reinterpret_cast<const void*>(s_dst[K]),
                                              (size_t)out_row_bytes, s_rpe[k]);
                    if (fp8)
                        nvshmemx_putmem_nbi_block(reinterpret_cast<void*>(s_rsc[k]),
                                                  reinterpret_cast<const void*>(s_scales[K]),
                                                  (size_t)(H / FP8_BLOCK) * 4, s_rpe[k]);
                }
            }
#endif
            __syncthreads();  // s_dst is rewritten for the next token
        }
    }
    if (!signal_done(peers, R, rank, CTRL_LL_DISPATCH_FLAG, seq)) return;
    // Last block: every source has pushed (or the wait fails with a recorded error).
    if (block_wait_all(my_ctrl, CTRL_LL_DISPATCH_FLAG, R, seq, timeout_ns, PHASE_LL_DISPATCH))
        return;
    __shared__ int s_count[LL_MAX_LOCAL_EXPERTS];
    if (threadIdx.x == 0) {
        const u64 posted = hist_posted(my_ctrl, R, seq);
        u64 left = left_out(my_ctrl, R, posted);
        // A call a source's bad ids failed moved nothing: it leaves every rank out (no counts,
        // and its combine sums nothing: zeros), and says why in the header.
        const u64 among = posted & ~left;
        const int bad = call_verdict(hist, HS, E, R, among);
        u64 verdict = 0, value = 0;
        if (bad >= 0) {
            const int* v = hist + (i64)bad * HS + E;
            left = R >= 64 ? ~0ull : (1ull << R) - 1;
            if (v[0] != 0) {  // its bad ids: code, source, token; the id
                verdict = (u64)(unsigned)v[0] | (u64)bad << 8 | (u64)(unsigned)v[1] << 32;
                value = (u64)(unsigned)v[2] | (u64)(unsigned)v[3] << 32;
            } else {  // its arguments differ from the lowest source's: ERR_DISAGREE, source,
                // its m; its fp8 | the lowest's fp8 << 1 | the lowest source << 8, the lowest's m
                const int first = __ffsll((long long)among) - 1;
                const int* f = hist + (i64)first * HS + E;
                verdict = (u64)ERR_DISAGREE | (u64)bad << 8 | (u64)(unsigned)v[1] << 32;
                value = (u64)(unsigned)(v[2] | f[2] << 1 | first << 8) |
                        (u64)(unsigned)f[1] << 32;
            }
        }
        s_left = left;
        // for this rank's combine of this buffer: which ranks took no part; for the done
        // word (the stream op's end): the verdict
        u64* header = reinterpret_cast<u64*>(my_base + o_topk);
        header[0] = left;
        header[1] = verdict;
        header[2] = value;
        header[3] = seq;
        header[LL_COMBINE_VERDICT + 1] = 0;  // (no combine of this dispatch has one yet)
    }
    __syncthreads();
    const u64 left = s_left;
    int* recv_count = reinterpret_cast<int*>(my_base + o_recv_count);
    for (int le = threadIdx.x; le < L; le += blockDim.x) {
        int c = 0;
        for (int s = 0; s < R && !((left >> rank) & 1ull); ++s)
            if (!((left >> s) & 1ull)) c += hist[(i64)s * HS + (i64)rank * L + le];
        c = min(c, rows);
        recv_count[le] = c;
        s_count[le] = c;
    }
    __syncthreads();
    int* src_rank = reinterpret_cast<int*>(my_base + o_src_rank);
    int* src_idx = reinterpret_cast<int*>(my_base + o_src_idx);
    for (i64 i = threadIdx.x; i < (i64)L * rows; i += blockDim.x) {
        const int le = (int)(i / rows), p = (int)(i - (i64)le * rows);
        if (p >= s_count[le]) { src_rank[i] = -1; src_idx[i] = -1; }
    }
    __threadfence_system();
    __syncthreads();
    if ((int)threadIdx.x < R) peer_signal(peers, R, threadIdx.x, CTRL_LL_READY_FLAG + rank, seq);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_dispatch(const char* __restrict__ x, i64 x_stride, i64 row_bytes,
                const i64* __restrict__ topk_idx, int T, int K, int L, int R, int rank, int H,
                int m, int fp8, int round_scale, const u64* __restrict__ peers,
                i64 o_recv_x, i64 o_scales, i64 o_src_rank, i64 o_src_idx, i64 o_src_k,
                i64 o_hist, i64 o_recv_count, i64 o_topk, u64 seq, i64 timeout_ns,
                i64 o_send_x, i64 o_send_scales) {
    ll_dispatch_body(x, x_stride, row_bytes, topk_idx, T, K, L, R, rank, H, m, fp8, round_scale,
                     peers, o_recv_x, o_scales, o_src_rank, o_src_idx, o_src_k, o_hist,
                     o_recv_count, o_topk, seq, timeout_ns, o_send_x, o_send_scales);
}

// ------------------------------------------------------------------------------------------
// low-latency combine, expert side: push every valid row of y [L][R*m][H] (row stride
// `y_stride` bytes, expert stride `y_expert_stride` bytes) back to its source's comb buffer.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ void
ll_combine_push_body(const char* __restrict__ y, i64 y_stride, i64 y_expert_stride,
                     i64 row_bytes, int L, int R, int rank, int m, int K,
                     const u64* __restrict__ peers, i64 o_src_rank, i64 o_src_idx, i64 o_src_k,
                     i64 o_recv_count, i64 o_comb, u64 seq, i64 timeout_ns, i64 o_send_y) {
    const int rows = R * m;
    u64* my_ctrl = ctrl_of(peers, rank);
    const char* my_base = reinterpret_cast<const char*>(peers[rank]);
    const int* recv_count = reinterpret_cast<const int*>(my_base + o_recv_count);
    const int* src_rank = reinterpret_cast<const int*>(my_base + o_src_rank);
    const int* src_idx = reinterpret_cast<const int*>(my_base + o_src_idx);
    const int* src_k = reinterpret_cast<const int*>(my_base + o_src_k);
    // Exclusive prefix of the per-expert counts: valid row j lives in the expert whose range
    // holds j. One block per row (like dispatch: a whole block's loads in flight per row).
    __shared__ int s_pre[1025];
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int le = 0; le < L; ++le) {
            s_pre[le] = acc;
            acc += min(recv_count[le], rows);
        }
        s_pre[L] = acc;
    }
    // Every source has reduced the previous combine (its comb rows are free again).
    if (block_go(my_ctrl, block_wait_all(my_ctrl, CTRL_LL_COMBINE_READY, R, seq - 1,
                                         timeout_ns, PHASE_LL_COMBINE))) {
        const int total = s_pre[L];
        const int nvec = (int)(row_bytes >> 4);
        for (int j = blockIdx.x; j < total; j += gridDim.x) {
            int lo = 0, hi = L - 1;  // the last expert whose range starts at or before j
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (s_pre[mid] <= j) lo = mid; else hi = mid - 1;
            }
            const i64 i = (i64)lo * rows + (j - s_pre[lo]);
            const int s = src_rank[i], t = src_idx[i], k = src_k[i];
            if (s < 0 || s >= R || t < 0 || t >= m || k < 0 || k >= K) continue;
            const int4* src = reinterpret_cast<const int4*>(
                y + (i64)lo * y_expert_stride + (i64)(j - s_pre[lo]) * y_stride);
            const i64 to = o_comb + ((i64)t * K + k) * row_bytes;
            if (!peer_remote(peers, s)) {
                int4* dst = reinterpret_cast<int4*>(reinterpret_cast<char*>(peers[s]) + to);
                for (int v = threadIdx.x; v < nvec; v += blockDim.x) dst[v] = __ldg(src + v);
            } else {  // (s is the same for the whole block)
#ifdef EPD_NVSHMEM
                int4* stage = reinterpret_cast<int4*>(const_cast<char*>(my_base) + o_send_y +
                                                      (i64)j * row_bytes);
                for (int v = threadIdx.x; v < nvec; v += blockDim.x) stage[v] = __ldg(src + v);
                __syncthreads();
                nvshmemx_putmem_nbi_block(reinterpret_cast<void*>(peer_sym(peers, R, s) + to),
                                          stage, (size_t)row_bytes, peer_pe(peers, R, s));
#endif
            }
        }
    }
    signal_done(peers, R, rank, CTRL_LL_COMBINE_FLAG, seq);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_combine_push(const char* __restrict__ y, i64 y_stride, i64 y_expert_stride,
                    i64 row_bytes, int L, int R, int rank, int m, int K,
                    const u64* __restrict__ peers, i64 o_src_rank, i64 o_src_idx, i64 o_src_k,
                    i64 o_recv_count, i64 o_comb, u64 seq, i64 timeout_ns, i64 o_send_y) {
    ll_combine_push_body(y, y_stride, y_expert_stride, row_bytes, L, R, rank, m, K, peers,
                         o_src_rank, o_src_idx, o_src_k, o_recv_count, o_comb, seq, timeout_ns,
                         o_send_y);
}

// A combine's verdict on its own top-k (the first bad entry a thread found wins the word): the
// same words as a dispatch's verdict in its header (code | source << 8 | token << 32, the id,
// the sequence), read and cleared by the kernel that writes the combine's done word.
__device__ __forceinline__ void post_combine_verdict(u64* area, int code, int rank, int t, i64 e,
                                                     u64 seq) {
    const u64 v = (u64)(unsigned)code | (u64)(unsigned)rank << 8 | (u64)(unsigned)t << 32;
    if (atomicCAS(reinterpret_cast<unsigned long long*>(area + 1), 0ull,
                  (unsigned long long)v) == 0ull) {
        area[2] = (u64)e;
        area[3] = seq;
    }
}

// ------------------------------------------------------------------------------------------
// low-latency combine, source side: out[t] = sum over k (in order, skipping -1) of
// w[t,k] * comb[t][k'] where k' is the dispatch position of expert topk_idx[t,k].
// One warp per token; every block waits for every peer's push first.
// ------------------------------------------------------------------------------------------
template <typename Tr>
__device__ __forceinline__ void
ll_combine_reduce_body(typename Tr::word* __restrict__ out, i64 out_stride,
                       const i64* __restrict__ topk_idx, const float* __restrict__ w,
                       i64 w_stride, int T, int K, int H, int R, int rank,
                       const u64* __restrict__ peers, i64 o_comb, i64 o_topk, u64 seq,
                       i64 timeout_ns, int L) {
    typedef typename Tr::word word;
    constexpr int V = Tr::kPerVec;
    u64* my_ctrl = ctrl_of(peers, rank);
    const u64 wait_start = globaltimer();
    if (!block_go(my_ctrl, block_wait_all(my_ctrl, CTRL_LL_COMBINE_FLAG, R, seq, timeout_ns,
                                          PHASE_LL_COMBINE))) {
        signal_done(peers, R, rank, CTRL_LL_COMBINE_READY, seq);  // (the group has failed)
        return;
    }
    // The ranks the dispatch left out (their rows never came; a rank left out itself gets
    // zeros), and after the wait a rank that went away meanwhile (its rows never came back):
    // by the control block, and by the host words if the wait lasted long enough to let a rank
    // go by them (HOST_POLL_AFTER_NS). One value for the whole block.
    __shared__ u64 s_gone;
    if (threadIdx.x == 0) {
        u64 g = gone_ranks(my_ctrl);
        if ((i64)(globaltimer() - wait_start) > HOST_POLL_AFTER_NS) g |= host_gone(my_ctrl);
        s_gone = g;
    }
    __syncthreads();
    const char* my_base = reinterpret_cast<const char*>(peers[rank]);
    const u64 left = *reinterpret_cast<const u64*>(my_base + o_topk);
    const u64 gone = left | s_gone;
    const bool out_all = (left >> rank) & 1ull;
    const word* comb = reinterpret_cast<const word*>(my_base + o_comb);
    const i64* disp = reinterpret_cast<const i64*>(my_base + o_topk + LL_TOPK_HEADER);
    u64* verdict_area = reinterpret_cast<u64*>(const_cast<char*>(my_base) + o_topk) +
                        LL_COMBINE_VERDICT;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int gw = blockIdx.x * warps + (threadIdx.x >> 5), nw = gridDim.x * warps;
    const int nvec = H / V;
    // Split each token's row into chunks so that all warps work when T is small (decode).
    const int nch = max(1, min((nvec + 31) / 32, nw / max(T, 1)));
    const int per = (nvec + nch - 1) / nch;
    __shared__ int s_kd[LL_THREADS / 32][32];
    __shared__ float s_w[LL_THREADS / 32][32];
    int* kds = s_kd[threadIdx.x >> 5];
    float* ws = s_w[threadIdx.x >> 5];
    for (int item = gw; item < T * nch; item += nw) {
        const int t = item / nch, c = item - t * nch;
        const int i0 = c * per, i1 = min(nvec, i0 + per);
        // Lane k < K: the dispatch position of this token's k-th combine expert, or -1. An
        // entry the dispatch did not send (or named twice in the row) is left out and fails
        // this rank's combine alone (its verdict): the top-k of a combine shapes only its own
        // output, so the peers' combines are exact and nothing aborts. The row's ids, the
        // dispatch's and the weights are loaded once, a lane each, and compared by shuffles
        // (the whole warp takes part: the item loop is warp-uniform).
        const i64 e = lane < K ? topk_idx[(i64)t * K + lane] : -1;
        const i64 de = lane < K ? disp[(i64)t * K + lane] : -1;
        const float wl = lane < K ? w[(i64)t * w_stride + lane] : 0.f;
        int kd = -1;
        bool twice = false;
        for (int j = 0; j < K; ++j) {
            const i64 ej = __shfl_sync(FULL_MASK, e, j), dj = __shfl_sync(FULL_MASK, de, j);
            twice |= j < lane && ej == e;
            if (kd < 0 && dj == e) kd = j;
        }
        if (lane < K) {
            float wk = 0.f;
            if (e == -1 || out_all) {
                kd = -1;
            } else {  // (the host path's order: range, twice, dispatched)
                int bad = (e < -1 || e >= (i64)L * R) ? ERR_BAD_INPUT
                          : twice                     ? ERR_BAD_DUPLICATE : 0;
                if (bad == 0 && kd < 0)
                    bad = ERR_NOT_DISPATCHED;  // (whatever became of the expert's rank)
                else if (bad == 0 && ((gone >> (int)(e / L)) & 1ull))
                    kd = -1;  // (a masked or gone expert's rank: its rows never came)
                if (bad != 0) {
                    kd = -1;
                    post_combine_verdict(verdict_area, bad, rank, t, e, seq);
                } else if (kd >= 0) {
                    wk = wl;
                }
            }
            kds[lane] = kd;
            ws[lane] = wk;
        }
        __syncwarp();
        for (int i = i0 + lane; i < i1; i += 32) {
            float acc[V];
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] = 0.f;
            for (int k = 0; k < K; ++k) {
                const int kk = kds[k];
                const float ww = ws[k];
                if (kk < 0) continue;
                int4 v = *reinterpret_cast<const int4*>(comb + ((i64)t * K + kk) * H +
                                                        (i64)i * V);
                const word* vw = reinterpret_cast<const word*>(&v);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    acc[j] = __fmaf_rn(ww, Tr::to_f32(vw[j]), acc[j]);  // (DeepEP's FMA)
            }
            int4 o;
            word* ow = reinterpret_cast<word*>(&o);
#pragma unroll
            for (int j = 0; j < V; ++j) ow[j] = Tr::from_f32(acc[j]);
            *reinterpret_cast<int4*>(out + (i64)t * out_stride + (i64)i * V) = o;
        }
        __syncwarp();  // the next token's lanes overwrite kds / ws
    }
    signal_done(peers, R, rank, CTRL_LL_COMBINE_READY, seq);  // comb rows free for the next
}

template <typename Tr>
__global__ void __launch_bounds__(LL_THREADS)
epd_ll_combine_reduce(typename Tr::word* __restrict__ out, i64 out_stride,
                      const i64* __restrict__ topk_idx, const float* __restrict__ w,
                      i64 w_stride, int T, int K, int H, int R, int rank,
                      const u64* __restrict__ peers, i64 o_comb, i64 o_topk, u64 seq,
                      i64 timeout_ns, int L) {
    ll_combine_reduce_body<Tr>(out, out_stride, topk_idx, w, w_stride, T, K, H, R, rank, peers,
                               o_comb, o_topk, seq, timeout_ns, L);
}

// ------------------------------------------------------------------------------------------
// Stream-ordered calls: after an armed operation's kernels, write its done word in the
// session's counter page (mapped host memory the client's stream waits on): 1 when the rank's
// kernels saw no error, else 2 | code << 8.
// ------------------------------------------------------------------------------------------
// The done word of a rank's stream-ordered op: DONE_OK, or DONE_FAILED | the first error.
__device__ __forceinline__ unsigned stream_done_value(const u64* peers, int rank) {
    const u64* ctrl = ctrl_of(peers, rank);
    const u64 code = *reinterpret_cast<const volatile u64*>(ctrl + CTRL_ERR_CODE);
    const u64 aborted = abort_code(ctrl);
    return (code == 0 && aborted == 0) ? DONE_OK
           : DONE_FAILED | ((unsigned)(code ? code : ERR_ABORTED) << DONE_CODE_SHIFT);
}

__device__ __forceinline__ void st_release_sys_u32(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A low-latency call's done word: as stream_done_value, then its verdict, at `verdict` (the
// receive buffer's header for a dispatch, written by its last block: a source's bad ids failed
// the call on every rank; the header's combine words for a combine, written by its reduce: a
// bad entry of this rank's top-k failed its combine alone; the group goes on): DONE_FAILED |
// code << 8 | (source + 1) << 16 | (sequence & 0x7f) << 24 (two failed triggers of one op
// differ; bit 31 stays clear, as the client's stream waits for done >= 1 with a cyclic
// comparison), the id, its token and the same value (sticky, no trigger clears it) in the op's
// slot (`write`: one thread writes them, before the done word; with `clear`, a combine's, it
// also clears the verdict: the next combine of the same dispatch starts without one).
__device__ __forceinline__ unsigned ll_done_value(const u64* peers, int rank, u64* verdict,
                                                  unsigned* done, bool write, bool clear) {
    const unsigned v = stream_done_value(peers, rank);
    if (verdict == nullptr) return v;
    const u64 word = reinterpret_cast<const volatile u64*>(verdict)[1];
    if (clear && write && word != 0) verdict[1] = 0;
    if (v != DONE_OK || word == 0) return v;
    const u64 seq = reinterpret_cast<const volatile u64*>(verdict)[3];
    const unsigned failed = DONE_FAILED | (unsigned)(word & 0xffull) << DONE_CODE_SHIFT |
                            ((unsigned)((word >> 8) & 0xffull) + 1u) << DONE_RANK_SHIFT |
                            (unsigned)(seq & 0x7full) << DONE_SEQ_SHIFT;
    if (write) {
        unsigned* slot = done - STREAM_DONE;
        slot[STREAM_FAIL_TOKEN] = (unsigned)(word >> 32);
        reinterpret_cast<i64*>(slot)[STREAM_FAIL_VALUE] =
            (i64)reinterpret_cast<const volatile u64*>(verdict)[2];
        slot[STREAM_FAIL_DONE] = failed;  // (sticky: the client raises it at check())
    }
    return failed;
}

// `verdict`: a low-latency call's verdict words (ll_done_value; null: none), `combine`: they
// are a combine's (read once: cleared here).
extern "C" __global__ void epd_stream_done(const u64* __restrict__ peers, int rank,
                                           unsigned* done, u64* verdict, int combine) {
    if (threadIdx.x != 0) return;
    const unsigned v = ll_done_value(peers, rank, verdict, done, true, combine != 0);
    __threadfence_system();
    st_release_sys_u32(done, v);
}

// ------------------------------------------------------------------------------------------
// The chain: armed low-latency ops run without the engine's host (docs/DESIGN_NOTES.md).
// A member's client publishes its k-th low-latency collective as ring[k % LL_RING] = entry
// (op index | receive buffer << 8 | generation << 16) and then tail = k + 1, in the chain slot
// of its counter page (mapped host memory). The engine keeps instances enqueued on the
// member's chain stream: wait(tail >= k + 1), epd_ll_exec(k), epd_ll_exec_reduce(k),
// epd_ll_exec_finish(k). The three kernels read the entry and the op's descriptor (the packed
// arguments of its ordinary launches, written at arm time to device memory) and take the
// collective's sequence from the member's device state, which only epd_ll_exec_finish advances,
// so the ring order is the collective order on every rank and no host knows a sequence.
// ------------------------------------------------------------------------------------------
#define LL_RING 64             // ring entries (int32 words 0..63 of the chain slot)
#define LL_RING_TAIL 64        // chain slot int32 word: entries the client published
#define LL_RING_HEAD 65        // chain slot int32 word: entries the chain finished
#define LL_RING_LOG 128        // chain slot int32 words: the entry last finished at each position
#define LL_CHAIN_OPS 255       // descriptors per member; an entry's index beyond: no op
#define LLX_WORDS 64           // u64 words per descriptor
#define LLX_KIND 0             // 0 free, LLX_DISPATCH, LLX_COMBINE
#define LLX_DISPATCH 1
#define LLX_COMBINE 2
#define LLX_GEN 1              // generation (low 16 bits must match the entry's)
#define LLX_DONE 2             // the op's done word (mapped host memory)
#define LLX_STATS 3            // dispatch: cumulative int32 per-expert counts, or 0
#define LLX_STATS_STRIDE 4     // ... its element stride
#define LLX_SOURCE 5           // combine: its dispatch's descriptor index
#define LLX_TRAIT 6            // combine: output element (0 bf16, 1 fp16, 2 fp32)
#define LLX_BUFFER_STRIDE 7    // bytes between receive buffers 0 and 1
#define LLX_STAMP 8            // [LL_BUFFERS] dispatch: sequence of its last fill of buffer b
#define LLX_ARGS 16            // epd_ll_dispatch's / epd_ll_combine_push's arguments, in order
#define LLX_ARGS2 40           // combine: epd_ll_combine_reduce's arguments, in order
#define LLS_SEQ_D 0            // member state: last low-latency dispatch sequence
#define LLS_SEQ_C 1            // last low-latency combine sequence
#define LLS_FILLED 2           // [LL_BUFFERS] the dispatch sequence that last filled buffer b
#define LLS_K 4                // instances finished: the head the next finish publishes, less 1
#define ERR_NOT_FILLED 6       // a combine whose buffer holds another dispatch (not launched)
#define ERR_RING_FULL 7        // the client's trigger found no ring entry free in time

// The chain's alternative to a stream wait on the tail: one thread spinning on it (a parked
// stream wait on host memory is slow to wake; see docs/BENCHMARKS.md).
extern "C" __global__ void epd_ll_gate(const unsigned* tail, unsigned want) {
    if (threadIdx.x != 0) return;
    const volatile unsigned* t = tail;
    while ((int)(*t - want) < 0) __nanosleep(64);
}

// EPD_CHAIN_ENTRY=device: one thread copies instance k's entry from the ring in mapped host
// memory into a device copy of the ring, which the instance's other kernels then read, instead
// of every block of each of them reading host memory.
extern "C" __global__ void epd_ll_exec_fetch(const unsigned* ring, u64 k, unsigned* copy) {
    if (threadIdx.x == 0)
        copy[k % LL_RING] = reinterpret_cast<const volatile unsigned*>(ring)[k % LL_RING];
}

// The op an entry names (null: a released entry, a freed or reused descriptor). One read of
// the entry per block (host memory), shared: block-uniform, like everything that follows.
__device__ __forceinline__ const u64* chain_op(const unsigned* ring, u64 k,
                                               const u64* table, int* buffer) {
    __shared__ unsigned s_entry;
    if (threadIdx.x == 0) s_entry = reinterpret_cast<const volatile unsigned*>(ring)[k % LL_RING];
    __syncthreads();
    const unsigned e = s_entry;
    const unsigned idx = e & 0xffu, b = (e >> 8) & 0xffu;
    if (idx >= LL_CHAIN_OPS || b > 1) return nullptr;
    const u64* d = table + (u64)idx * LLX_WORDS;
    if (d[LLX_KIND] == 0 || (d[LLX_GEN] & 0xffffull) != (e >> 16)) return nullptr;
    *buffer = (int)b;
    return d;
}

// A combine brings back its dispatch only while buffer b still holds that dispatch's rows.
__device__ __forceinline__ bool combine_holds(const u64* d, const u64* table, const u64* state,
                                              int b) {
    const u64 stamp = table[d[LLX_SOURCE] * LLX_WORDS + LLX_STAMP + b];
    return stamp != 0 && state[LLS_FILLED + b] == stamp;
}

// An op's body from its descriptor row `d` with receive buffer b (the sequences from the
// member's device state).
__device__ __forceinline__ void chain_dispatch(const u64* d, int b, const u64* state) {
    const u64* a = d + LLX_ARGS;
    const i64 bo = (i64)b * (i64)d[LLX_BUFFER_STRIDE];
    ll_dispatch_body(reinterpret_cast<const char*>(a[0]), (i64)a[1], (i64)a[2],
                     reinterpret_cast<const i64*>(a[3]), (int)a[4], (int)a[5], (int)a[6],
                     (int)a[7], (int)a[8], (int)a[9], (int)a[10], (int)a[11], (int)a[12],
                     reinterpret_cast<const u64*>(a[13]), (i64)a[14] + bo, (i64)a[15] + bo,
                     (i64)a[16] + bo, (i64)a[17] + bo, (i64)a[18] + bo, (i64)a[19],
                     (i64)a[20] + bo, (i64)a[21] + bo, state[LLS_SEQ_D] + 1, (i64)a[23],
                     (i64)a[24], (i64)a[25]);
}

__device__ __forceinline__ void chain_push(const u64* d, int b, const u64* state) {
    const u64* a = d + LLX_ARGS;
    const i64 bo = (i64)b * (i64)d[LLX_BUFFER_STRIDE];
    ll_combine_push_body(reinterpret_cast<const char*>(a[0]), (i64)a[1], (i64)a[2], (i64)a[3],
                         (int)a[4], (int)a[5], (int)a[6], (int)a[7], (int)a[8],
                         reinterpret_cast<const u64*>(a[9]), (i64)a[10] + bo, (i64)a[11] + bo,
                         (i64)a[12] + bo, (i64)a[13] + bo, (i64)a[14], state[LLS_SEQ_C] + 1,
                         (i64)a[16], (i64)a[17]);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec(const unsigned* ring, u64 k, const u64* __restrict__ table,
            const u64* __restrict__ state) {
    int b = 0;
    const u64* d = chain_op(ring, k, table, &b);
    if (d == nullptr) return;
    if (d[LLX_KIND] == LLX_DISPATCH)
        chain_dispatch(d, b, state);
    else if (d[LLX_KIND] == LLX_COMBINE && combine_holds(d, table, state, b))
        chain_push(d, b, state);
}

// The same, one kind per kernel (EPD_CHAIN_EXEC=split): a chain instance launches both and the
// one of the other kind returns at once. Each carries one body's registers and shared memory
// (the dispatch's 37.5 KB, the push's 4 KB) instead of both together (41.6 KB, spills).
extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec_dispatch(const unsigned* ring, u64 k, const u64* __restrict__ table,
                     const u64* __restrict__ state) {
    int b = 0;
    const u64* d = chain_op(ring, k, table, &b);
    if (d != nullptr && d[LLX_KIND] == LLX_DISPATCH) chain_dispatch(d, b, state);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec_push(const unsigned* ring, u64 k, const u64* __restrict__ table,
                 const u64* __restrict__ state) {
    int b = 0;
    const u64* d = chain_op(ring, k, table, &b);
    if (d != nullptr && d[LLX_KIND] == LLX_COMBINE && combine_holds(d, table, state, b))
        chain_push(d, b, state);
}

template <typename Tr>
__device__ __forceinline__ void chain_reduce(const u64* a, i64 bo, u64 seq) {
    ll_combine_reduce_body<Tr>(reinterpret_cast<typename Tr::word*>(a[0]), (i64)a[1],
                               reinterpret_cast<const i64*>(a[2]),
                               reinterpret_cast<const float*>(a[3]), (i64)a[4], (int)a[5],
                               (int)a[6], (int)a[7], (int)a[8], (int)a[9],
                               reinterpret_cast<const u64*>(a[10]), (i64)a[11],
                               (i64)a[12] + bo, seq, (i64)a[14], (int)a[15]);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec_reduce(const unsigned* ring, u64 k, const u64* __restrict__ table,
                   const u64* __restrict__ state) {
    int b = 0;
    const u64* d = chain_op(ring, k, table, &b);
    if (d == nullptr || d[LLX_KIND] != LLX_COMBINE || !combine_holds(d, table, state, b))
        return;
    const i64 bo = (i64)b * (i64)d[LLX_BUFFER_STRIDE];
    const u64 seq = state[LLS_SEQ_C] + 1;
    switch ((int)d[LLX_TRAIT]) {
        case 0: chain_reduce<Bf16>(d + LLX_ARGS2, bo, seq); break;
        case 1: chain_reduce<F16>(d + LLX_ARGS2, bo, seq); break;
        default: chain_reduce<F32>(d + LLX_ARGS2, bo, seq); break;
    }
}

// The chain's reduce for one element type. A member's combines all have its group's dtype, so
// its chain launches this kernel (about the registers and shared memory of the standalone
// reduce) instead of epd_ll_exec_reduce, whose switch over the three types takes 104
// registers and 12 KB of shared memory per block: a block that cannot share an SM with another
// rank's resident ones (docs/BENCHMARKS.md, thirteenth session: 120 µs for a no-op reduce).
template <typename Tr>
__device__ __forceinline__ void chain_exec_reduce(const unsigned* ring, u64 k, const u64* table,
                                                  const u64* state) {
    int b = 0;
    const u64* d = chain_op(ring, k, table, &b);
    if (d == nullptr || d[LLX_KIND] != LLX_COMBINE || !combine_holds(d, table, state, b))
        return;
    chain_reduce<Tr>(d + LLX_ARGS2, (i64)b * (i64)d[LLX_BUFFER_STRIDE], state[LLS_SEQ_C] + 1);
}

// (Spelled out, not by a macro: tests/test_abi.py reads each kernel's parameters.)
extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec_reduce_Bf16(const unsigned* ring, u64 k, const u64* __restrict__ table,
                        const u64* __restrict__ state) {
    chain_exec_reduce<Bf16>(ring, k, table, state);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec_reduce_F16(const unsigned* ring, u64 k, const u64* __restrict__ table,
                       const u64* __restrict__ state) {
    chain_exec_reduce<F16>(ring, k, table, state);
}

extern "C" __global__ void __launch_bounds__(LL_THREADS)
epd_ll_exec_reduce_F32(const unsigned* ring, u64 k, const u64* __restrict__ table,
                       const u64* __restrict__ state) {
    chain_exec_reduce<F32>(ring, k, table, state);
}

// One block: the dispatch's cumulative stats, the sequences and stamps, the op's done word,
// then the entry logged and cleared, and head = instances finished (the client's trigger may
// reuse the entry; the engine tops the chain up). The head comes from the member's state, not
// from k: an instance launched as a CUDA graph is one of LL_RING fixed ones, its k the ring
// position (cuda_chain.py), and waits for its entry to be nonzero, which the clear makes false
// until the trigger publishes the next call there (after this head).
extern "C" __global__ void epd_ll_exec_finish(const unsigned* ring, u64 k, u64* table,
                                              u64* state, unsigned* head) {
    int b = 0;
    u64* d = const_cast<u64*>(chain_op(ring, k, table, &b));
    if (d != nullptr) {
        const u64* a = d + LLX_ARGS;
        const i64 bo = (i64)b * (i64)d[LLX_BUFFER_STRIDE];
        unsigned v;
        if (d[LLX_KIND] == LLX_DISPATCH) {
            const u64* peers = reinterpret_cast<const u64*>(a[13]);
            const int rank = (int)a[8];
            int* stats = reinterpret_cast<int*>(d[LLX_STATS]);
            if (stats != nullptr) {
                const int* counts = reinterpret_cast<const int*>(
                    reinterpret_cast<const char*>(peers[rank]) + (i64)a[20] + bo);
                for (int le = threadIdx.x; le < (int)a[6]; le += blockDim.x)
                    stats[(i64)le * (i64)d[LLX_STATS_STRIDE]] += counts[le];
            }
            u64* header = reinterpret_cast<u64*>(
                reinterpret_cast<char*>(peers[rank]) + (i64)a[21] + bo);
            v = ll_done_value(peers, rank, header, reinterpret_cast<unsigned*>(d[LLX_DONE]),
                              threadIdx.x == 0, false);
            __syncthreads();
            if (threadIdx.x == 0) {
                const u64 seq = state[LLS_SEQ_D] + 1;
                state[LLS_SEQ_D] = seq;
                state[LLS_FILLED + b] = seq;
                d[LLX_STAMP + b] = seq;
            }
        } else if (combine_holds(d, table, state, b)) {
            const u64* r = d + LLX_ARGS2;  // (epd_ll_combine_reduce's: peers, rank, o_topk)
            const u64* peers = reinterpret_cast<const u64*>(r[10]);
            const int rank = (int)r[9];
            u64* verdict = reinterpret_cast<u64*>(reinterpret_cast<char*>(peers[rank]) +
                                                  (i64)r[12] + bo) + LL_COMBINE_VERDICT;
            v = ll_done_value(peers, rank, verdict, reinterpret_cast<unsigned*>(d[LLX_DONE]),
                              threadIdx.x == 0, true);
            __syncthreads();
            if (threadIdx.x == 0) state[LLS_SEQ_C] += 1;
        } else {
            v = DONE_FAILED | ((unsigned)ERR_NOT_FILLED << DONE_CODE_SHIFT);
        }
        if (threadIdx.x == 0) {
            __threadfence_system();
            st_release_sys_u32(reinterpret_cast<unsigned*>(d[LLX_DONE]), v);
        }
    }
    if (threadIdx.x == 0) {
        unsigned* slot = head - LL_RING_HEAD;  // (the ring in host memory: `ring` may be a copy)
        const unsigned j = (unsigned)(k % LL_RING);
        volatile unsigned* v = slot;
        v[LL_RING_LOG + j] = reinterpret_cast<const volatile unsigned*>(ring)[j];
        v[j] = 0u;
        const u64 finished = state[LLS_K] + 1;
        state[LLS_K] = finished;
        __threadfence_system();
        st_release_sys_u32(head, (unsigned)finished);
    }
}

#ifndef __CUDACC_RTC__  // NVRTC instantiates through name expressions
template __global__ void epd_ll_combine_reduce<Bf16>(Bf16::word*, i64, const i64*, const float*,
    i64, int, int, int, int, int, const u64*, i64, i64, u64, i64, int);
template __global__ void epd_ll_combine_reduce<F16>(F16::word*, i64, const i64*, const float*,
    i64, int, int, int, int, int, const u64*, i64, i64, u64, i64, int);
template __global__ void epd_ll_combine_reduce<F32>(F32::word*, i64, const i64*, const float*,
    i64, int, int, int, int, int, const u64*, i64, i64, u64, i64, int);
#endif

#ifdef EPD_NVSHMEM  // a linked module is searched by plain names: one per combine element type
#define EPD_LL_REDUCE_BY_NAME(Tr)                                                              \
    extern "C" __global__ void __launch_bounds__(LL_THREADS) epd_ll_combine_reduce_##Tr(       \
        Tr::word* __restrict__ out, i64 out_stride, const i64* __restrict__ topk_idx,          \
        const float* __restrict__ w, i64 w_stride, int T, int K, int H, int R, int rank,       \
        const u64* __restrict__ peers, i64 o_comb, i64 o_topk, u64 seq, i64 timeout_ns,        \
        int L) {                                                                               \
        ll_combine_reduce_body<Tr>(out, out_stride, topk_idx, w, w_stride, T, K, H, R, rank,   \
                                   peers, o_comb, o_topk, seq, timeout_ns, L);                 \
    }
EPD_LL_REDUCE_BY_NAME(Bf16)
EPD_LL_REDUCE_BY_NAME(F16)
EPD_LL_REDUCE_BY_NAME(F32)
#endif
