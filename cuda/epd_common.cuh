// EPD intranode kernels: shared definitions.
//
// Header-free on purpose (no cuda_bf16.h / cuda_fp16.h): NVRTC as shipped with the CuPy wheels
// may not find the toolkit headers, and we only need bit-level conversions.
#pragma once

typedef long long i64;
typedef unsigned long long u64;

// Most ranks of a normal-mode group (one bit each in a token's destination mask, one node).
#define EPD_MAX_RANKS 8
// Most ranks of a low-latency group (one bit each in the u64 masks; EP across nodes).
#define LL_MAX_RANKS 64

// Control block at the start of every rank buffer (u64 words). Every value of this header is
// defined once in proto/abi.py; tests/test_abi.py fails when one here differs.
#define CTRL_ABORT 0           // nonzero: the group was aborted (value = code)
#define CTRL_ERR_CODE 1        // first error seen by this rank's kernels
#define CTRL_ERR_RANK 2        // the rank that did not arrive (or -1)
#define CTRL_ERR_PHASE 3       // which wait failed (PHASE_*)
#define CTRL_ERR_SEQ 4         // sequence of the failed collective
#define CTRL_CALL_ERR 5        // bad input of the current stream-ordered call (cleared when reported)
#define CTRL_CALL_ERR_VALUE 7  // the offending value (an expert id)
#define CALL_ERR_CLAIMED 0xFFFF  // CTRL_CALL_ERR while its first reporter writes the value
#define CTRL_TICKET 6          // last-block ticket of the data kernels (u32 in the low half)
#define CTRL_NOTIFY_FLAG 8     // [R] notify payload from source s has arrived (value = seq)
#define CTRL_DISPATCH_FLAG 16  // [R] source s finished its dispatch pushes
#define CTRL_DISPATCH_ENTRY 24 // [R] source s entered a cached dispatch (buffer free barrier)
#define CTRL_COMBINE_FLAG 32   // [R] source s finished its combine pushes
#define CTRL_COMBINE_ENTRY 40  // [R] source s entered combine (buffer free barrier)
#define CTRL_NODE_TOKENS 48    // [R] hierarchical notify: source s's tokens with an expert on this node
#define CTRL_COMBINE_REFUSED 56  // [R] source s's engine refused its part of combine #value
#define CTRL_MASK 80              // bit r: rank r went away (shrink groups): waits skip it
#define CTRL_HOST_WORDS 96        // device address of this rank's host words (0: none), below
#define CTRL_REJOIN_HELLO 98       // rejoin: the replacement's nonce, in each taking-part rank's block
#define CTRL_REJOIN_READY 99       // rejoin: this rank arrived (= the nonce), its sequences below
#define CTRL_REJOIN_LL_DISPATCH 100  // rejoin: this rank's low-latency dispatch sequence
#define CTRL_REJOIN_LL_COMBINE 101   // rejoin: this rank's low-latency combine sequence
#define CTRL_REJOIN_ACK 102        // rejoin: the replacement took the sequences (= the nonce)
#define CTRL_LIVE_MASK 97         // bit r: rank r is masked by a call (alive: still waited for)
// Low-latency flags, [LL_MAX_RANKS] each (a low-latency group may span nodes):
#define CTRL_LL_DISPATCH_FLAG 128 // source s finished its low-latency dispatch pushes
#define CTRL_LL_COMBINE_FLAG 192  // source s finished its low-latency combine pushes
#define CTRL_LL_READY_FLAG 256    // destination d finished (published) its low-latency dispatch
#define CTRL_LL_COMBINE_READY 320 // source s finished reducing its low-latency combine
#define CTRL_LL_HIST_FLAG 384     // source s posted its low-latency dispatch histogram
#define CTRL_LL_SEEN 448          // the ranks source s saw masked or gone when it posted its histogram
// Host words: mapped host memory of the rank's engine, which its host writes with no GPU work
// (an abort, a rank that went away), so that no kernel or stream wait queued ahead can delay
// them: under MPS one parked client stream can stall a hardware queue the engine's own
// streams share. The engine also writes both into the control blocks (by kernels it does not
// await), so the host words are the backstop for a stuck queue, read only where a wait has
// lasted HOST_POLL_AFTER_NS: in the wait (then every 64 spins) and by the code right after
// such a wait (host_gone). Nowhere else: the single reads at every kernel's entry slowed each
// call ~6x on the H200 (a D low-latency pair 0.46 -> 2.8 ms; reads inside the waits on top:
// 3.7 ms; docs/BENCHMARKS.md), and what they carry only has to beat deadlines of seconds.
#define HOST_WORD_ABORT 0         // nonzero: the group was aborted (value = code)
#define HOST_WORD_GONE 1          // bit r: rank r went away (shrink groups)
#define HOST_POLL_AFTER_NS 1000000  // a wait reads the host words after 1 ms, not sooner
#define CTRL_PAYLOAD_BYTES 4096 // notify payload: [R_MAX][NOTIFY_HEAD + L] int32 per source slot
// A notify payload from one source: R_MAX per-destination counts, the source's token count, its
// bad input (a whole group's dispatch: 0, ERR_BAD_INPUT or ERR_BAD_COUNT, then the first bad
// value's low and high 32 bits), then its L per-expert counts for the destination.
#define NOTIFY_TOKENS 8  // EPD_MAX_RANKS
#define NOTIFY_BAD 9
#define NOTIFY_HEAD 12
static_assert(NOTIFY_TOKENS == EPD_MAX_RANKS && NOTIFY_BAD == NOTIFY_TOKENS + 1 &&
              NOTIFY_HEAD == NOTIFY_BAD + 3, "notify payload layout");

