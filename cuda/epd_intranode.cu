// EPD intranode kernels: notify, dispatch, combine (the semantics of server/reference.py;
// layout is epd_layout.cu).
//
// Design (docs/GPU_NOTES.md says why): every rank's buffer is reachable by a plain pointer
// (`peers[r]` = base of rank r's buffer; NVSHMEM peer pointers over NVLink, or offsets of one
// heap when ranks share a GPU). Every buffer has the same layout, so a sub-buffer of rank r is
// `peers[r] + off`. Data moves by PUSH straight into its final place:
//   dispatch: source s writes each token row once per destination d, at row
//             prefix[s-1][d] + pos[t][d] of d's receive buffer (the order of section 6);
//   combine:  expert rank d writes each received row back into source s's staging buffer at
//             send_off[s][d] + pos[t][d]; s then reduces rows in ascending d, in fp32.
// Completion is a per-source flag (value = sequence) that the last block of a kernel raises in
// every peer after a system fence; waits poll with a deadline and an abort word, never trap.
#include "epd_common.cuh"

// ------------------------------------------------------------------------------------------
// Hierarchical normal mode: a group over N > 1 nodes of R / N ranks, placed node-major
// (`num_nodes` <= 1: flat, the one-node code). DeepEP's internode semantics over the same
// direct puts (server/reference.py, hierarchical_dispatch / hierarchical_combine):
//   - every destination takes its sources' blocks in the order (local index i, then node a),
//     the order in which forwarder (b, i) would pass on the rows of sources (a, i);
//   - recv_src_idx is a row's index in its forwarder's rail list: the tokens of sources
//     (a' < a, i) with an expert on the destination's node, then those of its own source
//     before it (the source writes the latter, the destination adds the former: node_base);
//   - combine sums each node's rows in fp32 (local ranks ascending), rounds that partial to
//     the combine dtype and adds the partials, nodes ascending, onto bias_0 + bias_1.
// rank_prefix keeps its meaning (rows from sources <= s by rank, a count): rows are located
// from count_matrix in the destination's source order instead (block_first).
// ------------------------------------------------------------------------------------------

// The source at place p of every destination's order.
__device__ __forceinline__ int src_at(int p, int R, int N) {
    if (N <= 1) return p;
    const int per_node = R / N;
    return (p % N) * per_node + p / N;
}

// First row of source s's block on destination d.
__device__ __forceinline__ int block_first(const int* __restrict__ rank_prefix,
                                           const int* __restrict__ count_matrix, int R, int N,
                                           int s, int d) {
    if (N <= 1) return s > 0 ? rank_prefix[(s - 1) * R + d] : 0;
    int acc = 0;
    for (int p = 0; p < R; ++p) {
        const int q = src_at(p, R, N);
        if (q == s) break;
        acc += count_matrix[q * R + d];
    }
    return acc;
}

// The source of row i of a receive buffer whose p-th block (in source order) starts at row
// first_at[p]: the last block starting at or before i (an empty block starts where the next
// one does). `first` takes that block's first row.
__device__ __forceinline__ int row_source(int i, const int (&first_at)[EPD_MAX_RANKS], int R,
                                          int N, int& first) {
    int s = 0;
    first = 0;
#pragma unroll
    for (int p = 1; p < EPD_MAX_RANKS; ++p)
        if (p < R && i >= first_at[p]) { s = src_at(p, R, N); first = first_at[p]; }
    return s;
}

// Bit b: a token of destination mask `mask` has an expert on a rank of node b.
__device__ __forceinline__ unsigned node_mask(unsigned mask, int R, int N) {
    const int per_node = R / N;
    const unsigned all = (1u << per_node) - 1u;
    unsigned m = 0;
    for (int b = 0; b < N; ++b) m |= (((mask >> (b * per_node)) & all) ? 1u : 0u) << b;
    return m;
}