#define ERR_DEADLINE 1
#define ERR_ABORTED 2
#define ERR_WORST_OVERFLOW 3
#define ERR_BAD_INPUT 4  // an expert id out of range
#define ERR_BAD_COUNT 5  // a negative num_tokens_per_expert of a dispatch without top-k
// A source's dispatch has more tokens than max_tokens_per_rank: every rank fails the call (its
// counter slot: NUM_RECV = the largest token count, ERR_RANK = its rank); nothing moved.
#define ERR_CAPACITY 8
// A rank's engine refused its part of a stream-ordered dispatch (bad descriptors): it takes part
// with no tokens and this code as its payload's verdict, so every rank fails the call.
#define ERR_REFUSED 9
// A low-latency dispatch's token names one expert twice (its verdict; ERR_BAD_INPUT: an id
// outside [-1, E)): every rank fails the call, nothing moves.
#define ERR_BAD_DUPLICATE 10
// A low-latency combine's top-k entry names an expert its dispatch did not send that token to
// (its verdict, as ERR_BAD_DUPLICATE for an expert twice in a row): that rank's combine fails,
// its output leaves the entry out; the other ranks' combines are exact and nothing aborts.
#define ERR_NOT_DISPATCHED 11
// The ranks of a low-latency dispatch passed different num_max_dispatch_tokens_per_rank or
// use_fp8 (its verdict): every rank fails the call, nothing moves, the group goes on.
#define ERR_DISAGREE 12

// Abort word a rank writes when it leaves: ((rank + 1) << ABORT_RANK_SHIFT) | ERR_ABORTED.
#define ABORT_RANK_SHIFT 8

// Stream-ordered calls: the done word is DONE_OK, or DONE_FAILED | code << DONE_CODE_SHIFT
// (| (source + 1) << DONE_RANK_SHIFT | (sequence & 0x7f) << DONE_SEQ_SHIFT for a low-latency
// dispatch a source's bad ids failed, with the id in int64 word STREAM_FAIL_VALUE, its token in
// int32 word STREAM_FAIL_TOKEN and the failed done value, which no trigger clears, in int32 word
// STREAM_FAIL_DONE of the op's counter slot; STREAM_DONE is the done word's int32 index there).
#define DONE_OK 1u
#define DONE_FAILED 2u
#define DONE_CODE_SHIFT 8
#define DONE_RANK_SHIFT 16
#define DONE_SEQ_SHIFT 24
#define STREAM_DONE 1
#define STREAM_FAIL_TOKEN 2
#define STREAM_FAIL_VALUE 2
#define STREAM_FAIL_DONE 6