// node_pos[t][b]: how many of this source's tokens before t have an expert on node b (t's
// row among the tokens it sends to node b), or -1. Block-wide (every thread calls it): tiles
// of blockDim.x tokens, warp ballots, the earlier warps' counts, a carry per node. `s_count`:
// the caller's [32][EPD_MAX_RANKS] shared scratch, free by now (notify's own s_warp: a
// separate array put notify past the 48 KiB of static shared memory in the NVSHMEM build,
// whose device library takes most of it).
__device__ void node_rows(const unsigned char* __restrict__ token_mask, int T, int R, int N,
                          int* __restrict__ node_pos, int (*s_count)[EPD_MAX_RANKS]) {
    __shared__ int s_carry[EPD_MAX_RANKS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (threadIdx.x < EPD_MAX_RANKS) s_carry[threadIdx.x] = 0;
    __syncthreads();
    for (int t0 = 0; t0 < T; t0 += blockDim.x) {
        const int t = t0 + threadIdx.x;
        const unsigned nm = t < T ? node_mask(token_mask[t], R, N) : 0u;
        for (int b = 0; b < N; ++b) {
            const unsigned bal = __ballot_sync(0xffffffffu, (nm >> b) & 1u);
            if (lane == 0) s_count[warp][b] = __popc(bal);
        }
        __syncthreads();
        for (int b = 0; b < N; ++b) {
            const bool in = (nm >> b) & 1u;
            const unsigned bal = __ballot_sync(0xffffffffu, in);
            int before = s_carry[b] + __popc(bal & ((1u << lane) - 1u));
            for (int w = 0; w < warp; ++w) before += s_count[w][b];
            if (t < T) node_pos[(i64)t * N + b] = in ? before : -1;
        }
        __syncthreads();  // every thread read this tile's counts and the carries
        if ((int)threadIdx.x < N) {
            int c = 0;
            for (int w = 0; w < nwarps; ++w) c += s_count[w][threadIdx.x];
            s_carry[threadIdx.x] += c;
        }
        __syncthreads();
    }
}

// The end of a notify (epd_notify, epd_wide_notify), every thread of the block: after the wait
// (`code`), the sources' payloads at `payload_bytes` of this rank's control block, `stride` words
// each: the count per destination rank first, the source's token count at word `tokens_at`,
// (bad_at >= 0) its bad input's code and value at word `bad_at` (NOTIFY_BAD), this rank's
// per-expert counts from word `experts_at`. A failed wait, or a source's bad input, or a source
// with more tokens than the group holds, or (num_worst > 0) a destination receiving more rows
// than num_worst, fails the call (every rank reads the same payloads: alike), before any row
// moves; else the count and prefix matrices, recv_info and the counter slot (payload, system
// fence, sequence word). Returns whether the call goes on.
__device__ __forceinline__ bool notify_publish(
        u64* my_ctrl, int code, int payload_bytes, int stride, int tokens_at, int bad_at,
        int experts_at, int R, int L, int rank, int max_tokens, int num_worst, int alignment,
        int* __restrict__ recv_info,
        int* __restrict__ count_matrix, int* __restrict__ rank_prefix, i64* counter_slot,
        u64 counter_seq) {
    const int tid = threadIdx.x;
    if (code) {
        if (tid == 0) {
            int missing = (int)(i64)my_ctrl[CTRL_ERR_RANK];
            recv_info[0] = -1; recv_info[1] = code; recv_info[2] = missing;
            if (counter_slot != nullptr) {
                counter_slot[SLOT_STATUS] = code;
                counter_slot[SLOT_ERR_RANK] = missing;
                __threadfence_system();
                reinterpret_cast<volatile i64*>(counter_slot)[SLOT_SEQ] = (i64)counter_seq;
            }
        }
        return false;
    }
    const volatile int* payload = reinterpret_cast<const volatile int*>(
        reinterpret_cast<const char*>(my_ctrl) + payload_bytes);
    i64 need = 0;  // (the counter slot's NUM_RECV of a failed call: what failed it)
    int needy = -1, fail = 0;
    for (int s = 0; bad_at >= 0 && s < R && !fail; ++s) {  // the lowest rank's first bad value
        const volatile int* p = payload + s * stride + bad_at;
        if (p[0]) {
            fail = p[0];
            needy = s;
            need = (i64)(((u64)(unsigned)p[2] << 32) | (u64)(unsigned)p[1]);
        }
    }
    for (int s = 0; !fail && s < R; ++s) {
        int ts = payload[s * stride + tokens_at];
        if (ts > need) { need = ts; needy = s; }
    }
    if (!fail && need > max_tokens) fail = ERR_CAPACITY;
    if (!fail && num_worst > 0) {  // every destination's rows: alike where num_worst is
        need = 0; needy = -1;       // (DeepEP's rule: every rank passes the same)
        for (int d = 0; d < R; ++d) {
            int n = 0;
            for (int s = 0; s < R; ++s) n += payload[s * stride + d];
            if (n > need) { need = n; needy = d; }
        }
        if (need > num_worst) fail = ERR_WORST_OVERFLOW;
    }
    if (fail) {  // (the data and combine kernels skip the call: recv_info[1]; the group goes on)
        if (tid == 0) {
            recv_info[0] = -1; recv_info[1] = fail; recv_info[2] = needy;
            if (counter_slot != nullptr) {
                counter_slot[SLOT_NUM_RECV] = need;
                counter_slot[SLOT_NUM_EXPERTS] = 0;
                counter_slot[SLOT_STATUS] = fail;
                counter_slot[SLOT_ERR_RANK] = needy;
                __threadfence_system();
                reinterpret_cast<volatile i64*>(counter_slot)[SLOT_SEQ] = (i64)counter_seq;
            }
        }
        return false;
    }
    for (int i = tid; i < R * R; i += blockDim.x) {
        const int s = i / R, d = i % R;
        count_matrix[i] = payload[s * stride + d];
        int acc = 0;
        for (int q = 0; q <= s; ++q) acc += payload[q * stride + d];
        rank_prefix[i] = acc;
    }
    for (int l = tid; l < L; l += blockDim.x) {
        int c = 0;
        for (int s = 0; s < R; ++s) c += payload[s * stride + experts_at + l];
        c = (c + alignment - 1) / alignment * alignment;
        recv_info[4 + l] = c;
        if (counter_slot != nullptr) counter_slot[SLOT_HEADER + l] = c;
    }
    if (tid == 0) {
        int n = 0;
        for (int s = 0; s < R; ++s) n += payload[s * stride + rank];
        recv_info[0] = n; recv_info[1] = 0; recv_info[2] = -1; recv_info[3] = 0;
        if (counter_slot != nullptr) {
            counter_slot[SLOT_NUM_RECV] = n;
            counter_slot[SLOT_NUM_EXPERTS] = L;
            counter_slot[SLOT_STATUS] = 0;
            counter_slot[SLOT_ERR_RANK] = -1;
        }
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0 && counter_slot != nullptr)
        reinterpret_cast<volatile i64*>(counter_slot)[SLOT_SEQ] = (i64)counter_seq;
    return true;
}

// ------------------------------------------------------------------------------------------
// notify: one block. Counts this rank's tokens per destination rank and pairs per expert,
// pushes (per-rank vector, the destination's local-expert counts) into every peer, raises the
// peer's notify flag, waits for all R sources, publishes the receive counts to the mapped
// counter slot (payload, system fence, sequence word), and then computes the per-destination
// positions pos[t][d] that the data kernels need (overlapping the host's reaction to counts).
//
// recv_info (int32, own device memory): [0] num_recv, [1] status, [2] missing rank, [3] 0,
// [4..4+L) per-local-expert counts rounded up to `alignment`.
// ------------------------------------------------------------------------------------------
#define NOTIFY_THREADS 1024
#define DATA_THREADS 512  // block size of the data kernels (<=128 registers per thread)

extern "C" __global__ void __launch_bounds__(NOTIFY_THREADS, 1)
epd_notify(const i64* __restrict__ topk_idx, int T, int K, int E, int R, int rank,
           const u64* __restrict__ peers, u64 seq, i64 timeout_ns, int alignment,
           int max_tokens,                         // the group's max_tokens_per_rank
           i64* counter_slot,                      // mapped host slot, or null
           u64 counter_seq,                        // value the slot's sequence word takes
           int* __restrict__ recv_info,            // [4 + L]
           int* __restrict__ count_matrix,         // [R, R]: tokens s -> d
           int* __restrict__ rank_prefix,          // [R, R]: rows from sources <= s on d
           unsigned char* __restrict__ token_mask, // [T] bit d: token goes to rank d
           int* __restrict__ pos,                  // [T, R]: row within (s -> d) block, or -1
           int* num_tokens_per_rank,               // [R] or null (layout outputs, free here)
           int* num_tokens_per_expert,             // [E] or null
           bool* is_token_in_rank,                 // [T, R] or null
           const bool* __restrict__ routing_in,    // [T, R]: routing without top-k
           const int* __restrict__ experts_in,     // [E] without top-k (else null): per expert
           int num_nodes,                          // > 1: hierarchical (see the top)
           int* __restrict__ node_base,            // [R] hierarchical: rail rows before s
           int* __restrict__ node_pos,             // [T, N] hierarchical: see node_rows
           int num_worst,                          // > 0: no destination receives more
           int bad_alike,    // a whole group's dispatch: a bad input fails it on every rank
           const int* __restrict__ fail_from,  // a stage's: its whole group's recv_info
           int refused) {  // (bad_alike) ERR_REFUSED: this rank's part was refused (T = 0)
    extern __shared__ int s_expert[];  // [E]
    __shared__ int s_rank[EPD_MAX_RANKS];
    __shared__ int s_node[EPD_MAX_RANKS];  // hierarchical: tokens with an expert on node b
    __shared__ int s_warp[32][EPD_MAX_RANKS];
    __shared__ u64 s_bad[2];  // bad_alike: this source's bad input (code, value) for the payload
    const int L = E / R;
    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    u64* my_ctrl = ctrl_of(peers, rank);
    // (Else reported on this rank alone, by the call's last kernel: a stage's notify, whose
    // whole group's notify reports the same ids.)
    const BadInput bad = bad_alike ? BadInput{&s_bad[0], &s_bad[1]} : call_err_words(my_ctrl);
    // A two-stage group's stage (cuda_stages.py): a call its whole group's notify failed on
    // every rank alike (bad input, capacity) is skipped by every stage alike, so no flag is
    // raised or awaited (flags only grow: the next call's wait is for its own sequence).
    if (fail_from != nullptr) {
        const int failed = fail_from[1];
        if (failed == ERR_BAD_INPUT || failed == ERR_BAD_COUNT || failed == ERR_CAPACITY ||
            failed == ERR_REFUSED) {
            if (tid == 0) {
                recv_info[0] = -1; recv_info[1] = failed; recv_info[2] = fail_from[2];
            }
            return;
        }
    }
    if (tid < 2) s_bad[tid] = tid == 0 ? (u64)refused : 0;  // (a report cannot claim it then)
    __syncthreads();

    // Without top-k (DeepEP's topk_idx=None) the caller declares its tokens per expert.
    for (int i = tid; i < E; i += blockDim.x) {
        int v = 0;
        if (experts_in != nullptr) {  // (not topk_idx == nullptr: an empty array has no data)
            v = experts_in[i];
            if (v < 0) { report_bad_input(bad, v, ERR_BAD_COUNT); v = 0; }
        }
        s_expert[i] = v;
    }
    if (tid < EPD_MAX_RANKS) s_node[tid] = 0;
    __syncthreads();

    // Phase A: each thread owns a contiguous chunk of tokens (so the positions are a scan).
    const int chunk = (T + blockDim.x - 1) / blockDim.x;
    const int t0 = min(T, tid * chunk), t1 = min(T, t0 + chunk);
    int cnt[EPD_MAX_RANKS];
#pragma unroll
    for (int d = 0; d < EPD_MAX_RANKS; ++d) cnt[d] = 0;
    for (int t = t0; t < t1; ++t) {
        unsigned mask = 0;
        if (experts_in != nullptr)  // routed by is_token_in_rank alone
            for (int d = 0; d < R; ++d) mask |= (routing_in[(i64)t * R + d] ? 1u : 0u) << d;
        mask |= (unsigned)token_ranks(topk_idx, t, K, E, L, s_expert, bad);  // (R <= 8)
        token_mask[t] = (unsigned char)mask;
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) cnt[d] += (mask >> d) & 1u;
        if (num_nodes > 1)
            for (unsigned nm = node_mask(mask, R, num_nodes); nm; nm &= nm - 1)
                atomicAdd(&s_node[__ffs(nm) - 1], 1);
    }
    // Block exclusive scan of cnt[d] (warp shuffles, then warp totals).
    int incl[EPD_MAX_RANKS];
#pragma unroll
    for (int d = 0; d < EPD_MAX_RANKS; ++d) {
        int v = cnt[d];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int n = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += n;
        }
        incl[d] = v;
        if (lane == 31) s_warp[warp][d] = v;
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) {
            int v = lane < nwarps ? s_warp[lane][d] : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                int n = __shfl_up_sync(0xffffffffu, v, o);
                if (lane >= o) v += n;
            }
            if (lane < nwarps) s_warp[lane][d] = v;  // inclusive over warps
            if (lane == 31) s_rank[d] = v;           // block total
        }
    }
    __syncthreads();
    int off[EPD_MAX_RANKS];
#pragma unroll
    for (int d = 0; d < EPD_MAX_RANKS; ++d)
        off[d] = incl[d] - cnt[d] + (warp > 0 ? s_warp[warp - 1][d] : 0);

    // Phase B: push [per-rank counts (R_MAX ints) | T | bad input (code, value low, high) |
    // destination's L expert counts] to every peer's slot for this source, fence, then raise
    // the flag. (s_bad is complete: the scan's barriers came after every report.)
    const int stride = NOTIFY_HEAD + L;
    for (int i = tid; i < R * stride; i += blockDim.x) {
        int r = i / stride, j = i % stride;
        int v = j < EPD_MAX_RANKS ? (j < R ? s_rank[j] : 0)
              : j == NOTIFY_TOKENS ? T
              : j == NOTIFY_BAD ? (int)s_bad[0]
              : j == NOTIFY_BAD + 1 ? (int)(unsigned)s_bad[1]
              : j == NOTIFY_BAD + 2 ? (int)(unsigned)(s_bad[1] >> 32)
              : s_expert[r * L + (j - NOTIFY_HEAD)];
        const i64 at = CTRL_PAYLOAD_BYTES + ((i64)rank * stride + j) * 4;
#ifdef EPD_NVSHMEM
        if (peer_remote(peers, r)) {  // another node: a put of the int (quiet below)
            nvshmem_int_p(reinterpret_cast<int*>(peer_sym(peers, R, r) + at), v,
                          peer_pe(peers, R, r));
            continue;
        }
#endif
        *reinterpret_cast<int*>(reinterpret_cast<char*>(ctrl_of(peers, r)) + at) = v;
    }
    if (num_nodes > 1 && tid < R) {  // hierarchical: my tokens with an expert on r's node
        const int r = tid, v = s_node[r / (R / num_nodes)];
#ifdef EPD_NVSHMEM
        if (peer_remote(peers, r))
            nvshmem_longlong_p(reinterpret_cast<long long*>(peer_sym(peers, R, r)) +
                                   CTRL_NODE_TOKENS + rank, (long long)v, peer_pe(peers, R, r));
        else
#endif
            ctrl_of(peers, r)[CTRL_NODE_TOKENS + rank] = (u64)v;
    }
    if (num_tokens_per_rank != nullptr && tid < R) num_tokens_per_rank[tid] = s_rank[tid];
    if (num_tokens_per_expert != nullptr)
        for (int i = tid; i < E; i += blockDim.x) num_tokens_per_expert[i] = s_expert[i];
#ifdef EPD_NVSHMEM
    nvshmem_quiet();  // every thread: its payload puts delivered before the flags
#endif
    __threadfence_system();
    __syncthreads();
    if (tid < R) peer_signal(peers, R, tid, CTRL_NOTIFY_FLAG + rank, seq);

    // Phase C: wait for every source (deadline + abort word); phase D: the counts.
    int code = block_wait_all(my_ctrl, CTRL_NOTIFY_FLAG, R, seq, timeout_ns, PHASE_NOTIFY);
    if (!notify_publish(my_ctrl, code, CTRL_PAYLOAD_BYTES, stride, NOTIFY_TOKENS, NOTIFY_BAD,
                        NOTIFY_HEAD, R, L, rank, max_tokens, num_worst, alignment, recv_info,
                        count_matrix, rank_prefix, counter_slot, counter_seq))
        return;
    if (num_nodes > 1 && tid < R) {  // the rail rows of forwarder (my node, i) before source s
        const int per_node = R / num_nodes, s = tid;
        const volatile u64* node_tokens = my_ctrl + CTRL_NODE_TOKENS;
        int acc = 0;
        for (int a = 0; a < s / per_node; ++a) acc += (int)node_tokens[a * per_node + s % per_node];
        node_base[s] = acc;
    }

    // Phase E: positions (after the host already has its counts).
    for (int t = t0; t < t1; ++t) {
        unsigned mask = token_mask[t];
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) {
            if (d < R) {
                bool in = (mask >> d) & 1u;
                pos[(i64)t * R + d] = in ? off[d]++ : -1;
                if (is_token_in_rank != nullptr) is_token_in_rank[(i64)t * R + d] = in;
            }
        }
    }
    if (num_nodes > 1) node_rows(token_mask, T, R, num_nodes, node_pos, s_warp);
}

// ------------------------------------------------------------------------------------------
// wide notify: the whole-group notify of a two-stage group of more than EPD_MAX_RANKS ranks
// (up to LL_MAX_RANKS: N <= 8 nodes x L <= 8 ranks; server/backends/cuda_stages.py). The
// counting and publishing half of notify alone, since such a group's rows move in its stage
// groups: no positions, no hierarchical node counts, no layout outputs. Each source pushes
// [a count per destination rank | its token count | its bad input (code, value low, high) |
// the destination's per-expert counts]
// into the payload region of every rank's notify-only slot, behind the region's own flags
// (notify's flags hold EPD_MAX_RANKS ranks); recv_info, the count and prefix matrices, the
// capacity check and the counter slot are notify's.
// ------------------------------------------------------------------------------------------
#define WIDE_NOTIFY_FLAG 512      // u64 word of the notify-only slot: [LL_MAX_RANKS] flags
#define WIDE_PAYLOAD_BYTES 4608   // then the payload: [R][R + 4 + L] int32 per source
static_assert(WIDE_NOTIFY_FLAG * 8 == CTRL_PAYLOAD_BYTES &&
              WIDE_PAYLOAD_BYTES == CTRL_PAYLOAD_BYTES + LL_MAX_RANKS * 8, "wide notify layout");