// FP8: one float32 scale per FP8_BLOCK channels; amax clamped to FP8_AMAX_MIN, scale =
// amax * (1 / FP8_MAX) (DeepEP's product, see block_quantize_scatter).
#define FP8_BLOCK 128
#define FP8_MAX 448.f
#define FP8_AMAX_MIN 1e-4f

#define PHASE_NOTIFY 1
#define PHASE_DISPATCH_ENTRY 2
#define PHASE_DISPATCH_DONE 3
#define PHASE_COMBINE_ENTRY 4
#define PHASE_COMBINE_DONE 5
#define PHASE_LL_DISPATCH 6
#define PHASE_LL_COMBINE 7

// Counter-page slot words (proto/counter_page.py).
#define SLOT_SEQ 0
#define SLOT_NUM_RECV 1
#define SLOT_NUM_EXPERTS 2
#define SLOT_STATUS 3
#define SLOT_ERR_RANK 4  // reserved word 4: the missing rank when STATUS != 0
#define SLOT_HEADER 8
// Stream-ordered normal-mode calls: int32 words of the slot (proto/abi.py says how they work).
#define SLOT32_DONE 10
#define SLOT32_FAIL_SEQ 11
#define SLOT32_FAIL_CODE 12
#define SLOT32_FAIL_RANK 13
#define SLOT_FAIL_VALUE 7
#define READY_RING 32
#define SLOT32_READY 992

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64* ctrl_of(const u64* peers, int r) {
    return reinterpret_cast<u64*>(peers[r]);
}

// Ranks on other nodes (built with EPD_NVSHMEM, server/backends/cuda_remote.py): the peer table
// has 3R words, peers[r] == 0 for a rank on another node, peers[R + r] the symmetric address
// of its buffer in this PE's heap and peers[2R + r] its PE; such a rank is reached only through
// NVSHMEM's device API (a network on a cluster, NVLink between logical nodes of one host).
#ifdef EPD_NVSHMEM
__device__ __forceinline__ bool peer_remote(const u64* peers, int r) { return peers[r] == 0; }
__device__ __forceinline__ u64 peer_sym(const u64* peers, int R, int r) { return peers[R + r]; }
__device__ __forceinline__ int peer_pe(const u64* peers, int R, int r) {
    return (int)peers[2 * R + r];
}
#else
__device__ __forceinline__ bool peer_remote(const u64*, int) { return false; }
#endif

// Raise control word `word` of rank r's block to v (a flag, an abort code). Over NVLink, a
// release store after this thread's writes; to another node, an NVSHMEM signal (its data
// was completed by nvshmem_quiet or travels with the signal).
__device__ __forceinline__ void peer_signal(const u64* peers, int R, int r, int word, u64 v) {
#ifdef EPD_NVSHMEM
    if (peer_remote(peers, r)) {
        nvshmemx_signal_op(reinterpret_cast<unsigned long*>(peer_sym(peers, R, r)) + word,
                           (unsigned long)v, NVSHMEM_SIGNAL_SET, peer_pe(peers, R, r));
        return;
    }
#endif
    st_release_sys(ctrl_of(peers, r) + word, v);
}

__device__ __forceinline__ const volatile u64* host_words(const u64* ctrl) {
    return reinterpret_cast<const volatile u64*>(
        *reinterpret_cast<const volatile u64*>(ctrl + CTRL_HOST_WORDS));
}

// The ranks that went away, as the control block says (the host words: host_gone).
__device__ __forceinline__ u64 gone_ranks(const u64* ctrl) {
    return ld_acquire_sys(ctrl + CTRL_MASK);
}

// The ranks that went away as the engine's host words say: only after a wait that lasted
// HOST_POLL_AFTER_NS, which may have let a rank go by its host word alone.
__device__ __forceinline__ u64 host_gone(const u64* ctrl) {
    const volatile u64* h = host_words(ctrl);
    return h != nullptr ? h[HOST_WORD_GONE] : 0ull;
}

// The group's abort code as the control block says (a wait also sees the host word's).
__device__ __forceinline__ u64 abort_code(const u64* ctrl) {
    return ld_acquire_sys(ctrl + CTRL_ABORT);
}