extern "C" __global__ void __launch_bounds__(NOTIFY_THREADS, 1)
epd_wide_notify(const i64* __restrict__ topk_idx, int T, int K, int E, int R, int rank,
                const u64* __restrict__ peers, u64 seq, i64 timeout_ns, int alignment,
                int max_tokens, i64* counter_slot, u64 counter_seq,
                int* __restrict__ recv_info,      // [4 + L], as notify's
                int* __restrict__ count_matrix,   // [R, R]: tokens s -> d
                int* __restrict__ rank_prefix,    // [R, R]: rows from sources <= s on d
                int refused) {  // ERR_REFUSED: this rank's part was refused (T = 0), as notify's
    extern __shared__ int s_expert[];  // [E]
    __shared__ int s_rank[LL_MAX_RANKS];
    __shared__ u64 s_bad[2];  // this source's bad input (code, value): the payload carries it
    const int L = E / R, tid = threadIdx.x;
    u64* my_ctrl = ctrl_of(peers, rank);
    for (int i = tid; i < E; i += blockDim.x) s_expert[i] = 0;
    if (tid < LL_MAX_RANKS) s_rank[tid] = 0;
    if (tid < 2) s_bad[tid] = tid == 0 ? (u64)refused : 0;  // (a report cannot claim it then)
    __syncthreads();
    for (int t = tid; t < T; t += blockDim.x) {
        u64 mask = token_ranks(topk_idx, t, K, E, L, s_expert, BadInput{&s_bad[0], &s_bad[1]});
        for (; mask; mask &= mask - 1) atomicAdd(&s_rank[__ffsll((long long)mask) - 1], 1);
    }
    __syncthreads();

    const int stride = R + 4 + L;
    for (int i = tid; i < R * stride; i += blockDim.x) {
        const int r = i / stride, j = i % stride;
        const int v = j < R ? s_rank[j] : j == R ? T : j == R + 1 ? (int)s_bad[0]
                    : j == R + 2 ? (int)(unsigned)s_bad[1]
                    : j == R + 3 ? (int)(unsigned)(s_bad[1] >> 32)
                    : s_expert[r * L + (j - R - 4)];
        const i64 at = WIDE_PAYLOAD_BYTES + ((i64)rank * stride + j) * 4;
#ifdef EPD_NVSHMEM
        if (peer_remote(peers, r)) {
            nvshmem_int_p(reinterpret_cast<int*>(peer_sym(peers, R, r) + at), v,
                          peer_pe(peers, R, r));
            continue;
        }
#endif
        *reinterpret_cast<int*>(reinterpret_cast<char*>(ctrl_of(peers, r)) + at) = v;
    }
#ifdef EPD_NVSHMEM
    nvshmem_quiet();
#endif
    __threadfence_system();
    __syncthreads();
    if (tid < R) peer_signal(peers, R, tid, WIDE_NOTIFY_FLAG + rank, seq);

    int code = block_wait_all(my_ctrl, WIDE_NOTIFY_FLAG, R, seq, timeout_ns, PHASE_NOTIFY);
    notify_publish(my_ctrl, code, WIDE_PAYLOAD_BYTES, stride, R, R + 1, R + 4, R, L, rank,
                   max_tokens, 0, alignment, recv_info, count_matrix, rank_prefix, counter_slot,
                   counter_seq);
}

// 16-byte copy of one row by one warp to up to R destinations (read once, store R times).
__device__ __forceinline__ void warp_copy_row_multi(const char* __restrict__ src,
                                                    char* const (&dst)[EPD_MAX_RANKS],
                                                    unsigned mask, i64 nbytes, int lane) {
    if ((nbytes & 15) == 0) {
        const int4* s4 = reinterpret_cast<const int4*>(src);
        const i64 n = nbytes >> 4;
        constexpr int U = 4;
        i64 i = lane;
        for (; i + 32 * (U - 1) < n; i += 32 * U) {
            int4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) v[u] = __ldg(s4 + i + 32 * u);
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d) {
                if ((mask >> d) & 1u) {
                    int4* d4 = reinterpret_cast<int4*>(dst[d]);
#pragma unroll
                    for (int u = 0; u < U; ++u) d4[i + 32 * u] = v[u];
                }
            }
        }
        for (; i < n; i += 32) {
            int4 v = __ldg(s4 + i);
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d)
                if ((mask >> d) & 1u) reinterpret_cast<int4*>(dst[d])[i] = v;
        }
    } else {
        for (i64 i = lane; i < nbytes; i += 32) {
            char v = src[i];
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d)
                if ((mask >> d) & 1u) dst[d][i] = v;
        }
    }
}

// ------------------------------------------------------------------------------------------
// dispatch: warp per source token; each token row is read once and stored into every
// destination that holds one of its experts, at its final row. Metadata rows alongside.
// Offsets (`off_*`) are byte offsets of the sub-buffers inside every rank buffer.
// num_worst > 0: rows [num_recv, num_worst) of this rank's outputs are padding (zero x and
// scales, topk_idx -1, weight 0, src -1).
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(DATA_THREADS)
epd_dispatch(const char* __restrict__ x, i64 x_row_bytes, i64 x_stride_bytes,
             const char* __restrict__ x_scales, i64 sc_row_bytes, i64 sc_stride_bytes,
             const i64* __restrict__ topk_idx, const float* __restrict__ topk_weights,
             int T, int K, int L, int R, int rank,
             const unsigned char* __restrict__ token_mask, const int* __restrict__ pos,
             const int* __restrict__ rank_prefix, const int* __restrict__ recv_info,
             const u64* __restrict__ peers, i64 off_x, i64 off_scales, i64 off_idx, i64 off_w,
             i64 off_src_idx, i64 off_src_rank, int num_worst, int with_meta, int with_scales,
             int barrier, u64 seq, i64 timeout_ns,
             i64 off_net,  // this rank's staging of puts to other nodes (EPD_NVSHMEM)
             const int* __restrict__ count_matrix,
             int num_nodes,                         // > 1: hierarchical (see the top)
             const int* __restrict__ node_pos,      // [T, N] hierarchical (notify)
             const int* __restrict__ node_base) {   // [R] hierarchical (notify)
    const int lane = threadIdx.x & 31;
    const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    u64* my_ctrl = ctrl_of(peers, rank);
    if (group_failed(my_ctrl) || recv_info[1] != 0) return;

    if (barrier && entry_barrier(peers, R, rank, CTRL_DISPATCH_ENTRY, seq, timeout_ns,
                                 PHASE_DISPATCH_ENTRY))
        return;

    // Start row of this source's block on each destination.
    int base[EPD_MAX_RANKS];
#pragma unroll
    for (int d = 0; d < EPD_MAX_RANKS; ++d)
        base[d] = d < R ? block_first(rank_prefix, count_matrix, R, num_nodes, rank, d) : 0;
    const int per_node = num_nodes > 1 ? R / num_nodes : R;

    // Ranks on other nodes (EPD_NVSHMEM) get no store through a pointer: a token's row is
    // staged once in this rank's own buffer (row t at off_net, its scales after the T rows),
    // then put to each of them; metadata goes as single-element puts.
    unsigned remote_mask = 0;
#ifdef EPD_NVSHMEM
    for (int d = 0; d < R; ++d) remote_mask |= (peer_remote(peers, d) ? 1u : 0u) << d;
#endif
    char* const my_base = reinterpret_cast<char*>(my_ctrl);
    const i64 off_net_sc = off_net + ((i64)T * x_row_bytes + 15) / 16 * 16;

    for (int t = gwarp; t < T; t += nwarps) {
        const unsigned mask = token_mask[t];
        if (mask == 0) continue;
        const unsigned far = mask & remote_mask;
        const int stage_d = far ? __ffs(far) - 1 : -1;  // its dst slot takes the staging row
        const unsigned copy_mask = (mask & ~remote_mask) | (far ? 1u << stage_d : 0u);
        int row[EPD_MAX_RANKS];
        char* dst[EPD_MAX_RANKS];
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) {
            row[d] = ((mask >> d) & 1u) ? base[d] + pos[(i64)t * R + d] : 0;
            dst[d] = d == stage_d ? my_base + off_net + (i64)t * x_row_bytes
                   : ((copy_mask >> d) & 1u)
                         ? reinterpret_cast<char*>(peers[d]) + off_x + (i64)row[d] * x_row_bytes
                         : nullptr;
        }
        warp_copy_row_multi(x + (i64)t * x_stride_bytes, dst, copy_mask, x_row_bytes, lane);
        if (with_scales) {
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d)
                dst[d] = d == stage_d ? my_base + off_net_sc + (i64)t * sc_row_bytes
                       : ((copy_mask >> d) & 1u) ? reinterpret_cast<char*>(peers[d]) + off_scales +
                                                       (i64)row[d] * sc_row_bytes
                                                 : nullptr;
            warp_copy_row_multi(x_scales + (i64)t * sc_stride_bytes, dst, copy_mask,
                                sc_row_bytes, lane);
        }
#ifdef EPD_NVSHMEM
        if (far) {
            __syncwarp();  // the staged row, written by every lane, before the warp's puts
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d) {
                if (!((far >> d) & 1u)) continue;
                char* sym = reinterpret_cast<char*>(peer_sym(peers, R, d));
                const int pe = peer_pe(peers, R, d);
                nvshmemx_putmem_nbi_warp(sym + off_x + (i64)row[d] * x_row_bytes,
                                         my_base + off_net + (i64)t * x_row_bytes, x_row_bytes,
                                         pe);
                if (with_scales)
                    nvshmemx_putmem_nbi_warp(sym + off_scales + (i64)row[d] * sc_row_bytes,
                                             my_base + off_net_sc + (i64)t * sc_row_bytes,
                                             sc_row_bytes, pe);
            }
        }
#endif
        // Metadata: lane k carries pair k; lane 31 the source index/rank.
        i64 e = -1;
        float w = 0.f;
        if (with_meta && lane < K) {
            e = topk_idx[(i64)t * K + lane];
            w = topk_weights[(i64)t * K + lane];
        }
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) {
            if (!((mask >> d) & 1u)) continue;
#ifdef EPD_NVSHMEM
            if ((far >> d) & 1u) {
                char* sym = reinterpret_cast<char*>(peer_sym(peers, R, d));
                const int pe = peer_pe(peers, R, d);
                if (with_meta && lane < K) {
                    bool here = e >= (i64)d * L && e < (i64)(d + 1) * L;
                    nvshmem_longlong_p(reinterpret_cast<long long*>(sym + off_idx) +
                                           (i64)row[d] * K + lane,
                                       here ? (long long)(e - (i64)d * L) : -1ll, pe);
                    nvshmem_float_p(reinterpret_cast<float*>(sym + off_w) + (i64)row[d] * K +
                                        lane, here ? w : 0.f, pe);
                }
                if (lane == 31) {
                    const int shown = num_nodes > 1 ? node_pos[(i64)t * num_nodes + d / per_node] : t;
                    nvshmem_int_p(reinterpret_cast<int*>(sym + off_src_idx) + row[d], shown, pe);
                    nvshmem_int_p(reinterpret_cast<int*>(sym + off_src_rank) + row[d], rank, pe);
                }
                continue;
            }
#endif
            char* pb = reinterpret_cast<char*>(peers[d]);
            if (with_meta && lane < K) {
                bool here = e >= (i64)d * L && e < (i64)(d + 1) * L;
                reinterpret_cast<i64*>(pb + off_idx)[(i64)row[d] * K + lane] = here ? e - (i64)d * L : -1;
                reinterpret_cast<float*>(pb + off_w)[(i64)row[d] * K + lane] = here ? w : 0.f;
            }
            if (lane == 31) {
                // (hierarchical: the token's row among mine for d's node; d adds node_base)
                reinterpret_cast<int*>(pb + off_src_idx)[row[d]] =
                    num_nodes > 1 ? node_pos[(i64)t * num_nodes + d / per_node] : t;
                reinterpret_cast<int*>(pb + off_src_rank)[row[d]] = rank;
            }
        }
    }

    // Padding rows of this rank's own outputs (fixed-size mode).
    if (num_worst > 0) {
        const int n = recv_info[0];
        if (n > num_worst) {
            if (blockIdx.x == 0 && threadIdx.x == 0)
                record_error(my_ctrl, ERR_WORST_OVERFLOW, -1, PHASE_DISPATCH_DONE, seq);
        } else {
            char* pb = reinterpret_cast<char*>(my_ctrl);
            for (int r = n + gwarp; r < num_worst; r += nwarps) {
                int4* d4 = reinterpret_cast<int4*>(pb + off_x + (i64)r * x_row_bytes);
                if ((x_row_bytes & 15) == 0) {
                    for (i64 i = lane; i < (x_row_bytes >> 4); i += 32) d4[i] = make_int4(0, 0, 0, 0);
                } else {
                    for (i64 i = lane; i < x_row_bytes; i += 32) pb[off_x + (i64)r * x_row_bytes + i] = 0;
                }
                if (with_scales)
                    for (i64 i = lane; i < sc_row_bytes; i += 32) pb[off_scales + (i64)r * sc_row_bytes + i] = 0;
                if (with_meta && lane < K) {
                    reinterpret_cast<i64*>(pb + off_idx)[(i64)r * K + lane] = -1;
                    reinterpret_cast<float*>(pb + off_w)[(i64)r * K + lane] = 0.f;
                }
                if (lane == 31) {
                    reinterpret_cast<int*>(pb + off_src_idx)[r] = -1;
                    reinterpret_cast<int*>(pb + off_src_rank)[r] = -1;
                }
            }
        }
    }

    if (signal_done(peers, R, rank, CTRL_DISPATCH_FLAG, seq)) {
        // The last block holds the kernel open until every source's rows have landed here, so
        // the kernel's completion (and the stream's next event) means recv_* are complete.
        const int code = block_wait_all(my_ctrl, CTRL_DISPATCH_FLAG, R, seq, timeout_ns,
                                        PHASE_DISPATCH_DONE);
        if (code == 0 && num_nodes > 1) {
            // Hierarchical: each row's index in its forwarder's rail list = the rail rows of
            // the sources before its own (node_base) + what its source wrote.
            int first_at[EPD_MAX_RANKS];
#pragma unroll
            for (int p = 0; p < EPD_MAX_RANKS; ++p)
                first_at[p] = p < R ? block_first(rank_prefix, count_matrix, R, num_nodes,
                                                  src_at(p, R, num_nodes), rank) : 0;
            volatile int* src_idx = reinterpret_cast<volatile int*>(
                reinterpret_cast<char*>(my_ctrl) + off_src_idx);
            const int n = recv_info[0];
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                int first;
                const int s = row_source(i, first_at, R, num_nodes, first);
                src_idx[i] = src_idx[i] + node_base[s];
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// combine, step 1 (on the expert side d): push every received row that came from another
// rank back into its source's staging buffer, at send_off[s][d] + (row - first row of s).
// Rows that came from this rank itself stay where they are (step 2 reads y directly).
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(DATA_THREADS)
epd_combine_push(const char* __restrict__ y, i64 y_row_bytes, i64 y_stride_bytes,
                 const float* __restrict__ w, i64 w_stride, int K, int R, int rank,
                 const int* __restrict__ recv_info, const int* __restrict__ count_matrix,
                 const int* __restrict__ rank_prefix, const u64* __restrict__ peers,
                 i64 off_stage_y, i64 off_stage_w, int barrier, u64 seq, i64 timeout_ns,
                 i64 off_net,    // this rank's staging of puts to other nodes (EPD_NVSHMEM)
                 int num_nodes) {  // > 1: hierarchical (the sources' order, see the top)
    const int lane = threadIdx.x & 31;
    const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    if (group_failed(ctrl_of(peers, rank)) || recv_info[1] != 0) return;

    if (barrier && entry_barrier(peers, R, rank, CTRL_COMBINE_ENTRY, seq, timeout_ns,
                                 PHASE_COMBINE_ENTRY))
        return;

    const int n = recv_info[0];
    int first_at[EPD_MAX_RANKS];  // first row on this rank of the p-th source in its order
    int dst_base[EPD_MAX_RANKS];  // send_off[s][rank]
#pragma unroll
    for (int s = 0; s < EPD_MAX_RANKS; ++s) {
        first_at[s] = s < R ? block_first(rank_prefix, count_matrix, R, num_nodes,
                                          src_at(s, R, num_nodes), rank) : 0;
        int acc = 0;
        if (s < R)
            for (int d = 0; d < rank; ++d) acc += count_matrix[s * R + d];
        dst_base[s] = acc;
    }
    for (int i = gwarp; i < n; i += nwarps) {
        int first;
        const int s = row_source(i, first_at, R, num_nodes, first);
        if (s == rank) continue;
        int srow = 0;
#pragma unroll
        for (int q = 0; q < EPD_MAX_RANKS; ++q)
            if (q == s) srow = dst_base[q] + i - first;
#ifdef EPD_NVSHMEM
        if (peer_remote(peers, s)) {  // another node: row i staged here (the weights after
            char* mine = reinterpret_cast<char*>(ctrl_of(peers, rank));  // the n rows), put
            char* st = mine + off_net + (i64)i * y_row_bytes;
            float* stw = reinterpret_cast<float*>(
                mine + off_net + ((i64)n * y_row_bytes + 15) / 16 * 16) + (i64)i * K;
            char* one[EPD_MAX_RANKS];
#pragma unroll
            for (int q = 0; q < EPD_MAX_RANKS; ++q) one[q] = st;
            warp_copy_row_multi(y + (i64)i * y_stride_bytes, one, 1u, y_row_bytes, lane);
            if (w != nullptr && lane < K) stw[lane] = w[(i64)i * w_stride + lane];
            __syncwarp();
            char* sym = reinterpret_cast<char*>(peer_sym(peers, R, s));
            const int pe = peer_pe(peers, R, s);
            nvshmemx_putmem_nbi_warp(sym + off_stage_y + (i64)srow * y_row_bytes, st,
                                     y_row_bytes, pe);
            if (w != nullptr)
                nvshmemx_putmem_nbi_warp(sym + off_stage_w + (i64)srow * K * 4, stw, K * 4, pe);
            continue;
        }
#endif
        char* pb = reinterpret_cast<char*>(peers[s]);
        char* dst[EPD_MAX_RANKS];
#pragma unroll
        for (int q = 0; q < EPD_MAX_RANKS; ++q) dst[q] = pb + off_stage_y + (i64)srow * y_row_bytes;
        warp_copy_row_multi(y + (i64)i * y_stride_bytes, dst, 1u, y_row_bytes, lane);
        if (w != nullptr && lane < K)
            reinterpret_cast<float*>(pb + off_stage_w)[(i64)srow * K + lane] =
                w[(i64)i * w_stride + lane];
    }
    signal_done(peers, R, rank, CTRL_COMBINE_FLAG, seq);
}

// ------------------------------------------------------------------------------------------
// combine, step 2 (on the source side s): wait for every peer's pushes, then per token
// acc = 0 + bias_0 + bias_1, += fp32(row from d) for d ascending, cast back (RNE).
// kHier (hierarchical, see the top): += round(fp32 partial of node b's rows) for the nodes b
// holding the token, ascending, each partial 0 + its local ranks' rows in ascending order.
// Warp per token, 16-byte loads, U vectors per lane in flight.
// ------------------------------------------------------------------------------------------
template <typename Tr, bool kHier>
__device__ __forceinline__ void
combine_reduce_body(typename Tr::word* __restrict__ out, i64 out_stride,
                    const typename Tr::word* __restrict__ y, i64 y_stride,
                    const typename Tr::word* __restrict__ bias0, i64 b0_stride,
                    const typename Tr::word* __restrict__ bias1, i64 b1_stride,
                    float* __restrict__ out_w, const float* __restrict__ w, i64 w_stride,
                    int T, int H, int K, int R, int rank,
                    const unsigned char* __restrict__ token_mask, const int* __restrict__ pos,
                    const int* __restrict__ count_matrix, const int* __restrict__ rank_prefix,
                    const u64* __restrict__ peers, i64 off_stage_y, i64 off_stage_w, u64 seq,
                    i64 timeout_ns, int num_nodes) {
    typedef typename Tr::word word;
    constexpr int V = Tr::kPerVec;
    // 16-byte vectors per lane in flight per source row (hierarchical: fewer, for the partial)
    constexpr int U = kHier ? 2 : 4;
    const int lane = threadIdx.x & 31;
    const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    u64* my_ctrl = ctrl_of(peers, rank);
    if (group_failed(my_ctrl)) return;

    if (block_wait_all(my_ctrl, CTRL_COMBINE_FLAG, R, seq, timeout_ns, PHASE_COMBINE_DONE))
        return;
    // A source whose engine refused its part pushed nothing (epd_combine_refused): this
    // call's output is zeros and the call reported (the group goes on).
    {
        __shared__ int s_refused;
        if (threadIdx.x == 0) s_refused = EPD_MAX_RANKS;
        __syncthreads();
        if ((int)threadIdx.x < R && ld_acquire_sys(my_ctrl + CTRL_COMBINE_REFUSED + threadIdx.x) == seq)
            atomicMin(&s_refused, (int)threadIdx.x);
        __syncthreads();
        const int refused = s_refused;
        if (refused < R) {
            if (blockIdx.x == 0 && threadIdx.x == 0)
                report_bad_input(call_err_words(my_ctrl), refused, ERR_REFUSED);
            // Its output is zeros, not whatever the caller's new tensor held: a caller that
            // never calls check() combines nothing rather than stale memory.
            for (int t = gwarp; t < T; t += nwarps) {
                for (int i = lane; i < H / V; i += 32)
                    *reinterpret_cast<int4*>(out + (i64)t * out_stride + (i64)i * V) =
                        make_int4(0, 0, 0, 0);
                if (out_w != nullptr && lane < K) out_w[(i64)t * K + lane] = 0.f;
            }
            return;
        }
    }

    const char* stage_y = reinterpret_cast<const char*>(my_ctrl) + off_stage_y;
    const float* stage_w = reinterpret_cast<const float*>(
        reinterpret_cast<const char*>(my_ctrl) + off_stage_w);
    int send_off[EPD_MAX_RANKS];  // row of the first (s=rank -> d) row in staging
    {
        int acc = 0;
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) {
            send_off[d] = acc;
            if (d < R) acc += count_matrix[rank * R + d];
        }
    }
    const int self_first = block_first(rank_prefix, count_matrix, R, num_nodes, rank, rank);
    const int nvec = H / V;
    // Hierarchical: bit d = rank d is the first (node_starts) or last (node_ends) of its node.
    const int per_node = kHier ? R / num_nodes : R;
    unsigned node_starts = 0, node_ends = 0;
    if (kHier)
        for (int b = 0; b < num_nodes; ++b) {
            node_starts |= 1u << (b * per_node);
            node_ends |= 1u << (b * per_node + per_node - 1);
        }

    for (int t = gwarp; t < T; t += nwarps) {
        const unsigned mask = token_mask[t];
        unsigned ends = 0;  // hierarchical: the last ranks of the nodes that hold the token
        if (kHier)
            for (int b = 0; b < num_nodes; ++b)
                if ((mask >> (b * per_node)) & ((1u << per_node) - 1u))
                    ends |= 1u << (b * per_node + per_node - 1);
        const int4* src[EPD_MAX_RANKS];
        int srow[EPD_MAX_RANKS];
#pragma unroll
        for (int d = 0; d < EPD_MAX_RANKS; ++d) {
            src[d] = nullptr;
            srow[d] = 0;
            if ((mask >> d) & 1u) {
                int p = pos[(i64)t * R + d];
                if (d == rank) {
                    srow[d] = self_first + p;
                    src[d] = reinterpret_cast<const int4*>(y + (i64)srow[d] * y_stride);
                } else {
                    srow[d] = send_off[d] + p;
                    src[d] = reinterpret_cast<const int4*>(stage_y + (i64)srow[d] * H * sizeof(word));
                }
            }
        }
        for (int i0 = lane; i0 < nvec; i0 += 32 * U) {
            float acc[U][V];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = i0 + 32 * u;
#pragma unroll
                for (int j = 0; j < V; ++j) acc[u][j] = 0.f;
                if (i < nvec) {
                    if (bias0 != nullptr) {
                        int4 b = *reinterpret_cast<const int4*>(bias0 + (i64)t * b0_stride + (i64)i * V);
                        const word* bw = reinterpret_cast<const word*>(&b);
#pragma unroll
                        for (int j = 0; j < V; ++j) acc[u][j] = acc[u][j] + Tr::to_f32(bw[j]);
                    }
                    if (bias1 != nullptr) {
                        int4 b = *reinterpret_cast<const int4*>(bias1 + (i64)t * b1_stride + (i64)i * V);
                        const word* bw = reinterpret_cast<const word*>(&b);
#pragma unroll
                        for (int j = 0; j < V; ++j) acc[u][j] = acc[u][j] + Tr::to_f32(bw[j]);
                    }
                }
            }
            if constexpr (!kHier) {
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d) {
                if ((mask >> d) & 1u) {
                    int4 v[U];
#pragma unroll
                    for (int u = 0; u < U; ++u)  // plain loads: peers wrote these rows
                        v[u] = i0 + 32 * u < nvec ? src[d][i0 + 32 * u] : make_int4(0, 0, 0, 0);
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        const word* vw = reinterpret_cast<const word*>(&v[u]);
#pragma unroll
                        for (int j = 0; j < V; ++j) acc[u][j] = acc[u][j] + Tr::to_f32(vw[j]);
                    }
                }
            }
            } else {
                float part[U][V];  // the partial sum of the current node (its forwarder's)
#pragma unroll
                for (int d = 0; d < EPD_MAX_RANKS; ++d) {
                    if ((node_starts >> d) & 1u) {
#pragma unroll
                        for (int u = 0; u < U; ++u)
#pragma unroll
                            for (int j = 0; j < V; ++j) part[u][j] = 0.f;
                    }
                    if ((mask >> d) & 1u) {
                        int4 v[U];
#pragma unroll
                        for (int u = 0; u < U; ++u)  // plain loads: peers wrote these rows
                            v[u] = i0 + 32 * u < nvec ? src[d][i0 + 32 * u]
                                                      : make_int4(0, 0, 0, 0);
#pragma unroll
                        for (int u = 0; u < U; ++u) {
                            const word* vw = reinterpret_cast<const word*>(&v[u]);
#pragma unroll
                            for (int j = 0; j < V; ++j)
                                part[u][j] = part[u][j] + Tr::to_f32(vw[j]);
                        }
                    }
                    if ((ends >> d) & 1u) {  // the node's partial, rounded as it would travel
#pragma unroll
                        for (int u = 0; u < U; ++u)
#pragma unroll
                            for (int j = 0; j < V; ++j)
                                acc[u][j] = acc[u][j] + Tr::to_f32(Tr::from_f32(part[u][j]));
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int i = i0 + 32 * u;
                if (i < nvec) {
                    int4 o;
                    word* ow = reinterpret_cast<word*>(&o);
#pragma unroll
                    for (int j = 0; j < V; ++j) ow[j] = Tr::from_f32(acc[u][j]);
                    *reinterpret_cast<int4*>(out + (i64)t * out_stride + (i64)i * V) = o;
                }
            }
        }
        if (out_w != nullptr && lane < K) {
            float a = 0.f;
            float part = 0.f;  // hierarchical: the node's partial (fp32, not rounded)
#pragma unroll
            for (int d = 0; d < EPD_MAX_RANKS; ++d) {
                if (kHier && ((node_starts >> d) & 1u)) part = 0.f;
                if ((mask >> d) & 1u) {
                    const float v = d == rank ? w[(i64)srow[d] * w_stride + lane]
                                              : stage_w[(i64)srow[d] * K + lane];
                    if (kHier) part = part + v;
                    else a = a + v;
                }
                if (kHier && ((ends >> d) & 1u)) a = a + part;
            }
            out_w[(i64)t * K + lane] = a;
        }
    }
}