// Spin until flags[r] >= seq, or rank r is masked (it went away: not waited for). Returns 0, or
// ERR_DEADLINE / ERR_ABORTED. Never traps: a trap would poison the CUDA context that every
// client of the engine shares (docs/DESIGN_NOTES.md).
__device__ __forceinline__ int wait_flag(const u64* flag, const u64* abort_word,
                                         const u64* mask_word, const volatile u64* host, int r,
                                         u64 seq, i64 timeout_ns) {
    u64 start = globaltimer();
    unsigned spins = 0;
    while (ld_acquire_sys(flag) < seq) {
        if (ld_acquire_sys(abort_word) != 0) return ERR_ABORTED;
        if ((ld_acquire_sys(mask_word) >> r) & 1ull) return 0;
        if (((++spins) & 63) == 0) {
            const i64 waited = (i64)(globaltimer() - start);
            if (host != nullptr && waited > HOST_POLL_AFTER_NS) {  // (see HOST_POLL_AFTER_NS)
                if (host[HOST_WORD_ABORT] != 0) return ERR_ABORTED;
                if ((host[HOST_WORD_GONE] >> r) & 1ull) return 0;
            }
            if (waited > timeout_ns) return ERR_DEADLINE;
        }
    }
    return 0;
}

// Record the first error of this rank in its control block (host reads it after the stream).
// `with_value`: also the offending value (an expert id...), in CTRL_CALL_ERR_VALUE.
__device__ __forceinline__ void record_error(u64* ctrl, int code, int rank, int phase, u64 seq,
                                             bool with_value = false, i64 value = 0) {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(ctrl + CTRL_ERR_CODE), 0ull,
                  (unsigned long long)code) == 0ull) {
        ctrl[CTRL_ERR_RANK] = (u64)(i64)rank;
        ctrl[CTRL_ERR_PHASE] = (u64)phase;
        ctrl[CTRL_ERR_SEQ] = seq;
        if (with_value) ctrl[CTRL_CALL_ERR_VALUE] = (u64)value;
        __threadfence_system();
    }
}

// Where a bad value in a call's inputs (an expert id out of range) is recorded: the rank's
// control block (CTRL_CALL_ERR / _VALUE: the call's last kernel reports it, epd_call_done, on
// this rank alone), or a whole group's notify's own pair in shared memory, which its payload
// carries to every rank (every rank then fails the dispatch alike). Null: not recorded.
struct BadInput {
    u64* code;
    u64* value;
};
__device__ __forceinline__ BadInput call_err_words(u64* ctrl) {
    return ctrl == nullptr ? BadInput{nullptr, nullptr}
                           : BadInput{ctrl + CTRL_CALL_ERR, ctrl + CTRL_CALL_ERR_VALUE};
}

// A bad value in a call's inputs: the entry is skipped, so every rank still moves consistent
// data. The first reporter claims the code word, writes the value, then the code: a host
// reading the words while the kernel still runs (the client's layout check) never takes a code
// with another call's value.
__device__ __forceinline__ void report_bad_input(BadInput to, i64 value,
                                                 int code = ERR_BAD_INPUT) {
    if (to.code != nullptr &&
        atomicCAS(reinterpret_cast<unsigned long long*>(to.code), 0ull,
                  (unsigned long long)CALL_ERR_CLAIMED) == 0ull) {
        *to.value = (u64)value;
        __threadfence_system();
        *reinterpret_cast<volatile u64*>(to.code) = (u64)code;
    }
}

// Token t's destination ranks (bit d: rank d holds one of its top-k experts, each rank once),
// counting each of its experts in s_expert; an id outside [-1, E) is reported and skipped.
// (The layout and both notify kernels: one rule for routing and for bad ids.)
__device__ __forceinline__ u64 token_ranks(const i64* topk_idx, int t, int K, int E, int L,
                                           int* s_expert, BadInput bad) {
    u64 mask = 0;
    for (int k = 0; k < K; ++k) {
        const i64 e = topk_idx[(i64)t * K + k];
        if (e < -1 || e >= E) { report_bad_input(bad, e); continue; }
        if (e >= 0) {
            mask |= 1ull << (int)(e / L);
            atomicAdd(&s_expert[e], 1);
        }
    }
    return mask;
}