// The flat or the hierarchical reduce (num_nodes > 1), each its own instantiation.
template <typename Tr>
__device__ __forceinline__ void
combine_reduce_any(typename Tr::word* __restrict__ out, i64 out_stride,
                   const typename Tr::word* __restrict__ y, i64 y_stride,
                   const typename Tr::word* __restrict__ bias0, i64 b0_stride,
                   const typename Tr::word* __restrict__ bias1, i64 b1_stride,
                   float* __restrict__ out_w, const float* __restrict__ w, i64 w_stride,
                   int T, int H, int K, int R, int rank,
                   const unsigned char* __restrict__ token_mask, const int* __restrict__ pos,
                   const int* __restrict__ count_matrix, const int* __restrict__ rank_prefix,
                   const u64* __restrict__ peers, i64 off_stage_y, i64 off_stage_w, u64 seq,
                   i64 timeout_ns, int num_nodes) {
    if (num_nodes > 1)
        combine_reduce_body<Tr, true>(out, out_stride, y, y_stride, bias0, b0_stride, bias1,
                                      b1_stride, out_w, w, w_stride, T, H, K, R, rank,
                                      token_mask, pos, count_matrix, rank_prefix, peers,
                                      off_stage_y, off_stage_w, seq, timeout_ns, num_nodes);
    else
        combine_reduce_body<Tr, false>(out, out_stride, y, y_stride, bias0, b0_stride, bias1,
                                       b1_stride, out_w, w, w_stride, T, H, K, R, rank,
                                       token_mask, pos, count_matrix, rank_prefix, peers,
                                       off_stage_y, off_stage_w, seq, timeout_ns, num_nodes);
}

template <typename Tr>
__global__ void __launch_bounds__(DATA_THREADS)
epd_combine_reduce(typename Tr::word* __restrict__ out, i64 out_stride,
                   const typename Tr::word* __restrict__ y, i64 y_stride,
                   const typename Tr::word* __restrict__ bias0, i64 b0_stride,
                   const typename Tr::word* __restrict__ bias1, i64 b1_stride,
                   float* __restrict__ out_w, const float* __restrict__ w, i64 w_stride,
                   int T, int H, int K, int R, int rank,
                   const unsigned char* __restrict__ token_mask, const int* __restrict__ pos,
                   const int* __restrict__ count_matrix, const int* __restrict__ rank_prefix,
                   const u64* __restrict__ peers, i64 off_stage_y, i64 off_stage_w, u64 seq,
                   i64 timeout_ns, int num_nodes, const int* __restrict__ recv_info) {
    // A dispatch that failed alike on every rank (capacity, num_worst_tokens, bad input, a
    // refused part: recv_info[1]) moved no row, and
    // its combine's push kernels skipped: no flag will come, and the handle's positions are not
    // this call's. The engine may launch such a combine before it knows (a worst-case
    // dispatch's receive count is not waited for on the host).
    if (recv_info[1] != 0) return;
    combine_reduce_any<Tr>(out, out_stride, y, y_stride, bias0, b0_stride, bias1, b1_stride,
                           out_w, w, w_stride, T, H, K, R, rank, token_mask, pos,
                           count_matrix, rank_prefix, peers, off_stage_y, off_stage_w, seq,
                           timeout_ns, num_nodes);
}

#ifndef __CUDACC_RTC__  // NVRTC instantiates through name expressions
template __global__ void epd_combine_reduce<Bf16>(Bf16::word*, i64, const Bf16::word*, i64,
    const Bf16::word*, i64, const Bf16::word*, i64, float*, const float*, i64, int, int, int,
    int, int, const unsigned char*, const int*, const int*, const int*, const u64*, i64, i64,
    u64, i64, int, const int*);
#endif

#ifdef EPD_NVSHMEM  // a linked module is searched by plain names: one per combine element type
#define EPD_REDUCE_BY_NAME(Tr)                                                                 \
    extern "C" __global__ void __launch_bounds__(DATA_THREADS) epd_combine_reduce_##Tr(        \
        Tr::word* __restrict__ out, i64 out_stride, const Tr::word* __restrict__ y,            \
        i64 y_stride, const Tr::word* __restrict__ bias0, i64 b0_stride,                       \
        const Tr::word* __restrict__ bias1, i64 b1_stride, float* __restrict__ out_w,          \
        const float* __restrict__ w, i64 w_stride, int T, int H, int K, int R, int rank,       \
        const unsigned char* __restrict__ token_mask, const int* __restrict__ pos,             \
        const int* __restrict__ count_matrix, const int* __restrict__ rank_prefix,             \
        const u64* __restrict__ peers, i64 off_stage_y, i64 off_stage_w, u64 seq,              \
        i64 timeout_ns, int num_nodes, const int* __restrict__ recv_info) {                    \
        if (recv_info[1] != 0) return; /* (as epd_combine_reduce) */                           \
        combine_reduce_any<Tr>(out, out_stride, y, y_stride, bias0, b0_stride, bias1,          \
                               b1_stride, out_w, w, w_stride, T, H, K, R, rank, token_mask,    \
                               pos, count_matrix, rank_prefix, peers, off_stage_y,             \
                               off_stage_w, seq, timeout_ns, num_nodes);                       \
    }
EPD_REDUCE_BY_NAME(Bf16)
EPD_REDUCE_BY_NAME(F16)
EPD_REDUCE_BY_NAME(F32)
#endif