// Block-wide wait for flags[0..R) >= seq: threads r < R poll, the block agrees on the outcome.
// Returns 0 or the error code; on error records it (missing rank = the lowest one).
__device__ __forceinline__ int block_wait_all(u64* ctrl, int flag_base, int R, u64 seq,
                                              i64 timeout_ns, int phase) {
    __shared__ int s_fail_rank;
    __shared__ int s_fail_code;
    if (threadIdx.x == 0) { s_fail_rank = LL_MAX_RANKS; s_fail_code = 0; }
    __syncthreads();
    if ((int)threadIdx.x < R) {
        int r = threadIdx.x;
        int code = wait_flag(ctrl + flag_base + r, ctrl + CTRL_ABORT, ctrl + CTRL_MASK,
                             host_words(ctrl), r, seq, timeout_ns);
        if (code) { atomicMin(&s_fail_rank, r); atomicMax(&s_fail_code, code); }
    }
    __syncthreads();
    int code = s_fail_code;
    if (code && threadIdx.x == 0) {
        record_error(ctrl, code, code == ERR_ABORTED ? -1 : s_fail_rank, phase, seq);
    }
    __syncthreads();
    return code;
}

// A failed or aborted group stops moving data: after an error the handle state may be
// garbage (notify returned early), and writing through it could corrupt a peer's memory.
__device__ __forceinline__ bool group_failed(const u64* ctrl) {
    return *reinterpret_cast<const volatile u64*>(ctrl + CTRL_ERR_CODE) != 0 ||
           abort_code(ctrl) != 0;
}

// ------------------------------------------------------------------------------------------
// Last-block completion: every block fences its pushes and takes a ticket; the last one
// raises flag[rank] = seq in every peer. Returns true in the last block.
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ bool signal_done(const u64* peers, int R, int rank, int flag_base,
                                            u64 seq) {
    __shared__ bool s_last;
    u64* my_ctrl = ctrl_of(peers, rank);
#ifdef EPD_NVSHMEM
    nvshmem_quiet();  // every thread: its puts to other nodes delivered before the ticket
#endif
    __threadfence_system();  // every thread: its own pushes before the ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned* ticket = reinterpret_cast<unsigned*>(my_ctrl + CTRL_TICKET);
        unsigned prev = atomicAdd(ticket, 1u);
        s_last = prev == gridDim.x - 1;
        if (s_last) {
            *ticket = 0;  // the next kernel on this stream starts after this one ends
            __threadfence_system();
        }
    }
    __syncthreads();
    if (s_last && (int)threadIdx.x < R) peer_signal(peers, R, threadIdx.x, flag_base + rank, seq);
    return s_last;
}

// Entry barrier (cached dispatch, combine): every peer reached this collective, so its
// destination buffer is no longer read by the previous one. Block 0 announces, all wait.
__device__ __forceinline__ int entry_barrier(const u64* peers, int R, int rank, int flag_base,
                                             u64 seq, i64 timeout_ns, int phase) {
    if (blockIdx.x == 0 && (int)threadIdx.x < R)
        peer_signal(peers, R, threadIdx.x, flag_base + rank, seq);
    return block_wait_all(ctrl_of(peers, rank), flag_base, R, seq, timeout_ns, phase);
}

// --- element conversions (bit exact, round-to-nearest-even like ml_dtypes) ---------------------

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned)h) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Element traits for the combine: storage word, lanes per 16-byte vector, conversions.
struct Bf16 {
    typedef unsigned short word;
    static constexpr int kPerVec = 8;
    __device__ static float to_f32(word w) { return bf16_to_f32(w); }
    __device__ static word from_f32(float f) { return f32_to_bf16(f); }
};
struct F16 {
    typedef unsigned short word;
    static constexpr int kPerVec = 8;
    __device__ static float to_f32(word w) { return f16_to_f32(w); }
    __device__ static word from_f32(float f) { return f32_to_f16(f); }
};
struct F32 {
    typedef unsigned word;
    static constexpr int kPerVec = 4;
    __device__ static float to_f32(word w) { return __uint_as_float(w); }
    __device__ static word from_f32(float f) { return __float_as_uint(f); }
};