// ------------------------------------------------------------------------------------------
// combine_refused: this rank's part of a stream-ordered combine its engine refused (bad
// descriptors): it passes the combine's entry barrier as a push would (so it never runs ahead
// of a peer still reducing the previous combine, whose refused word it would overwrite), says
// in every peer's block that it refused this sequence, then raises its push flag. Every peer's
// reduce then reports ERR_REFUSED naming this rank instead of waiting out its deadline for
// pushes that never come. Skipped as the push is: a failed group, or the combine of a dispatch
// that failed alike (`recv_info`, when the engine knows the handle). One block.
// ------------------------------------------------------------------------------------------
extern "C" __global__ void epd_combine_refused(const u64* __restrict__ peers, int R, int rank,
                                               u64 seq, i64 timeout_ns,
                                               const int* __restrict__ recv_info) {
    if (group_failed(ctrl_of(peers, rank)) || (recv_info != nullptr && recv_info[1] != 0))
        return;
    if (entry_barrier(peers, R, rank, CTRL_COMBINE_ENTRY, seq, timeout_ns,
                      PHASE_COMBINE_ENTRY))
        return;
    const int r = threadIdx.x;
    if (r >= R) return;
    peer_signal(peers, R, r, CTRL_COMBINE_REFUSED + rank, seq);
#ifdef EPD_NVSHMEM
    if (peer_remote(peers, r)) nvshmem_fence();  // (the verdict lands before the flag)
#endif
    peer_signal(peers, R, r, CTRL_COMBINE_FLAG + rank, seq);
}

// ------------------------------------------------------------------------------------------
// abort: raise the abort word of every rank of the group (launched on a side stream while the
// group's own stream may be stuck in a wait).
// ------------------------------------------------------------------------------------------
// ------------------------------------------------------------------------------------------
// call_done: the last kernel of a stream-ordered normal-mode call. Reports the call's bad input
// (and clears it: the group goes on) or the group's sticky error in the counter slot, then
// writes DONE = seq, which the client's stream waits for.
// ------------------------------------------------------------------------------------------
extern "C" __global__ void epd_call_done(const u64* __restrict__ peers, int rank,
                                         unsigned* slot32, unsigned seq) {
    if (threadIdx.x != 0) return;
    u64* ctrl = ctrl_of(peers, rank);
    i64* slot64 = reinterpret_cast<i64*>(slot32);
    const u64 call = *reinterpret_cast<volatile u64*>(ctrl + CTRL_CALL_ERR);
    const u64 code = *reinterpret_cast<volatile u64*>(ctrl + CTRL_ERR_CODE);
    const u64 aborted = abort_code(ctrl);
    if (call || code || aborted) {
        unsigned c;
        int who;
        i64 value = (i64)ctrl[CTRL_CALL_ERR_VALUE];
        if (call) {  // (reported once, whatever is reported: the group goes on after it)
            ctrl[CTRL_CALL_ERR_VALUE] = 0;
            ctrl[CTRL_CALL_ERR] = 0;
        }
        // A fatal failure first: the bad input of a layout must not hide a deadline or an
        // abort from the host, which refuses later calls by the latest failure it reads.
        if (!code && !aborted) {
            c = (unsigned)call;
            // (a combine a peer's engine refused: the value is that rank)
            who = call == ERR_REFUSED ? (int)value : rank;
        } else if (code) {
            c = (unsigned)code | ((unsigned)ctrl[CTRL_ERR_PHASE] << 8);
            who = (int)(i64)ctrl[CTRL_ERR_RANK];
            value = (i64)ctrl[CTRL_ERR_SEQ];
            // A kernel that stopped on the abort word names no rank: the word does.
            if (who < 0 && aborted) who = (int)(aborted >> ABORT_RANK_SHIFT) - 1;
        } else {
            c = ERR_ABORTED;
            who = (int)(aborted >> ABORT_RANK_SHIFT) - 1;
            value = 0;
        }
        slot64[SLOT_FAIL_VALUE] = value;
        slot32[SLOT32_FAIL_CODE] = c;
        slot32[SLOT32_FAIL_RANK] = (unsigned)who;
        __threadfence_system();
        reinterpret_cast<volatile unsigned*>(slot32)[SLOT32_FAIL_SEQ] = seq;
    }
    __threadfence_system();
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(slot32 + SLOT32_DONE), "r"(seq)
                 : "memory");
}

// A two-stage group's stream-ordered call (server/backends/cuda_stages.py): its stage kernels
// record failures in their own control blocks, and epd_call_done reads the rank's whole-group
// block alone. So, before it, the first failure of the rail stage, then of the node stage, is
// recorded in the whole-group block (if that holds none), the stage's rank turned into the group
// rank (rail rank a: a * L + local; node rank j: node * L + j). A stage's bad-input word is
// cleared: the whole-group notify reads the same ids and reports them itself.
extern "C" __global__ void epd_stage_errors(const u64* __restrict__ peers, int rank,
                                            u64* rail_ctrl, u64* node_ctrl, int per_node) {
    if (threadIdx.x != 0) return;
    u64* ctrl = ctrl_of(peers, rank);
    const int node = rank / per_node, local = rank % per_node;
    u64* const stage[2] = {rail_ctrl, node_ctrl};
    for (int i = 0; i < 2; ++i) {
        u64* st = stage[i];
        st[CTRL_CALL_ERR] = 0;
        st[CTRL_CALL_ERR_VALUE] = 0;
        const u64 code = *reinterpret_cast<volatile u64*>(st + CTRL_ERR_CODE);
        if (code == 0 || *reinterpret_cast<volatile u64*>(ctrl + CTRL_ERR_CODE) != 0) continue;
        int who = (int)(i64)st[CTRL_ERR_RANK];
        if (who >= 0) who = i == 0 ? who * per_node + local : node * per_node + who;
        record_error(ctrl, (int)code, who, (int)st[CTRL_ERR_PHASE], st[CTRL_ERR_SEQ]);
    }
}

extern "C" __global__ void epd_abort(const u64* __restrict__ peers, int R, u64 code) {
    int r = threadIdx.x;
    if (r < R) peer_signal(peers, R, r, CTRL_ABORT, code);
}

// A live rank of a shrink group masked (or unmasked) by a call: its bit in every rank's
// CTRL_LIVE_MASK. Its flags are still awaited (it keeps calling); each low-latency dispatch
// agrees on the ranks it leaves out (epd_low_latency.cu). Only the ranks of this node (as
// epd_mask_rank): the others still leave the rank out, from what this node's ranks post.
extern "C" __global__ void epd_live_mask(const u64* __restrict__ peers, int R, int rank,
                                         int masked) {
    int r = threadIdx.x;
    if (r < R && !peer_remote(peers, r)) {
        unsigned long long* w =
            reinterpret_cast<unsigned long long*>(ctrl_of(peers, r) + CTRL_LIVE_MASK);
        if (masked) atomicOr_system(w, 1ull << rank);
        else atomicAnd_system(w, ~(1ull << rank));
        __threadfence_system();
    }
}

// A replacement rejoined in rank `rank`'s place: this rank's waits include it again (its
// CTRL_MASK bit cleared atomically: another engine may be masking a rank at the same time).
extern "C" __global__ void epd_unmask_rank(u64* ctrl, int rank) {
    if (threadIdx.x == 0) {
        atomicAnd_system(reinterpret_cast<unsigned long long*>(ctrl + CTRL_MASK),
                         ~(1ull << rank));
        __threadfence_system();
    }
}

// A rank of a shrink group went away: every rank's waits skip it from now on (CTRL_MASK bit).
// Only the ranks of this node: a remote OR would need NVSHMEM's network atomics; each node's
// engine masks its own ranks.
extern "C" __global__ void epd_mask_rank(const u64* __restrict__ peers, int R, int gone) {
    int r = threadIdx.x;
    if (r < R && !peer_remote(peers, r)) {
        atomicOr_system(reinterpret_cast<unsigned long long*>(ctrl_of(peers, r) + CTRL_MASK),
                        1ull << gone);
        __threadfence_system();
    }
}
